"""The parallel layout and batch arithmetic derived from a config (no torch): the one description
of a run's ranks, read by the DeviceMesh (nxdt.parallel.mesh builds it from `Layout.sizes()`), the
parallel plan, the planner and the start summary.

    dp               = world / (tp x pp x cp) = dp_replicate x dp_shard
    num_microbatches = global_batch_size / (micro_batch_size x dp)
    local_batch_size = micro_batch_size x num_microbatches   (one dp rank's share of a step)
    tokens_per_step  = global_batch_size x seq_length

Each division must be exact; otherwise `compute_layout` raises ConfigError naming the numbers.

The data-parallel ranks split into replicated copies x FSDP shards by the sharding strategy
(`split_dp`): replicate (no-shard / DDP / ZeRO-1): all dp ranks replicate; FSDP / grad-shard: all
shard; hybrid (HSDP): shard within a node, replicate across nodes.

Mesh axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (`MESH_AXES`);
with expert parallelism a second mesh over the same ranks splits dp into ``edp`` x ``ep``
(`EXPERT_MESH_AXES`, see nxdt.parallel.mesh).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.schema import sharding_way

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "edp", "ep", "cp", "tp")
_WAYS = ("replicate", "shard", "grad-shard", "hybrid", "hybrid-grad-shard")


@dataclass(frozen=True)
class Layout:
    """How a run's ranks are laid out (and its batch arithmetic). `Layout(tp=2)` is a mesh shape
    alone (the batch fields keep their defaults), as the tests and benchmarks build meshes."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """expert parallel, within dp (not an axis of the main mesh: see nxdt.parallel.mesh)"""
    dp_replicate: int = 1
    dp_shard: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    num_microbatches: int = 1
    local_batch_size: int = 1
    seq_length: int | None = None
    tokens_per_step: int | None = None

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def sizes(self) -> tuple[int, ...]:
        """The DeviceMesh's sizes, in `MESH_AXES` order."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def expert_sizes(self) -> tuple[int, ...]:
        """The expert mesh's sizes, in `EXPERT_MESH_AXES` order (dp = edp x ep)."""
        return (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)

    def with_sharding(self, sharding: Any = None, num_nodes: int = 1) -> Layout:
        """This layout with dp split as `sharding` builds it: a `sharding_strategy` spelling, a way
        name, or a ShardingMode (nxdt.spec.parallel); None = replicate."""
        replicate, shard = split_dp(self.dp, _way(sharding), num_nodes)
        return replace(self, dp_replicate=replicate, dp_shard=shard)


def _way(sharding: Any) -> str:
    name = getattr(sharding, "name", sharding)  # a ShardingMode's name is its way
    return name if name in _WAYS else sharding_way(name)


def split_dp(dp: int, way: str, num_nodes: int = 1) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a sharding way (nxdt.config.schema.sharding_way's names)."""
    if way.startswith("hybrid"):
        replicate = max(1, min(num_nodes, dp))
        if dp % replicate:
            replicate = 1
        return replicate, dp // replicate
    if way == "replicate":
        return dp, 1
    return 1, dp


def compute_layout(cfg: Any, world_size: int | None = None) -> Layout:
    """Layout of `cfg` (an NxdtConfig) on `world_size` ranks (default: trainer.devices x trainer.num_nodes),
    dp split by its sharding strategy (HSDP replicates over hsdp_replicate_size, null: the nodes)."""
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
    num_nodes = d.hsdp_replicate_size or int(cfg.trainer.num_nodes)  # null: shard within a node
    replicate, shard = split_dp(dp, sharding_way(d.sharding_strategy, d.fsdp), num_nodes)
    return Layout(
        tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=replicate, dp_shard=shard, vpp=vpp,
        micro_batch_size=mbs, global_batch_size=gbs, num_microbatches=nmb,
        local_batch_size=mbs * nmb, seq_length=seq,
        tokens_per_step=gbs * seq if seq is not None else None,
    )
