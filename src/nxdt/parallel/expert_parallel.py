"""Expert parallelism: each MoE layer's experts sharded over the `ep` axis, tokens exchanged with
all-to-all; and expert tensor parallelism: each expert's intermediate dimension split over `tp`.

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

Tensor parallel (NxD's ExpertMLPs): every tp rank routes the same (whole, with sequence parallel
gathered) tokens; each holds every expert's slice r of the intermediate dimension F (of its own
E/ep experts with expert parallelism). The checkpoint keeps transformers' layouts, contiguous
shards that reshard between tp sizes like any other:

    gate_up_proj [E, 2F, H]   Shard(1): rank r holds rows [r 2F/tp, (r+1) 2F/tp) of gate-then-up
    down_proj    [E, H, F]    Shard(2): rank r holds columns [r F/tp, (r+1) F/tp)

A rank's gate_up rows are not its gate and up slices of one F range (tp 2: rank 0 holds the
whole gate, rank 1 the whole up), so the projected activations [N, 2F] are redistributed from
Shard(-1) to _StridedShard(-1, split_factor=2) (DTensor's exchange of columns): rank r then has
gate and up columns of F range r, the SwiGLU is local, and down_proj gives this rank's partial
sums. The experts' input is Replicate with a Partial gradient (summed over tp on the way back),
and so are the routing weights the outputs are multiplied by; the layer then adds the weighted
rows into its [tokens, H] output still as partial sums, which the plan's output style on the MoE
layer reduces once: all-reduce, or with sequence parallel reduce-scatter to the sequence shard
(NxD's MoE layer). So the router and the residual get one process's gradients on every tp rank.
LoRA on the experts (nxdt.models.lora_experts) splits with its weight: gate_up_proj's B by rows
(Shard(1)), its A whole; down_proj's A by columns (Shard(2)), its B whole; the whole factors feed this
rank's partial sums, so their gradients are summed over tp (`_tp_local`).
With `model.moe.dropout` > 0 the dropout needs the whole output: the experts all-reduce their
rows themselves (`reduce_output`) and the layer's output is whole. (A weight placed
_StridedShard directly would save the exchange, but torch's DCP cannot write a non-contiguous
shard.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from nxdt.models.moe import MoEExperts, swiglu_experts

# each expert weight's tensor-parallel dimension (the intermediate F): gate_up rows, down_proj columns
TP_DIMS = {"gate_up_proj": 1, "down_proj": 2}
# LoRA on the experts (W_e + B_e A_e) split the way its weight is: gate_up_proj's rows are B's rows (A [E, r, H]
# whole), down_proj's columns are A's columns (B [E, H, r] whole); a whole factor's gradient is summed over tp
ADAPTER_TP_PLACEMENTS = {("lora_A", "gate_up_proj"): Replicate(), ("lora_B", "gate_up_proj"): Shard(1),
                         ("lora_A", "down_proj"): Shard(2), ("lora_B", "down_proj"): Replicate()}


def expert_modules(model: nn.Module) -> list[MoEExperts]:
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights (sharded over ep): data parallel and ZeRO-1 treat them apart."""
    return {p for m in expert_modules(model) for p in m.parameters()}


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Shard every MoEExperts of `model` over `ep_mesh` (no-op without one or at size 1); experts
    already split over tp (ExpertsTensorParallel) go on the expert mesh's (ep, tp) axes."""
    if ep_mesh is None or ep_mesh.size() == 1:
        return
    ep = ep_mesh.size()
    for experts in expert_modules(model):
        if experts.num_experts % ep:
            raise ValueError(f"{experts.num_experts} experts cannot be split over {ep} expert-parallel ranks")
        tp_mesh = getattr(experts, "tp_mesh", None)
        # the weights, and LoRA adapters on them ([E, ...] too, in child modules: nxdt.models.lora_experts)
        for path, param in list(experts.named_parameters()):
            owner_path, _, name = path.rpartition(".")
            if tp_mesh is None:
                # a meta-device model keeps meta shards (materialised later, drawing the full tensor)
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None if param.is_meta else 0)
            else:  # this rank's experts of its tp shard (or of a whole adapter factor): a view, no communication
                mesh = ep_mesh._get_root_mesh()["ep", "tp"]
                local = param.data.to_local().chunk(ep)[ep_mesh.get_local_rank()]
                sharded = DTensor.from_local(local, mesh, [Shard(0), param.data.placements[0]], run_check=False)
            owner = experts.get_submodule(owner_path) if owner_path else experts
            owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_mesh = ep_mesh
        experts.__class__ = _expert_parallel_class(type(experts))


class ExpertsTensorParallel(ParallelStyle):
    """The plan's style for an MoE layer's experts: each expert's intermediate dimension over tp
    (see the module docstring); the router stays whole on every tp rank. `reduce_output`: the
    experts return whole rows (all-reduced); otherwise this rank's partial sums, which the layer's
    output style reduces."""

    def __init__(self, reduce_output: bool = False) -> None:
        super().__init__()
        self.reduce_output = reduce_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoEExperts):
            raise ValueError(f"ExpertsTensorParallel applies to nxdt's MoEExperts, got {type(module).__name__}")
        tp = device_mesh.size()
        ffn = module.down_proj.shape[2]
        if ffn % tp:
            raise ValueError(f"the experts' intermediate size ({ffn}) is not divisible by tensor_model_parallel_size "
                             f"({tp})")
        # the weights, and LoRA adapters on them (nxdt.models.lora_experts: `lora_A.<weight>`, `lora_B.<weight>`)
        for path, param in list(module.named_parameters()):
            owner_path, _, name = path.rpartition(".")
            src = None if param.is_meta else 0
            placement = ADAPTER_TP_PLACEMENTS[(owner_path, name)] if owner_path else Shard(TP_DIMS[name])
            sharded = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=src)
            owner = module.get_submodule(owner_path) if owner_path else module
            owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.tp_mesh, module.tp_reduce_output = device_mesh, self.reduce_output
        module.__class__ = _tensor_parallel_class(type(module))
        return module


def distribute_expert_adapters(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """LoRA on tensor-parallel experts: each adapter factor a DTensor on `tp_mesh` placed as
    ADAPTER_TP_PLACEMENTS (after the plan, whose styles run with the adapters detached)."""
    for experts in expert_modules(model):
        if getattr(experts, "tp_mesh", None) is None or "lora_A" not in experts._modules:
            continue
        for holder_name in ("lora_A", "lora_B"):
            holder = experts.get_submodule(holder_name)
            for name, p in list(holder.named_parameters(recurse=False)):
                placement = ADAPTER_TP_PLACEMENTS[(holder_name, name)]
                sharded = distribute_tensor(p.data, tp_mesh, [placement], src_data_rank=None if p.is_meta else 0)
                holder.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))


@torch.compiler.disable  # data-dependent row counts, as swiglu_experts
def tp_swiglu_experts(x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """swiglu_experts over this tp rank's shards ([E, 2F/tp, H] rows of gate-then-up, [E, H, F/tp]),
    x [N, H] the same on every tp rank → this rank's partial sums [N, H] (their sum over tp is the output)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, gate_up_proj, down_proj = x.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
    counts = tokens_per_expert.tolist()
    rows = _replicate_in(x, tp_mesh).split(counts)
    gate_up = torch.cat([F.linear(r, w) for r, w in zip(rows, gate_up_proj.unbind(0))])
    # Shard(-1) of [N, 2F] → gate and up columns of this rank's F range
    gate_up = DTensor.from_local(gate_up, tp_mesh, [Shard(1)], run_check=False)
    gate, up = gate_up.redistribute(tp_mesh, [_StridedShard(1, split_factor=2)]).to_local().chunk(2, dim=-1)
    h = (F.silu(gate) * up).split(counts)
    return torch.cat([F.linear(r, w) for r, w in zip(h, down_proj.unbind(0))])


def _replicate_in(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """x, the same on every tp rank, feeding per-rank partial sums: its gradient is summed over tp."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _run_experts(module: MoEExperts, x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """The experts over this rank's (local) weights: whole, or this tp rank's partial sums."""
    tp_mesh = getattr(module, "tp_mesh", None)
    if tp_mesh is None:
        return swiglu_experts(x, tokens_per_expert, gate_up, down)
    return tp_swiglu_experts(x, tokens_per_expert, gate_up, down, tp_mesh)


def _weigh(module: MoEExperts, out: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The experts' rows times their routing weights: with tp partial sums (unless the experts reduce
    their output), the weights' gradient summed over tp."""
    tp_mesh = getattr(module, "tp_mesh", None)
    if tp_mesh is not None and module.tp_reduce_output:
        out = DTensor.from_local(out, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Replicate()])
        out = out.to_local()
    elif tp_mesh is not None and weights is not None:
        weights = _replicate_in(weights, tp_mesh)
    return out if weights is None else out * weights.to(out.dtype)


class TensorParallelExperts(MoEExperts):
    """MoEExperts whose weights are split over tp (each expert's F): runs its shards."""

    tp_mesh: DeviceMesh
    tp_reduce_output: bool

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor | None = None
                ) -> torch.Tensor:
        gate_up, down = self.expert_weights(lambda w: _tp_local(w, self.tp_mesh))
        return _weigh(self, tp_swiglu_experts(x, tokens_per_expert, gate_up, down, self.tp_mesh), weights)


def _tp_local(weight: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's part of an expert weight (or LoRA factor); a factor whole on every tp rank (its last
    placement Replicate) feeds this rank's partial sums, so its gradient is summed over tp."""
    if not isinstance(weight, DTensor):
        return weight
    local = weight.to_local()
    return _replicate_in(local, tp_mesh) if isinstance(weight.placements[-1], Replicate) else local


_TP_CLASSES: dict[type, type] = {}


def _tensor_parallel_class(cls: type) -> type:
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelExperts, cls), {})
    return _TP_CLASSES[cls]


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _CLASSES[cls]


class ExpertParallelExperts(MoEExperts):
    """MoEExperts whose forward runs this rank's experts over every ep rank's tokens for them."""

    ep_mesh: DeviceMesh

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor | None = None
                ) -> torch.Tensor:
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
        tp_mesh = getattr(self, "tp_mesh", None)
        gate_up, down = self.expert_weights(lambda w: _local_weight(w, x.dtype, ep, tp_mesh))
        out = _run_experts(self, rows[order], received.view(ep, num_local).sum(0), gate_up, down)
        # 3. undo the grouping, combine back to the tokens' ranks
        out = torch.empty_like(out).index_copy_(0, order, out)
        return _weigh(self, _all_to_all(out, send_splits, recv_splits, group), weights)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


def _local_weight(weight: torch.Tensor, dtype: torch.dtype, ep: int, tp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """This rank's experts as a plain tensor in the compute dtype (FSDP's mixed precision leaves
    ignored parameters in fp32), its gradient scaled by 1/ep (see the module docstring); under tp a
    LoRA factor whole on every tp rank has its gradient summed over tp (`_tp_local`)."""
    local = weight.to_local() if tp_mesh is None or not isinstance(weight, DTensor) else _tp_local(weight, tp_mesh)
    return _ScaleGrad.apply(local, 1.0 / ep).to(dtype)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
