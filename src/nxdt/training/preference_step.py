"""The forward/backward of one DPO or ORPO step, and the reference log-probs DPO compares with.

    forward_backward = preference_forward_backward(model, precision, num_microbatches, kind="dpo",
                                                   beta=0.1, loss_type="sigmoid",
                                                   reference=reference_from_table(table))
    m = train_step(model, optimizer, scheduler, precision, forward_backward, batch, step=s, clip=1.0)
    forward_backward.metrics   # this step's scalars (see below), detached

It plays the part of nxdt.training.step.microbatch_forward_backward for preference batches
(nxdt.data.preference: chosen_* / rejected_* rows and `index`), so train_step, the precision call
points and the gradient-sync switch are the same. Per micro-batch, as TRL does, chosen and
rejected rows go through one forward concatenated [chosen; rejected] along the batch axis; the
loss is the mean over the micro-batch's prompts (ORPO: TRL's micro-batch loss, whose NLL is a
token mean), divided by the number of micro-batches, so the step's loss is their mean.

Metrics (TRL's names; means over this rank's prompts, so a mean over dp ranks is the global one):
    DPO   rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
          logps/chosen, logps/rejected (summed response log-probs)
    ORPO  the same (rewards = beta × average log-probs, logps = average log-probs), and
          nll_loss, log_odds_ratio (mean logsigmoid(log_odds)), log_odds_chosen (mean log_odds)

DPO's reference: `reference(micro_batch) -> (ref_chosen, ref_rejected)` summed log-probs [B].
With precompute_ref_log_probs the table of `compute_reference_logps` (every row of a split,
computed once, before training, by the initial model) is looked up by the rows' `index`
(`reference_from_table`); with LoRA and no table, `batch_reference_logps` under a context that
disables the adapters gives the frozen base's values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from nxdt.models import logits_of
from nxdt.models.moe import set_aux_loss_scale
from nxdt.parallel.data_parallel import set_gradient_sync
from nxdt.precision.precision import Precision
from nxdt.training.preference_loss import (
    dpo_loss,
    masked_sums,
    orpo_loss,
    reward_metrics,
    through_last_response_token,
    token_logps,
)
from nxdt.training.step import loss_parallel_context, split_microbatches

Batch = dict[str, torch.Tensor]
Reference = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
KINDS = ("dpo", "orpo")


# ---- one micro-batch -------------------------------------------------------------------------
def concatenated(mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, labels, loss_mask of [chosen; rejected] (TRL's order), [2B, S] each."""
    return tuple(torch.cat([mb[f"chosen_{k}"], mb[f"rejected_{k}"]]) for k in ("input_ids", "labels", "loss_mask"))


def pair_token_logps(model: nn.Module, mb: Batch, precision: Precision, *,
                     device_type: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of [chosen; rejected]: (per-token fp32 log p(label) [2B, S], loss_mask [2B, S]).
    Under tensor parallelism call it inside `loss_parallel_context(tp)`."""
    input_ids, labels, loss_mask = concatenated(mb)
    with precision.autocast(device_type):
        logits = logits_of(model(input_ids=input_ids, position_ids=None))
    return token_logps(logits, labels), loss_mask


def batch_reference_logps(model: nn.Module, mb: Batch, precision: Precision, *, device_type: str = "cpu",
                          tp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed response log-probs [B] of `model`, without gradients: the reference
    of a micro-batch (the caller sets eval mode, or disables LoRA adapters, around it)."""
    with torch.no_grad(), loss_parallel_context(tp):
        per_token, loss_mask = pair_token_logps(model, mb, precision, device_type=device_type)
        sums, _ = masked_sums(per_token, loss_mask)
    return sums.chunk(2)


def preference_microbatch_loss(model: nn.Module, mb: Batch, precision: Precision, *, kind: str, beta: float,
                               loss_type: str = "sigmoid", reference: Reference | None = None,
                               device_type: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward, its DPO / ORPO loss (a scalar with grad) and its metrics (detached).
    Also the validation loss (under torch.no_grad). Tensor parallel: inside `loss_parallel_context(tp)`."""
    per_token, loss_mask = pair_token_logps(model, mb, precision, device_type=device_type)
    sums, counts = masked_sums(per_token, loss_mask)
    chosen_logps, rejected_logps = sums.chunk(2)
    chosen_counts, rejected_counts = counts.chunk(2)
    if kind == "dpo":
        if reference is None:
            raise ValueError("preference loss 'dpo' needs a reference (a table lookup or a reference forward)")
        ref_chosen, ref_rejected = (t.to(chosen_logps.device, torch.float32) for t in reference(mb))
        losses, chosen_rewards, rejected_rewards = dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected,
                                                            beta, loss_type, chosen_counts, rejected_counts)
        metrics = reward_metrics(chosen_rewards, rejected_rewards)
        metrics["logps/chosen"] = chosen_logps.detach().mean()
        metrics["logps/rejected"] = rejected_logps.detach().mean()
        return losses.mean(), metrics
    if kind != "orpo":
        raise ValueError(f"preference loss: unknown kind {kind!r} (one of {list(KINDS)})")
    chosen_avg = chosen_logps / chosen_counts.clamp(min=1.0)
    rejected_avg = rejected_logps / rejected_counts.clamp(min=1.0)
    # TRL's ORPO NLL: token mean over the chosen sequences' prompt and response
    nll_sum, nll_count = masked_sums(per_token[: len(chosen_logps)], through_last_response_token(
        loss_mask[: len(chosen_logps)]))
    nll = -nll_sum.sum() / nll_count.sum().clamp(min=1.0)
    out = orpo_loss(chosen_avg, rejected_avg, nll, beta)
    metrics = reward_metrics(out.chosen_rewards, out.rejected_rewards)
    metrics.update({"logps/chosen": chosen_avg.detach().mean(), "logps/rejected": rejected_avg.detach().mean(),
                    "nll_loss": out.nll, "log_odds_ratio": out.log_odds_ratio, "log_odds_chosen": out.log_odds_chosen})
    return out.loss, metrics


# ---- one step --------------------------------------------------------------------------------
class PreferenceForwardBackward:
    """`forward_backward(batch) -> loss` for train_step; `.metrics` holds the last step's scalars
    (mean over the micro-batches, detached). Built by `preference_forward_backward`."""

    def __init__(self, model: nn.Module, precision: Precision, num_microbatches: int, *, kind: str, beta: float,
                 loss_type: str, reference: Reference | None, backward: Callable[[torch.Tensor], None] | None,
                 device_type: str, tp: int, batch_size: int | None):
        if kind not in KINDS:
            raise ValueError(f"preference loss: unknown kind {kind!r} (one of {list(KINDS)})")
        if kind == "dpo" and reference is None:
            raise ValueError("preference loss 'dpo' needs a reference (a table lookup or a reference forward)")
        self.model, self.precision, self.num_microbatches = model, precision, int(num_microbatches)
        self.kind, self.beta, self.loss_type, self.reference = kind, float(beta), loss_type, reference
        self.run_backward = backward if backward is not None else torch.Tensor.backward
        self.device_type, self.tp, self.batch_size = device_type, tp, batch_size
        self.metrics: dict[str, torch.Tensor] = {}

    def __call__(self, batch: Batch) -> torch.Tensor:
        microbatches = split_microbatches(batch, self.num_microbatches, self.batch_size)
        n = len(microbatches)
        total, sums = None, {}
        for i, mb in enumerate(microbatches):
            set_gradient_sync(self.model, i == n - 1)
            set_aux_loss_scale(self.precision.loss_scale / n)
            with loss_parallel_context(self.tp):
                loss, metrics = preference_microbatch_loss(
                    self.model, mb, self.precision, kind=self.kind, beta=self.beta, loss_type=self.loss_type,
                    reference=self.reference, device_type=self.device_type)
                loss = loss / n
                self.run_backward(self.precision.scale_loss(loss))
            total = loss.detach() if total is None else total + loss.detach()
            for k, v in metrics.items():
                sums[k] = v / n if k not in sums else sums[k] + v / n
        self.metrics = sums
        return total


def preference_forward_backward(model: nn.Module, precision: Precision, num_microbatches: int, *, kind: str,
                                beta: float, loss_type: str = "sigmoid", reference: Reference | None = None,
                                backward: Callable[[torch.Tensor], None] | None = None, device_type: str = "cpu",
                                tp: int = 1, batch_size: int | None = None) -> PreferenceForwardBackward:
    """`forward_backward` for DPO (`kind='dpo'`, `reference` required) or ORPO (`kind='orpo'`,
    `beta` is ORPO's lambda, no reference); see the module docstring. `backward(loss)` defaults to
    `loss.backward()` (Lightning: `manual_backward`); `batch_size` (prompts), when given, is checked."""
    return PreferenceForwardBackward(model, precision, num_microbatches, kind=kind, beta=beta, loss_type=loss_type,
                                     reference=reference, backward=backward, device_type=device_type, tp=tp,
                                     batch_size=batch_size)


# ---- the reference table ---------------------------------------------------------------------
def reference_from_table(table: torch.Tensor) -> Reference:
    """A `reference` that looks a micro-batch's rows up by their `index` in a [rows, 2] table."""

    def lookup(mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = table[mb["index"].to(table.device)].to(mb["chosen_input_ids"].device)
        return rows[:, 0], rows[:, 1]

    return lookup


def all_gather_over(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `all_gather` of compute_reference_logps over a process group: [M, 2] → [group size, M, 2]."""
    import torch.distributed as dist

    def gather(local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    return gather


def _collate(items: list[Batch], device: torch.device) -> Batch:
    return {k: torch.stack([it[k] for it in items]).to(device) for k in items[0]}


def compute_reference_logps(model: nn.Module, dataset, batch_size: int, precision: Precision, *,
                            device_type: str = "cpu", tp: int = 1, dp_rank: int = 0, dp_size: int = 1,
                            all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                            progress: bool = True, label: str = "train") -> torch.Tensor:
    """(chosen, rejected) summed response log-probs of every row of `dataset`: float32 [rows, 2] on
    the CPU, the same on every rank.

    Eval mode, no gradients, `batch_size` prompts per forward. Data-parallel rank r computes rows
    r, r + dp_size, ...; every rank runs the same number of forwards (short ranks repeat a row),
    which sharded data parallelism (FSDP) needs, and `all_gather(local [M, 2]) -> [dp_size, M, 2]`
    (rank order; `all_gather_over(dp_group)`) joins the parts. Tensor-parallel peers compute the
    same rows. `progress`: a line on stdout every ~10% (give it to one rank)."""
    n = len(dataset)
    if dp_size > 1 and all_gather is None:
        raise ValueError("compute_reference_logps: dp_size > 1 needs all_gather")
    mine = list(range(dp_rank, n, dp_size))
    per_rank = math.ceil(n / dp_size)
    mine += [mine[-1] if mine else 0] * (per_rank - len(mine))  # equal forwards on every rank
    device = next(model.parameters()).device
    local = torch.empty(per_rank, 2, dtype=torch.float32, device=device)
    batches = math.ceil(per_rank / batch_size)
    start_time, next_report = time.perf_counter(), 0.1
    if progress:
        print(f"reference log-probs ({label}): {n} rows, {batches} batches of {batch_size} per rank", flush=True)
    was_training = model.training
    model.eval()
    try:
        for b, start in enumerate(range(0, per_rank, batch_size)):
            mb = _collate([dataset[i] for i in mine[start:start + batch_size]], device)
            chosen, rejected = batch_reference_logps(model, mb, precision, device_type=device_type, tp=tp)
            local[start:start + len(chosen)] = torch.stack([chosen, rejected], dim=1)
            done = (b + 1) / batches
            if progress and (done >= next_report or b + 1 == batches):
                print(f"reference log-probs ({label}): {min(n, (start + len(chosen)) * dp_size)}/{n} rows "
                      f"({100 * done:.0f}%, {time.perf_counter() - start_time:.1f}s)", flush=True)
                next_report = math.floor(done * 10 + 1) / 10
    finally:
        model.train(was_training)
    gathered = all_gather(local) if dp_size > 1 else local[None]
    gathered = gathered.to("cpu", torch.float32)
    table = torch.empty(n, 2, dtype=torch.float32)
    for r in range(dp_size):
        rows = len(range(r, n, dp_size))
        table[r::dp_size] = gathered[r, :rows]
    return table
