"""GPT-NeoX / Pythia checkpoints ⇄ the native model: weight names, the fused QKV, and the model keys.

transformers' `GPTNeoXForCausalLM` is the native model with other names (the arithmetic is the
same: LayerNorm with bias, GELU MLP with biases (exact GELU, or its tanh approximation =
native `gelu_tanh` for hidden_act gelu_fast / gelu_new / gelu_pytorch_tanh), partial "rotate
half" rotary on the first `rotary_pct` of each head, parallel residual with two input norms =
native `gpt_j` with `gpt_j_tied: false`, sequential = `pre_ln`):

    gpt_neox.embed_in                       model.embed_tokens
    gpt_neox.layers.N.input_layernorm       model.layers.N.input_layernorm
    gpt_neox.layers.N.post_attention_layernorm   model.layers.N.post_attention_layernorm
    gpt_neox.layers.N.attention.query_key_value  model.layers.N.self_attn.{q,k,v}_proj
    gpt_neox.layers.N.attention.dense       model.layers.N.self_attn.o_proj
    gpt_neox.layers.N.mlp.dense_h_to_4h     model.layers.N.mlp.up_proj
    gpt_neox.layers.N.mlp.dense_4h_to_h     model.layers.N.mlp.down_proj
    gpt_neox.final_layer_norm               model.norm
    embed_out (on disk; lm_head in memory   lm_head
      with transformers >= 5)

The fused QKV's output rows are grouped per head: transformers views its output as
[..., heads, 3 * head_dim] and chunks the last dim, so the rows are [heads, 3, head_dim]
(q, k, v of head 0, then of head 1, ...), weight and bias alike. The native model keeps the
separate q/k/v projections so that its tensor-parallel plans and checkpoints stay those of Llama.
`neox_model_keys` turns a GPT-NeoX config.json into the nxdt `model:` keys of that native model.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

_LAYER = re.compile(r"^gpt_neox\.layers\.(\d+)\.(.+)$")
_RENAMES = {  # per layer, GPT-NeoX suffix -> native suffix (the fused QKV aside)
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "attention.dense": "self_attn.o_proj",
    "mlp.dense_h_to_4h": "mlp.up_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj",
}
_TOP = {"gpt_neox.embed_in": "model.embed_tokens", "gpt_neox.final_layer_norm": "model.norm"}
# buffers older GPT-NeoX checkpoints (Pythia's) store: the causal mask and the rotary frequencies
_BUFFERS = re.compile(r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")
OUTPUT_KEYS = ("embed_out.weight", "lm_head.weight")
# transformers' hidden_act -> native activation: exact GELU, or its tanh approximation (three names in
# transformers, equal within ~1e-7; GPT-NeoX-20B's config.json says gelu_fast)
HIDDEN_ACT = {"gelu": "gelu", "gelu_fast": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def neox_to_native(state: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """A GPTNeoXForCausalLM state dict (either name of the output layer) → native names; the fused
    QKV split into q/k/v. Raises ValueError listing keys it does not know (never drops weights)."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, t in state.items():
        if _BUFFERS.search(key):
            continue
        if key in OUTPUT_KEYS:
            out["lm_head.weight"] = t
            continue
        name, _, kind = key.rpartition(".")
        if name in _TOP:
            out[f"{_TOP[name]}.{kind}"] = t
            continue
        m = _LAYER.match(name)
        if m is None:
            unknown.append(key)
        elif m.group(2) == "attention.query_key_value":
            for proj, part in zip("qkv", split_qkv(t, num_heads)):
                out[f"model.layers.{m.group(1)}.self_attn.{proj}_proj.{kind}"] = part
        elif m.group(2) in _RENAMES:
            out[f"model.layers.{m.group(1)}.{_RENAMES[m.group(2)]}.{kind}"] = t
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not GPT-NeoX weights: {', '.join(sorted(unknown)[:5])}")
    return out


def native_to_neox(state: dict[str, torch.Tensor], num_heads: int,
                   output_key: str = "embed_out.weight") -> dict[str, torch.Tensor]:
    """The inverse of `neox_to_native`. `output_key`: 'embed_out.weight' as GPT-NeoX folders store it
    (transformers 4 and 5 load it), 'lm_head.weight' for `load_state_dict` into transformers >= 5."""
    inverse = {v: k for k, v in _RENAMES.items()}
    top = {v: k for k, v in _TOP.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, t in state.items():
        if key == "lm_head.weight":
            out[output_key] = t
            continue
        name, _, kind = key.rpartition(".")
        if name in top:
            out[f"{top[name]}.{kind}"] = t
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if m is None:
            unknown.append(key)
        elif m.group(2) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((m.group(1), kind), {})[m.group(2)[-6]] = t
        elif m.group(2) in inverse:
            out[f"gpt_neox.layers.{m.group(1)}.{inverse[m.group(2)]}.{kind}"] = t
        else:
            unknown.append(key)
    for (layer, kind), parts in qkv.items():
        if set(parts) != set("qkv"):
            unknown.append(f"model.layers.{layer}.self_attn.{{q,k,v}}_proj.{kind} (incomplete)")
            continue
        out[f"gpt_neox.layers.{layer}.attention.query_key_value.{kind}"] = fuse_qkv(
            parts["q"], parts["k"], parts["v"], num_heads)
    if unknown:
        raise ValueError(f"not expressible as GPT-NeoX weights: {', '.join(sorted(unknown)[:5])}")
    return out


def split_qkv(fused: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[3·H·D, ...] rows grouped [H, 3, D] → q, k, v, each [H·D, ...] (weight or bias)."""
    rows, rest = fused.shape[0], fused.shape[1:]
    grouped = fused.reshape(num_heads, 3, rows // (3 * num_heads), *rest)
    return tuple(grouped[:, i].reshape(rows // 3, *rest).contiguous() for i in range(3))  # type: ignore[return-value]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    rest = q.shape[1:]
    per_head = [t.reshape(num_heads, q.shape[0] // num_heads, *rest) for t in (q, k, v)]
    return torch.stack(per_head, dim=1).reshape(3 * q.shape[0], *rest).contiguous()


# --------------------------------------------------------------------------- config.json → model keys


def neox_rope(hf: dict[str, Any]) -> tuple[float, float, str]:
    """(rotary fraction, base, rope type) of a GPT-NeoX config.json, in either transformers format:
    `rope_parameters` (5.x, wins when present) or `rotary_pct` / `rotary_emb_base` (4.x, the Hub's
    Pythia files); absent ones take transformers' defaults (0.25, 10000)."""
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    pct = rp.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    base = rp.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(pct), float(base), str(kind)


def neox_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The nxdt `model:` keys (model_source megatron) that build the native twin of a GPT-NeoX
    config.json; ValueError naming what the native model cannot express.

    The vocabulary is kept exactly: make_vocab_size_divisible_by is the largest power of two
    (at most 128) dividing the config's vocab_size, so Megatron padding adds no rows (with tensor
    parallel the padding multiplies by tp: the rows must still divide)."""
    pct, base, rope_type = neox_rope(hf)
    problems = []
    act = hf.get("hidden_act", "gelu")
    if act not in HIDDEN_ACT:
        problems.append(f"hidden_act={act} (nxdt reads {', '.join(sorted(HIDDEN_ACT))})")
    if not hf.get("attention_bias", True):
        problems.append("attention_bias=false (native has_bias covers attention and MLP)")
    if hf.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings=true")
    if rope_type != "default":
        problems.append(f"rope_type={rope_type}")
    if problems:
        raise ValueError(f"GPT-NeoX config.json options the native model cannot express: {', '.join(problems)}")
    vocab = int(hf["vocab_size"])
    parallel = hf.get("use_parallel_residual", True)
    keys = {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_attention_heads"], "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "normalization": "layernorm", "layernorm_epsilon": hf.get("layer_norm_eps", 1e-5),
        "activation": HIDDEN_ACT[act],
        "has_bias": True, "transformer_block_type": "gpt_j" if parallel else "pre_ln",
        "position_embedding_type": "rope", "rotary_percentage": pct, "rotary_emb_base": base,
        "share_embeddings_and_output_weights": False, "vocab_size": vocab,
        "make_vocab_size_divisible_by": math.gcd(vocab, 128),
        "hidden_dropout": hf.get("hidden_dropout", 0.0), "attention_dropout": hf.get("attention_dropout", 0.0),
        "init_method_std": hf.get("initializer_range", 0.02),
    }
    if parallel:
        keys["gpt_j_tied"] = False
    return keys
