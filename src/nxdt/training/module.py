"""NxdtLightningModule: one optimizer step per batch.

A batch is this data-parallel rank's share of one global batch (B = micro_batch_size ×
num_microbatches). `training_step` cuts it into micro-batches, accumulates gradients with the
dp reduction switched off until the last one, clips by the global norm, steps the optimizer and
the scheduler. Optimization is manual on purpose: it is the only place that needs to know about
micro-batches, gradient sync, clipping and (later) pipeline schedules and loss scaling, and
Lightning's automatic loop would hide all four.

The loss follows Megatron/NxDT: per micro-batch the mean over unmasked tokens, then the mean
over the micro-batches of the global batch, so every layout of the same global batch gives the
same loss.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from nxdt.models import build_model, count_parameters, logits_of
from nxdt.parallel.mesh import all_reduce_mean
from nxdt.parallel.parallelize import parallelize_llama, set_gradient_sync
from nxdt.training.optimizers import build_optimizer
from nxdt.training.schedulers import build_scheduler


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the tokens whose loss_mask is 1 (fp32 for the softmax)."""
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    mask = loss_mask.flatten().to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


class NxdtLightningModule(pl.LightningModule):
    def __init__(self, cfg, layout, vocab_size: int | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.layout = layout
        self.vocab_size = vocab_size
        self.model: torch.nn.Module | None = None
        self.num_parameters = 0
        # Samples consumed by finished optimizer steps; data modules read it to resume in place.
        self.consumed_samples = 0

    # ---- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this twice (fit after validate, ...)
            return
        model = build_model(self.cfg, self.vocab_size)
        self.num_parameters = count_parameters(model)
        self.model = parallelize_llama(model, self.device_mesh, self.cfg)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self._autocast():
            return logits_of(self.model(input_ids=input_ids, position_ids=position_ids))

    def _autocast(self):
        if self.cfg.precision.type == "autocast":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # ---- optimization --------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optim_cfg = self.cfg.model.optim
        optimizer = build_optimizer(self.model, optim_cfg, self.cfg.model.do_layer_norm_weight_decay)
        scheduler = build_scheduler(optimizer, optim_cfg.get("sched"), self.cfg.trainer.max_steps)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        n = self.layout.num_microbatches
        size = batch["input_ids"].shape[0]
        if size != self.layout.local_batch_size:
            raise RuntimeError(
                f"batch of {size} samples, expected micro_batch_size × num_microbatches = "
                f"{self.layout.local_batch_size} per data-parallel rank"
            )
        return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]

    def _microbatch_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(mb["input_ids"], mb.get("position_ids"))
        return masked_token_loss(logits, mb["labels"], mb["loss_mask"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(batch)
        grad_norm, lr = self._clip_and_step(optimizer, scheduler)
        self.consumed_samples += self.layout.global_batch_size
        reduced = all_reduce_mean(loss, self.device_mesh, "dp")
        self._log_step(reduced, lr, grad_norm)
        return reduced

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Accumulate the gradients of one global step's share; returns the (unreduced) loss."""
        microbatches = self._microbatches(batch)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(microbatches):
            set_gradient_sync(self.model, i == len(microbatches) - 1)
            loss = self._microbatch_loss(mb) / len(microbatches)
            self.manual_backward(loss)
            total += loss.detach()
        return total

    def _clip_and_step(self, optimizer, scheduler) -> tuple[torch.Tensor, float]:
        """Clip by the global gradient norm, step optimizer and scheduler; returns (grad norm, lr used)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.trainer.gradient_clip_val
        grad_norm = _total_norm(
            torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip and clip > 0 else math.inf, foreach=True)
        )
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return grad_norm, lr

    def _log_step(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> None:
        exp = self.cfg.exp_manager
        self.log("reduced_train_loss", loss, prog_bar=True, rank_zero_only=True)
        self.log("lr", lr, prog_bar=False, rank_zero_only=True)
        if exp.log_gradient_norm:
            self.log("gradient_norm", grad_norm, rank_zero_only=True)
        if exp.log_parameter_norm and self.global_step % self.trainer.log_every_n_steps == 0:
            self.log("parameter_norm", _total_norm(_parameter_norm(self.model)), rank_zero_only=True)
        self.log("consumed_samples", float(self.consumed_samples), rank_zero_only=True)
        self.log("global_step", float(self.global_step), rank_zero_only=True)

    # ---- validation ----------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        microbatches = self._microbatches(batch)
        loss = sum(self._microbatch_loss(mb) for mb in microbatches) / len(microbatches)
        reduced = all_reduce_mean(loss.detach(), self.device_mesh, "dp")
        self.log("val_loss", reduced, prog_bar=True, rank_zero_only=True, on_epoch=True, batch_size=1)
        return reduced

    # ---- state carried in checkpoints ----------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["consumed_samples"] = self.consumed_samples

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.consumed_samples = int(checkpoint.get("consumed_samples", 0))


def _total_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm that may be a DTensor (sharded/replicated params) as a plain tensor."""
    full = getattr(norm, "full_tensor", None)
    return (full() if full is not None else norm).detach()


@torch.no_grad()
def _parameter_norm(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p for p in model.parameters()], foreach=True)
