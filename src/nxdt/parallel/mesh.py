"""The one DeviceMesh every parallelism of a run is cut from.

The mesh's shape is a `nxdt.spec.layout.Layout` (torch-free: the planner reads the same one).
Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` and ``dp_shard`` (data
parallel: replicated copies and FSDP shards; their product is dp), ``cp`` (context
parallel) and ``tp`` (tensor parallel, innermost so its ranks are neighbours on a node).
Every axis exists even when its size is 1, so code can always ask for ``mesh["tp"]``;
``dp`` is the flattened (dp_replicate, dp_shard) axis that data loading and loss
reduction use.

Expert parallelism (ep > 1) splits dp into ``edp`` x ``ep`` (ep innermost: an ep group is dp
neighbours). Those two axes live on a second mesh over the same ranks, (pp, edp, ep, cp, tp),
so that expert weights (sharded over ep) and data parallel over their replicas (edp) share one
root mesh, as FSDP2 requires of a 2-D layout; `submesh(mesh, "ep")` and `"edp"` find them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nxdt.spec.layout import EXPERT_MESH_AXES, MESH_AXES, Layout


def build_mesh(shape: Layout, device_type: str) -> DeviceMesh:
    """The run's DeviceMesh for `shape` (a Layout: its `sizes()` over `MESH_AXES`), with the
    flattened dp axes and, for ep > 1, the expert mesh."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if shape.world_size != world:
        raise ValueError(
            f"parallel layout pp={shape.pp} × dp={shape.dp} × cp={shape.cp} × tp={shape.tp} = "
            f"{shape.world_size} does not match the world size {world}"
        )
    mesh = init_device_mesh(device_type, shape.sizes(), mesh_dim_names=MESH_AXES)
    _FLAT[(mesh, "dp")] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if shape.cp > 1:
        # Gradients are reduced over dp and cp together (a cp rank is one more data-parallel
        # rank to the optimizer): replicate uses dp_cp, FSDP shards over dp_shard_cp.
        _FLAT[(mesh, "dp_cp")] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        _FLAT[(mesh, "dp_shard_cp")] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if shape.ep > 1:
        experts = init_device_mesh(device_type, shape.expert_sizes(), mesh_dim_names=EXPERT_MESH_AXES)
        _FLAT[(mesh, "ep")] = experts["ep"]
        _FLAT[(mesh, "edp")] = experts["edp"]
    return mesh


# Flattened axes, kept here because slicing a flattened axis from the root mesh is deprecated.
_FLAT: dict[tuple[DeviceMesh, str], DeviceMesh] = {}


# Without context parallelism the dp × cp axes are just the dp axes.
_WITHOUT_CP = {"dp_cp": "dp", "dp_shard_cp": "dp_shard"}


def submesh(mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """`mesh[axis]`, also for the flattened axes `dp`, `dp_cp` and `dp_shard_cp`, and the expert
    axes `ep` and `edp` (a KeyError when the run has no expert parallelism)."""
    flat = _FLAT.get((mesh, axis))
    if flat is not None:
        return flat
    if axis in _WITHOUT_CP:
        return submesh(mesh, _WITHOUT_CP[axis])
    if axis in ("ep", "edp"):
        raise KeyError(f"mesh axis {axis!r}: this run has no expert parallelism")
    return mesh[axis]


def expert_mesh(mesh: DeviceMesh, axis: str = "ep") -> DeviceMesh | None:
    """The `ep` (or `edp`) axis, None without expert parallelism."""
    return _FLAT.get((mesh, axis))


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    dp = submesh(mesh, "dp")
    return dp.get_local_rank(), dp.size()


def all_reduce_mean(value: torch.Tensor, mesh: DeviceMesh, axis: str = "dp") -> torch.Tensor:
    """Mean of a (scalar) metric over one mesh axis, for logging; a no-op when that axis has size 1."""
    sub = submesh(mesh, axis)
    if sub.size() == 1:
        return value
    out = value.detach().clone()
    # gloo has no AVG op: sum then divide.
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=sub.get_group())
    return out / sub.size()
