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
    """Compile with tensor parallelism is refused (not supported yet): with torch 2.13 the compiled
    blocks' backward fails in DTensor's redistribution of the tp plan's activations."""
    if wants_compile(cfg) and layout.tp > 1:
        raise ConfigError("model.fusions.torch_compile with distributed_strategy.tensor_model_parallel_size > 1 is not "
                          "supported yet (the compiled blocks' backward fails in DTensor's redistribution); compile "
                          "works with FSDP / ZeRO-1 / replicate, activation checkpointing and pipelines")
