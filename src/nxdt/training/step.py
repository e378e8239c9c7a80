"""One optimizer step, in plain PyTorch: the step NxdtLightningModule, the tests, the benchmarks
and the XLA runner all run.

    m = train_step(model, optimizer, scheduler, precision, forward_backward, batch, step=s, clip=1.0)

`train_step` owns the order of the precision call points (nxdt.precision.precision), the
gradient norm, the NaN/inf guard, clipping and the update. What differs between layouts is
passed in:

- `forward_backward(batch) -> loss`: accumulates the gradients of this rank's share of the
  global batch and returns its loss (mean over the micro-batches). Without pipeline parallelism
  it is `microbatch_forward_backward(...)`; with it `pipeline_forward_backward(...)` (the
  schedule runs forward and backward of all micro-batches).
- `reduce_loss(loss)`: the mean over the ranks holding other parts of the batch (the mesh's
  `dp_cp` axis); identity in one process. The guard reads the reduced loss, so every rank
  decides on the same value.
- `norm_over_stages(norm)`: pipelines, each rank's gradient norm → the norm over all stages.

No Lightning and no DeviceMesh are needed: in one process, pass a plain model and optimizer.
Under Lightning, pass the LightningOptimizer (its `.step()` is what Lightning counts) and
`backward=self.manual_backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from nxdt.models import logits_of
from nxdt.models.chunked_loss import IGNORE_INDEX
from nxdt.models.moe import set_aux_loss_scale
from nxdt.parallel.context_parallel import shard_sequence
from nxdt.parallel.data_parallel import set_gradient_sync
from nxdt.parallel.tensor_parallel import clip_grads_with_norm_, loss_parallel, total_norm
from nxdt.precision.precision import Precision
from nxdt.training.loss import masked_token_loss

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepMetrics:
    """What one step reports: the reduced loss, the gradient norm (over all stages), the lr the
    update used (read before the scheduler steps) and whether the update was applied."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    applied: bool


def train_step(model: nn.Module, optimizer, scheduler, precision: Precision,
               forward_backward: Callable[[Batch], torch.Tensor], batch: Batch, *, step: int,
               clip: float | None, reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
               norm_over_stages: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepMetrics:
    """Zero the grads, forward/backward, then clip by the global gradient norm and step the
    optimizer and the scheduler (`clip` None or 0: no clipping; `scheduler` may be None).

    A non-finite loss or gradient norm (or an fp16 overflow) skips the update and the scheduler
    step, or stops the run (precision.on_nonfinite; NumericalInstabilityError naming `step`).
    """
    optimizer.zero_grad(set_to_none=True)
    precision.begin_step(model)
    loss = forward_backward(batch)
    if reduce_loss is not None:  # before the guard: it reads the loss every rank agrees on
        loss = reduce_loss(loss)
    precision.finish_grads(model)  # fp32 master weights and fp32, unscaled grads
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = total_norm([p.grad for p in params]).detach()  # float64; DTensor and plain grads mixed under tp
    if norm_over_stages is not None:  # each pp rank holds some stages: the norm of all of them
        grad_norm = norm_over_stages(grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    if not precision.check_step(step, loss, grad_norm, model):
        precision.skip_step(optimizer, model)
        return StepMetrics(loss, grad_norm, lr, False)
    clip_grads_with_norm_(params, clip, grad_norm)
    precision.optimizer_step(optimizer)
    if scheduler is not None:
        scheduler.step()
    return StepMetrics(loss, grad_norm, lr, True)


# ---- forward / backward ----------------------------------------------------------------------
def split_microbatches(batch: Batch, num_microbatches: int, expected_size: int | None = None) -> list[Batch]:
    """Cut this rank's batch into `num_microbatches` along the sample axis (checking its size; a
    preference batch counts prompts)."""
    check_batch_size(batch, expected_size)
    return [{k: v.chunk(num_microbatches)[i] for k, v in batch.items()} for i in range(num_microbatches)]


def check_batch_size(batch: Batch, expected_size: int | None) -> None:
    # DPO / ORPO batches (nxdt.data.preference) hold a chosen and a rejected sequence per prompt
    key, unit = ("input_ids", "samples") if "input_ids" in batch else ("chosen_input_ids", "prompts")
    size = batch[key].shape[0]
    if expected_size is not None and size != expected_size:
        raise RuntimeError(
            f"batch of {size} {unit}, expected micro_batch_size × num_microbatches = "
            f"{expected_size} per data-parallel rank"
        )


def loss_parallel_context(tp: int):
    """tp > 1: logits are vocabulary shards; the cross entropy (forward and backward) runs under this."""
    return loss_parallel() if tp > 1 else nullcontext()


def microbatch_loss(model: nn.Module, mb: Batch, precision: Precision, *, loss_fn: LossFn = masked_token_loss,
                    device_type: str = "cpu", cp_mesh=None, loss_chunk_size: int | None = None) -> torch.Tensor:
    """One micro-batch's forward (under precision.autocast) and its loss; with `cp_mesh` (cp > 1)
    on this rank's slice of every sequence. `loss_chunk_size`: the model computes the per-token
    losses itself, its output layer a chunk of tokens at a time (the whole logits never exist)."""
    if cp_mesh is not None:
        mb = shard_sequence(mb, cp_mesh)
    # the masked tokens' labels ignored inside the model too, so the loss's gradient is the same on every
    # token the model scores: what lets the fused output layer keep the gradients of its forward
    # (nxdt.models.chunked_loss); their per-token losses are 0 either way once masked below
    chunked = ({"labels": mb["labels"].masked_fill(mb["loss_mask"] == 0, IGNORE_INDEX),
                "loss_chunk_size": loss_chunk_size} if loss_chunk_size else {})
    with precision.autocast(device_type):
        logits = logits_of(model(input_ids=mb["input_ids"], position_ids=mb.get("position_ids"), **chunked))
    return loss_fn(logits, mb["labels"], mb["loss_mask"])


def microbatch_forward_backward(model: nn.Module, precision: Precision, num_microbatches: int, *,
                                loss_fn: LossFn = masked_token_loss,
                                backward: Callable[[torch.Tensor], None] | None = None, device_type: str = "cpu",
                                tp: int = 1, cp_mesh=None, batch_size: int | None = None,
                                loss_chunk_size: int | None = None) -> Callable[[Batch], torch.Tensor]:
    """`forward_backward` without pipeline parallelism: gradient accumulation over micro-batches.

    Each micro-batch's loss is divided by their number (the step's loss is their mean) and
    scaled by the precision's loss scale for the backward; so are the MoE layers' auxiliary
    losses (nxdt.models.moe.set_aux_loss_scale). The data-parallel gradient reduction
    is switched off until the last micro-batch. `loss_fn(logits, labels, loss_mask)` (give it
    the cp group under context parallelism); `backward(loss)` defaults to `loss.backward()`
    (Lightning: `manual_backward`); `batch_size`, when given, is checked.
    """
    run_backward = backward if backward is not None else torch.Tensor.backward

    def forward_backward(batch: Batch) -> torch.Tensor:
        microbatches = split_microbatches(batch, num_microbatches, batch_size)
        total = None
        with precision.step_autocast(device_type):  # each weight cast once a step, not once a micro-batch
            for i, mb in enumerate(microbatches):
                set_gradient_sync(model, i == len(microbatches) - 1)
                set_aux_loss_scale(precision.loss_scale / len(microbatches))
                with loss_parallel_context(tp):
                    loss = microbatch_loss(model, mb, precision, loss_fn=loss_fn, device_type=device_type,
                                           cp_mesh=cp_mesh, loss_chunk_size=loss_chunk_size) / len(microbatches)
                    with precision.backward_context(device_type):
                        run_backward(precision.scale_loss(loss))
                total = loss.detach() if total is None else total + loss.detach()
        return total

    return forward_backward


def pipeline_forward_backward(pipeline, precision: Precision, *, device_type: str = "cpu", tp: int = 1,
                              cp_mesh=None, batch_size: int | None = None) -> Callable[[Batch], torch.Tensor]:
    """`forward_backward` with pipeline parallelism: the schedule runs forward and backward of all
    micro-batches (nxdt.parallel.pipeline.Pipeline.step; it applies the loss scale itself).

    Every pp rank of a dp index gets the same batch; the first stage reads input_ids, the last
    stage labels and loss_mask. Returns the mean micro-batch loss on every pp rank."""

    def forward_backward(batch: Batch) -> torch.Tensor:
        check_batch_size(batch, batch_size)
        if cp_mesh is not None:
            batch = shard_sequence(batch, cp_mesh)
        set_aux_loss_scale(pipeline.aux_loss_scale(precision.loss_scale))
        with precision.autocast(device_type), loss_parallel_context(tp):
            return pipeline.step(batch["input_ids"], batch["labels"], batch["loss_mask"], batch.get("position_ids"))

    return forward_backward
