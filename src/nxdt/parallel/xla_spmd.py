"""The parallel plan as torch-xla SPMD (GSPMD) shardings: one process drives all of its host's XLA
devices, and parallelism is written as sharding annotations on a device mesh; XLA's partitioner
inserts the collectives (none is written here).

What a device holds comes from the same `ParallelPlan` (nxdt.parallel.plan.make_plan) that the
torch.distributed path applies with DTensor styles, read per parameter (`spmd_shardings`):

    plan.tensor_parallel style        partition spec of the module's parameters (mesh axis per dim)
    ColwiseParallel  (Linear)         weight ("tp", -), bias ("tp",)     whole heads / ffn columns
    RowwiseParallel  (Linear)         weight (-, "tp"), bias whole        partial sums reduced by XLA
    RowwiseParallel  (Embedding)      weight ("tp", -)                    vocabulary-parallel embedding
    ColwiseParallel  (lm_head)        weight ("tp", -)                    vocabulary-parallel logits
    SequenceParallel (norms)          weights whole; the module's output sharded (dp, "tp") on the
                                      sequence: the activations between tp regions live on a shard
    ExpertsTensorParallel             each expert's intermediate dim over "tp"; experts over "ep"
    KVHeadSelect, others              whole

    plan.sharding.shard (FSDP, ZeRO-3)   + the first still-whole dimension of every parameter (and
                                         so of its gradient and optimizer state) over dp
    distributed_strategy.zero1           parameters as above without dp; the optimizer state gets
                                         the FSDP spec (ZeRO-1: state sharded over dp only)
    the batch                            dim 0 over dp (the data-parallel axes ("dp", "ep"))

The mesh is `Layout`'s: ("dp", "ep", "tp") with dp = edp (the data-parallel ranks outside expert
parallel), ep and tp; the batch is split over ("dp", "ep"), so dp x ep is the data-parallel size of the
layout. Pipeline and context parallel have no SPMD form here (refused by nxdt.spec.parallel).

torch-xla is optional; it is imported where used, never at module import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from nxdt.parallel.expert_parallel import TP_DIMS, ExpertsTensorParallel, expert_modules
from nxdt.parallel.plan import ParallelPlan
from nxdt.spec.layout import Layout

MESH_AXES = ("dp", "ep", "tp")
DATA_AXES = ("dp", "ep")
"""the batch's dim 0 is split over both: together they are the layout's data-parallel ranks"""

Spec = tuple[Any, ...]


@dataclass(frozen=True)
class SpmdShardings:
    """Partition specs (one mesh axis, a tuple of axes, or None per dimension) by parameter name."""

    params: dict[str, Spec]
    optimizer_state: dict[str, Spec]
    sequence_parallel: tuple[str, ...] = ()
    """modules whose output is the sequence-sharded residual stream (their output gets (dp, "tp"))"""
    mesh_shape: tuple[int, int, int] = (1, 1, 1)


def mesh_shape(layout: Layout) -> tuple[int, int, int]:
    """(dp, ep, tp) of the SPMD mesh: the layout's data-parallel ranks split as edp x ep, then tp."""
    return (layout.dp // layout.ep, layout.ep, layout.tp)


def tp_spec(style: ParallelStyle | None, module: nn.Module, param: str, ndim: int) -> Spec:
    """The tp part of one parameter's spec, as the DTensor style `style` places it."""
    whole: list[Any] = [None] * ndim
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ExpertsTensorParallel) and param in TP_DIMS:
        whole[TP_DIMS[param]] = "tp"
    elif isinstance(style, ColwiseParallel):  # Linear: output features (+ bias); Embedding: hidden
        whole[1 if embedding else 0] = "tp"
    elif isinstance(style, RowwiseParallel) and param == "weight":  # Linear: input features; Embedding: vocabulary
        whole[0 if embedding else ndim - 1] = "tp"
    return tuple(whole)


def with_dp(spec: Spec, shape: torch.Size, dp: int) -> Spec:
    """`spec` with its first whole dimension that dp divides split over dp (FSDP's shard); unchanged
    where none is (a parameter too small to split stays whole on every dp rank)."""
    if dp == 1:
        return spec
    for dim, axis in enumerate(spec):
        if axis is None and shape[dim] % dp == 0 and shape[dim] >= dp:
            return spec[:dim] + ("dp",) + spec[dim + 1:]
    return spec


def spmd_shardings(model: nn.Module, plan: ParallelPlan, zero1: bool = False) -> SpmdShardings:
    """Every parameter's and optimizer state's partition spec under `plan` (made for `model`, one stage)."""
    if plan.num_stages > 1:
        raise ValueError("pipeline parallel has no SPMD form here")
    styles = plan.stages[0].tensor_parallel
    shape = mesh_shape(plan.layout)
    experts = {id(m) for m in expert_modules(model)}
    params: dict[str, Spec] = {}
    states: dict[str, Spec] = {}
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        spec = tp_spec(styles.get(path), module, leaf, p.dim())
        if id(module) in experts and shape[1] > 1:
            spec = ("ep",) + spec[1:]
        sharded = with_dp(spec, p.shape, shape[0])
        params[name] = sharded if plan.sharding.shard else spec
        states[name] = sharded if (plan.sharding.shard or zero1) else spec
    sp = tuple(path for path, style in styles.items()
               if isinstance(style, SequenceParallel) and _sequence_dim(style) == 1) if plan.sequence_parallel else ()
    return SpmdShardings(params=params, optimizer_state=states, sequence_parallel=sp, mesh_shape=shape)


def _sequence_dim(style: SequenceParallel) -> int:
    return style.sequence_sharding[0].dim


# --------------------------------------------------------------------------- applying them (torch-xla)
def _xs():
    import torch_xla.distributed.spmd as xs  # torch-xla is optional (its own torch build)

    return xs


def use_spmd() -> None:
    """Switch torch-xla to SPMD: one process, every addressable device behind one virtual device.
    Must run before any XLA tensor is made."""
    import torch_xla.runtime as xr  # torch-xla is optional

    if not xr.is_spmd():
        xr.use_spmd()


def device_count() -> int:
    """The devices the SPMD mesh spans (all hosts')."""
    import torch_xla.runtime as xr  # torch-xla is optional

    return xr.global_runtime_device_count()


def build_mesh(shape: tuple[int, int, int]):
    """The SPMD mesh ("dp", "ep", "tp") over all devices; their number must be dp x ep x tp."""
    n = device_count()
    if n != shape[0] * shape[1] * shape[2]:
        raise ValueError(f"the XLA mesh (dp, ep, tp) = {shape} needs {shape[0] * shape[1] * shape[2]} devices; "
                         f"torch-xla sees {n}")
    return _xs().Mesh(np.arange(n), shape, MESH_AXES)


def shard_model(model: nn.Module, mesh: Any, shardings: SpmdShardings) -> nn.Module:
    """Annotate every parameter of `model` (on the XLA device) with its spec, and the sequence-
    parallel modules' outputs with (dp, "tp") on the sequence."""
    xs = _xs()
    for name, p in model.named_parameters():
        xs.mark_sharding(p, mesh, shardings.params[name])
    for path in shardings.sequence_parallel:
        model.get_submodule(path).register_forward_hook(_sequence_sharded_output(mesh))
    return model


def _sequence_sharded_output(mesh: Any):
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        _xs().mark_sharding(output, mesh, (DATA_AXES, "tp") + (None,) * (output.dim() - 2))
    return hook


def shard_batch(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """Each tensor of the batch (on the XLA device) split on dim 0 over the data-parallel axes."""
    for t in batch.values():
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            _xs().mark_sharding(t, mesh, (DATA_AXES,) + (None,) * (t.dim() - 1))
    return batch


def shard_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, mesh: Any,
                          shardings: SpmdShardings) -> None:
    """Give the optimizer's per-parameter state (made at its first step) the state specs: a step
    post-hook annotates every state tensor shaped like its parameter, each step, before the graph is cut."""
    spec_of = {id(p): shardings.optimizer_state[name] for name, p in model.named_parameters()}

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape and id(p) in spec_of:
                        _mark(value, mesh, spec_of[id(p)])

    optimizer.register_step_post_hook(hook)


def _mark(t: torch.Tensor, mesh: Any, spec: Spec) -> None:
    """Annotate `t` with `spec`; a tensor that carries another sharding (e.g. a state made by
    `zeros_like` of its parameter, which copies the parameter's) has it cleared first. Annotating
    with the sharding a tensor already has is a no-op, and in-place updates keep it."""
    xs = _xs()
    try:
        xs.mark_sharding(t, mesh, spec)
    except RuntimeError as e:
        if "Existing annotation" not in str(e):
            raise
        xs.clear_sharding(t)
        xs.mark_sharding(t, mesh, spec)


def sharding_of(t: torch.Tensor) -> str:
    """torch-xla's sharding annotation of `t` ('' when it has none: replicated)."""
    import torch_xla  # torch-xla is optional

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes device 0 holds of `tensors`, read from their shardings (the shard shapes torch-xla holds)."""
    xs = _xs()
    total = 0
    for t in tensors:
        if sharding_of(t):
            shard = xs.XLAShardedTensor(t).local_shards[0].data
            total += shard.numel() * shard.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (tensors shaped like their parameter) one device holds."""
    return device_bytes(v for p, state in optimizer.state.items() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.shape == p.shape)


# --------------------------------------------------------------------------- a run's SPMD side
@dataclass
class SpmdRun:
    """The mesh and shardings one SPMD process applies (to its model, optimizer and batches)."""

    mesh: Any
    shardings: SpmdShardings

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        shard_optimizer_state(optimizer, model, self.mesh, self.shardings)

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_batch(batch, self.mesh)


def is_spmd(layout: Layout) -> bool:
    """Several devices under XLA run as one SPMD process (the layout spans more than one device)."""
    return layout.world_size > 1


def process_layout(layout: Layout) -> Layout:
    """The layout the one SPMD process sees: every parallel axis folded into it (its batch is all dp
    ranks' shares; the model is whole, its shardings are annotations), the batch arithmetic unchanged."""
    dp = layout.dp
    return Layout(vpp=layout.vpp, micro_batch_size=layout.micro_batch_size * dp,
                  global_batch_size=layout.global_batch_size, num_microbatches=layout.num_microbatches,
                  local_batch_size=layout.local_batch_size * dp, seq_length=layout.seq_length,
                  tokens_per_step=layout.tokens_per_step)


def parallelize_spmd(model: nn.Module, plan: ParallelPlan, device: Any, zero1: bool = False) -> tuple[nn.Module, SpmdRun]:
    """`model` (whole, on the CPU) moved to the XLA device and annotated as `plan` says; its SpmdRun."""
    shardings = spmd_shardings(model, plan, zero1=zero1)
    mesh = build_mesh(shardings.mesh_shape)
    model = model.to(device)
    return shard_model(model, mesh, shardings), SpmdRun(mesh, shardings)


def check_device_count(layout: Layout) -> None:
    """The devices torch-xla sees are the layout's (one line otherwise: on XLA:CPU, CPU_NUM_DEVICES)."""
    n = device_count()
    if n != layout.world_size:
        raise ValueError(f"trainer.devices x trainer.num_nodes = {layout.world_size} XLA devices, but torch-xla sees "
                         f"{n} (XLA:CPU: set CPU_NUM_DEVICES={layout.world_size})")


# --------------------------------------------------------------------------- checkpoints (DCP)
def one_write_per_chunk(items: list) -> list:
    """`items` (one SPMD process's DCP write items) with each chunk of a tensor once: the first of its
    replicas. A tensor sharded over some mesh axes and replicated over others (under tp2 x FSDP2 a norm
    weight: dp-sharded, tp-replicated) has one local shard per device, so the one process's plan holds
    each chunk as many times as it is replicated. DCP's MetadataIndex compares (fqn, offset) only,
    and torch-xla 2.9's `dedup_tensors` (made for one plan per process, each chunk once) then sees
    "the same chunk in several plans" and drops every copy, the first included: the `.metadata`
    had no entry for those tensors (their load failed with a KeyError)."""
    seen: set = set()
    kept = []
    for item in items:
        if item.index not in seen:  # MetadataIndex equality: (fqn, offset), its `index` hint ignored
            seen.add(item.index)
            kept.append(item)
    return kept


def save_planner():
    """torch-xla's SPMDSavePlanner with each chunk of a partially replicated tensor planned once
    (`one_write_per_chunk`): every shard written once, from a device that holds it."""
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner  # torch-xla is optional

    class OneWritePerChunk(SPMDSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            return dataclasses.replace(plan, items=one_write_per_chunk(plan.items))

    return OneWritePerChunk()


def dcp_planner(kind: str):
    """The SPMD planner for a DCP save ('save': `save_planner`) or load ('load': torch-xla's
    SPMDLoadPlanner, each device's shards read into place). nxdt.checkpoint's writer and reader
    take it from the XLA strategy (nxdt.training.xla)."""
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner  # torch-xla is optional

    return save_planner() if kind == "save" else SPMDLoadPlanner()


def save_checkpoint(state: dict[str, Any], path: Any) -> None:
    """Save a state dict of sharded XLA tensors with torch.distributed.checkpoint and the SPMD save
    planner: each shard is written once, from a device that holds it; no process group needed.
    The checkpoint is plain DCP: a CPU or CUDA run of any layout loads it (DefaultLoadPlanner)."""
    import torch.distributed.checkpoint as dcp  # the CPU path needs it only through nxdt.checkpoint

    dcp.save(state, checkpoint_id=str(path), planner=save_planner())


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: Any) -> None:
    """Load what `save_checkpoint` wrote ({"model": ..., "optimizer": ...}) into a model (and its
    optimizer) already sharded: each device reads its own shards. The optimizer's state is made first
    (torch-xla's prime_optimizer: one zero-gradient step, overwritten here)."""
    import torch.distributed.checkpoint as dcp  # the CPU path needs it only through nxdt.checkpoint
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, prime_optimizer  # torch-xla is optional

    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        prime_optimizer(optimizer)
        state["optimizer"] = optimizer.state_dict()
    dcp.load(state, checkpoint_id=str(path), planner=SPMDLoadPlanner())
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
