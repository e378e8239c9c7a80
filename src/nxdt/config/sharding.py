"""Sharding strategies: every accepted spelling -> what nxdt builds (one table).

    spelling (NxDT, fms-fsdp, minimal_fsdp)            built
    no-shard, DDP (default)                            replicate over dp (gradients all-reduced)
    FSDP, full-shard                                   FSDP2 full shard over dp
    grad-shard                                         full shard, parameters kept gathered
                                                       between forward and backward (ZeRO-2-like)
    HSDP, hybrid-full-shard                            shard within a node, replicate across nodes
    hybrid-grad-shard                                  HSDP without reshard after forward
    distributed_strategy.fsdp: true, no strategy       FSDP

Lowercase and underscore spellings (fms-fsdp's `fsdp`, `hsdp`, `ddp`, `hybrid_shard`,
`full_shard`, ...) mean the same. `schema.SHARDING_STRATEGIES` (the schema's Literal) is the
key list of `SHARDING_MODES`. This module imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nxdt.config.errors import ConfigError


@dataclass(frozen=True)
class ShardingMode:
    """What a sharding strategy builds."""

    shard: bool
    """True: FSDP2 fully_shard over dp_shard; False: replicate (DDP semantics) over dp."""
    reshard_after_forward: bool = True
    """False for grad-shard: parameters stay gathered between forward and backward."""
    hybrid: bool = False
    """HSDP: dp = dp_replicate (across nodes) x dp_shard (within a node)."""

    @property
    def name(self) -> str:
        """Short name for messages: replicate | shard | grad-shard | hybrid | hybrid-grad-shard."""
        if not self.shard:
            return "replicate"
        base = "hybrid" if self.hybrid else "shard"
        return base if self.reshard_after_forward else ("hybrid-grad-shard" if self.hybrid else "grad-shard")


REPLICATE = ShardingMode(shard=False)
FULL_SHARD = ShardingMode(shard=True)
GRAD_SHARD = ShardingMode(shard=True, reshard_after_forward=False)
HYBRID = ShardingMode(shard=True, hybrid=True)
HYBRID_GRAD_SHARD = ShardingMode(shard=True, reshard_after_forward=False, hybrid=True)

# Documented spellings first (the schema's error message lists them in this order), then the
# lowercase / underscore ones that fms-fsdp and minimal_fsdp configs use.
SHARDING_MODES: dict[str, ShardingMode] = {
    "FSDP": FULL_SHARD, "HSDP": HYBRID, "full-shard": FULL_SHARD, "hybrid-full-shard": HYBRID,
    "grad-shard": GRAD_SHARD, "hybrid-grad-shard": HYBRID_GRAD_SHARD, "no-shard": REPLICATE, "DDP": REPLICATE,
    "fsdp": FULL_SHARD, "hsdp": HYBRID, "ddp": REPLICATE, "full_shard": FULL_SHARD,
    "hybrid_shard": HYBRID, "hybrid_full_shard": HYBRID, "grad_shard": GRAD_SHARD,
    "hybrid_grad_shard": HYBRID_GRAD_SHARD, "no_shard": REPLICATE,
}


def sharding_mode(name: str | None) -> ShardingMode:
    """The mode of a `sharding_strategy` spelling (case-insensitive; None = no-shard)."""
    if name is None:
        return REPLICATE
    mode = SHARDING_MODES.get(str(name))
    if mode is None:
        folded = {k.lower(): v for k, v in SHARDING_MODES.items()}
        mode = folded.get(str(name).lower())
    if mode is None:
        raise ConfigError(f"distributed_strategy.sharding_strategy: unknown strategy '{name}' "
                          f"(expected one of {list(SHARDING_MODES)})")
    return mode


def sharding_mode_of(ds: Any) -> ShardingMode:
    """The mode of a `distributed_strategy` section: `sharding_strategy`, else FSDP when fms-fsdp's
    `fsdp: true` is set, else replicate."""
    if ds.sharding_strategy is not None:
        return sharding_mode(ds.sharding_strategy)
    return FULL_SHARD if ds.fsdp else REPLICATE
