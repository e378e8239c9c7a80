"""Whether a run compiles its decoder blocks: `model.fusions.torch_compile` or fms-fsdp's
`model.use_torch_compile` (either turns it on). One reader for validation, the parallel plan and
the run. Standard library only."""

from __future__ import annotations

from typing import Any

from nxdt.config.errors import ConfigError


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
