"""The transformers config.json equivalent to a native model's `LlamaArgs`, for `nxdt convert nxdt-to-hf`.

Five families cover what the native model builds and transformers can load unchanged:

- `LlamaForCausalLM`: RMSNorm, SwiGLU, pre_ln blocks, full rotary (the native model's defaults);
- `MixtralForCausalLM`: the same with Mixtral-style MoE layers;
- `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`: the same with q/k norms (`qk_layernorm`), and for
  Qwen3-MoE experts of their own width in the MoE layers (the others dense, `mlp_only_layers`);
- `DeepseekV3ForCausalLM`: multi-head latent attention (nxdt.models.deepseek_v3);
- `GPTNeoXForCausalLM` (GPT-NeoX, Pythia): LayerNorm, GELU (exact: hidden_act gelu; gelu_tanh:
  gelu_pytorch_tanh), biases, partial rotary, untied embeddings, and either parallel residual
  with two input norms (native `gpt_j` with `gpt_j_tied: false` = transformers'
  `use_parallel_residual: true`) or sequential (`pre_ln`). Llama and Mixtral are SwiGLU only.

The family is chosen from the arguments; when none can express them, the ValueError names, per
family, every option it lacks, so the user sees what to change. GPT-NeoX's parameter names
differ from the native (Llama) ones: `nxdt.models.neox` maps the weights.
"""

from __future__ import annotations

from typing import Any

from nxdt.models.deepseek_v3 import deepseek_v3_config_dict

# a native model's arguments, nxdt.models.llama.LlamaArgs (read by attribute): llama.py imports this
# module (LlamaArgs.to_hf_config_dict), so this one does not import it back
LlamaArgs = Any

# the plain Mixtral router: anything else is nxdt's own (LLaMA-MoE gates, sinkhorn, ...)
_MIXTRAL_MOE = {"frequency": 1, "routing_algorithm": "top_k", "router_activation": "softmax",
                "normalize_top_k_affinities": True, "score_scale": 1.0, "gate_type": "mixtral",
                "expert_activation": "swiglu", "gate_network": "linear"}


def hf_config_dict(args: LlamaArgs) -> dict[str, Any]:
    """config.json (as a dict) of the transformers model equal to `NxdtLlamaForCausalLM(args)`.
    Raises ValueError naming the options no transformers family here can express."""
    if args.mla is not None:  # DeepSeek-V3 is the family with multi-head latent attention
        return deepseek_v3_config_dict(args)
    if args.qk_layernorm:  # Qwen3 is the family with q/k norms
        issues = qwen3_issues(args)
        if issues:
            raise ValueError(f"transformers Qwen3{'Moe' if args.moe else ''}Config cannot express: {', '.join(issues)}")
        return _qwen3(args)
    if args.moe is not None:
        issues = _llama_issues(args) + [f"moe.{k}={getattr(args.moe, k)}" for k, v in _MIXTRAL_MOE.items()
                                        if getattr(args.moe, k) != v]
        if args.moe_layers is not None and len(args.moe_layers) != args.num_layers:
            issues.append("moe.layers (dense layers between the MoE ones: Qwen3-MoE has them, with qk_layernorm)")
        if args.moe_ffn_hidden_size not in (None, args.ffn_hidden_size):
            issues.append("moe.ffn_hidden_size != ffn_hidden_size")
        if issues:
            raise ValueError(f"transformers MixtralConfig cannot express: {', '.join(issues)}")
        return _mixtral(args)
    llama = _llama_issues(args)
    if not llama:
        return _llama(args)
    neox = neox_issues(args)
    if not neox:
        return _neox(args)
    raise ValueError(f"transformers LlamaConfig cannot express: {', '.join(llama)}; "
                     f"GPTNeoXConfig cannot express: {', '.join(neox)}")


def _llama_issues(a: LlamaArgs) -> list[str]:
    issues = []
    if a.normalization != "rmsnorm":
        issues.append(f"normalization={a.normalization}")
    if a.activation != "swiglu":
        issues.append(f"activation={a.activation}")
    if a.transformer_block_type != "pre_ln":
        issues.append(f"transformer_block_type={a.transformer_block_type}")
    if a.position_embedding_type != "rope":
        issues.append(f"position_embedding_type={a.position_embedding_type}")
    if a.rotary_percentage != 1.0:
        issues.append("rotary_percentage<1")
    if a.sliding_window_size is not None:
        issues.append("sliding_window_size")
    return issues


def neox_issues(a: LlamaArgs) -> list[str]:
    """What transformers' GPTNeoXConfig cannot express of `a` (empty: it is a GPT-NeoX)."""
    issues = []
    if a.moe is not None:
        issues.append("moe")
    if a.normalization != "layernorm":
        issues.append(f"normalization={a.normalization}")
    if a.activation not in ("gelu", "gelu_tanh"):
        issues.append(f"activation={a.activation}")
    if not a.has_bias:  # GPT-NeoX's MLP always has biases
        issues.append("has_bias=false")
    if a.mlp_bias is not None and a.mlp_bias != a.has_bias:  # ... and its attention too
        issues.append(f"mlp_bias={str(a.mlp_bias).lower()}")
    if a.transformer_block_type == "gpt_j" and a.gpt_j_tied:
        issues.append("transformer_block_type=gpt_j with gpt_j_tied=true (GPT-NeoX has two input norms)")
    elif a.transformer_block_type not in ("gpt_j", "pre_ln"):
        issues.append(f"transformer_block_type={a.transformer_block_type}")
    if a.position_embedding_type != "rope":
        issues.append(f"position_embedding_type={a.position_embedding_type}")
    if a.rope_scaling:
        issues.append("rope_scaling")
    if a.num_kv_heads != a.num_attention_heads:
        issues.append(f"num_kv_heads={a.num_kv_heads} (grouped-query attention)")
    if a.head_dim * a.num_attention_heads != a.hidden_size:
        issues.append(f"kv_channels={a.kv_channels}")
    if a.sliding_window_size is not None:
        issues.append("sliding_window_size")
    if a.share_embeddings_and_output_weights:
        issues.append("share_embeddings_and_output_weights=true")
    return issues


def qwen3_issues(a: LlamaArgs) -> list[str]:
    """What transformers' Qwen3Config / Qwen3MoeConfig cannot express of `a` (q/k norms assumed)."""
    issues = _llama_issues(a)
    if a.has_bias:  # Qwen3's attention_bias has no MLP counterpart
        issues.append("has_bias=true")
    if a.mlp_bias:  # nor biases in its MLP
        issues.append("mlp_bias=true")
    if a.rope_scaling:
        issues.append("rope_scaling")
    if a.moe is not None:
        plain = {**_MIXTRAL_MOE, "frequency": a.moe.frequency, "normalize_top_k_affinities": a.moe.normalize_top_k_affinities}
        issues += [f"moe.{k}={getattr(a.moe, k)}" for k, v in plain.items() if getattr(a.moe, k) != v]
    return issues


def _qwen3(a: LlamaArgs) -> dict[str, Any]:
    """Qwen3ForCausalLM, or Qwen3MoeForCausalLM with experts: every layer that is not an MoE one
    is listed in mlp_only_layers (decoder_sparse_step 1), which expresses any choice of MoE layers."""
    d = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "hidden_act": "silu", "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": a.layernorm_epsilon, "rope_theta": a.rope_theta, "attention_bias": False,
        "attention_dropout": a.attention_dropout, "initializer_range": a.init_method_std,
        "tie_word_embeddings": a.share_embeddings_and_output_weights, "use_sliding_window": False,
        "sliding_window": None,
    }
    moe = a.moe
    if moe is None:
        return d
    return {
        **d, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": a.moe_ffn_hidden_size or a.ffn_hidden_size, "norm_topk_prob": moe.normalize_top_k_affinities,
        "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(a.num_layers) if not a.is_moe_layer(i)],
        "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": moe.aux_loss_coef > 0,
    }


def _llama(a: LlamaArgs) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "hidden_act": "silu", "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": a.layernorm_epsilon, "rope_theta": a.rope_theta,
        "rope_scaling": dict(a.rope_scaling) if a.rope_scaling else None,
        "attention_bias": a.has_bias, "mlp_bias": a.has_bias if a.mlp_bias is None else a.mlp_bias,
        "attention_dropout": a.attention_dropout,
        "initializer_range": a.init_method_std, "tie_word_embeddings": a.share_embeddings_and_output_weights,
    }


def _mixtral(a: LlamaArgs) -> dict[str, Any]:
    moe = a.moe
    return {  # its inference computes every routed token (no capacity)
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size,
        "num_hidden_layers": a.num_layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim, "hidden_act": "silu",
        "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.layernorm_epsilon,
        "rope_theta": a.rope_theta, "attention_dropout": a.attention_dropout,
        "initializer_range": a.init_method_std, "tie_word_embeddings": a.share_embeddings_and_output_weights,
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": moe.aux_loss_coef > 0,
        "router_jitter_noise": 0.0, "sliding_window": None,
    }


def _neox(a: LlamaArgs) -> dict[str, Any]:
    # rotary_pct / rotary_emb_base: the names transformers 4.x reads and 5.x converts into its
    # rope_parameters, so either version loads the folder
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads,
        "hidden_act": "gelu_pytorch_tanh" if a.activation == "gelu_tanh" else "gelu",
        "max_position_embeddings": a.max_position_embeddings, "layer_norm_eps": a.layernorm_epsilon,
        "rotary_pct": a.rotary_percentage, "rotary_emb_base": a.rope_theta,
        "use_parallel_residual": a.transformer_block_type == "gpt_j", "attention_bias": True,
        "attention_dropout": a.attention_dropout, "hidden_dropout": a.hidden_dropout,
        "initializer_range": a.init_method_std, "tie_word_embeddings": False,
    }
