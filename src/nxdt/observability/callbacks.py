"""Callbacks that show a run to a person: the start summary, throughput and MFU, the time estimate
once the first steps are timed (observability/eta.py), measured peak memory (the progress bar:
observability/progress.py). The figures they print are `nxdt plan`'s
(nxdt.planner.estimate), so the summary and the plan agree for the same config."""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from nxdt import hardware
from nxdt.device import max_memory_allocated, reset_peak_memory
from nxdt.hardware import Peak, device_peak, low_precision_notice
from nxdt.models.param_count import ParameterCount, activated_lines
from nxdt.observability.eta import FirstStepsTiming
from nxdt.observability.memory import CpuStepPeak
from nxdt.planner.estimate import batch_lines, flops_line, memory_line, peak_lines, plan, stage_lines

GIB = 1024**3

MEMORY_EVERY = 50
"""CPU: the peak memory is measured on the second step of a fit, then every this many steps."""


class RunFigures:
    """What this run costs (`nxdt plan`'s dict for its config and vocabulary) and what one device
    can do (its peak TFLOP/s), each worked out once per process, when the first callback asks at
    fit start (the vocabulary is the data module's, known by then). `spec`: the run spec."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.cfg = spec.cfg
        self._plan: dict[str, Any] | None = None
        self._peak: dict[str, Peak | None] = {}

    def plan(self, vocab_size: int | None, parallel=None) -> dict[str, Any]:
        """`parallel`: the run's parallel plan (nxdt.parallel.plan, the module's `parallel_plan`): the
        figures are read from the plan the run applied (None: the planner makes the same one)."""
        if self._plan is None:
            self._plan = plan(self.spec, vocab_size, parallel)
        return self._plan


    def peak(self, device: torch.device) -> Peak | None:
        key = str(device)
        if key not in self._peak:
            t = self.cfg.trainer
            self._peak[key] = device_peak(device, self.spec.precision.compute_dtype,
                                          t.peak_tflops, t.lnc)
        return self._peak[key]

    def precision_notice(self, device: torch.device) -> str | None:
        """The one line for a bf16/fp16 preset on a device that runs it slower than fp32 (nxdt.hardware)."""
        return low_precision_notice(device, self.spec.precision.compute_dtype, self.cfg.precision.type)


def run_figures(figures: RunFigures, pl_module) -> dict[str, Any]:
    """The figures of the run `pl_module` trains: for its vocabulary, read from its parallel plan
    (the one configure_model made and applied) when it has one."""
    parallel = getattr(pl_module, "parallel_plan", None)
    vocab = getattr(pl_module, "vocab_size", None)
    return figures.plan(vocab, parallel) if parallel is not None else figures.plan(vocab)


def _logger(pl_module):
    # nxdt's module logs per-step scalars through a step closure on XLA (no mid-step graph run)
    return getattr(pl_module, "log_step_scalar", None) or partial(pl_module.log, rank_zero_only=True)


class ThroughputMonitor(Callback):
    """After each optimizer step: `step_time` (s), `throughput` (tokens/s, all ranks together),
    `tflops` (model TFLOP/s per device) and `mfu` (% of the device's peak). Once the first steps
    are timed, rank 0 prints the run's time estimate from these step times (nxdt.observability.eta)."""

    def __init__(self, tokens_per_step: int | None, figures: RunFigures | None = None) -> None:
        self.tokens_per_step = tokens_per_step
        self.figures = figures
        self._start: float | None = None
        self.flops_per_token: int | None = None
        self.peak: Peak | None = None
        self._steps = self._above_peak = 0  # steps with an mfu, and those over 100%
        self.timing = FirstStepsTiming()

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.figures is None:
            return
        self.flops_per_token = run_figures(self.figures, pl_module)["flops_per_token"]
        self.peak = self.figures.peak(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._start is None:
            return
        step_time = time.perf_counter() - self._start
        log = _logger(pl_module)
        log("step_time", step_time)
        self._estimate(trainer, step_time)
        if not self.tokens_per_step:
            return
        log("throughput", self.tokens_per_step / step_time, prog_bar=True)
        if self.flops_per_token:
            tflops = achieved_tflops(self.flops_per_token, self.tokens_per_step, step_time, trainer.world_size)
            log("tflops", tflops)
            if self.peak is not None:
                mfu = mfu_percent(tflops, self.peak.tflops)
                log("mfu", mfu, prog_bar=True)
                self._steps += 1
                self._above_peak += mfu > 100

    def _estimate(self, trainer, step_time: float) -> None:
        """The time estimate, once: from this fit's step times (printed by rank 0)."""
        steps_done = getattr(trainer, "global_step", None)  # None: a stand-in trainer without steps
        if steps_done is None:
            return
        line = self.timing.add(steps_done, step_time, trainer.max_steps, time.time())
        if line and trainer.is_global_zero:
            print(line, flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        """Most steps faster than a CPU peak measured here: the probe ran under other load. Drop
        the stored figure so that the next run measures again."""
        if self.peak is not None and self.peak.measured and self._above_peak > self._steps / 2:
            hardware.forget_cpu_peak(self.peak.measured)
            if trainer.is_global_zero:
                print(f"note: MFU above 100% on {self._above_peak} of {self._steps} steps: the CPU peak "
                      f"({self.peak.tflops:.4g} TFLOP/s) was measured while the machine was busy; "
                      "the next run measures it again", flush=True)


def achieved_tflops(flops_per_token: float, tokens_per_step: int, step_time: float, world_size: int) -> float:
    """Model TFLOP/s per device. The FLOPs are the whole model's for every token of the global
    batch, divided by all ranks: under tensor, pipeline, context or expert parallelism a rank does a
    part of each token's work, under data parallelism all of the work of a part of the tokens;
    either way the world's devices share the step's FLOPs."""
    return flops_per_token * tokens_per_step / step_time / world_size / 1e12


def mfu_percent(tflops: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the achieved model TFLOP/s as a percentage of the device's peak."""
    return 100.0 * tflops / peak_tflops


class MemoryMonitor(Callback):
    """The measured peak memory per rank (nxdt.observability.memory): `memory/peak_gib`, the highest
    peak of any rank so far (the rank that runs out first), measured on the second step of the fit,
    then every MEMORY_EVERY, and logged with every step after the first measurement; at the end of
    the fit rank 0 prints it next to the estimate."""

    def __init__(self, cfg, figures: RunFigures) -> None:
        self.cfg, self.figures = cfg, figures
        self.kind: str | None = None  # cuda | cpu | None (not measured: XLA, or the step profiler is on)
        self.peak_bytes = 0  # this rank's highest measured peak
        self.highest = 0  # the highest of every rank's, as of the last measured step
        self.sampled = 0  # steps measured (CPU)
        self._steps = 0
        self._cpu = None
        self._measuring = False

    def on_fit_start(self, trainer, pl_module) -> None:
        device = pl_module.device
        if device.type == "cuda":
            self.kind = "cuda"
            reset_peak_memory(device)
        elif device.type == "cpu" and not self.cfg.exp_manager.profiler.enabled:  # one profiler at a time
            self.kind, self._cpu = "cpu", CpuStepPeak()

    def _sampled_step(self) -> bool:
        return self._steps == 1 or (self._steps > 0 and self._steps % MEMORY_EVERY == 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kind == "cpu" and self._sampled_step():
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]  # the step frees them first
            self._measuring = self._cpu.begin(freed_first=grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sampled = self._sampled_step()
        self._steps += 1
        if self.kind == "cuda":
            self.peak_bytes = max_memory_allocated(pl_module.device)
        elif self._measuring:
            self._measuring = False
            self.peak_bytes = max(self.peak_bytes, self._cpu.end())
            self.sampled += 1
        if self.kind is not None and sampled:  # every rank at the same steps: a collective
            self.highest = max(_gather(self.peak_bytes, pl_module.device))
        if self.highest:
            # the highest so far, on every step: the logged steps (trainer.log_every_n_steps) need
            # not be the measured ones
            _logger(pl_module)("memory/peak_gib", self.highest / GIB)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.kind is None:
            if trainer.is_global_zero:
                print(memory_report(run_figures(self.figures, pl_module), [], self.cfg, None), flush=True)
            return
        peaks = _gather(self.peak_bytes, pl_module.device)
        if trainer.is_global_zero:
            how = "CUDA allocator" if self.kind == "cuda" else f"live CPU tensor bytes, {self.sampled} sampled step(s)"
            print(memory_report(run_figures(self.figures, pl_module), peaks, self.cfg, how), flush=True)


def _gather(value: int, device: torch.device) -> list[int]:
    """`value` of every rank (this one's alone without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def memory_report(p: dict[str, Any], peaks: list[int], cfg, how: str | None) -> str:
    """One line: the plan's estimate for the fullest rank vs the measured peaks of the ranks."""
    mem = p["memory_per_rank_bytes"]
    parts = ", ".join(f"{k} {mem[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "activations"))
    line = f"memory/rank  estimate {mem['total'] / GIB:.2f} GiB ({parts})"
    measured = [b for b in peaks if b]
    if not measured:
        why = ("exp_manager.profiler is on" if cfg.exp_manager.profiler.enabled else
               "no step was sampled" if how else "not measured on this device")
        return f"{line} vs measured peak: none ({why})"
    top = max(measured)
    line += f" vs measured peak {top / GIB:.2f} GiB"
    if len(peaks) > 1:
        line += f" (rank {peaks.index(top)}, the highest of {len(peaks)}; lowest {min(measured) / GIB:.2f} GiB)"
    return f"{line}  [{how}]"


def format_summary(cfg, layout, p: dict[str, Any], log_dir: str | None, peak: Peak | None = None,
                   threads: str | None = None) -> str:
    """The start summary: `p` is the plan of this config (nxdt.planner.estimate.plan), so the
    parameters, memory and FLOPs lines are the figures `nxdt plan` prints; `threads`: the CPU
    threads line (threads_line), before the peak measured with them."""
    counts = ParameterCount(total=p["parameters"], activated=p["parameters_activated"], **p["parameter_breakdown"])
    n = p["parameters"]
    lines = [
        f"nxdt run '{cfg.name}'  model_source={cfg.model_source}  precision={cfg.precision.type}",
        f"  layout       world={layout.world_size}  dp={layout.dp}  tp={layout.tp}  pp={layout.pp}  cp={layout.cp}"
        + (f"  ep={layout.ep}" if layout.ep > 1 else ""),
        f"  parameters   {n:,}  ({n / 1e6:.1f} M)  {p['parameters_per_rank']:,} on the fullest rank",
        *activated_lines(counts),
        # nxdt plan's batch lines, from this run's layout: global batch, tokens per step, max_steps
        # (from trainer.max_tokens when given) and the tokens the run trains
        *batch_lines(layout.global_batch_size, layout.micro_batch_size, layout.num_microbatches,
                     layout.seq_length, cfg.trainer.max_steps, cfg.trainer.max_tokens),
        *stage_lines(p),
        memory_line(p["memory_per_rank_bytes"], "  (estimate, fullest rank)"),
        flops_line(p),
        *([threads] if threads else []),
    ]
    lines += peak_lines(p, peak, layout.world_size)
    if log_dir:
        lines.append(f"  log dir      {log_dir}")
    return "\n".join(lines)


def threads_line(env=os.environ) -> str:
    """The start summary's CPU line: how many intra-op threads torch uses per rank and why, and how
    to change it (OMP_NUM_THREADS, read when torch starts; nxdt has no config key for it). On a
    machine whose load is at or above its CPUs, a hint: fewer threads can be much faster there
    (2 threads on a loaded 2-core machine ran 12.5 s/step, 1 thread 0.93 s)."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    omp = env.get("OMP_NUM_THREADS")
    if omp:
        launched = int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1
        why = f"OMP_NUM_THREADS={omp}" + (" (torchrun's 1 per rank unless it is given)" if launched else "")
    else:
        why = f"torch's default: one per CPU this process may use ({cpus})"
    line = f"  threads      {threads} torch thread{'s' * (threads != 1)} per rank, from {why}; set OMP_NUM_THREADS=N to change it"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads > 1 and load >= cpus:
        line += (f"\n               the machine is loaded (load average {load:.1f} on {cpus} CPUs): fewer threads "
                 "can be much faster, e.g. OMP_NUM_THREADS=1")
    return line


def cpu_heap_line(kept: bool | None) -> str | None:
    """The start summary's line on how the CPU heap is kept between steps (nxdt.training.trainer.keep_cpu_heap:
    glibc's mallopt, an environment switch like OMP_NUM_THREADS, not a config key); None where it does not
    apply (not a CPU run, or not glibc)."""
    if kept is None:
        return None
    if kept:
        return ("  cpu heap     a step's freed buffers stay in the process for the next step (glibc: up to 1 GiB "
                "each); NXDT_KEEP_CPU_HEAP=0 gives them back to the OS")
    return "  cpu heap     glibc's defaults: buffers over 32 MiB are mapped afresh each step"


class RunSummary(Callback):
    """Prints a one-screen summary (layout, parameters, batch, tokens per step, max_steps and the
    tokens in all, memory, FLOPs) at fit start."""

    def __init__(self, spec, log_dir: str | None, figures: RunFigures | None = None,
                 cpu_heap_kept: bool | None = None) -> None:
        """`spec`: the run spec (its config and layout); `cpu_heap_kept`: keep_cpu_heap's outcome on a
        CPU run with glibc (None elsewhere)."""
        self.cfg, self.layout, self.log_dir = spec.cfg, spec.layout, log_dir
        self.figures = figures or RunFigures(spec)
        self.heap = cpu_heap_line(cpu_heap_kept)

    @rank_zero_only
    def on_fit_start(self, trainer: pl.Trainer, pl_module) -> None:
        p = run_figures(self.figures, pl_module)
        threads = threads_line() if pl_module.device.type == "cpu" else None  # CPU: torch's intra-op threads
        if threads and self.heap:
            threads += "\n" + self.heap
        text = format_summary(self.cfg, self.layout, p, self.log_dir, self.figures.peak(pl_module.device), threads)
        lora = getattr(pl_module, "lora_summary", None)  # LoRA: trainable vs total (lora_verbose: per target)
        print(text + (f"\n  lora         {lora}" if lora else ""), flush=True)
        notice = self.figures.precision_notice(pl_module.device)  # e.g. bf16 on a CPU without fast bf16
        if notice:
            print(notice, flush=True)


class CompileTimer(Callback):
    """model.fusions.torch_compile: the blocks compile during the first step's forward and backward;
    rank 0 prints how long that step took, once (the steps after it reuse the compiled graphs)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self.first_step_s: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first_step_s is None and self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_step_s is None and self._start is not None:
            self.first_step_s = time.perf_counter() - self._start
            if trainer.is_global_zero:
                print(f"torch.compile: the first step took {self.first_step_s:.1f} s (each decoder block compiled "
                      "for its forward and backward; the steps after it reuse the graphs)", flush=True)
