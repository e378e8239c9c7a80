"""Callbacks that show a run to a person: the start summary and throughput (the progress bar: training/progress.py)."""

from __future__ import annotations

import time
from functools import partial

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from nxdt.models.param_count import ParameterCount, activated_lines, parameter_counts


class ThroughputMonitor(Callback):
    """Logs step time and tokens/s (all data-parallel ranks together) after each optimizer step."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self._start: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._start is None:
            return
        step_time = time.perf_counter() - self._start
        # nxdt's module logs per-step scalars through a step closure on XLA (no mid-step graph run)
        log = getattr(pl_module, "log_step_scalar", None) or partial(pl_module.log, rank_zero_only=True)
        log("step_time", step_time)
        log("throughput", self.tokens_per_step / step_time, prog_bar=True)


def format_summary(cfg, layout, num_parameters: int, memory: dict[str, int], log_dir: str | None,
                   counts: ParameterCount | None = None) -> str:
    """`counts`: adds the activated-per-token breakdown of an MoE model (nothing for a dense one)."""
    gib = 1024**3
    lines = [
        f"nxdt run '{cfg.name}'  model_source={cfg.model_source}  precision={cfg.precision.type}",
        f"  layout       world={layout.world_size}  dp={layout.dp}  tp={layout.tp}  pp={layout.pp}  cp={layout.cp}"
        + (f"  ep={layout.ep}" if layout.ep > 1 else ""),
        f"  parameters   {num_parameters:,}  ({num_parameters / 1e6:.1f} M)",
        *(activated_lines(counts) if counts is not None else []),
        f"  batch        global={layout.global_batch_size}  micro={layout.micro_batch_size}  "
        f"microbatches/step={layout.num_microbatches}  seq={cfg.data.seq_length}",
        f"  tokens/step  {layout.tokens_per_step:,}   max_steps={cfg.trainer.max_steps}",
        "  memory/rank  "
        + "  ".join(f"{k}={v / gib:.2f}GiB" for k, v in memory.items())
        + "  (estimate)",
    ]
    if log_dir:
        lines.append(f"  log dir      {log_dir}")
    return "\n".join(lines)


def estimate_memory_per_rank(num_parameters: int, layout, cfg, bytes_per_param: int = 4) -> dict[str, int]:
    """A first-order estimate: fp32 params + grads + Adam's two moments, split over tp × pp.

    Activations: per layer ~ 34·s·b·h bytes·(fp32/2) (Korthikanti et al.), micro-batch only.
    `nxdt plan` will refine this per sharding and checkpointing choice.
    """
    shard = layout.tp * layout.pp
    params = num_parameters * bytes_per_param // shard
    grads = params
    optimizer = 2 * num_parameters * 4 // shard
    s, b, h = cfg.data.seq_length, layout.micro_batch_size, cfg.model.hidden_size
    layers = cfg.model.num_layers // layout.pp
    activations = int(34 * s * b * h * layers * bytes_per_param / 2 / layout.tp)
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
            "total": params + grads + optimizer + activations}


class RunSummary(Callback):
    """Prints a one-screen summary (layout, parameters, tokens per step, memory) once the model exists."""

    def __init__(self, cfg, layout, log_dir: str | None) -> None:
        self.cfg, self.layout, self.log_dir = cfg, layout, log_dir

    @rank_zero_only
    def on_fit_start(self, trainer: pl.Trainer, pl_module) -> None:
        n = pl_module.num_parameters
        memory = estimate_memory_per_rank(n, self.layout, self.cfg)
        # A pipeline rank's module is only its own stages, so its split would be partial; the
        # whole (parallelized) model counts right, sharded weights being DTensors of global size.
        whole = getattr(pl_module, "pipeline", None) is None and pl_module.model is not None
        counts = parameter_counts(pl_module.model) if whole else None
        text = format_summary(self.cfg, self.layout, n, memory, self.log_dir, counts)
        lora = getattr(pl_module, "lora_summary", None)  # LoRA: trainable vs total (lora_verbose: per target)
        print(text + (f"\n  lora         {lora}" if lora else ""), flush=True)
