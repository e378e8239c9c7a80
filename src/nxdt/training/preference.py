"""What NxdtLightningModule does differently for DPO and ORPO (model_alignment_strategy.dpo / orpo).

The optimizer step is the same `train_step`; only its forward/backward is the preference one
(`preference_forward_backward`, below), and a few things happen around it:

- DPO's reference log-probs. With `precompute_ref_log_probs` every row of the train (and
  validation) split is scored once, before the first step, by the starting model — with LoRA by
  the frozen base (adapters off, as TRL does with peft) — and the table lives in the data module's
  state, so it is checkpointed and a resume never recomputes it with trained weights. Without
  precompute (LoRA only; validation refuses it otherwise) each micro-batch's reference is a
  no-grad forward of the base with the adapters off: no second model copy either way.
- Logged each step, besides the loss: TRL's metrics (rewards/chosen, rewards/rejected,
  rewards/margins, rewards/accuracies, logps/*; ORPO also nll_loss, log_odds_ratio,
  log_odds_chosen), each the mean over the data-parallel ranks.
- Validation: the same loss on the validation split.

The forward/backward of one DPO or ORPO step, and the reference log-probs DPO compares with:

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

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from nxdt.config.errors import ConfigError
from nxdt.models import logits_of
from nxdt.models.chunked_loss import IGNORE_INDEX
from nxdt.models.lora import adapters_disabled
from nxdt.models.moe import set_aux_loss_scale
from nxdt.parallel.data_parallel import set_gradient_sync
from nxdt.parallel.mesh import all_reduce_mean, submesh
from nxdt.precision.precision import Precision
from nxdt.training.loss import (
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


def pair_token_logps(model: nn.Module, mb: Batch, precision: Precision, *, device_type: str = "cpu",
                     loss_chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of [chosen; rejected]: (per-token fp32 log p(label) [2B, S], loss_mask [2B, S]).
    Under tensor parallelism call it inside `loss_parallel_context(tp)`. `loss_chunk_size`
    (model.fusions.cross_entropy_chunk_size, one tensor-parallel rank): the model scores the
    labels itself, a chunk at a time and only on the response tokens (nxdt.models.chunked_loss):
    the prompt's and the padding's logits are never computed; 0 there, as the mask leaves them out."""
    input_ids, labels, loss_mask = concatenated(mb)
    if loss_chunk_size:
        scored = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
        with precision.autocast(device_type):
            losses = model(input_ids=input_ids, position_ids=None, labels=scored, loss_chunk_size=loss_chunk_size)
        return -losses, loss_mask
    with precision.autocast(device_type):
        logits = logits_of(model(input_ids=input_ids, position_ids=None))
    return token_logps(logits, labels), loss_mask


def batch_reference_logps(model: nn.Module, mb: Batch, precision: Precision, *, device_type: str = "cpu",
                          tp: int = 1, loss_chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed response log-probs [B] of `model`, without gradients: the reference
    of a micro-batch (the caller sets eval mode, or disables LoRA adapters, around it)."""
    with torch.no_grad(), loss_parallel_context(tp):
        per_token, loss_mask = pair_token_logps(model, mb, precision, device_type=device_type,
                                                loss_chunk_size=loss_chunk_size if tp == 1 else None)
        sums, _ = masked_sums(per_token, loss_mask)
    return sums.chunk(2)


def preference_microbatch_loss(model: nn.Module, mb: Batch, precision: Precision, *, kind: str, beta: float,
                               loss_type: str = "sigmoid", reference: Reference | None = None,
                               device_type: str = "cpu", loss_chunk_size: int | None = None
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward, its DPO / ORPO loss (a scalar with grad) and its metrics (detached).
    Also the validation loss (under torch.no_grad). Tensor parallel: inside `loss_parallel_context(tp)`.
    `loss_chunk_size` (DPO, one tensor-parallel rank): see pair_token_logps."""
    chunk = loss_chunk_size if kind == "dpo" else None  # ORPO's NLL also scores the prompt: whole logits
    per_token, loss_mask = pair_token_logps(model, mb, precision, device_type=device_type, loss_chunk_size=chunk)
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
                 device_type: str, tp: int, batch_size: int | None, loss_chunk_size: int | None = None):
        if kind not in KINDS:
            raise ValueError(f"preference loss: unknown kind {kind!r} (one of {list(KINDS)})")
        if kind == "dpo" and reference is None:
            raise ValueError("preference loss 'dpo' needs a reference (a table lookup or a reference forward)")
        self.model, self.precision, self.num_microbatches = model, precision, int(num_microbatches)
        self.kind, self.beta, self.loss_type, self.reference = kind, float(beta), loss_type, reference
        self.run_backward = backward if backward is not None else torch.Tensor.backward
        self.device_type, self.tp, self.batch_size = device_type, tp, batch_size
        self.loss_chunk_size = loss_chunk_size if tp == 1 else None
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
                    reference=self.reference, device_type=self.device_type, loss_chunk_size=self.loss_chunk_size)
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
                                tp: int = 1, batch_size: int | None = None,
                                loss_chunk_size: int | None = None) -> PreferenceForwardBackward:
    """`forward_backward` for DPO (`kind='dpo'`, `reference` required) or ORPO (`kind='orpo'`,
    `beta` is ORPO's lambda, no reference); see the module docstring. `backward(loss)` defaults to
    `loss.backward()` (Lightning: `manual_backward`); `batch_size` (prompts), when given, is checked;
    `loss_chunk_size`: see pair_token_logps."""
    return PreferenceForwardBackward(model, precision, num_microbatches, kind=kind, beta=beta, loss_type=loss_type,
                                     reference=reference, backward=backward, device_type=device_type, tp=tp,
                                     batch_size=batch_size, loss_chunk_size=loss_chunk_size)


# ---- the reference table ---------------------------------------------------------------------
def reference_from_table(table: torch.Tensor) -> Reference:
    """A `reference` that looks a micro-batch's rows up by their `index` in a [rows, 2] table."""

    def lookup(mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = table[mb["index"].to(table.device)].to(mb["chosen_input_ids"].device)
        return rows[:, 0], rows[:, 1]

    return lookup


def all_gather_over(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `all_gather` of compute_reference_logps over a process group: [M, 2] → [group size, M, 2]."""
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
                            progress: bool = True, label: str = "train",
                            loss_chunk_size: int | None = None) -> torch.Tensor:
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
            chosen, rejected = batch_reference_logps(model, mb, precision, device_type=device_type, tp=tp,
                                                     loss_chunk_size=loss_chunk_size)
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


class PreferenceSteps:
    """Mixed into NxdtLightningModule (it provides cfg, alignment, model, precision, layout, trainer)."""

    def _preference_options(self) -> tuple[str, float, str]:
        al = self.alignment
        if al.dpo is not None:
            return "dpo", al.dpo.kl_beta, al.dpo.loss_type
        return "orpo", al.orpo.beta, "sigmoid"

    def _base_context(self):
        """The reference model: the frozen base with LoRA (adapters off), else the model as it is."""
        return adapters_disabled(self.model) if self.alignment.peft is not None else contextlib.nullcontext()

    def _reference(self, split: str):
        if self.alignment.dpo is None:
            return None
        tables = getattr(self.trainer.datamodule, "reference_logps", None) or {}
        if tables.get(split) is not None:
            return reference_from_table(tables[split])
        if self.alignment.dpo.precompute_ref_log_probs:
            raise RuntimeError(f"DPO reference log-probs for the {split} split were not computed")

        def from_base(mb):  # LoRA without a table: the base, adapters off, no gradients
            with self._base_context():
                return batch_reference_logps(self.model, mb, self.precision, device_type=self.device.type,
                                             tp=self.layout.tp, loss_chunk_size=self.spec.loss_chunk_size)

        return from_base

    def preference_forward_backward(self):
        kind, beta, loss_type = self._preference_options()
        return preference_forward_backward(
            self.model, self.precision, self.layout.num_microbatches, kind=kind, beta=beta, loss_type=loss_type,
            reference=self._reference("train"), backward=self.manual_backward, device_type=self.device.type,
            tp=self.layout.tp, batch_size=self.layout.local_batch_size, loss_chunk_size=self.spec.loss_chunk_size)

    def log_preference_metrics(self, forward_backward) -> None:
        for key, value in getattr(forward_backward, "metrics", {}).items():
            self.log_step_scalar(key, all_reduce_mean(value.detach(), self.device_mesh, "dp_cp"))

    def preference_validation_loss(self, batch) -> torch.Tensor:
        kind, beta, loss_type = self._preference_options()
        microbatches = split_microbatches(batch, self.layout.num_microbatches, self.layout.local_batch_size)
        reference = self._reference("validation")
        with loss_parallel_context(self.layout.tp):
            losses = [preference_microbatch_loss(self.model, mb, self.precision, kind=kind, beta=beta,
                                                 loss_type=loss_type, reference=reference,
                                                 device_type=self.device.type,
                                                 loss_chunk_size=self.spec.loss_chunk_size if self.layout.tp == 1
                                                 else None)[0] for mb in microbatches]
        return sum(losses) / len(losses)

    def precompute_reference_logps(self) -> None:
        """DPO with precompute_ref_log_probs: the table of every split that has none yet (a resume
        brings it back from the checkpoint; computing it after training started would be wrong)."""
        dpo = self.alignment.dpo
        if dpo is None or not dpo.precompute_ref_log_probs:
            return
        dm = self.trainer.datamodule
        for split in ("train", "validation"):
            dataset = dm.datasets.get(split)
            if dataset is None or (dm.reference_logps or {}).get(split) is not None:
                continue
            if self.global_step > 0:
                raise ConfigError(f"resuming DPO at step {self.global_step}: the checkpoint has no reference "
                                  f"log-probs for the {split} split, and computing them now would use trained "
                                  "weights; resume from a checkpoint of this run")
            dp = submesh(self.device_mesh, "dp")
            with self._base_context():
                table = compute_reference_logps(
                    self.model, dataset, self.layout.micro_batch_size, self.precision, device_type=self.device.type,
                    tp=self.layout.tp, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                    all_gather=all_gather_over(dp.get_group()) if dp.size() > 1 else None,
                    progress=self.global_rank == 0, label=split, loss_chunk_size=self.spec.loss_chunk_size)
            dm.set_reference_logps(split, table)
