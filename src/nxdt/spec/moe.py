"""`model.moe` in the run spec (`MoESpec`: experts, top-k, the canonical gate) and its checks:
routing choices that fit together, and what the MoE layer is built with.

Each problem is one ConfigError line naming the dotted key. Called by `validate` after the schema's
stage, where `canonical_gate_type` normalises the aliases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.schema import canonical_gate_type

# LLaMA-MoE's class names (their config's `gate_type`) → nxdt's names
LLAMA_MOE_GATES = ("top_k_balanced_noisy", "switch_balanced")


@dataclass(frozen=True)
class MoESpec:
    """What model.moe builds, aliases resolved."""

    num_experts: int
    """Experts per MoE layer; 0: a dense model."""
    top_k: int
    """Experts each token is routed to."""
    gate_type: str
    """The gate, canonical: mixtral | top_k_balanced_noisy | switch_balanced (LLaMA-MoE's names mapped)."""
    load_balancing: str = "aux_loss"
    """aux_loss | loss_free | none; model.moe.load_balancing null resolves to aux_loss (the balance loss as
    output_router_logits / gate_balance_loss_weight say, as before the key existed)."""

    @property
    def enabled(self) -> bool:
        """An MoE model (num_experts > 0)."""
        return self.num_experts > 0

    @property
    def llama_moe_gate(self) -> bool:
        """One of LLaMA-MoE's gates (their own routing and balance loss)."""
        return self.gate_type in LLAMA_MOE_GATES


def moe_of(cfg: Any) -> MoESpec:
    """The MoE piece of the run spec of a typed `cfg`."""
    moe = cfg.model.moe
    return MoESpec(num_experts=int(moe.num_experts), top_k=int(moe.top_k), gate_type=canonical_gate_type(moe.gate_type),
                   load_balancing=moe.load_balancing or "aux_loss")


def check_moe(cfg: Any, piece: MoESpec, hf_json: dict) -> None:
    """model.moe of the typed `cfg`; `piece`: its MoESpec; `hf_json` is model.model_config's content ({} when none)."""
    moe = cfg.model.moe
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts: must be >= 0, got {moe.num_experts}")
    gate = piece.gate_type
    if gate in LLAMA_MOE_GATES and cfg.model_source != "megatron":  # hf: also when config.json gives the experts
        raise ConfigError(f"model.moe.gate_type {gate}: LLaMA-MoE's gates are built for model_source megatron "
                          f"only (got {cfg.model_source})")
    hf_type = hf_json.get("model_type", "llama") if cfg.model_source == "hf" else None
    if piece.load_balancing != "aux_loss" and hf_type not in (None, "mixtral", "deepseek_v3"):
        raise ConfigError(f"model.moe.load_balancing {piece.load_balancing}: built for nxdt's MoE block (model_source "
                          f"megatron, or hf with a mixtral / deepseek_v3 config.json), not transformers' {hf_type!r} block")
    if not moe.num_experts:
        return
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k ({moe.top_k}) must be between 1 and model.moe.num_experts ({moe.num_experts})")
    if moe.frequency < 1:
        raise ConfigError(f"model.moe.frequency: must be >= 1 (every N-th layer is MoE), got {moe.frequency}")
    if moe.routing_algorithm == "sinkhorn" and moe.top_k != 1:
        raise ConfigError(f"model.moe.routing_algorithm sinkhorn picks one expert per token: model.moe.top_k must "
                          f"be 1, got {moe.top_k}")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0 and not moe.dropless:
        raise ConfigError(f"model.moe.capacity_factor: must be > 0 (or null, or model.moe.dropless=true), "
                          f"got {moe.capacity_factor}")
    if moe.sinkhorn_iterations < 1:
        raise ConfigError(f"model.moe.sinkhorn_iterations: must be >= 1, got {moe.sinkhorn_iterations}")
    check_gate(cfg, gate)
    check_llama_moe_layer(cfg, gate)
    check_routing_extras(cfg, piece)
    check_experts(cfg)
    if cfg.model_source == "hf":
        if hf_json.get("model_type") == "deepseek_v3":
            # nxdt's native DeepSeek-V3 (nxdt.models.deepseek_v3): the config.json routes (sigmoid, groups, shared
            # experts); model.moe.num_experts / top_k override n_routed_experts / num_experts_per_tok, and
            # load_balancing / bias_update_rate apply; every layout the native model takes
            return
        if hf_json and "num_local_experts" not in hf_json:
            raise ConfigError(f"model.moe.num_experts ({moe.num_experts}) with model_source hf needs a Mixtral-style "
                              f"model.model_config (with num_local_experts); {cfg.model.model_config} is model_type "
                              f"'{hf_json.get('model_type', 'llama')}'")
        if hf_json.get("model_type", "mixtral") == "mixtral":
            # nxdt's MoE block in transformers' names (nxdt.models.hf): every routing key applies but the
            # layer pattern, which is the config.json's (every Mixtral layer is an MoE layer)
            if moe.frequency != 1:
                raise ConfigError(f"model.moe.frequency={moe.frequency}: not supported with model_source hf "
                                  f"(every layer of transformers' Mixtral is an MoE layer); nxdt's own MoE builds it "
                                  f"under model_source megatron with the architecture in model.*")
            return
        routing = {"frequency": 1, "routing_algorithm": "top_k", "router_activation": "softmax", "num_groups": None,
                   "num_shared_experts": 0, "load_balancing": None,
                   "capacity_factor": None, "normalize_top_k_affinities": True, "moe_calculator_score_scale_factor": 1.0,
                   "gate_type": "mixtral"}
        for key, plain in routing.items():
            if getattr(moe, key) != plain:
                raise ConfigError(f"model.moe.{key}={getattr(moe, key)}: not supported with model_source hf and "
                                  f"model_type {hf_json['model_type']!r} (its own MoE block routes every layer top-k by "
                                  f"softmax, renormalized, no capacity); Mixtral's is nxdt's MoE block")
        for key in HF_MOE_NOT_SUPPORTED_YET:
            size = getattr(cfg.distributed_strategy, key)
            if size > 1:
                raise ConfigError(f"'distributed_strategy.{key}' > 1 with model_source hf and model_type "
                                  f"{hf_json['model_type']!r} is not supported yet (got {size}); Mixtral's MoE takes it")


def check_routing_extras(cfg: Any, piece: MoESpec) -> None:
    """Group-limited routing (num_groups / group_top_k), shared experts and loss-free balancing: the
    mixtral gate's top-k routing only, with numbers that fit together."""
    moe = cfg.model.moe
    if moe.group_top_k is not None and moe.num_groups is None:
        raise ConfigError("model.moe.group_top_k needs model.moe.num_groups (the groups it picks among)")
    if moe.num_groups is not None:
        groups, per = moe.num_groups, moe.num_experts // moe.num_groups
        if moe.num_experts % groups:
            raise ConfigError(f"model.moe.num_groups ({groups}) does not divide model.moe.num_experts ({moe.num_experts})")
        pick = moe.group_top_k or groups
        if pick > groups or pick * per < moe.top_k or (groups > 1 and per < 2):
            raise ConfigError(f"model.moe.group_top_k ({pick}) must be <= model.moe.num_groups ({groups}) and its groups "
                              f"hold the top_k ({moe.top_k}) experts, {per} per group (at least 2: a group scores by "
                              "its two best)")
    extras = [k for k, on in (("num_groups", moe.num_groups is not None), ("num_shared_experts", moe.num_shared_experts),
                              ("load_balancing loss_free", piece.load_balancing == "loss_free")) if on]
    if extras and (piece.gate_type != "mixtral" or moe.routing_algorithm != "top_k"):
        raise ConfigError(f"model.moe.{extras[0]}: built for the mixtral gate's top_k routing (got gate_type "
                          f"{piece.gate_type}, routing_algorithm {moe.routing_algorithm})")
    if piece.load_balancing == "loss_free" and moe.output_router_logits:
        raise ConfigError("model.moe.load_balancing loss_free balances without the auxiliary loss: set "
                          "model.moe.output_router_logits false (or load_balancing aux_loss)")


def check_experts(cfg: Any) -> None:
    """model.moe.expert_activation (null: model.activation): swiglu experts are nxdt's (Mixtral's
    layout, every parallel layout); two-matrix experts (GPT-NeoX's) are built for model_source
    megatron and stay whole on each rank (no expert parallelism yet). Experts have no biases: with
    model.has_bias only attention and dense MLP layers get them (as GPT-NeoX's MoE)."""
    moe = cfg.model.moe
    act = moe.expert_activation or cfg.model.activation
    if cfg.model_source == "hf":
        if moe.gate_network != "linear":
            raise ConfigError(f"model.moe.gate_network={moe.gate_network}: built for model_source megatron only "
                              f"(transformers' MoE blocks bring their own router)")
        if moe.expert_activation not in (None, "swiglu"):
            raise ConfigError(f"model.moe.expert_activation={moe.expert_activation}: two-matrix experts are built "
                              f"for model_source megatron only (transformers' MoE blocks bring their own experts)")
        return
    if act not in ("swiglu", "gelu", "gelu_tanh", "silu"):
        raise ConfigError(f"model.moe.expert_activation: null takes model.activation ({act}), which the experts "
                          f"do not build; give swiglu, gelu, gelu_tanh or silu")
    if cfg.model.mlp_bias and (moe.frequency == 1 and moe.layers is None):
        raise ConfigError("model.mlp_bias=true with every layer an MoE layer: experts have no biases "
                          "(model.has_bias gives attention its biases; the experts' MLPs have none)")
    ep = cfg.distributed_strategy.expert_model_parallel_size
    if act != "swiglu" and ep > 1:
        raise ConfigError(f"'distributed_strategy.expert_model_parallel_size' > 1 with two-matrix experts "
                          f"(model.moe.expert_activation {act}) is not supported yet (got {ep})")


LLAMA_MOE_LAYER_DEFAULTS = {
    "calculator_type": "UniversalCalculator", "drop_tokens": True, "dropped_padding": "zero", "gate_use_softmax": True,
    "gate_use_balance": True, "multiply_gate_scores": True, "add_weight_norm": False, "switch_gate_weight": "probability",
    "size_experts": None, "num_experts_residual": 0, "residual_ffn_hidden_size": None, "gate_use_softmax_residual": True,
    "multiply_gate_scores_residual": True, "score_scale_factor_residual": 1.0}
"""LLaMA-MoE's layer keys beyond its gates (nxdt.models.moe_calculators) at the values that build nothing new."""


def check_llama_moe_layer(cfg: Any, gate: str) -> None:
    """LLaMA-MoE's calculators, gate switches, unequal experts and residual block: model_source megatron,
    numbers that fit the model, one process per expert bank (no tp / ep yet)."""
    moe = cfg.model.moe
    changed = [k for k, plain in LLAMA_MOE_LAYER_DEFAULTS.items() if getattr(moe, k) != plain]
    if not changed:
        return
    key = f"model.moe.{changed[0]}"
    if cfg.model_source != "megatron":
        raise ConfigError(f"{key}={getattr(moe, changed[0])}: LLaMA-MoE's layer options are built for model_source "
                          f"megatron only (got {cfg.model_source})")
    for size in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        if getattr(cfg.distributed_strategy, size) > 1:
            raise ConfigError(f"'distributed_strategy.{size}' > 1 with {key} (LLaMA-MoE's layer options) is not "
                              f"supported yet (got {getattr(cfg.distributed_strategy, size)})")
    if moe.calculator_type == "SwitchDropTokenCalculator" and moe.top_k != 1:
        raise ConfigError(f"model.moe.calculator_type SwitchDropTokenCalculator computes one expert per token: "
                          f"model.moe.top_k (num_selects) must be 1, got {moe.top_k}")
    if moe.calculator_type == "SwitchDropTokenCalculator" and moe.dropless:
        raise ConfigError("model.moe.dropless=true with calculator_type SwitchDropTokenCalculator: set "
                          "model.moe.drop_tokens false instead (LLaMA-MoE's name)")
    if moe.switch_gate_weight != "probability" and gate != "switch_balanced":
        raise ConfigError(f"model.moe.switch_gate_weight={moe.switch_gate_weight}: needs model.moe.gate_type "
                          f"switch_balanced (SwitchBalancedGate), got {gate}")
    if not moe.gate_use_softmax and gate not in LLAMA_MOE_GATES:
        raise ConfigError("model.moe.gate_use_softmax=false: LLaMA-MoE's gates' switch; needs model.moe.gate_type "
                          f"top_k_balanced_noisy or switch_balanced, got {gate}")
    width = moe.ffn_hidden_size or cfg.model.ffn_hidden_size
    if moe.size_experts is not None:
        rows = moe.size_experts
        if (moe.expert_activation or cfg.model.activation) != "swiglu":
            raise ConfigError("model.moe.size_experts: built for swiglu experts")
        if peft_targets_experts(cfg):
            raise ConfigError("model.moe.size_experts with model_alignment_strategy.peft.target_parameters: LoRA on "
                              "unequal experts is not supported yet (the adapters would fill their zero padding)")
        if len(rows) != cfg.model.num_layers:
            raise ConfigError(f"model.moe.size_experts: one list per layer ({cfg.model.num_layers}), got {len(rows)}")
        for i, row in enumerate(rows):
            if len(row) != moe.num_experts or not all(1 <= int(s) <= width for s in row):
                raise ConfigError(f"model.moe.size_experts[{i}] = {list(row)}: needs {moe.num_experts} widths in "
                                  f"[1, {width}] (model.moe.ffn_hidden_size, the stored width)")
    if moe.num_experts_residual and not (moe.residual_ffn_hidden_size or moe.ffn_hidden_size):
        raise ConfigError("model.moe.num_experts_residual: give model.moe.residual_ffn_hidden_size (each residual "
                          "expert's width)")


def peft_targets_experts(cfg: Any) -> bool:
    """LoRA adapters on the expert weights (model_alignment_strategy.peft.target_parameters)."""
    peft = getattr(getattr(cfg, "model_alignment_strategy", None), "peft", None)
    return bool(getattr(peft, "target_parameters", None))


def check_gate(cfg: Any, gate: str) -> None:
    """The gate (`gate`: canonical) and its balance loss: LLaMA-MoE's gates bring their own routing
    and loss, so the mixtral gate's keys must stay at their defaults with them (they would be
    ignored), and the other way round."""
    moe = cfg.model.moe
    if moe.gate_balance_loss_weight < 0:
        raise ConfigError(f"model.moe.gate_balance_loss_weight: must be >= 0, got {moe.gate_balance_loss_weight}")
    if moe.gate_noise_epsilon < 0:
        raise ConfigError(f"model.moe.gate_noise_epsilon: must be >= 0, got {moe.gate_noise_epsilon}")
    if gate not in LLAMA_MOE_GATES:
        if moe.gate_balance_loss_weight > 0:
            raise ConfigError(f"model.moe.gate_balance_loss_weight={moe.gate_balance_loss_weight} weighs LLaMA-MoE's "
                              f"balance loss: needs model.moe.gate_type top_k_balanced_noisy or switch_balanced "
                              f"(the mixtral gate's loss is model.moe.router_aux_loss_coef)")
        return
    if gate == "switch_balanced" and moe.top_k != 1:
        raise ConfigError(f"model.moe.gate_type switch_balanced picks one expert per token: model.moe.top_k "
                          f"(num_selects) must be 1, got {moe.top_k}")
    mixtral_only = {"routing_algorithm": "top_k", "router_activation": "softmax", "output_router_logits": False}
    for key, plain in mixtral_only.items():
        if getattr(moe, key) != plain:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)}: the mixtral gate's setting; with "
                              f"model.moe.gate_type {gate} routing and its loss are the gate's own "
                              f"(weight: model.moe.gate_balance_loss_weight)")


# pp, ep and cp are built for nxdt's MoE block (native, and hf Mixtral's), not for another transformers
# MoE block (checked in check_moe, which knows the config.json's model_type; its balance loss is a hook's)
HF_MOE_NOT_SUPPORTED_YET = ("pipeline_model_parallel_size", "expert_model_parallel_size", "context_parallel_size")


def check_moe_layouts_supported(cfg: Any) -> None:
    """'not supported yet' for the parallel layouts an MoE model cannot take yet (skippable, like
    every NOT_SUPPORTED_YET check): under context parallel a cp rank routes a slice of each sequence,
    which only per-token routing takes (the balance loss and loads are summed over cp: nxdt.models.moe_balance)."""
    moe, cp = cfg.model.moe, cfg.distributed_strategy.context_parallel_size
    if not moe.num_experts or cp <= 1:
        return
    refused = {"model.moe.capacity_factor (an expert's capacity is the whole micro-batch's; set model.moe.dropless)":
               moe.capacity_factor is not None and not moe.dropless,
               f"model.moe.routing_algorithm {moe.routing_algorithm} (balances over all the micro-batch's tokens)":
               moe.routing_algorithm != "top_k",
               f"model.moe.gate_type {moe.gate_type} (LLaMA-MoE's gate losses)": canonical_gate_type(moe.gate_type)
               != "mixtral"}
    for what, bad in refused.items():
        if bad:
            raise ConfigError(f"'distributed_strategy.context_parallel_size' > 1 with {what} is not supported yet "
                              f"(got {cp})")


def check_expert_parallel(cfg: Any) -> None:
    """distributed_strategy.expert_model_parallel_size: an MoE model whose experts split evenly."""
    ep, moe = cfg.distributed_strategy.expert_model_parallel_size, cfg.model.moe
    if ep <= 1:
        return
    key = "distributed_strategy.expert_model_parallel_size"
    if not moe.num_experts:
        raise ConfigError(f"{key} ({ep}) needs an MoE model (model.moe.num_experts > 0)")
    if moe.num_experts % ep:
        raise ConfigError(f"model.moe.num_experts ({moe.num_experts}) is not divisible by {key} ({ep})")
