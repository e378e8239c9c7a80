"""Model FLOPs per trained token: the one formula behind `nxdt plan` and the run's `tflops` / `mfu`.

    flops/token = 6 x N_matmul                          (weights: 2 forward + 4 backward per weight)
                + 12 x layers x heads x head_dim x keys  (attention scores QK^T and AV, forward + backward)

N_matmul is the parameters one token multiplies: the activated count of nxdt.models.param_count
(a mixture of experts: top_k of E experts, plus the routers) less the lookup tables (the token
embedding unless tied to lm_head, learned positions), which are read, not multiplied; lm_head is
counted. Grouped-query attention is in N_matmul through its smaller k/v projections; the score
matmuls run per query head, so `heads` (not kv_heads) counts there. `keys` is the mean number of
keys a query attends to: (s + 1) / 2 for causal attention over s tokens (query i sees i + 1), fewer
under a sliding window. This is the work a causal kernel has to do; torchtitan's and PaLM's
6N + 12·L·H·Q·T count the masked half too (keys = s), so their MFU reads higher by that part
(12·L·H·Q·s/2 per token; for Llama-2-7B at 4,096 tokens 3.2 GFLOP, +7.5%).

Model FLOPs, not hardware FLOPs: recomputation under activation checkpointing, the elementwise
work (norms, rotary, softmax) and the loss are not counted (the MFU convention of PaLM, Megatron
and torchtitan). A LoRA run's frozen base weights do no weight-gradient matmul: 4 FLOPs each.
Checked against torch.utils.flop_counter on the native model (tests/test_mfu_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nxdt.models.param_count import ParameterCount


@dataclass(frozen=True)
class ModelShape:
    """What the attention term and the activation estimate need of an architecture."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    window: int | None = None
    """Sliding-window attention: a query sees at most this many keys (itself included)."""


def model_shape(model: nn.Module) -> ModelShape:
    """The shape of nxdt's model (its LlamaArgs) or of a transformers model (its config)."""
    args = getattr(model, "args", None)
    if args is not None:
        # MLA: QK^T over qk_nope + qk_rope dims, AV over v_head_dim; the attention term's 12 x head_dim is their sum x 6
        mla = args.mla
        head_dim = (mla.qk_head_dim + mla.v_head_dim) // 2 if mla is not None else args.head_dim
        return ModelShape(hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=args.num_attention_heads,
                          kv_heads=args.num_kv_heads, head_dim=head_dim, layers=args.num_layers,
                          vocab=args.vocab_size, window=args.sliding_window_size)
    c = model.config
    heads = c.num_attention_heads
    return ModelShape(hidden=c.hidden_size, ffn=c.intermediate_size, heads=heads,
                      kv_heads=getattr(c, "num_key_value_heads", heads) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                      layers=c.num_hidden_layers, vocab=c.vocab_size,
                      window=getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None)


def lookup_parameters(model: nn.Module) -> int:
    """Elements of the embedding tables that are looked up, not multiplied: every nn.Embedding
    weight that is not also a Linear's weight (a tied lm_head multiplies it, so it counts)."""
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    tables = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(n for key, n in tables.items() if key not in multiplied)


def mean_keys_per_query(seq_length: int, window: int | None = None, causal: bool = True) -> float:
    """Keys one query attends to, averaged over the s positions of a sequence."""
    s = seq_length
    if not causal:
        return float(min(s, window) if window else s)
    w = min(window, s) if window else s
    # query i (0-based) sees min(i + 1, w) keys: 1 + 2 + ... + w, then w for the remaining s - w
    return (w * (w + 1) / 2 + (s - w) * w) / s


@dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs of one trained token (forward + backward), split into its two terms."""

    matmul: int
    attention: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention


def flops_per_token(shape: ModelShape, counts: ParameterCount, lookup: int, seq_length: int, *,
                    frozen: int = 0, causal: bool = True) -> FlopsPerToken:
    """`counts`: the model's parameter_counts; `lookup`: lookup_parameters(model); `frozen`: of
    the multiplied parameters, how many get no gradient (LoRA's base): 4 FLOPs instead of 6."""
    matmul_params = counts.activated - lookup
    trained = matmul_params - frozen
    matmul = 6 * trained + 4 * frozen
    keys = mean_keys_per_query(seq_length, shape.window, causal)
    attention = round(12 * shape.layers * shape.heads * shape.head_dim * keys)
    return FlopsPerToken(matmul=matmul, attention=attention)
