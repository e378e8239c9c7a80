"""`build_model(cfg, vocab_size)`: the one place the `model.*` keys become a module.

`cfg.model_source` picks the implementation:
- 'megatron' → nxdt's own Llama (`NxdtLlamaForCausalLM`), architecture from `cfg.model.*`,
  vocabulary padded Megatron-style;
- 'hf'       → a `transformers` model from the local `cfg.model.model_config` json.

`cfg` is the typed config (`nxdt.config.schema.NxdtConfig`); defaults live in the schema only.
The model comes with its source's adapter (nxdt.models.adapter: `adapter_of(model)`), which answers
what parallelism, generation and the planner ask of it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from nxdt.models.adapter import HF, NATIVE, adapter_of, attach_adapter
from nxdt.models.deepseek_v3 import DEEPSEEK_V3_MODEL_TYPES, deepseek_v3_model_keys
from nxdt.models.hf import HF_MOE_OVERRIDES, HF_OVERRIDES, build_hf_model, load_config_dict
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.models.lora import adapters_detached, reset_lora_parameters
from nxdt.models.mla import MLAArgs
from nxdt.models.moe import MoEArgs
from nxdt.models.moe_calculators import with_llama_moe
from nxdt.spec import config_from_dict


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Smallest multiple of divisible_by × tp that is ≥ vocab_size (Megatron's padding:
    each tensor-parallel rank then holds an equal, aligned slice of the embedding)."""
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(vocab_size) // multiple) * multiple


def count_parameters(model: nn.Module) -> int:
    """Number of parameters; a shared (tied) tensor counts once. Works on meta tensors."""
    return sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates


def logits_of(output: Any) -> torch.Tensor:
    """Logits from either model source: the native model returns them, transformers wraps them."""
    return output if isinstance(output, torch.Tensor) else output.logits


def llama_args_from_cfg(cfg: Any, vocab_size: int | None = None) -> LlamaArgs:
    """LlamaArgs from the typed config's `model` section (megatron source), with the vocabulary
    padded (make_vocab_size_divisible_by x tensor_model_parallel_size).

    Defaults are the schema's; a null below has the meaning the schema documents for it.
    """
    m = cfg.model
    missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
               if getattr(m, k) is None]
    if missing:
        raise ValueError(f"model_source megatron needs model.{', model.'.join(missing)}")
    if vocab_size is None:
        vocab_size = m.vocab_size
    if vocab_size is None:
        raise ValueError("model_source megatron needs a vocabulary size (from the tokenizer, or model.vocab_size)")
    tp = cfg.distributed_strategy.tensor_model_parallel_size
    return LlamaArgs(
        vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_kv_heads=m.num_kv_heads,  # null = num_attention_heads (LlamaArgs)
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,  # null = hidden_size / num_attention_heads (LlamaArgs)
        # null = encoder_seq_length (validation sets it so for megatron; a hand-made config may not)
        max_position_embeddings=m.max_position_embeddings or m.encoder_seq_length,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        activation=m.activation,
        has_bias=m.has_bias,
        mlp_bias=m.mlp_bias,
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percentage=m.rotary_percentage,
        rope_theta=rope_base(m),
        rope_scaling=m.rope_scaling,  # an open section: a plain dict
        sliding_window_size=m.sliding_window_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        ffn_dropout=m.ffn_dropout,
        init_method_std=m.init_method_std,
        use_scaled_init_method=m.use_scaled_init_method,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        transformer_block_type=m.transformer_block_type,
        gpt_j_tied=m.gpt_j_tied,
        moe=moe_args_from_cfg(m.moe, m.activation),
        moe_ffn_hidden_size=m.moe.ffn_hidden_size if m.moe.num_experts else None,
        moe_layers=tuple(m.moe.layers) if m.moe.num_experts and m.moe.layers is not None else None,
        qk_layernorm=m.qk_layernorm,
        mla=mla_args_from_cfg(m.mla),
    )


def mla_args_from_cfg(mla: Any) -> MLAArgs | None:
    """MLAArgs from the typed `model.mla` section; None (plain attention) without mla.kv_lora_rank."""
    if mla.kv_lora_rank is None:
        return None
    return MLAArgs(kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                   rope_interleave=mla.rope_interleave)


def rope_base(m: Any) -> float:
    """The rotary base of the typed `model` section: rope_theta, or NeoX's rotary_emb_base (validation
    refuses both with different values); null = 10000 for megatron (schema)."""
    for value in (m.rope_theta, m.rotary_emb_base):
        if value is not None:
            return float(value)
    return 10000.0


def moe_args_from_cfg(moe: Any, activation: str = "swiglu") -> MoEArgs | None:
    """MoEArgs from the typed `model.moe` section; None for a dense model (num_experts 0).
    The mixtral gate's load-balancing loss joins the training loss only with output_router_logits,
    as in transformers' Mixtral; LLaMA-MoE's gates weigh theirs by gate_balance_loss_weight (0:
    not added). The statistics are logged either way. The experts take model.moe.expert_activation,
    null: `activation` (model.activation)."""
    if not moe.num_experts:
        return None
    gate_type = moe.gate_type  # LLaMA-MoE's class names are normalised by validation (nxdt.config.schema)
    balancing = moe.load_balancing or "aux_loss"  # null: the balance loss as before (nxdt.spec.moe)
    if balancing != "aux_loss":
        coef = 0.0  # loss_free balances by the selection bias; none: statistics only
    elif gate_type == "mixtral":
        coef = moe.router_aux_loss_coef if moe.output_router_logits else 0.0
    else:
        coef = moe.gate_balance_loss_weight
    return with_llama_moe(MoEArgs(
        num_experts=moe.num_experts, top_k=moe.top_k, frequency=moe.frequency,
        routing_algorithm=moe.routing_algorithm, router_activation=moe.router_activation,
        normalize_top_k_affinities=moe.normalize_top_k_affinities, capacity_factor=moe.capacity_factor,
        dropless=moe.dropless, sinkhorn_iterations=moe.sinkhorn_iterations,
        sinkhorn_tol=None if moe.sinkhorn_tol is None else float(moe.sinkhorn_tol),
        aux_loss_coef=coef, dropout=moe.dropout, score_scale=moe.moe_calculator_score_scale_factor,
        gate_type=gate_type, gate_add_noise=moe.gate_add_noise, gate_noise_epsilon=moe.gate_noise_epsilon,
        num_groups=moe.num_groups, group_top_k=moe.group_top_k, load_balancing=balancing,
        bias_update_rate=moe.bias_update_rate, num_shared_experts=moe.num_shared_experts,
        expert_activation=getattr(moe, "expert_activation", None) or activation,
        gate_network=getattr(moe, "gate_network", "linear"),
    ), moe)


def native_twin_args(cfg: Any, model_config: str, overrides: dict[str, Any]) -> LlamaArgs | None:
    """model_source hf with a config.json nxdt builds natively (DeepSeek-V3: transformers' parameter names,
    nxdt.models.deepseek_v3): the native model's arguments (vocabulary as the config.json's, unpadded, as
    transformers keeps it; model.moe.load_balancing / bias_update_rate from the YAML); None otherwise."""
    d = load_config_dict(model_config, overrides)
    if d.get("model_type") not in DEEPSEEK_V3_MODEL_TYPES:
        return None
    keys = deepseek_v3_model_keys(d)
    moe = cfg.model.moe
    if "moe" in keys:
        keys["moe"].update(bias_update_rate=moe.bias_update_rate,
                           **({"load_balancing": moe.load_balancing} if moe.load_balancing else {}))
    return llama_args_from_cfg(config_from_dict({"model_source": "megatron", "model": keys}))


def build_model(cfg: Any, vocab_size: int | None = None, device: str | torch.device | None = None) -> nn.Module:
    """The model for the typed config `cfg` (see module docstring), fp32.

    device='meta' builds the structure without allocating memory (for models larger than
    host memory, or to count parameters); materialise later with `init_model_weights`.
    On a real device the weights are initialised here.
    """
    source = cfg.model_source
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        if source == "megatron":
            model = attach_adapter(NxdtLlamaForCausalLM(llama_args_from_cfg(cfg, vocab_size)), NATIVE)
        elif source == "hf":
            model_config = cfg.model.model_config
            if not model_config:
                raise ValueError("model_source hf needs model.model_config (path to a config.json)")
            overrides = {k: getattr(cfg.model, k) for k in HF_OVERRIDES}
            native = native_twin_args(cfg, model_config, overrides)
            if native is not None:  # DeepSeek-V3: the native model in transformers' names
                model = attach_adapter(NxdtLlamaForCausalLM(native), NATIVE)
            elif cfg.model.moe.num_experts:
                overrides.update({f"moe.{k}": getattr(cfg.model.moe, k) for k in HF_MOE_OVERRIDES})
            if native is None:
                model = attach_adapter(build_hf_model(model_config, overrides, moe_args_from_cfg(cfg.model.moe)), HF)
        else:
            raise ValueError(f"model_source must be 'megatron' or 'hf', got {source!r}")
    if not _is_meta(model) and adapter_of(model) is NATIVE:
        model.init_weights()  # Megatron init, not nn.Linear's default kaiming-uniform
    return model


@torch.no_grad()
def init_model_weights(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Materialise a meta-device model on `device` (if given) and (re)initialise its weights,
    for either model source. Tied weights are re-tied.

    LoRA adapters (nxdt.models.lora) are drawn after the model's own weights, as peft draws them
    (A kaiming-uniform, B zeros). While the model initialises itself they are taken off, so its
    initialisation of every nn.Linear neither touches them nor draws for them: with the same seed
    the base weights equal those of the same model without LoRA."""
    if device is not None:
        model.to_empty(device=device)
    with adapters_detached(model):
        adapter_of(model).init_weights(model)
    reset_lora_parameters(model)
    return model


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())
