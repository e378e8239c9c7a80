"""Expert parallelism: each MoE layer's experts sharded over the `ep` axis, tokens exchanged with
all-to-all.

The ep axis is carved out of data parallel (nxdt.parallel.mesh): dp = edp x ep, ep innermost, so
the ranks of one ep group are data-parallel neighbours holding different tokens. Each of them
keeps E/ep whole experts (a DTensor sharded on the expert dimension, so checkpoints reshard
between ep sizes like any other sharded weight). In an MoE layer's forward every rank still
routes its own tokens; then, per layer:

    dispatch   all_to_all_single: each token-slot goes to the rank owning its expert
               (uneven splits: the counts are exchanged first), then the received rows are
               grouped by local expert;
    experts    nxdt.models.moe.swiglu_experts over the local experts only;
    combine    the inverse regrouping and all_to_all_single back to the token's rank, where
               the layer weights and sums the slots as without expert parallelism.

Both exchanges are differentiable (funcol's all_to_all_single_autograd), so the backward sends
every expert's output gradient to its owner and the input gradient back.

Gradients. The dense parameters are averaged over dp by data parallel. An expert's gradient
arrives already summed over the ep group's tokens, so it is scaled by 1/ep here; data parallel
over the edp axis (when dp > ep) then averages it over the expert's replicas: 1/dp in all, the
same mean as a dense weight. The model file knows none of this: the plan swaps the experts
module's class (as FSDP2 does) for one whose forward adds the two exchanges.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nxdt.models.moe import MoEExperts, swiglu_experts


def expert_modules(model: nn.Module) -> list[MoEExperts]:
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights (sharded over ep): data parallel and ZeRO-1 treat them apart."""
    return {p for m in expert_modules(model) for p in m.parameters()}


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Shard every MoEExperts of `model` over `ep_mesh` (no-op without one or at size 1)."""
    if ep_mesh is None or ep_mesh.size() == 1:
        return
    for experts in expert_modules(model):
        if experts.num_experts % ep_mesh.size():
            raise ValueError(f"{experts.num_experts} experts cannot be split over {ep_mesh.size()} expert-parallel ranks")
        for name, param in list(experts.named_parameters(recurse=False)):
            # a meta-device model keeps meta shards (materialised later, drawing the full tensor)
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None if param.is_meta else 0)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_mesh = ep_mesh
        experts.__class__ = _expert_parallel_class(type(experts))


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _CLASSES[cls]


class ExpertParallelExperts(MoEExperts):
    """MoEExperts whose forward runs this rank's experts over every ep rank's tokens for them."""

    ep_mesh: DeviceMesh

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ep = self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        num_local = self.num_experts // ep
        # 1. counts: received[r * num_local + j] = rows rank r sends to my local expert j
        received = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received, tokens_per_expert, group=group)
        send_splits = tokens_per_expert.view(ep, num_local).sum(1).tolist()
        recv_splits = received.view(ep, num_local).sum(1).tolist()
        # 2. dispatch, then group the received rows by local expert (source rank order within one)
        rows = _all_to_all(x, recv_splits, send_splits, group)
        local_expert = torch.arange(num_local, device=x.device).repeat(ep).repeat_interleave(received)
        order = torch.argsort(local_expert, stable=True)
        gate_up, down = (_local_weight(w, x.dtype, ep) for w in (self.gate_up_proj, self.down_proj))
        out = swiglu_experts(rows[order], received.view(ep, num_local).sum(0), gate_up, down)
        # 3. undo the grouping, combine back to the tokens' ranks
        out = torch.empty_like(out).index_copy_(0, order, out)
        return _all_to_all(out, send_splits, recv_splits, group)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


def _local_weight(weight: torch.Tensor, dtype: torch.dtype, ep: int) -> torch.Tensor:
    """This rank's experts as a plain tensor in the compute dtype (FSDP's mixed precision leaves
    ignored parameters in fp32), its gradient scaled by 1/ep (see the module docstring)."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return _ScaleGrad.apply(local, 1.0 / ep).to(dtype)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
