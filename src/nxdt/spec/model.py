"""The model's architecture and fusion settings beyond a single key's type: rotary and block-type
options, the layouts transformers' GPT-NeoX is not built for, whether blocks compile
(`model.fusions.torch_compile` / `model.use_torch_compile`), and where the chunked output layer +
cross entropy (`model.fusions.cross_entropy_chunk_size`) is built. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.resolvers import shipped_conf_dir
from nxdt.spec.alignment import alignment_of


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
    if cfg.model_source == "megatron" and m.transformer_block_type == "normformer" and m.moe.num_experts:
        raise ConfigError("model.transformer_block_type normformer with model.moe: the experts have no FFN norm "
                          "(normformer's third norm); use pre_ln, post_ln or gpt_j with MoE")


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


def check_loss_chunking(cfg: Any, layout: Any) -> None:
    if not cfg.model.fusions.cross_entropy_chunk_size:
        return
    alignment = alignment_of(cfg)
    why = ("model_source=hf (transformers' models compute their own logits)" if cfg.model_source == "hf" else
           "distributed_strategy.pipeline_model_parallel_size > 1 (the last stage's loss runs inside the "
           "pipeline schedule)" if layout.pp > 1 else
           "DPO / ORPO (their losses take per-sequence log-probs from the logits)" if alignment.preference is not None
           else None)
    if why is not None:
        raise ConfigError(f"{CHUNK_KEY} with {why} is not supported yet; leave it null there")
