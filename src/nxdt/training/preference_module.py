"""What NxdtLightningModule does differently for DPO and ORPO (model_alignment_strategy.dpo / orpo).

The optimizer step is the same `train_step`; only its forward/backward is the preference one
(nxdt.training.preference_step), and a few things happen around it:

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
"""

from __future__ import annotations

import contextlib

import torch

from nxdt.config.errors import ConfigError
from nxdt.models.lora import adapters_disabled
from nxdt.parallel.mesh import all_reduce_mean, submesh
from nxdt.training.preference_step import (
    all_gather_over,
    batch_reference_logps,
    compute_reference_logps,
    preference_forward_backward,
    preference_microbatch_loss,
    reference_from_table,
)
from nxdt.training.step import loss_parallel_context, split_microbatches


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
                                             tp=self.layout.tp)

        return from_base

    def preference_forward_backward(self):
        kind, beta, loss_type = self._preference_options()
        return preference_forward_backward(
            self.model, self.precision, self.layout.num_microbatches, kind=kind, beta=beta, loss_type=loss_type,
            reference=self._reference("train"), backward=self.manual_backward, device_type=self.device.type,
            tp=self.layout.tp, batch_size=self.layout.local_batch_size)

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
                                                 device_type=self.device.type)[0] for mb in microbatches]
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
                    progress=self.global_rank == 0, label=split)
            dm.set_reference_logps(split, table)
