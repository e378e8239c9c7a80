"""NxdtLightningModule: one optimizer step per batch.

A batch is this data-parallel rank's share of one global batch (B = micro_batch_size ×
num_microbatches). `training_step` runs nxdt.training.step.train_step: micro-batches with the
dp reduction switched off until the last one (or the pipeline schedule), clipping by the global
norm, the optimizer and the scheduler. Optimization is manual on purpose: the step is the only
place that needs to know about micro-batches, gradient sync, clipping, pipeline schedules and
loss scaling, and Lightning's automatic loop would hide all of them.

The loss follows Megatron/NxDT (nxdt.training.loss.masked_token_loss): per micro-batch the mean
over unmasked tokens, then the mean over the micro-batches of the global batch, so every layout
of the same global batch gives the same loss.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import torch

from nxdt.models import logits_of
from nxdt.parallel.mesh import all_reduce_mean
from nxdt.parallel.data_parallel import wants_meta_init
from nxdt.parallel.mesh import submesh
from nxdt.parallel.context_parallel import shard_sequence
from nxdt.parallel.parallelize import parallelize_llama
from nxdt.parallel.pipeline import build_pipeline, model_of
from nxdt.parallel.plan import make_plan
from nxdt.parallel import xla_spmd
from nxdt.parallel.tensor_parallel import total_norm
from nxdt.training.preference import PreferenceSteps
from nxdt.rl.module import GRPOSteps
from nxdt.precision.precision import Precision
from nxdt.device import use_xla
from nxdt.observability.step_scalars import logging_step, step_logger
from nxdt.training.builder import build_base_model, build_optimizer_and_scheduler
from nxdt.training.loss import EvalTally, masked_token_loss
from nxdt.models.moe import pop_router_stats
from nxdt.models.moe_balance import update_expert_bias
from nxdt.training.step import (loss_parallel_context, microbatch_forward_backward, microbatch_loss,
                                pipeline_forward_backward, split_microbatches, train_step)


class NxdtLightningModule(PreferenceSteps, GRPOSteps, pl.LightningModule):
    def __init__(self, spec, vocab_size: int | None) -> None:
        """`spec`: the run spec (nxdt.spec.RunSpec), built once at the entry."""
        super().__init__()
        self.automatic_optimization = False
        self.spec = spec
        self.cfg = cfg = spec.cfg
        # several XLA devices: one SPMD process holds every dp rank's batch; the plan keeps spec.layout
        self.spmd = None  # nxdt.parallel.xla_spmd.SpmdRun, made by configure_model
        on_spmd = use_xla(cfg) and xla_spmd.is_spmd(spec.layout)
        self.layout = xla_spmd.process_layout(spec.layout) if on_spmd else spec.layout
        self.vocab_size = vocab_size
        self.model: torch.nn.Module | None = None
        self.pipeline = None  # nxdt.parallel.pipeline.Pipeline when pipeline_model_parallel_size > 1
        self.parallel_plan = None  # nxdt.parallel.plan.ParallelPlan, made by configure_model
        self.num_parameters = 0
        self.alignment = spec.alignment  # sft / peft (LoRA) / dpo / orpo (nxdt.spec.alignment)
        self.lora_summary: str | None = None  # LoRA: trainable vs total, for the run summary
        # precision.type / fp16 / NaN guard: dtypes, autocast, loss scale, skipped steps (checkpointed)
        self.precision = Precision.from_spec(spec, on_xla=use_xla(cfg))
        # per-step scalars go straight to the loggers (step_scalars.py: before the step's checkpoint);
        # on XLA read in a step closure, after the step's graph ran
        self._step_logger = step_logger(cfg)
        # Samples consumed by finished optimizer steps; data modules read it to resume in place.
        self.consumed_samples = 0
        # token-weighted loss sums of the current validation / test run (nxdt.training.evaluate)
        self.eval_tally = EvalTally()

    # ---- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this twice (fit after validate, ...)
            return
        # meta-device init (low_cpu_fsdp / meta_init): only this rank's shards are ever allocated
        base = build_base_model(self.spec, self.vocab_size, self.precision,
                                meta=wants_meta_init(self.cfg, self.device.type))
        self.num_parameters, self.lora_summary = base.num_parameters, base.lora_summary
        # what each rank holds and what is done to each module; the start summary's figures read it too
        self.parallel_plan = make_plan(base.model, self.spec)
        if self.layout is not self.spec.layout:  # several XLA devices: the plan as SPMD shardings
            self.model, self.spmd = xla_spmd.parallelize_spmd(base.model, self.parallel_plan, self.device,
                                                              zero1=bool(self.cfg.distributed_strategy.zero1))
            self.precision.attach(self.model)
            return
        if self.layout.pp > 1:
            self._configure_pipeline(base.model)
            self.precision.attach(self.model, delegate=True)  # the schedule runs fwd/bwd: autocast only
            return
        self.model = parallelize_llama(base.model, self.device_mesh, self.cfg, self.device, plan=self.parallel_plan)
        self.precision.attach(self.model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self._autocast():
            return logits_of(self.model(input_ids=input_ids, position_ids=position_ids))

    def _autocast(self):
        return self.precision.autocast(self.device.type)

    def _loss_parallel(self):
        return loss_parallel_context(self.layout.tp)

    # ---- optimization --------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer, scheduler = build_optimizer_and_scheduler(self.spec, self.model, submesh(self.device_mesh, "dp"),
                                                             self.cfg.trainer.max_steps)
        if self.spmd is not None:
            self.spmd.shard_optimizer(optimizer, self.model)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return split_microbatches(batch, self.layout.num_microbatches, self.layout.local_batch_size)

    def _cp_mesh(self):
        """Context parallel: the cp axis, which slices every sequence (None when cp == 1)."""
        return self.device_mesh["cp"] if self.layout.cp > 1 else None

    def _cp_slice(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Context parallel: this rank's slice of every sequence (the batch itself when cp == 1)."""
        cp_mesh = self._cp_mesh()
        return shard_sequence(batch, cp_mesh) if cp_mesh is not None else batch

    def _cp_group(self):
        cp_mesh = self._cp_mesh()
        return cp_mesh.get_group() if cp_mesh is not None else None

    def _loss_fn(self):
        """The per-micro-batch loss (logits, labels, loss_mask) of both paths; its cross entropy
        compiled with the blocks (model.fusions.torch_compile; not on XLA, which compiles anyway)."""
        compiled = self.spec.compile and self.device.type != "xla"
        return functools.partial(masked_token_loss, cp_group=self._cp_group(), compiled=compiled)

    def _microbatch_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return microbatch_loss(self.model, mb, self.precision, loss_fn=self._loss_fn(),
                               device_type=self.device.type, cp_mesh=self._cp_mesh(),
                               loss_chunk_size=self.spec.loss_chunk_size)

    def on_train_start(self) -> None:
        self.precompute_reference_logps()  # DPO: once, before the first step (nxdt.training.preference)
        self.grpo_start()  # GRPO: reward functions, the reference weights (nxdt.rl.module)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.spmd is not None:
            self.spmd.shard_batch(batch)  # dim 0 over the data-parallel axes
        # GRPO: this step's rollouts first (sampled on the policy as it is), then its forward/backward
        forward_backward = self.grpo_forward_backward(batch) if self.alignment.grpo else self._forward_backward()
        # the LightningOptimizer: its step() is what Lightning counts (global_step), skipped steps too
        metrics = train_step(self.model, self.optimizers(), self.lr_schedulers(), self.precision,
                             forward_backward, batch, step=self.global_step,
                             clip=self.cfg.trainer.gradient_clip_val,
                             reduce_loss=functools.partial(all_reduce_mean, mesh=self.device_mesh, axis="dp_cp"),
                             norm_over_stages=self.pipeline.norm_over_stages if self.pipeline is not None else None)
        self.consumed_samples += self.layout.global_batch_size
        # loss-free MoE balancing: each layer's selection bias moves by this step's expert loads (all dp ranks')
        balance = update_expert_bias(self.model, submesh(self.device_mesh, "dp_cp").get_group())
        self._log_step(metrics.loss, metrics.lr, metrics.grad_norm)
        for key, value in balance.items():  # moe/layer<i>/load_min|max|std: shares of the step's routed tokens
            self.log_step_scalar(key, value)
        self.log_preference_metrics(forward_backward)  # DPO / ORPO: rewards, accuracies, margins
        if self.alignment.grpo is not None:
            self.log_grpo_metrics(forward_backward)  # rewards, KL, clipping, lengths, entropy, tokens/s
        return metrics.loss

    def _forward_backward(self):
        """The step's forward/backward: the pipeline schedule, or gradient accumulation over micro-batches
        (of preference pairs for DPO / ORPO)."""
        if self.alignment.preference is not None:
            return self.preference_forward_backward()
        common = dict(device_type=self.device.type, tp=self.layout.tp, cp_mesh=self._cp_mesh(),
                      batch_size=self.layout.local_batch_size)
        if self.pipeline is not None:
            return pipeline_forward_backward(self.pipeline, self.precision, **common)
        return microbatch_forward_backward(self.model, self.precision, self.layout.num_microbatches,
                                           loss_fn=self._loss_fn(), backward=self.manual_backward,
                                           loss_chunk_size=self.spec.loss_chunk_size, **common)

    def log_step_scalar(self, name: str, value: Any, prog_bar: bool = False) -> None:
        """One scalar per optimizer step, through `nxdt.observability.step_scalars` (self.log if switched off)."""
        if self._step_logger is not None:
            self._step_logger.log(self.trainer, name, value, prog_bar)
        else:
            self.log(name, value, prog_bar=prog_bar, rank_zero_only=True)
            # at the same step as the writers' (optimizer steps done; Lightning's own axis is one below)
            self.log("step", float(logging_step(self.trainer)[0]), rank_zero_only=True)

    def _log_step(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> None:
        exp = self.cfg.exp_manager
        log = self.log_step_scalar
        log("reduced_train_loss", loss, prog_bar=True)
        log("lr", lr)
        if exp.log_gradient_norm:
            log("gradient_norm", grad_norm)
        if exp.log_parameter_norm and self.global_step % self.trainer.log_every_n_steps == 0:
            log("parameter_norm", self._parameter_norm())
        log("consumed_samples", float(self.consumed_samples))
        log("global_step", float(self.global_step))
        for key, value in self.precision.metrics().items():  # loss_scale, skipped_steps
            log(key, value)
        for key, value in pop_router_stats(self.model).items():  # MoE: this rank's routing, mean over layers
            log(f"moe/{key}", value)

    # ---- validation and test -------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        reduced = self._eval_loss(batch)
        self.log("val_loss", reduced, prog_bar=True, rank_zero_only=True, on_epoch=True, batch_size=1)
        # the loggers' step: optimizer steps done, as the training scalars' (Lightning's axis is one below)
        self.log("step", float(self.trainer.global_step), rank_zero_only=True, on_epoch=True, batch_size=1)
        return reduced

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        reduced = self._eval_loss(batch)
        self.log("test_loss", reduced, prog_bar=True, rank_zero_only=True, on_epoch=True, batch_size=1)
        return reduced

    def _eval_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's loss as training reports it (the mean of the micro-batch means, over dp × cp);
        the token-weighted sums for `nxdt evaluate` are kept on the side (EvalTally)."""
        if self.alignment.preference is not None:
            loss = self.preference_validation_loss(batch)
        elif self.pipeline is not None:
            whole = batch  # every cp rank's micro-batches before slicing: their token counts
            batch = self._cp_slice(batch)
            with self._autocast(), self._loss_parallel():
                losses = self.pipeline.eval(batch["input_ids"], batch["labels"], batch["loss_mask"],
                                            batch.get("position_ids"), per_microbatch=True)
            loss = losses.sum() / len(losses)
            self.eval_tally.add(list(losses), self._microbatches(whole), self.layout.cp)
        else:
            microbatches = self._microbatches(batch)
            with self._loss_parallel():
                losses = [self._microbatch_loss(mb) for mb in microbatches]
                loss = sum(losses) / len(losses)
            self.eval_tally.add(losses, microbatches, self.layout.cp)
        return all_reduce_mean(loss.detach(), self.device_mesh, "dp_cp")

    def on_validation_epoch_start(self) -> None:
        self.eval_tally.reset()

    def on_test_epoch_start(self) -> None:
        self.eval_tally.reset()

    def _parameter_norm(self) -> torch.Tensor:
        norm = _total_norm(_parameter_norm(self.model))
        return self.pipeline.norm_over_stages(norm) if self.pipeline is not None else norm

    # ---- pipeline parallel (pipeline_model_parallel_size > 1) ----------------------------------
    def _configure_pipeline(self, model: torch.nn.Module) -> None:
        """Split into this rank's stages (each parallelized like a whole model) and build the schedule."""
        # fp16: the schedule's loss is multiplied by the current loss scale (so is every stage's backward)
        scale = (lambda: self.precision.loss_scale) if self.precision.scaler is not None else None
        self.pipeline = build_pipeline(model, self.device_mesh, self.cfg, self.layout, self.device,
                                       loss_fn=self._loss_fn(), parallelize_fn=parallelize_llama, loss_scale=scale,
                                       plan=self.parallel_plan)
        self.model = model_of(self.pipeline)

    # ---- state carried in checkpoints ----------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["consumed_samples"] = self.consumed_samples
        checkpoint["precision"] = self.precision.state_dict()
        self.grpo_save_state(checkpoint)  # GRPO: a batch of rollouts between its num_iterations

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.consumed_samples = int(checkpoint.get("consumed_samples", 0))
        if checkpoint.get("precision"):
            self.precision.load_state_dict(checkpoint["precision"])
        self.grpo_load_state(checkpoint)


def _total_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm that may be a DTensor (sharded/replicated params) as a plain tensor."""
    full = getattr(norm, "full_tensor", None)
    return (full() if full is not None else norm).detach()


@torch.no_grad()
def _parameter_norm(model: torch.nn.Module) -> torch.Tensor:
    return total_norm([p.detach() for p in model.parameters()])
