"""The model's architecture and fusion settings beyond a single key's type: the effective
architecture numbers (`ModelArch`: the config's keys over a transformers config.json), their
divisibility by the tensor-parallel size, rotary and block-type options, activation
checkpointing's class names and chunks, the layouts transformers' GPT-NeoX is not built for,
whether blocks compile (`model.fusions.torch_compile` / `model.use_torch_compile`), and where the
chunked output layer + cross entropy (`model.fusions.cross_entropy_chunk_size`) is built. Torch-free."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.resolvers import shipped_conf_dir
from nxdt.config.validate import did_you_mean
from nxdt.spec.alignment import Alignment
from nxdt.spec.layout import Layout


# --------------------------------------------------------------------------- effective architecture
@dataclass(frozen=True)
class ModelArch:
    """Architecture numbers as the model builder will see them (hf: config.json under the config's keys)."""

    num_layers: int | None
    """Decoder blocks (model.num_layers / num_hidden_layers)."""
    hidden_size: int | None
    """Width of the residual stream."""
    ffn_hidden_size: int | None
    """Width of the MLP (intermediate_size)."""
    num_attention_heads: int | None
    """Query heads."""
    num_kv_heads: int | None
    """Key/value heads (= num_attention_heads without grouped-query attention)."""
    max_position_embeddings: int | None
    """Longest sequence the positions cover."""
    kv_channels: int | None
    """Head dimension when given (model.kv_channels / head_dim), else None."""
    hf_json: dict = field(default_factory=dict, compare=False)
    """The transformers config.json model.model_config names ({} for megatron or when unreadable)."""

    @property
    def head_dim(self) -> int | None:
        """The effective head dimension (kv_channels, else hidden / heads; None when not known yet)."""
        heads, hidden = self.num_attention_heads, self.hidden_size
        return self.kv_channels or (hidden // heads if hidden and heads else None)


def hf_json(cfg: Any) -> dict:
    """The content of model.model_config under model_source hf ({} otherwise or when unreadable)."""
    path = cfg.model.model_config
    if cfg.model_source != "hf" or not path or not os.path.isfile(str(path)):
        return {}
    try:
        with open(str(path), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def model_arch(cfg: Any) -> ModelArch:
    """The effective architecture of `cfg` (hf: config.json's numbers under the config's overrides)."""
    hf = hf_json(cfg)
    m = cfg.model

    def pick(key: str, json_key: str):
        v = getattr(m, key)
        return v if v is not None else hf.get(json_key)

    heads = pick("num_attention_heads", "num_attention_heads")
    kv = pick("num_kv_heads", "num_key_value_heads") or heads
    return ModelArch(
        num_layers=pick("num_layers", "num_hidden_layers"),
        hidden_size=pick("hidden_size", "hidden_size"),
        ffn_hidden_size=pick("ffn_hidden_size", "intermediate_size"),
        num_attention_heads=heads,
        num_kv_heads=kv,
        max_position_embeddings=pick("max_position_embeddings", "max_position_embeddings"),
        kv_channels=pick("kv_channels", "head_dim"),
        hf_json=hf,
    )


def check_source(cfg: Any) -> None:
    """The keys each model_source needs: megatron's architecture numbers, hf's config.json."""
    model = cfg.model
    if cfg.model_source == "megatron":
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if getattr(model, key) is None:
                raise ConfigError(f"model.{key} is required for model_source megatron")
    elif model.model_config is None:
        raise ConfigError("model.model_config (a transformers config.json) is required for model_source hf")


def check_dimensions(cfg: Any, arch: ModelArch, layout: Layout) -> None:
    """Numbers >= 1, heads split over tensor parallel, K/V heads and tp dividing one another, the
    sequence within the positions."""
    heads, kv, hidden, tp = arch.num_attention_heads, arch.num_kv_heads, arch.hidden_size, layout.tp
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads",
                "max_position_embeddings"):
        value = getattr(arch, key)
        if value is not None and value < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {value}")
    if heads is not None:
        if heads % tp:
            raise ConfigError(f"model.num_attention_heads ({heads}) is not divisible by "
                              f"distributed_strategy.tensor_model_parallel_size ({tp})")
        if hidden is not None and arch.kv_channels is None and hidden % heads:
            raise ConfigError(f"model.hidden_size ({hidden}) is not divisible by model.num_attention_heads ({heads})")
        if kv is not None:
            if heads % kv:
                raise ConfigError(f"model.num_attention_heads ({heads}) is not divisible by model.num_kv_heads ({kv})")
            if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
                raise ConfigError(f"model.num_kv_heads ({kv}) and distributed_strategy.tensor_model_parallel_size "
                                  f"({tp}) must divide one another (K/V heads are split or replicated across tp)")
    seq, maxpos = cfg.data.seq_length, arch.max_position_embeddings
    if seq is not None and maxpos is not None and seq > maxpos:
        raise ConfigError(f"data.seq_length ({seq}) exceeds model.max_position_embeddings ({maxpos})")


# --------------------------------------------------------------------------- activation checkpointing
# Module classes of a Llama block that `model.activations_checkpoint_recompute` may name (native
# model; transformers' Llama has the same names, CoreAttention meaning its LlamaAttention).
RECOMPUTE_CLASSES = ("CoreAttention", "LlamaAttention", "LlamaDecoderLayer", "LlamaLayerNorm", "LlamaMLP",
                     "LlamaRMSNorm", "Linear", "SiLU", "GELU", "Dropout",
                     # NxDT's HF Mixtral names (the native MoE model is the Llama), and its rotary
                     # embeddings, which nxdt computes once per forward (nothing to recompute)
                     "MixtralRMSNorm", "MixtralDecoderLayer", "LlamaRotaryEmbedding", "MixtralRotaryEmbedding")


def check_recompute_classes(cfg: Any, arch: ModelArch) -> None:
    """Unknown class names in activations_checkpoint_recompute (Llama models; other transformers
    architectures are checked against their modules when the model is built)."""
    names = cfg.model.activations_checkpoint_recompute
    if not names:
        return
    if cfg.model_source == "hf" and arch.hf_json.get("model_type", "llama") != "llama":
        return
    for name in names:
        if name not in RECOMPUTE_CLASSES:
            raise ConfigError(f"model.activations_checkpoint_recompute: unknown module class '{name}'"
                              f"{did_you_mean(str(name), RECOMPUTE_CLASSES)}; valid: {', '.join(RECOMPUTE_CLASSES)}")


def check_checkpoint_layers(cfg: Any) -> None:
    """model.checkpoint_num_layers > 1 checkpoints chunks of whole blocks (ranges: the schema's)."""
    model = cfg.model
    p, n = model.selective_checkpointing, model.checkpoint_num_layers
    if n > 1 and (model.activations_checkpoint_granularity != "full" or p is not None):
        raise ConfigError(f"model.checkpoint_num_layers ({n}) needs model.activations_checkpoint_granularity=full "
                          "and no model.selective_checkpointing")


# --------------------------------------------------------------------------- arch checks
# transformers' GPT-NeoX under model_source hf: its blocks are `gpt_neox.layers` with a fused QKV and
# `attention.dense`, which the tensor/context/expert-parallel plans and the pipeline cuts (written for
# Llama's tree) do not know. Data parallel is built. The native model (model_source megatron with the
# NeoX keys, `nxdt convert hf-to-nxdt` writes them) takes every layout.
HF_NEOX_NOT_SUPPORTED_YET = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                             "context_parallel_size", "expert_model_parallel_size")


def check_architecture(cfg: Any, head_dim: int | None) -> None:
    """`head_dim`: the effective head dimension (None when it cannot be known yet)."""
    m = cfg.model
    pct = m.rotary_percentage
    if not 0.0 < pct <= 1.0:
        raise ConfigError(f"model.rotary_percentage: must be in (0, 1], got {pct} (Pythia rotates a quarter: 0.25)")
    if m.rope_theta is not None and m.rotary_emb_base is not None and float(m.rope_theta) != float(m.rotary_emb_base):
        raise ConfigError(f"model.rotary_emb_base ({m.rotary_emb_base}) and model.rope_theta ({m.rope_theta}) are "
                          "the same setting (GPT-NeoX's and Llama's name for the rotary base); give one")
    if cfg.model_source == "megatron" and m.position_embedding_type == "rope" and head_dim:
        rotary = int(head_dim * pct)
        if rotary < 2 or rotary % 2:
            raise ConfigError(f"model.rotary_percentage: {pct} of the head dimension {head_dim} is {rotary} "
                              "dimensions; rotary embedding needs an even number >= 2")
    check_native_only_keys(cfg)
    if cfg.model_source == "megatron" and m.transformer_block_type == "normformer" and m.moe.num_experts:
        raise ConfigError("model.transformer_block_type normformer with model.moe: the experts have no FFN norm "
                          "(normformer's third norm); use pre_ln, post_ln or gpt_j with MoE")


def check_native_only_keys(cfg: Any) -> None:
    """The native model's keys: model.qk_layernorm, model.moe.layers / ffn_hidden_size, model.mlp_bias (with
    model_source hf the config.json says: q/k norms, mlp_only_layers, moe_intermediate_size); MoE
    layer indices within the model."""
    m = cfg.model
    given = [key for key, value in (("model.qk_layernorm", m.qk_layernorm), ("model.moe.layers", m.moe.layers),
                                    ("model.moe.ffn_hidden_size", m.moe.ffn_hidden_size),
                                    ("model.mlp_bias", m.mlp_bias is not None),
                                    ("model.mla.kv_lora_rank", m.mla.kv_lora_rank is not None)) if value]
    if cfg.model_source == "hf" and given:
        raise ConfigError(f"{', '.join(given)}: the native model's (model_source megatron); with model_source hf "
                          "model.model_config's config.json sets them (Qwen3: q_norm / k_norm, mlp_only_layers, "
                          "moe_intermediate_size; Llama: mlp_bias; DeepSeek-V3: kv_lora_rank ...)")
    if m.mla.kv_lora_rank is not None and m.num_kv_heads not in (None, m.num_attention_heads):
        raise ConfigError(f"model.num_kv_heads ({m.num_kv_heads}): multi-head latent attention (model.mla) gives every "
                          f"head its own keys and values; leave it null or = model.num_attention_heads "
                          f"({m.num_attention_heads})")
    if m.mtp_num_layers:
        raise ConfigError(f"model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction is not supported yet")
    layers = m.moe.layers
    if layers is None or cfg.model_source != "megatron":
        return
    if not m.moe.num_experts:
        raise ConfigError("model.moe.layers names MoE layers: needs model.moe.num_experts > 0")
    if m.moe.frequency != 1:
        raise ConfigError(f"model.moe.layers and model.moe.frequency ({m.moe.frequency}) both choose the MoE layers; "
                          "give one")
    bad = [i for i in layers if m.num_layers is not None and not 0 <= i < m.num_layers]
    if bad or len(set(layers)) != len(layers):
        raise ConfigError(f"model.moe.layers {list(layers)}: distinct layer indices in [0, model.num_layers="
                          f"{m.num_layers}) expected")


def check_hf_layouts(cfg: Any) -> None:
    """'not supported yet' for model_source hf with a GPT-NeoX config.json under tp/pp/cp/ep > 1."""
    if cfg.model_source != "hf" or hf_model_type(cfg.model.model_config) != "gpt_neox":
        return
    for key in HF_NEOX_NOT_SUPPORTED_YET:
        size = getattr(cfg.distributed_strategy, key)
        if size > 1:
            raise ConfigError(f"'distributed_strategy.{key}' > 1 with model_source hf and a gpt_neox model_config "
                              f"is not supported yet (got {size}); use model_source megatron with the NeoX keys "
                              "(nxdt convert hf-to-nxdt writes them)")


def hf_model_type(path: str | None) -> str | None:
    """model_type of the config.json `model.model_config` names (a file or a folder holding one, as
    given or under nxdt's conf/, as nxdt.models.hf finds it); None when it cannot be read here
    (check_files reports a missing file)."""
    if not path:
        return None
    given = Path(str(path)).expanduser()
    for candidate in (given, shipped_conf_dir() / given):
        if candidate.is_dir():
            candidate = candidate / "config.json"
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            return data.get("model_type") if isinstance(data, dict) else None
    return None


# --------------------------------------------------------------------------- compile settings
def wants_compile(cfg: Any) -> bool:
    """model.fusions.torch_compile, or fms-fsdp's model.use_torch_compile: the blocks compile."""
    model = cfg.model
    return bool(model.fusions.torch_compile or model.use_torch_compile)


def check_compile(cfg: Any, layout: Any) -> None:
    """Compile with tensor parallelism and selective activation checkpointing is refused (not
    supported yet): with torch 2.13 the compiled attention's saved-tensor policy meets the tp plan's
    DeviceMesh and fails. Full recomputation, or selective without tp, compiles."""
    if wants_compile(cfg) and layout.tp > 1 and cfg.model.activations_checkpoint_granularity == "selective":
        raise ConfigError("model.fusions.torch_compile with distributed_strategy.tensor_model_parallel_size > 1 and "
                          "model.activations_checkpoint_granularity=selective is not supported yet (torch 2.13's "
                          "compiled selective recomputation fails on the tensor-parallel plan); use "
                          "activations_checkpoint_granularity=full, or compile without tp")


# --------------------------------------------------------------------------- loss checks
CHUNK_KEY = "model.fusions.cross_entropy_chunk_size"


def check_loss_chunking(cfg: Any, layout: Layout, alignment: Alignment) -> None:
    """Where the chunked output layer + cross entropy is not built yet."""
    if not cfg.model.fusions.cross_entropy_chunk_size:
        return
    why = ("model_source=hf (transformers' models compute their own logits)" if cfg.model_source == "hf" else
           "distributed_strategy.pipeline_model_parallel_size > 1 (the last stage's loss runs inside the "
           "pipeline schedule)" if layout.pp > 1 else
           "ORPO (its NLL also scores the prompt tokens)" if alignment.preference == "orpo" else
           "DPO and distributed_strategy.tensor_model_parallel_size > 1 (DPO scores its response tokens in the "
           "model on one tensor-parallel rank only)" if alignment.preference == "dpo" and layout.tp > 1 else None)
    if why is not None:
        raise ConfigError(f"{CHUNK_KEY} with {why} is not supported yet; leave it null there")
