"""Qwen3 and Qwen3-MoE as the native model: the `model.*` keys of a transformers config.json
(model_type qwen3 / qwen3_moe) and the experts' weights in the layout the native model (and
transformers >= 5) keeps.

Qwen3 is nxdt's Llama with three options (nxdt.models.llama.LlamaArgs): `qk_layernorm` (an RMSNorm
over each head's queries and keys before rotary: `self_attn.q_norm` / `k_norm`), `kv_channels`
(transformers' head_dim, independent of hidden / heads) and, for small ones, tied embeddings.
Qwen3-MoE adds Mixtral-style experts (nxdt.models.moe: softmax over all experts, the top k,
renormalised when norm_topk_prob) of their own width (`model.moe.ffn_hidden_size` =
moe_intermediate_size) in the layers `(i + 1) % decoder_sparse_step == 0` not listed in
mlp_only_layers (`model.moe.layers`); the other layers keep the dense MLP (intermediate_size).
Parameter names are transformers' in both, so the weights are a copy; published Qwen3-MoE folders
store each expert apart (`mlp.experts.<e>.gate_proj.weight`, transformers 4's layout), which
`fuse_experts` stacks into `mlp.experts.gate_up_proj` [E, 2F, H] and `mlp.experts.down_proj`
[E, H, F], as transformers 5 does when it loads them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

QWEN3_MODEL_TYPES = ("qwen3", "qwen3_moe")


def qwen3_moe_layers(hf: dict[str, Any]) -> list[int]:
    """The MoE layers of a Qwen3-MoE config.json, as transformers' Qwen3MoeDecoderLayer picks them."""
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(int(hf["num_hidden_layers"])) if (i + 1) % step == 0 and i not in dense]


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json form: transformers 4's rope_theta +
    rope_scaling, or 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta", params.pop("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def qwen3_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The `model.*` keys of the native model equal to a Qwen3 / Qwen3-MoE config.json; ValueError
    naming what the native model cannot express. The vocabulary is kept exactly (as for GPT-NeoX:
    make_vocab_size_divisible_by divides vocab_size, so padding adds no rows)."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']} (Qwen3's MLP is SwiGLU: silu)")
    if hf.get("attention_bias", False):
        problems.append("attention_bias=true (the native has_bias puts biases on the MLP too)")
    if hf.get("use_sliding_window", False):
        problems.append("use_sliding_window=true")
    theta, scaling = _rope(hf)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "linear"):
        problems.append(f"rope_scaling type {scaling.get('rope_type', scaling.get('type'))} (native: llama3, linear)")
    if problems:
        raise ValueError(f"{hf.get('model_type')} config.json options the native model cannot express: "
                         f"{', '.join(problems)}")
    vocab, heads = int(hf["vocab_size"]), int(hf["num_attention_heads"])
    keys: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads, "qk_layernorm": True,
        "max_position_embeddings": hf.get("max_position_embeddings", 40960),
        "normalization": "rmsnorm", "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6), "activation": "swiglu",
        "has_bias": False, "position_embedding_type": "rope", "rope_theta": theta,
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "vocab_size": vocab, "make_vocab_size_divisible_by": math.gcd(vocab, 128),
        "attention_dropout": hf.get("attention_dropout", 0.0), "init_method_std": hf.get("initializer_range", 0.02),
    }
    if scaling:
        keys["rope_scaling"] = dict(scaling)
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 writes the latter
    if hf.get("model_type") == "qwen3_moe" and experts:
        layers = qwen3_moe_layers(hf)
        keys["moe"] = {
            "num_experts": experts, "top_k": hf["num_experts_per_tok"], "frequency": 1,
            "ffn_hidden_size": hf["moe_intermediate_size"], "routing_algorithm": "top_k",
            "router_activation": "softmax", "normalize_top_k_affinities": bool(hf.get("norm_topk_prob", True)),
            "capacity_factor": None, "dropless": True,
            "output_router_logits": bool(hf.get("output_router_logits", False)),
            "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
        }
        if len(layers) != keys["num_layers"]:
            keys["moe"]["layers"] = layers
    return keys


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (`<block>.mlp.experts.<e>.{gate,up,down}_proj.weight`) stacked into
    `<block>.mlp.experts.gate_up_proj` [E, 2F, H] (each expert's gate rows, then its up rows) and
    `<block>.mlp.experts.down_proj` [E, H, F]; other tensors (and already fused ones) unchanged.
    ValueError when a block's experts are not numbered 0..E-1 with all three weights."""
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        blocks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in blocks.items():
        n = len(experts)
        if sorted(experts) != list(range(n)) or any(len(w) != 3 for w in experts.values()):
            raise ValueError(f"{prefix}: experts must be numbered 0..{n - 1}, each with gate_proj, up_proj "
                             "and down_proj weights")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])
    return out
