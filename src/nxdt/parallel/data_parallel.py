"""Data parallelism: replicate (DDP / ZeRO-1), FSDP2 full shard, HSDP, grad-shard; meta-device init.

The dp part of the mesh is (dp_replicate, dp_shard) (see nxdt.parallel.mesh):

    mode (nxdt.spec.parallel)   mesh used                         FSDP2 call
    replicate (no-shard, DDP)     flattened dp                      replicate (gradients all-reduced)
    shard (FSDP, full-shard)      dp_shard                          fully_shard(reshard_after_forward=True)
    grad-shard                    dp_shard                          fully_shard(reshard_after_forward=False)
    hybrid (HSDP, hybrid-*)       (dp_replicate, dp_shard)          fully_shard on the 2-D mesh
    Every spelling of distributed_strategy.sharding_strategy is in nxdt.spec.parallel.SHARDING_MODES.
With context parallelism (cp > 1) replicate runs over dp × cp and FSDP shards over dp_shard × cp:
cp ranks hold the same parameters and sum their slices' gradients like dp ranks.

Each decoder block is its own unit (its gradient reduction overlaps the backward of the
block before it); the root takes what is left (embedding, final norm, lm_head). The modules
already carry the tp sharding as DTensors, so FSDP over dp composes into a 2-D layout.

Expert parallelism (nxdt.parallel.expert_parallel): the expert weights are sharded over ep, a
part of dp, so they are not reduced over all of dp. Each experts module becomes its own unit
over the edp axis (the experts' replicas) when edp > 1; with dp == ep they have no replicas and
data parallel leaves them out (`ignored_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor

from nxdt.config.errors import ConfigError
from nxdt.device import accelerator_available
from nxdt.models import init_model_weights
from nxdt.models.adapter import adapter_of
from nxdt.parallel.expert_parallel import expert_modules, expert_parameters
from nxdt.parallel.mesh import expert_mesh, submesh
from nxdt.precision.precision import fsdp_mixed_precision_policy, stochastic_master_weights
from nxdt.precision.sr_fsdp import SRState, wrap_for_stochastic_rounding


@dataclass(frozen=True)
class DataParallelConfig:
    """What `apply_data_parallel` does; built from the run spec by `data_parallel_config` (the plan holds it)."""

    mode: str = "replicate"
    """'replicate' (DDP semantics) or 'shard' (FSDP2 over dp_shard, HSDP when dp_replicate > 1)."""
    reshard_after_forward: bool = True
    """False for grad-shard (ZeRO-2-like: parameters stay gathered between forward and backward)."""
    mp_policy: object | None = None
    """A torch.distributed.fsdp.MixedPrecisionPolicy, or None (fp32 throughout)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy)."""
    stochastic_rounding: bool = False
    """mixed_precisionSR: the bf16 all-gather copy is stochastically rounded (nxdt.precision.sr_fsdp)."""


def data_parallel_config(sharding, precision, cpu_offload: bool = False) -> DataParallelConfig:
    """From the run spec's sharding mode (nxdt.spec.parallel.ShardingMode) and precision settings
    (nxdt.spec.precision.PrecisionSettings), and `distributed_strategy.cpu_offload`."""
    shard = sharding.shard
    mp_policy = fsdp_mixed_precision_policy(precision) if shard else None
    if precision.reduce_dtype == "bf16":  # fms-fsdp's bfSixteen: gradients reduced (and averaged) in bf16
        if not shard:
            raise ConfigError("precision.grad_reduce_dtype=bf16 needs a sharding data-parallel mode (FSDP2 reduces "
                              "in its reduce_dtype): set distributed_strategy.fsdp=true or sharding_strategy FSDP / "
                              "HSDP, or keep fp32")
        mp_policy = dataclasses.replace(mp_policy or MixedPrecisionPolicy(), reduce_dtype=torch.bfloat16)
    return DataParallelConfig(
        mode="shard" if shard else "replicate",
        reshard_after_forward=sharding.reshard_after_forward,
        mp_policy=mp_policy,
        cpu_offload=cpu_offload,
        stochastic_rounding=shard and stochastic_master_weights(precision),
    )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (`model.model.layers`; `model.gpt_neox.layers` for transformers' GPT-NeoX)."""
    return adapter_of(model).blocks(model)


def _units(model: nn.Module, units: tuple[str, ...] | None) -> list[nn.Module]:
    """The data-parallel units besides the root: a plan's (StagePlan.data_parallel), else the blocks."""
    return transformer_blocks(model) if units is None else [model.get_submodule(path) for path in units]


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh, dp_cfg: DataParallelConfig | None = None,
                        units: tuple[str, ...] | None = None) -> None:
    """Wrap `model` for data parallelism over the dp axes of `mesh` (no-op when dp == 1), each of
    `units` (module paths; None: the decoder blocks) its own unit, the root the rest."""
    dp_cfg = dp_cfg or DataParallelConfig()
    if dp_cfg.mode == "shard":
        _fully_shard(model, mesh, dp_cfg, units)
    else:
        _replicate(model, mesh, units)


def _replicate(model: nn.Module, mesh: DeviceMesh, units: tuple[str, ...] | None = None) -> None:
    """FSDP2's replicate (DDP semantics, per-block buckets) over the flattened dp axis.

    Gradients are all-reduced (averaged) during the backward of the last micro-batch; the
    training step turns the sync off for the earlier ones with `set_requires_gradient_sync`.
    """
    dp_mesh = submesh(mesh, "dp_cp")  # context-parallel ranks reduce gradients like dp ranks
    if dp_mesh.size() == 1:
        return
    ignored = _wrap_experts(model, mesh, replicate)
    for block in _units(model, units):
        replicate(block, mesh=dp_mesh, ignored_params=ignored)
    replicate(model, mesh=dp_mesh, ignored_params=ignored)


def _wrap_experts(model: nn.Module, mesh: DeviceMesh, wrap, **kwargs) -> set[nn.Parameter] | None:
    """Expert-parallel experts: their own data-parallel units over edp (when it has replicas).
    Returns the expert weights the dense units must leave alone (None without expert parallelism)."""
    edp = expert_mesh(mesh, "edp")
    if edp is None:
        return None
    if edp.size() > 1:
        for experts in expert_modules(model):
            wrap(experts, mesh=edp, **kwargs)
    return expert_parameters(model)


def _fully_shard(model: nn.Module, mesh: DeviceMesh, dp_cfg: DataParallelConfig,
                 units: tuple[str, ...] | None = None) -> None:
    if mesh["dp_replicate"].size() > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"]  # HSDP: replicate × shard (cp > 1 refused by validation)
    else:
        dp_mesh = submesh(mesh, "dp_shard_cp")  # with cp > 1 parameters are sharded over dp × cp
    if dp_mesh.size() == 1:
        return
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=dp_cfg.mp_policy or MixedPrecisionPolicy(),
        # pinned host memory needs an accelerator; on a CPU-only run offloading changes nothing
        offload_policy=CPUOffloadPolicy(pin_memory=accelerator_available()) if dp_cfg.cpu_offload else OffloadPolicy(),
    )
    if dp_cfg.stochastic_rounding:  # before fully_shard: FSDP shards (and keeps) the subclass
        wrap_for_stochastic_rounding(model, SRState())  # Precision.attach seeds and steps it
    expert_kwargs = {k: v for k, v in kwargs.items() if k != "mesh"}
    ignored = _wrap_experts(model, mesh, fully_shard, reshard_after_forward=dp_cfg.reshard_after_forward,
                            **expert_kwargs)
    blocks = _units(model, units)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward: keep them.
        fully_shard(block, reshard_after_forward=dp_cfg.reshard_after_forward and i < len(blocks) - 1,
                    ignored_params=ignored, **kwargs)
    fully_shard(model, reshard_after_forward=dp_cfg.reshard_after_forward, ignored_params=ignored, **kwargs)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn dp gradient reduction on/off (no-op for a model without data parallelism)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


# --------------------------------------------------------------------------- meta-device init
def wants_meta_init(cfg, device_type: str) -> bool:
    """Build on the meta device and materialise only this rank's shards: `low_cpu_fsdp` /
    `meta_init`, or `model.use_cpu_initialization: false` on an accelerator."""
    ds = cfg.distributed_strategy
    if ds.low_cpu_fsdp or ds.meta_init:
        return True
    return not cfg.model.use_cpu_initialization and device_type != "cpu"


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device (already parallelized) model on `device` and initialise it.

    Only the local shards are allocated. Random initialisers are drawn as in one process:
    each random fill of a DTensor draws the full tensor from the (identically seeded) default
    generator, one parameter at a time, and keeps the local shard — so shards are never
    duplicates of one another, and the weights equal an unsharded meta-init with the same seed.
    """
    model.to_empty(device=device)
    with _FullRandomFill():
        init_model_weights(model)
    return model


class _FullRandomFill(torch.overrides.TorchFunctionMode):
    """Random fills of a DTensor draw the global tensor, then keep this rank's shard.

    On CPU meshes DTensor's own RNG tracker is off: every rank would fill its shard from the
    same generator state, making all shards equal."""

    _RANDOM = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.normal_, torch.nn.init.uniform_,
               torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_,
               torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.nn.init functions pass the tensor as a keyword (`tensor=`), Tensor methods positionally
        target = args[0] if args else kwargs.get("tensor")
        if func in self._RANDOM and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            if args:
                func(full, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": full})
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target.to_local().copy_(local)
            return target
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- ZeRO-1
def zero1_optimizer(params, optimizer_class: type, kwargs: dict, process_group,
                    rank_local: set[torch.Tensor] | None = None):
    """`optimizer_class(params, **kwargs)` with its state sharded over `process_group` (ZeRO-1).

    torch's ZeroRedundancyOptimizer: each dp rank steps the parameters it owns (whole tensors,
    balanced by size) and broadcasts them to the others. Gradients stay all-reduced (replicate),
    so every rank holds full gradients and clipping sees the true global norm.
    Parameter groups without `weight_decay` support get a single group.

    `rank_local`: parameters that differ between the dp ranks (expert-parallel experts, already
    sharded over ep): every rank steps its own, none is broadcast. (Their optimizer state is
    sharded by ep, not further over the experts' replicas.)
    """
    if "weight_decay" not in inspect.signature(optimizer_class.__init__).parameters:
        params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return DTensorZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=process_group,
                                          rank_local=rank_local, **kwargs)


class DTensorZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer that also takes DTensor parameters (tensor parallel / replicate).

    The only change: the post-step broadcast sends each parameter's local tensor (c10d
    collectives do not accept DTensors). Each rank's dp peers hold the same tp shard, so the
    local tensors are what must agree.

    Checkpoints: `state_dict()` needs `consolidate_state_dict(to=0)` first (a gather on rank 0);
    for sharded checkpoints save `self.optim.state_dict()` on every rank instead.
    """

    def __init__(self, params, *, rank_local: set[torch.Tensor] | None = None, **kwargs) -> None:
        self._rank_local = set(rank_local or ())  # before torch's __init__, which partitions
        super().__init__(params, **kwargs)

    def _partition_parameters(self, params_per_rank=None):
        """torch's partition, then the rank-local parameters moved into every rank's share."""
        fresh = not self._partition_parameters_cache
        partition = super()._partition_parameters(params_per_rank)
        if fresh and self._rank_local:
            for rank_groups in partition:
                for group, full in zip(rank_groups, self.param_groups):
                    group["params"] = ([p for p in group["params"] if p not in self._rank_local]
                                       + [p for p in full["params"] if p in self._rank_local])
        return partition

    def _broadcast_params_from_rank(self, rank: int):
        if self.parameters_as_bucket_view:
            return super()._broadcast_params_from_rank(rank)
        src = dist.get_global_rank(self.process_group, rank)
        handles = []
        with torch.no_grad():
            for group in self._partition_parameters()[rank]:
                for param in group["params"]:
                    if param in self._rank_local:
                        continue
                    tensor = param.to_local() if isinstance(param, DTensor) else param
                    handles.append(dist.broadcast(tensor.detach(), src=src, group=self.process_group,
                                                  async_op=True))
        return handles
