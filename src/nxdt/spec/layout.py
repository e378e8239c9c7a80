"""The parallel layout and batch arithmetic derived from a config (no torch).

    dp               = world / (tp x pp x cp)
    num_microbatches = global_batch_size / (micro_batch_size x dp)
    local_batch_size = micro_batch_size x num_microbatches   (one dp rank's share of a step)
    tokens_per_step  = global_batch_size x seq_length

Each division must be exact; otherwise `compute_layout` raises ConfigError naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nxdt.config.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    vpp: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    local_batch_size: int
    seq_length: int | None
    tokens_per_step: int | None

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


def compute_layout(cfg: Any, world_size: int | None = None) -> Layout:
    """Layout of `cfg` (an NxdtConfig) on `world_size` ranks (default: trainer.devices x trainer.num_nodes)."""
    if world_size is None:
        world_size = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    ds = "distributed_strategy"
    d = cfg.distributed_strategy
    tp = int(d.tensor_model_parallel_size)
    pp = int(d.pipeline_model_parallel_size)
    cp = int(d.context_parallel_size)
    ep = int(d.expert_model_parallel_size)
    vpp = int(d.virtual_pipeline_model_parallel_size or 1)  # null = 1 (schema)
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                        ("virtual_pipeline_model_parallel_size", vpp)):
        if value < 1:
            raise ConfigError(f"{ds}.{name}: must be >= 1, got {value}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    mp = tp * pp * cp
    if world_size % mp:
        raise ConfigError(
            f"{ds}.tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x "
            f"context_parallel_size ({cp}) = {mp} does not divide the world size {world_size}")
    dp = world_size // mp
    if dp % ep:
        raise ConfigError(
            f"{ds}.expert_model_parallel_size ({ep}) does not divide the data-parallel size {dp} "
            f"(= world {world_size} / (tp x pp x cp = {mp}))")
    mbs = int(cfg.data.micro_batch_size)
    gbs = int(cfg.data.global_batch_size)
    if mbs < 1 or gbs < 1:
        raise ConfigError(f"data.micro_batch_size ({mbs}) and data.global_batch_size ({gbs}) must be >= 1")
    if gbs % (mbs * dp):
        raise ConfigError(
            f"data.global_batch_size ({gbs}) is not divisible by data.micro_batch_size ({mbs}) x "
            f"data-parallel size ({dp}) = {mbs * dp}")
    nmb = gbs // (mbs * dp)
    seq = cfg.data.seq_length
    seq = int(seq) if isinstance(seq, (int, float)) and not isinstance(seq, bool) else None
    return Layout(
        world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, vpp=vpp,
        micro_batch_size=mbs, global_batch_size=gbs, num_microbatches=nmb,
        local_batch_size=mbs * nmb, seq_length=seq,
        tokens_per_step=gbs * seq if seq is not None else None,
    )
