"""Llama in plain PyTorch: the native ("megatron" source) model of nxdt.

Read it top to bottom: arguments, norms, rotary embedding, attention, MLP,
decoder layer, the model, and weight initialisation.

Design points:
- The module tree and parameter names are exactly those of
  `transformers.LlamaForCausalLM` (`model.embed_tokens`, `model.layers.<i>.self_attn.q_proj`,
  ..., `lm_head`), so a state dict moves between the two with no renaming and the
  parallel plans can name modules by these paths.
- No distributed code here: tensor/pipeline/data parallelism is applied from the
  outside (nxdt.parallel), the way torchtitan and gpt-fast do it.
- Activation checkpointing selects modules by class name (`CoreAttention`,
  `LlamaMLP`, `LlamaRMSNorm`), which is why the SDPA call lives in its own small
  parameter-free `CoreAttention` module.
- Megatron-style options (`normalization`, `activation`, `position_embedding_type`,
  `rotary_percentage`, `has_bias`, dropouts, scaled init, `transformer_block_type`) are
  supported so the NxDT "megatron" model configs mean what they say; GPT-NeoX / Pythia are this
  model with layernorm, gelu, biases, partial rotary and the gpt_j block (nxdt.models.neox); Qwen3 is
  it with per-head q/k norms (`qk_layernorm`) and its own head_dim (`kv_channels`), Qwen3-MoE adds
  experts of their own width in chosen layers (nxdt.models.qwen3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nxdt.models.chunked_loss import chunked_cross_entropy
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.kv_cache import KVCache
from nxdt.models.moe import LlamaMoE, MoEArgs, MoEExperts, MoERouter
from nxdt.models.moe_calculators import moe_for_layer, reset_llama_moe_parts
from nxdt.models.moe_neox import MLPExperts
from nxdt.models.rope import LlamaRotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half  # noqa: F401 - re-exported


BLOCK_TYPES = ("pre_ln", "post_ln", "normformer", "gpt_j")


@dataclass
class LlamaArgs:
    """Architecture of a Llama-family decoder. Names follow NxDT/Megatron model keys."""

    vocab_size: int = 32000
    """Rows of the embedding and the output layer (already padded by the builder)."""
    hidden_size: int = 4096
    num_layers: int = 32
    num_attention_heads: int = 32
    num_kv_heads: int | None = None
    """Key/value heads (GQA). None → num_attention_heads (plain multi-head attention)."""
    ffn_hidden_size: int = 11008
    kv_channels: int | None = None
    """Head dimension override. None → hidden_size // num_attention_heads."""
    max_position_embeddings: int = 4096
    """Rows of the learned position table; unused by RoPE (which needs no table)."""
    normalization: str = "rmsnorm"
    """'rmsnorm' (Llama) or 'layernorm' (GPT-style, with a bias)."""
    layernorm_epsilon: float = 1e-5
    activation: str = "swiglu"
    """'swiglu' (down(silu(gate(x)) * up(x))), 'gelu' (down(gelu(up(x))), no gate_proj; exact erf GELU)
    or 'gelu_tanh' (the same with GELU's tanh approximation: GPT-NeoX-20B's gelu_fast)."""
    has_bias: bool = False
    """Bias on every linear layer of attention and MLP (never on lm_head)."""
    mlp_bias: bool | None = None
    """Bias on the MLP's linear layers; None = has_bias (GPT-NeoX's use_bias_in_mlp, transformers' mlp_bias)."""
    share_embeddings_and_output_weights: bool = False
    """Tie lm_head.weight to model.embed_tokens.weight (one tensor, counted once)."""
    position_embedding_type: str = "rope"
    """'rope', 'learned_absolute' (adds model.embed_positions) or 'none' (no position signal but the causal mask)."""
    rotary_percentage: float = 1.0
    """Fraction of each head dim that is rotated (GPT-NeoX partial rotary); the rest passes through."""
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, or HF-style {'rope_type': 'llama3', 'factor', 'low_freq_factor',
    'high_freq_factor', 'original_max_position_embeddings'} (Llama 3.1 long context)."""
    sliding_window_size: int | None = None
    """If set, a token sees at most this many tokens (itself included), as in Mistral."""
    hidden_dropout: float = 0.0
    """Dropout on the embeddings and on the attention / MLP outputs before each residual add."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    ffn_dropout: float = 0.0
    """Dropout inside the MLP, after the activation."""
    init_method_std: float = 0.02
    use_scaled_init_method: bool = True
    """Output projections (o_proj, down_proj) get std / sqrt(2 * num_layers), as in GPT-2/Megatron:
    each layer adds two residual branches, this keeps the residual stream's variance from growing."""
    moe: MoEArgs | None = None
    """Mixture of experts (nxdt.models.moe) in place of the MLP of every `moe.frequency`-th layer
    (or of the `moe_layers`); None = dense. Experts have no bias: SwiGLU (Mixtral, Qwen3-MoE) or
    two-matrix ones (GPT-NeoX's; moe.expert_activation); has_bias / mlp_bias concern the rest."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's width (Qwen3-MoE's moe_intermediate_size); None = ffn_hidden_size (Mixtral)."""
    moe_layers: tuple[int, ...] | None = None
    """The MoE layers by index, the others dense (Qwen3-MoE's decoder_sparse_step, mlp_only_layers);
    None = every `moe.frequency`-th layer."""
    qk_layernorm: bool = False
    """A norm (`normalization`, head_dim wide, one per q and k) over each head's queries and keys
    before the rotary embedding: Qwen3's `self_attn.q_norm` / `k_norm` (Megatron's qk_layernorm)."""
    mla: Any = None
    """nxdt.models.mla.MLAArgs: multi-head latent attention (DeepSeek-V3) in place of q/k/v/o
    projections; None = the attention above. The rotary part is then MLA's qk_rope_head_dim."""
    transformer_block_type: str = "pre_ln"
    """How a block connects its norms, attention and MLP (see `LlamaDecoderLayer`): 'pre_ln',
    'post_ln', 'normformer' or 'gpt_j' (parallel residual)."""
    gpt_j_tied: bool = True
    """gpt_j only: one input norm shared by attention and MLP (GPT-J, NeMo); False: two (GPT-NeoX /
    Pythia, transformers' GPTNeoX with use_parallel_residual)."""
    apply_query_key_layer_scaling: bool = False
    """Accepted for NxDT compatibility, no effect. In Megatron it divides QK^T by the layer
    number and multiplies it back inside an fp32 softmax: an fp16 overflow guard that leaves
    the result unchanged. Our softmax (SDPA) is numerically safe, so the math is the same."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.normalization not in ("rmsnorm", "layernorm"):
            raise ValueError(f"normalization must be 'rmsnorm' or 'layernorm', got {self.normalization!r}")
        if self.activation not in ("swiglu", "gelu", "gelu_tanh"):
            raise ValueError(f"activation must be 'swiglu', 'gelu' or 'gelu_tanh', got {self.activation!r}")
        if self.position_embedding_type not in ("rope", "learned_absolute", "none"):
            raise ValueError("position_embedding_type must be 'rope', 'learned_absolute' or 'none', "
                             f"got {self.position_embedding_type!r}")
        if self.transformer_block_type not in BLOCK_TYPES:
            raise ValueError(f"transformer_block_type must be one of {', '.join(BLOCK_TYPES)}, "
                             f"got {self.transformer_block_type!r}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless kv_channels is set"
            )
        if not 0.0 < self.rotary_percentage <= 1.0:
            raise ValueError(f"rotary_percentage must be in (0, 1], got {self.rotary_percentage}")
        if self.position_embedding_type == "rope" and self.rotary_dim % 2 != 0:
            raise ValueError(f"rotary dimension {self.rotary_dim} (head_dim × rotary_percentage) must be even")
        if self.moe is not None and self.transformer_block_type == "normformer":
            # the experts have no FFN norm: MoE layers would silently lose normformer's third norm
            raise ValueError("transformer_block_type normformer has no MoE form (the experts have no FFN norm)")
        if self.moe_layers is not None and (self.moe is None or not all(0 <= i < self.num_layers for i in self.moe_layers)):
            raise ValueError(f"moe_layers {self.moe_layers} needs moe and layer indices in [0, {self.num_layers})")
        if self.sliding_window_size is not None and self.sliding_window_size < 1:
            raise ValueError(f"sliding_window_size must be >= 1 or None, got {self.sliding_window_size}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` has experts and a router in place of the MLP."""
        if self.moe is None:
            return False
        return layer_idx in self.moe_layers if self.moe_layers is not None else self.moe.is_moe_layer(layer_idx)

    @property
    def rotary_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla is not None else int(self.head_dim * self.rotary_percentage)

    def to_hf_config_dict(self) -> dict[str, Any]:
        """The equivalent transformers config.json (Llama, Mixtral or GPT-NeoX) as a dict;
        ValueError for options none of them can express. See `nxdt.models.hf_export`."""
        return hf_config_dict(self)


# --------------------------------------------------------------------------- norms


class LlamaRMSNorm(nn.Module):
    """RMSNorm, computed in fp32 and cast back (same arithmetic as transformers' LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaLayerNorm(nn.LayerNorm):
    """LayerNorm with bias (normalization: layernorm); a named class so checkpointing can select it."""


def make_norm(args: LlamaArgs, size: int | None = None) -> nn.Module:
    size = args.hidden_size if size is None else size
    if args.normalization == "rmsnorm":
        return LlamaRMSNorm(size, eps=args.layernorm_epsilon)
    return LlamaLayerNorm(size, eps=args.layernorm_epsilon)


# --------------------------------------------------------------------------- attention


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, S, D] → [B, KV * n_rep, S, D]: each K/V head serves n_rep query heads (GQA)."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Which packed document each token belongs to, or None if every row is one document.

    A new document starts wherever the position does not advance by exactly 1 (the
    rule transformers uses for packed sequences), e.g. positions [0 1 2 0 1 0] →
    documents [0 0 0 1 1 2].
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.cumsum(-1)


def build_attention_mask(
    seq_len: int,
    device: torch.device,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Boolean mask [B|1, 1, S, S] (True = may attend), or None when plain causal is enough.

    Causal, further limited to the last `sliding_window` tokens, and, when the
    position ids show several packed documents, to the token's own document.
    """
    docs = document_ids(position_ids) if position_ids is not None else None
    if sliding_window is None and docs is None:
        return None  # the fast path: SDPA's is_causal
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    mask = k <= q
    if sliding_window is not None:
        mask = mask & (k > q - sliding_window)
    mask = mask[None, None]  # [1, 1, S, S]
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return mask


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V via SDPA. Parameter-free, so it is the cheap thing to recompute."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.dropout = args.attention_dropout
        # The attention kernel, with F.scaled_dot_product_attention's signature. A parallelize
        # plan may swap it from outside (context parallel puts ring attention here).
        self.sdpa = F.scaled_dot_product_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Q, D], k and v [B, KV, L, D]. `mask` None means causal: SDPA's `is_causal` when
        Q = L (a square block), or, for one query after cached keys (Q = 1 < L, a decode step), no
        mask at all: the newest token sees every key (`is_causal` would be wrong there, as SDPA
        aligns it top-left and would leave the query the first key only)."""
        # Repeating K/V explicitly (instead of SDPA's enable_gqa) off the CPU keeps CUDA's
        # memory-efficient kernel and XLA on their paths. The ratio is read from the tensors, not
        # the config, so a tensor-parallel shard holding fewer (or replicated) heads works.
        b, heads, q_len, d = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        n_rep = heads // kv_heads
        dropout = self.dropout if self.training else 0.0
        if q_len != kv_len:
            if mask is None and q_len != 1:
                raise ValueError(f"attention of {q_len} queries to {kv_len} keys needs an explicit mask")
            if q_len == 1 and n_rep > 1:
                # One query per row (a decode step): fold each K/V head's n_rep query heads into the
                # query axis, [B, H, 1, D] -> [B, KV, n_rep, D], and attend to the K/V heads as they
                # are, instead of copying the whole (growing) cache n_rep times. A decode mask
                # [B|1, 1, 1, L] is the same for every head and broadcasts over the folded queries.
                out = self.sdpa(q.reshape(b, kv_heads, n_rep, d), k, v, attn_mask=mask, dropout_p=dropout,
                                is_causal=False)
                return out.reshape(b, heads, 1, d)
        # on CPU SDPA's own grouped-query path, no K/V copies (docs/performance.md: 10-20% faster)
        gqa = n_rep > 1 and q.device.type == "cpu" and self.sdpa is F.scaled_dot_product_attention
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return self.sdpa(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None and q_len == kv_len,
            **({"enable_gqa": True} if gqa else {}),
        )


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its slot in a KVCache
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.use_rope = args.position_embedding_type == "rope"
        bias = args.has_bias
        self.q_proj = nn.Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, args.hidden_size, bias=bias)
        if args.qk_layernorm:  # per head: whole on every tensor-parallel rank, whatever heads it holds
            self.q_norm, self.k_norm = make_norm(args, self.head_dim), make_norm(args, self.head_dim)
        self.qk_layernorm = args.qk_layernorm
        self.core_attention = CoreAttention(args)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # [B, S, H*D] → [B, H, S, D]; reshape with -1 heads so a tensor-parallel shard
        # (fewer local heads, same head_dim) runs this code unchanged.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.qk_layernorm:  # over head_dim, before rotary (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:  # decoding: attend to the cached tokens too (keys after rotary)
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = self.core_attention(q, k, v, mask)  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


# --------------------------------------------------------------------------- MLP


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GELU: down(gelu(up(x))) (no gate_proj), gelu_tanh with
    GELU's tanh approximation."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.swiglu = args.activation == "swiglu"
        bias = args.has_bias if args.mlp_bias is None else args.mlp_bias
        if self.swiglu:
            self.gate_proj = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=bias)
        self.up_proj = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=bias)
        self.down_proj = nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=bias)
        # a module, as in transformers' tree
        self.act_fn = nn.SiLU() if self.swiglu else nn.GELU(
            approximate="tanh" if args.activation == "gelu_tanh" else "none")
        # normformer: a norm over the intermediate activations (NormFormer's "FFN LN", NeMo's)
        self.ffn_layernorm = make_norm(args, args.ffn_hidden_size) if args.transformer_block_type == "normformer" else None
        self.dropout = nn.Dropout(args.ffn_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.act_fn(self.up_proj(x))
        if self.ffn_layernorm is not None:
            h = self.ffn_layernorm(h)
        return self.down_proj(self.dropout(h))


# --------------------------------------------------------------------------- decoder


class LlamaDecoderLayer(nn.Module):
    """One block; `transformer_block_type` says how norms (n), attention and MLP connect:

        pre_ln      h = x + attn(n1(x));      out = h + mlp(n2(h))          Llama, GPT-2, NeoX sequential
        post_ln     h = n1(x + attn(x));      out = n2(h + mlp(h))          original Transformer, BERT
        normformer  h = x + n3(attn(n1(x)));  out = h + mlp(n2(h))          NormFormer (+ a norm in the MLP)
        gpt_j       out = x + attn(n1(x)) + mlp(n2(x))                     parallel residual (GPT-J: n2 = n1)

    Module names: pre_ln, normformer and gpt_j keep transformers' `input_layernorm` (n1) and
    `post_attention_layernorm` (n2); post_ln's norms follow the residual adds, so they are
    `post_attention_layernorm` and `post_mlp_layernorm`; normformer's n3 is
    `attention_output_layernorm`; a tied gpt_j block has `input_layernorm` only.
    """

    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.block_type = kind = args.transformer_block_type
        self.shared_input_norm = kind == "gpt_j" and args.gpt_j_tied  # GPT-J: one norm feeds attention and MLP
        # Registration order = transformers' order, so state dicts list keys identically.
        self.self_attn = LlamaAttention(args, layer_idx) if args.mla is None else args.mla.attention(args, layer_idx)
        expert_width = args.moe_ffn_hidden_size or args.ffn_hidden_size
        if args.is_moe_layer(layer_idx):
            shared = args.moe.num_shared_experts  # DeepSeek-V3: one MLP of n x the experts' width for every token
            shared = LlamaMLP(replace(args, ffn_hidden_size=expert_width * shared)) if shared else None
            self.mlp = LlamaMoE(args.hidden_size, expert_width, moe_for_layer(args.moe, layer_idx), shared_experts=shared)
        else:
            self.mlp = LlamaMLP(args)
        if kind != "post_ln":
            self.input_layernorm = make_norm(args)
        if not self.shared_input_norm:
            self.post_attention_layernorm = make_norm(args)
        if kind == "post_ln":
            self.post_mlp_layernorm = make_norm(args)
        if kind == "normformer":
            self.attention_output_layernorm = make_norm(args)
        self.dropout = nn.Dropout(args.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        kind = self.block_type
        # the cache goes as a keyword only when given: tensor-parallel plans describe the positional inputs
        cache = {} if kv_cache is None else {"kv_cache": kv_cache}
        if kind == "gpt_j":
            attn_in = self.input_layernorm(x)
            mlp_in = attn_in if self.shared_input_norm else self.post_attention_layernorm(x)
            return x + self.dropout(self.self_attn(attn_in, rope, mask, **cache)) + self.dropout(self.mlp(mlp_in))
        if kind == "post_ln":
            h = self.post_attention_layernorm(x + self.dropout(self.self_attn(x, rope, mask, **cache)))
            return self.post_mlp_layernorm(h + self.dropout(self.mlp(h)))
        attn = self.self_attn(self.input_layernorm(x), rope, mask, **cache)
        if kind == "normformer":
            attn = self.attention_output_layernorm(attn)
        h = x + self.dropout(attn)
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class LlamaModel(nn.Module):
    """Embeddings → decoder layers → final norm (no output layer); HF's `LlamaModel`."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        elif args.position_embedding_type == "rope":
            self.rotary_emb = LlamaRotaryEmbedding(args)
        self.embed_dropout = nn.Dropout(args.hidden_dropout)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        # post_ln blocks end normalized: no final norm (Megatron/NeMo); Identity keeps `norm` a module
        # (None means "a pipeline stage without the final norm")
        self.norm = nn.Identity() if args.transformer_block_type == "post_ln" else make_norm(args)
        self.positions_mark_documents = True  # a jump in caller-given position ids starts a new document

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        # A pipeline stage (see nxdt.parallel.pipeline) holds only some parts: without
        # embed_tokens, `input_ids` are the previous stage's hidden states [B, S, H];
        # without norm, the hidden states are returned unnormalised.
        b, s = input_ids.shape[:2]
        explicit_positions = position_ids is not None
        if position_ids is None:
            start = kv_cache.length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + s, device=input_ids.device)[None].expand(b, s)
        if self.embed_tokens is None:
            x = input_ids
        else:
            x = self.embed_tokens(input_ids)
            if self.args.position_embedding_type == "learned_absolute":
                x = x + self.embed_positions(position_ids)
            x = self.embed_dropout(x)
        rope = None
        if self.args.position_embedding_type == "rope":
            rope = self.rotary_emb(x, position_ids)
        # Only caller-given positions can describe several packed documents (unless the
        # owner says positions may jump for another reason: context-parallel slices do).
        if kv_cache is not None:  # decoding: causal over cached + new tokens, left padding masked
            mask = kv_cache.attention_mask(s, x.device, self.args.sliding_window_size)
            for layer in self.layers:
                x = layer(x, rope, mask, kv_cache=kv_cache)
            kv_cache.advance(s)
            return self.norm(x) if self.norm is not None else x
        documents = explicit_positions and self.positions_mark_documents
        mask = build_attention_mask(s, x.device, position_ids if documents else None, self.args.sliding_window_size)
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.norm(x) if self.norm is not None else x


class NxdtLlamaForCausalLM(nn.Module):
    """Decoder + output layer: `forward(input_ids, position_ids=None) -> logits [B, S, V]` (fp)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head use the embedding matrix (one Parameter). Re-run after `to_empty`,
        which gives each module its own new tensor."""
        if self.args.share_embeddings_and_output_weights:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, labels: torch.Tensor | None = None,
                loss_chunk_size: int | None = None) -> torch.Tensor:
        """`kv_cache` (nxdt.models.kv_cache): decode incrementally; the tokens are appended after the
        cached ones and position_ids default to their columns. `labels` with `loss_chunk_size`: the
        per-token cross entropy [B, S] (fp32) instead of the logits, the output layer run a chunk of
        tokens at a time (nxdt.models.chunked_loss: the whole logits never exist)."""
        hidden = self.model(input_ids, position_ids, kv_cache=kv_cache)
        if self.lm_head is None:  # a pipeline stage without the output layer passes its hidden states on
            return hidden
        if labels is not None and loss_chunk_size:
            return chunked_cross_entropy(hidden, self.lm_head, labels, loss_chunk_size)
        return self.lm_head(hidden)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron-style initialisation; valid on freshly `to_empty`-ed (garbage) memory.

        Linear and embedding weights ~ N(0, init_method_std); o_proj and down_proj use
        std / sqrt(2 * num_layers) when use_scaled_init_method; biases 0; norm weights 1. MoE:
        the router and the experts' gate/up ~ N(0, std), the experts' down_proj like down_proj,
        a noisy gate's noise weight 0.
        """
        a = self.args
        self.tie_weights()
        std = a.init_method_std
        out_std = std / math.sqrt(2.0 * a.num_layers) if a.use_scaled_init_method else std
        tied = a.share_embeddings_and_output_weights
        for name, module in self.named_modules():
            if tied and module is self.lm_head:
                continue  # its weight is model.embed_tokens.weight, drawn as an embedding
            if isinstance(module, nn.Linear):
                is_output_proj = name.endswith(("self_attn.o_proj", "mlp.down_proj", "shared_experts.down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_output_proj else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, MoERouter):
                module.reset_parameters(std)
            elif isinstance(module, MoEExperts):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(module.down_proj, mean=0.0, std=out_std)
            elif isinstance(module, MLPExperts):
                module.reset_parameters(std, out_std)
            elif isinstance(module, LlamaRMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        reset_llama_moe_parts(self, std, out_std)  # LLaMA-MoE's residual blocks, weight norms, unequal experts
