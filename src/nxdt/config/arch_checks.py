"""Checks of the model's architecture keys that no single key's type can express (torch-free):
the rotary settings, the block-type options, and the parallel layouts transformers' GPT-NeoX
(model_source hf) is not built for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.resolvers import shipped_conf_dir

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
