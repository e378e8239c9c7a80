"""DeepSeek-V3 as the native model: the `model.*` keys of a transformers config.json (model_type
deepseek_v3) and back (`deepseek_v3_config_dict`, for nxdt convert nxdt-to-hf).

DeepSeek-V3 is nxdt's Llama with
- multi-head latent attention (nxdt.models.mla; `model.mla.*`: kv_lora_rank, q_lora_rank (null in
  V2-Lite-style configs), qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave);
- dense MLPs (intermediate_size) in the first `first_k_dense_replace` layers, MoE layers after
  (`model.moe.layers`), experts moe_intermediate_size wide (`model.moe.ffn_hidden_size`);
- in each MoE layer, `n_shared_experts` shared experts (`model.moe.num_shared_experts`: one
  SwiGLU MLP `mlp.shared_experts`), sigmoid scores (`router_activation: sigmoid`), group-limited
  top-k (`n_group` / `topk_group` → `model.moe.num_groups` / `group_top_k`), `norm_topk_prob`
  (`normalize_top_k_affinities`), `routed_scaling_factor` (`moe_calculator_score_scale_factor`) and
  the selection bias `mlp.gate.e_score_correction_bias` (a buffer: `load_balancing: loss_free`);
- YaRN rope scaling (rope_scaling as transformers writes it; the softmax scale gets mscale^2).
Parameter names are transformers', so the weights are a copy. Multi-token prediction
(num_nextn_predict_layers, `model.mtp_num_layers`) is not built yet: the published config.json
carries num_nextn_predict_layers 1 with its MTP layer stored as layer `num_hidden_layers`
(model.layers.61), which is left out, with a notice, as transformers leaves it out.
"""

from __future__ import annotations

import math
from typing import Any

DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3",)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta", params.pop("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or params or {}) or None
    if scaling:
        kind = scaling.pop("type", None)
        scaling["rope_type"] = scaling.get("rope_type", kind or "default")
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def mtp_notice(hf: dict[str, Any]) -> str | None:
    """One line when the config.json carries multi-token prediction layers (left out), else None."""
    n = int(hf.get("num_nextn_predict_layers") or 0)
    if not n:
        return None
    last = int(hf["num_hidden_layers"])
    return (f"notice: num_nextn_predict_layers={n}: multi-token prediction is not supported yet; its layer(s) "
            f"model.layers.{last}{'..' + str(last + n - 1) if n > 1 else ''} are left out (as transformers does)")


def deepseek_v3_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The `model.*` keys of the native model equal to a DeepSeek-V3 config.json; ValueError naming
    what the native model cannot express."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']}")
    if hf.get("attention_bias", False):
        problems.append("attention_bias=true")
    if hf.get("topk_method", "noaux_tc") not in ("noaux_tc", "group_limited_greedy"):
        problems.append(f"topk_method={hf['topk_method']}")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf['scoring_func']}")
    theta, scaling = _rope(hf)
    if scaling and scaling["rope_type"] not in ("yarn", "llama3", "linear"):
        problems.append(f"rope_scaling type {scaling['rope_type']} (native: yarn, llama3, linear)")
    if problems:
        raise ValueError(f"deepseek_v3 config.json options the native model cannot express: {', '.join(problems)}")
    vocab, heads, layers = int(hf["vocab_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    dense = int(hf.get("first_k_dense_replace") or 0)
    keys: dict[str, Any] = {
        "num_layers": layers, "hidden_size": hf["hidden_size"], "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads, "num_kv_heads": heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "normalization": "rmsnorm", "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6), "activation": "swiglu",
        "has_bias": False, "position_embedding_type": "rope", "rope_theta": theta,
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "vocab_size": vocab, "make_vocab_size_divisible_by": math.gcd(vocab, 128),
        "attention_dropout": hf.get("attention_dropout", 0.0), "init_method_std": hf.get("initializer_range", 0.02),
        "mla": {"kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": hf.get("q_lora_rank"),
                "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                "v_head_dim": hf["v_head_dim"], "rope_interleave": bool(hf.get("rope_interleave", True))},
    }
    if scaling:
        keys["rope_scaling"] = scaling
    experts = hf.get("num_local_experts") or hf.get("n_routed_experts")  # the former: a YAML override
    if experts and dense < layers:
        groups = hf.get("n_group") or 1
        keys["moe"] = {
            "num_experts": experts, "top_k": hf["num_experts_per_tok"], "frequency": 1,
            "ffn_hidden_size": hf["moe_intermediate_size"], "routing_algorithm": "top_k",
            "router_activation": "sigmoid", "normalize_top_k_affinities": bool(hf.get("norm_topk_prob", True)),
            "capacity_factor": None, "dropless": True,
            "num_shared_experts": int(hf.get("n_shared_experts") or 0),
            "num_groups": groups, "group_top_k": hf.get("topk_group") or groups,
            "moe_calculator_score_scale_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "load_balancing": "loss_free",  # the e_score_correction_bias buffer, updated as DeepSeek-V3 trains
        }
        if dense:
            keys["moe"]["layers"] = list(range(dense, layers))
    return keys


def deepseek_v3_config_dict(a: Any) -> dict[str, Any]:
    """transformers' DeepseekV3Config (as a config.json dict) of native LlamaArgs `a` with MLA; ValueError
    for what it cannot express."""
    m, moe = a.mla, a.moe
    issues = [text for bad, text in (
        (a.has_bias or a.mlp_bias, "biases"), (a.normalization != "rmsnorm", "layernorm"),
        (a.activation != "swiglu", f"activation {a.activation}"), (a.transformer_block_type != "pre_ln", "block type"),
        (a.qk_layernorm, "qk_layernorm"), (a.num_kv_heads != a.num_attention_heads, "num_kv_heads"),
        (a.sliding_window_size is not None, "sliding window"), (a.position_embedding_type != "rope", "no rope"),
        (moe is not None and (moe.router_activation != "sigmoid" or moe.drops_tokens or moe.gate_type != "mixtral"
                              or moe.routing_algorithm != "top_k"), "routing other than sigmoid top-k, dropless"),
    ) if bad]
    layers = list(a.moe_layers) if moe is not None and a.moe_layers is not None else list(range(a.num_layers))
    first_dense = layers[0] if layers else a.num_layers
    if moe is not None and layers != list(range(first_dense, a.num_layers)):
        issues.append(f"moe.layers {layers} (DeepSeek-V3: every layer from first_k_dense_replace on)")
    if moe is not None and moe.frequency != 1 and a.moe_layers is None:
        issues.append(f"moe.frequency {moe.frequency}")
    if issues:
        raise ValueError(f"transformers DeepseekV3Config cannot express: {', '.join(issues)}")
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_attention_heads,
        "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.layernorm_epsilon,
        "hidden_act": "silu", "rope_theta": a.rope_theta, "tie_word_embeddings": a.share_embeddings_and_output_weights,
        "attention_bias": False, "attention_dropout": a.attention_dropout, "initializer_range": a.init_method_std,
        "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
        "num_nextn_predict_layers": 0, "first_k_dense_replace": first_dense,
    }
    if a.rope_scaling:
        d["rope_scaling"] = dict(a.rope_scaling)
    if moe is None:  # an MLA model without experts: every layer dense
        d.update(first_k_dense_replace=a.num_layers, n_routed_experts=1, num_experts_per_tok=1, n_group=1,
                 topk_group=1, n_shared_experts=1, moe_intermediate_size=a.ffn_hidden_size)
        return d
    d.update({"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
              "moe_intermediate_size": a.moe_ffn_hidden_size or a.ffn_hidden_size,
              "n_shared_experts": moe.num_shared_experts, "n_group": moe.num_groups or 1,
              "topk_group": moe.group_top_k or 1, "norm_topk_prob": moe.normalize_top_k_affinities,
              "routed_scaling_factor": moe.score_scale})
    return d
