"""Pipeline parallelism with `torch.distributed.pipelining`, the torchtitan way.

1. **Split.** The whole model is built once (same seed, so the same weights as one process);
   each stage is a pruned copy of it: stage 0 keeps `model.embed_tokens`, the last stage keeps
   `model.norm` and `lm_head`, every stage keeps its own decoder layers *under their original
   names* (`model.layers.18` stays `model.layers.18`, see `StageLayers`), so parallel plans and
   checkpoints name the same parameters in every layout. Layers split evenly over
   pp × vpp stages, or after the layers named by `model.pipeline_cuts` (NxD's meaning): the run's
   plan (nxdt.parallel.plan) says which stages each pp rank holds.
2. **Parallelize each stage** with the same function as a whole model (`parallelize_llama`:
   tensor parallel, checkpointing, data parallel), as torchtitan does.
3. **Schedule.** `PipelineStage`s on the mesh's `pp` axis, driven by 1F1B (vpp = 1) or
   interleaved 1F1B (vpp > 1) unless `distributed_strategy.schedule` names another
   (`torch.distributed.pipelining.schedules.get_schedule_class`).

The loss is computed on the last stage per micro-batch; `labels` and `loss_mask` reach it as
the schedule's `target` (stacked as float64, exact for any vocabulary). The schedule scales
gradients by 1/num_microbatches (`scale_grads=True`), so a per-micro-batch mean loss gives the
same gradients as the non-pipeline step. `Pipeline.step` returns that loss on every pp rank.

Stage modules run as plain modules: the native Llama's forward accepts hidden states when it
has no `embed_tokens` and returns them when it has no `norm` / `lm_head`; a transformers model
runs as its adapter's stage module (nxdt.models.adapter.HFStage, same parameter names).
`position_ids`, when the batch has them, are given to every stage (the schedule passes keyword
arguments to all stages).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from nxdt.models.adapter import adapter_of
from nxdt.models.moe import reset_router_stats
from nxdt.spec import build_spec
from nxdt.parallel.plan import ParallelPlan, make_plan


class StageLayers(nn.Module):
    """The decoder layers one stage keeps, registered under their original indices.

    Iterates like the `nn.ModuleList` it replaces (the model's `for layer in self.layers`
    runs unchanged); `layers[18]` is layer 18 of the whole model, a slice gives a list.
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(list(self.children()))

    def __len__(self) -> int:
        return len(list(self.children()))

    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return list(self.children())[index]
        return self.get_submodule(str(index))

    def __setitem__(self, index: int, module: nn.Module) -> None:  # e.g. a checkpoint wrapper
        self.register_module(str(index), module)

    def indices(self) -> list[int]:
        return [int(name) for name, _ in self.named_children()]


def prune_to_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` holding only what one stage needs; the parts it drops are not copied. The
    model's adapter says what a stage drops and what module it runs as (nxdt.models.adapter)."""
    adapter = adapter_of(model)
    blocks = adapter.decoder(model).layers
    drop: list[nn.Module] = [layer for i, layer in enumerate(blocks) if i not in layers]
    drop += adapter.stage_drops(model, is_first, is_last)
    # deepcopy's memo maps a dropped module to None: the copy gets None there and never copies it.
    part = copy.deepcopy(model, {id(m): None for m in drop})
    inner = adapter.decoder(part)
    inner.layers = StageLayers({i: inner.layers[i] for i in layers})
    return adapter.as_stage(part, is_first, is_last)


@dataclass
class Pipeline:
    schedule: object
    stages: list[PipelineStage]
    parts: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    pp_group: dist.ProcessGroup
    v_style: bool = False
    # fp16: id(scaled loss the schedule got) -> that loss before scaling (what is reported)
    unscaled_losses: dict[int, torch.Tensor] | None = None
    num_microbatches: int = 1

    def aux_loss_scale(self, loss_scale: float) -> float:
        """What one micro-batch's MoE auxiliary loss weighs in the backward, as its main loss:
        without a loss scale the schedule divides the gradients by the micro-batches afterwards
        (scale_grads); with one, each loss is scaled by loss_scale / micro-batches (stage_loss)."""
        return 1.0 if self.unscaled_losses is None else loss_scale / self.num_microbatches

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def _run(self, fn, input_ids, labels, loss_mask, position_ids, per_microbatch: bool = False) -> torch.Tensor:
        args = (input_ids,) if self.has_first else ()
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        target = torch.stack((labels.double(), loss_mask.double()), dim=-1) if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        if self.unscaled_losses is not None:
            self.unscaled_losses.clear()
        fn(*args, target=target, losses=losses, **kwargs)
        if losses and self.unscaled_losses is not None:
            # report the loss, not loss × scale (which may be inf); looked up by identity, since the
            # schedule's metadata inference also calls the loss function, on uninitialised tensors
            losses = [self.unscaled_losses[id(loss)] for loss in losses]
        if losses:
            local = torch.stack([loss.detach().float() for loss in losses])
        else:
            local = torch.zeros(self.num_microbatches, device=input_ids.device)
        if not per_microbatch:
            local = local.sum() / len(local)
        # only the rank with the last stage has the loss: a sum over pp hands it to all
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.pp_group)
        return local

    def norm_over_stages(self, local_norm: torch.Tensor) -> torch.Tensor:
        return norm_over_stages(local_norm, self.pp_group)

    def step(self, input_ids, labels, loss_mask, position_ids=None) -> torch.Tensor:
        """Forward + backward of one batch (all micro-batches); the mean micro-batch loss on every pp rank."""
        return self._run(self.schedule.step, input_ids, labels, loss_mask, position_ids)

    def eval(self, input_ids, labels, loss_mask, position_ids=None, per_microbatch: bool = False) -> torch.Tensor:
        """Forward only (validation); the mean micro-batch loss on every pp rank (`per_microbatch`:
        each micro-batch's, a [num_microbatches] tensor, for token-weighted evaluation).

        torch's V-shaped schedules (ZBVZeroBubble, DualPipeV) fail in `eval()` (their runtime
        still hands backward inputs between the two local stages), so for them validation runs
        a full `step()` and throws the gradients away: same loss, more compute.
        """
        if not self.v_style:
            with torch.no_grad():
                return self._run(self.schedule.eval, input_ids, labels, loss_mask, position_ids, per_microbatch)
        with torch.inference_mode(False), torch.enable_grad():
            loss = self._run(self.schedule.step, input_ids, labels, loss_mask, position_ids, per_microbatch)
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        return loss


def forget_inference_routing(stage: PipelineStage) -> PipelineStage:
    """torch's first step infers the stages' shapes by a forward and backward of its own, on uninitialised
    tensors: the MoE layers' routing statistics (and loss-free balancing's expert loads) would count that
    pass. They are dropped when it ends (before any micro-batch is trained)."""
    infer = getattr(stage, "_backward_metadata_inference", None)
    if infer is None:
        return stage

    def backward_metadata_inference(*args, **kwargs):
        out = infer(*args, **kwargs)
        reset_router_stats(stage.submod)
        return out

    stage._backward_metadata_inference = backward_metadata_inference
    return stage


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg,
    layout,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize_fn: Callable[..., nn.Module] | None = None,
    loss_scale: Callable[[], float] | None = None,
    plan: ParallelPlan | None = None,
) -> Pipeline:
    """Split `model` into this rank's stages, parallelize each, and build the schedule.

    `loss_fn(logits, labels, loss_mask)` is the per-micro-batch loss (a mean over tokens).
    `loss_scale()` (fp16): the current loss scale, read at every micro-batch. The loss handed to
    the schedule's backward is then `loss × scale / num_microbatches` (DeepSpeed's pipeline
    engine does the same) and the schedule no longer divides the gradients: every stage's
    backward runs on scaled gradients in the same range as the non-pipeline step's, and the
    gradients come out `scale` × the true ones, for `Precision.finish_grads` to unscale.
    `plan`: the run's (nxdt.parallel.plan.make_plan of `model` on `layout`), made here when not given;
    `parallelize_fn(part, mesh, cfg, plan=plan)` applies it to each stage.
    """
    if plan is None:  # a caller without a run (tests): its spec on `layout`
        plan = make_plan(model, build_spec(cfg, layout=layout))
    num_stages = plan.num_stages
    schedule_cls = get_schedule_class(plan.schedule)
    pp_mesh = mesh["pp"]
    pp_rank, pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    stage_ids = list(plan.rank_stages[pp_rank])

    parts, stages = [], []
    for sid in stage_ids:
        stage = plan.stages[sid]
        part = prune_to_stage(model, range(stage.layers[0], stage.layers[-1] + 1), stage.first, stage.last)
        if parallelize_fn is not None:
            part = parallelize_fn(part, mesh, cfg, plan=plan)
        parts.append(part)
        stages.append(forget_inference_routing(
            PipelineStage(part, stage_index=sid, num_stages=num_stages, device=device, group=pp_group)))

    n = layout.num_microbatches
    unscaled: dict[int, torch.Tensor] | None = {} if loss_scale is not None else None

    def stage_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, target[..., 0].long(), target[..., 1].float())
        if unscaled is None:
            return loss
        scaled = loss * (loss_scale() / n)
        unscaled[id(scaled)] = loss.detach()
        return scaled

    scale_grads = loss_scale is None  # a scaled loss already carries the 1/num_microbatches
    if issubclass(schedule_cls, PipelineScheduleSingle):
        schedule = schedule_cls(stages[0], n_microbatches=n, loss_fn=stage_loss, scale_grads=scale_grads)
    else:
        schedule = schedule_cls(stages, n_microbatches=n, loss_fn=stage_loss, scale_grads=scale_grads)
    return Pipeline(schedule=schedule, stages=stages, parts=parts, stage_ids=stage_ids,
                    num_stages=num_stages, pp_group=pp_group, v_style=plan.v_style, unscaled_losses=unscaled,
                    num_microbatches=n)


def model_of(pipeline: Pipeline) -> nn.Module:
    """The module the LightningModule holds: the single stage part, or a ModuleList of them (vpp > 1)."""
    return pipeline.parts[0] if len(pipeline.parts) == 1 else nn.ModuleList(pipeline.parts)


def norm_over_stages(local_norm: torch.Tensor, pp_group: dist.ProcessGroup, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of tensors spread over the pipeline stages from each rank's norm of its own:
    (sum over pp of local^p)^(1/p). Gradient clipping then uses the true global norm."""
    total = local_norm.detach().to(torch.promote_types(local_norm.dtype, torch.float32)).pow(norm_type)  # fp64 stays
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total.pow(1.0 / norm_type)
