"""`exp_manager.profiler`: torch.profiler traces of a window of training steps (fms-fsdp's use_profiler).

On the ranks in `ranks`, `torch.profiler.profile` runs with `schedule(wait, warmup, active,
repeat)` over the optimizer steps of this run (counted from its first step, a resumed run
included): `wait` steps skipped, `warmup` steps profiled and dropped, `active` steps recorded into
`<log_dir>/profiler/rank<R>.<time>.pt.trace.json` (TensorBoard's profiler plugin, or Perfetto),
`repeat` times (0: until the end). One profiler step is one optimizer step together with what
follows it before the next begins (validation, a checkpoint save, samples): the profiler steps at
the start of each batch and stops after the last, so a checkpoint saved at step N is in the
trace as `ProfilerStep#N`, not in the step after it.

`cuda_memory_snapshot` (CUDA only; a notice elsewhere): the caching allocator's history over the
first active window, written to `<log_dir>/profiler/memory_snapshot_rank<R>.pickle` for
pytorch.org/memory_viz.

The profiler's own chatter stays out of the run's output: Kineto's `USDT: ... profiler_start` /
`profiler_stop` lines (written by libkineto to fd 2 at each start and stop of a recording,
whatever KINETO_LOG_LEVEL says) and torch's "Profiler clears events at the end of each cycle"
warning are dropped from the profiler's calls (`quiet_profiler`), nothing else.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule, tensorboard_trace_handler

from nxdt.config.errors import ConfigError
from nxdt.device import dump_memory_snapshot, record_memory_history

SNAPSHOT_ENTRIES = 100_000  # allocator events kept (PyTorch's memory_viz guide uses this)
RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


def check_profiler(settings, world_size: int) -> None:
    """One line for settings torch.profiler would assert on, or ranks outside the world."""
    for name in ("wait", "warmup", "repeat"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"exp_manager.profiler.{name}: must be >= 0, got {getattr(settings, name)}")
    if settings.active < 1:
        raise ConfigError(f"exp_manager.profiler.active: must be >= 1 (steps recorded), got {settings.active}")
    outside = [rank for rank in settings.ranks if not 0 <= rank < world_size]
    if outside or not settings.ranks:
        raise ConfigError(f"exp_manager.profiler.ranks: {list(settings.ranks)} "
                          + (f"has {outside} outside the world of {world_size} ranks (0..{world_size - 1})"
                             if outside else "is empty: name at least one global rank"))


@contextmanager
def quiet_profiler():
    """Around one call into torch.profiler: fd 2 goes to a temporary file, whose lines other than
    Kineto's `USDT:` ones are written back after the call; the profiler's cycle warning is ignored."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Profiler clears events at the end of each cycle")
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(line for line in tmp.read().splitlines(keepends=True) if not line.startswith(b"USDT:"))
            if kept:
                os.write(2, kept)


class StepProfiler(Callback):
    """torch.profiler over a window of optimizer steps on this rank (if it is one of `settings.ranks`)."""

    def __init__(self, settings, out_dir: Path, world_size: int, global_rank: int) -> None:
        check_profiler(settings, world_size)
        self.settings, self.out_dir, self.rank = settings, Path(out_dir), global_rank
        self.here = global_rank in settings.ranks
        self._schedule = schedule(wait=settings.wait, warmup=settings.warmup, active=settings.active,
                                  repeat=settings.repeat)
        self._window = settings.wait + settings.warmup + settings.active
        self._prof: profile | None = None
        self._steps = 0  # optimizer steps ended since the profiler started (= its step_num)
        self._finished = False
        self._snapshot = "off"  # off | waiting | recording | written
        self._reported = False

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer, pl_module) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        if self.settings.cuda_memory_snapshot:
            if cuda:
                self._snapshot = "waiting"
            elif trainer.is_global_zero:
                print(f"note: exp_manager.profiler.cuda_memory_snapshot has no effect on this device "
                      f"({trainer.strategy.root_device.type}): it records the CUDA caching allocator", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.here or self._finished:
            return
        if self._prof is None:
            self._start(trainer)
        else:
            with quiet_profiler():
                self._prof.step()  # ends the previous optimizer step, with everything after it
            self._steps += 1
            if self.settings.repeat and self._steps >= self._window * self.settings.repeat:
                self._stop()  # every window is written: nothing more to record
                return
        self._maybe_start_snapshot()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()
        self._report(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop()  # a window cut short is still written
        self._report(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop()

    # ------------------------------------------------------------------ the profiler
    def _start(self, trainer) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        s = self.settings
        self._prof = profile(
            activities=activities, schedule=self._schedule, on_trace_ready=self._trace_ready,
            record_shapes=s.record_shapes, profile_memory=s.profile_memory, with_stack=s.with_stack)
        with quiet_profiler():
            self._prof.start()

    def _trace_ready(self, prof: profile) -> None:
        tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}")(prof)
        if self._snapshot == "recording":
            dump_memory_snapshot(self.out_dir / f"memory_snapshot_rank{self.rank}.pickle")
            record_memory_history(False)
            self._snapshot = "written"

    def _maybe_start_snapshot(self) -> None:
        if self._snapshot == "waiting" and self._schedule(self._steps) in RECORDING:
            record_memory_history(True, SNAPSHOT_ENTRIES)
            self._snapshot = "recording"

    def _stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            self._steps += 1  # the step in progress ends here
            with quiet_profiler():
                prof.stop()  # a window being recorded is written (on_trace_ready)
        if self._snapshot == "recording":  # the window had not reached the trace: stop recording anyway
            record_memory_history(False)
            self._snapshot = "off"
        self._finished = True

    def _report(self, trainer) -> None:
        if not trainer.is_global_zero or self._reported:
            return
        self._reported = True
        s = self.settings
        first = s.wait + s.warmup  # the first recorded step, counted from 0 (the ProfilerStep#N numbers)
        if self.here and self._steps <= first:
            print(f"profiler: no trace: the run ended after {self._steps} steps, before the profiler's first "
                  f"active step (wait={s.wait} + warmup={s.warmup})", flush=True)
            return
        snapshots = " (memory snapshots: memory_snapshot_rank<R>.pickle, in https://pytorch.org/memory_viz)"
        print(f"profiler: traces of rank(s) {', '.join(map(str, s.ranks))} in {self.out_dir}: "
              f"tensorboard --logdir {self.out_dir.parent} (pip install torch-tb-profiler), "
              "or open a .pt.trace.json in https://ui.perfetto.dev"
              + (snapshots if self._snapshot == "written" else ""), flush=True)
