"""Preemption and failed asynchronous saves: what every rank agrees on after each step.

Preemption. Slurm sends SIGTERM (or, with `--signal=USR1@120`, SIGUSR1) before it kills a job;
spot and reclaimed nodes do the same. On any of `exp_manager.preemption_signals` a rank only
records the signal (a signal handler must not run collectives). After each training step the
ranks agree, with one all-reduce of two flags on a small gloo group of their own, whether any rank
was signalled or saw its asynchronous save fail. If signalled, every rank finishes the step, saves
a complete checkpoint (waiting for it, asynchronous or not), and the run stops there and exits 0.
In a Slurm batch job, rank 0 then requeues it (`scontrol requeue`) unless
`exp_manager.requeue_on_preemption=false`. The next launch with `resume_if_exists` continues bit
for bit. Lightning's own SIGTERM handling (stop at once, no checkpoint) is replaced while
training runs, and the handlers before the run are restored after it. Loader workers ignore the
stop signals (nxdt.data.common.worker_init), so a signal to the whole process group, or
torchrun's `killpg` of each rank's group, leaves them to end with their rank after the save.

Ctrl-C (SIGINT, always handled) is the same stop: the first saves at the end of the current step
and the entry prints the command that continues; a second one before that save is done stops at
once (`os._exit(130)`), saying that nothing was saved. Under torchrun the second Ctrl-C reaches
torchrun only, which then sends the ranks SIGTERM (and SIGKILL 30 s later): any stop signal after a
Ctrl-C counts as the second. Were the launcher gone instead, the ranks' watchdog says the same
(nxdt.training.launcher_watchdog).

Failed saves. An asynchronous save's error is seen by `Checkpointer.poll` on the ranks whose
background write has finished; the agreement makes every rank wait for its own and raise the same
error at the same step (nxdt.checkpoint.save_errors), which `exp_manager.on_checkpoint_error`
turns into a stop or a warning (nxdt.checkpoint.callbacks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from nxdt.checkpoint.callbacks import NxdtCheckpoint
from nxdt.spec.exp import parse_signals
from nxdt.training.launcher_watchdog import interrupted, preemption_save_in_progress

INTERRUPTED_EXIT = 130
"""Exit status of a run stopped by a second Ctrl-C (128 + SIGINT, as a shell reports it)."""


class FaultTolerance(Callback):
    """Preemption signals → save and stop; failed async saves → the same error on every rank."""

    def __init__(self, cfg) -> None:
        exp = cfg.exp_manager
        self.signals = parse_signals(exp.preemption_signals)
        self.handled = [*self.signals, *([signal.SIGINT] if signal.SIGINT not in self.signals else [])]
        self.requeue = bool(exp.requeue_on_preemption)
        self.received: str | None = None  # the first preemption signal this rank got
        self.preempted_at: int | None = None  # the step the run stopped at for a preemption
        self._before: dict[signal.Signals, object] = {}
        self._group = None
        self._step = 0  # the last finished step (for a second Ctrl-C's line)

    # ---- signals
    def _on_signal(self, signum, _frame) -> None:
        sig = signal.Signals(signum)
        if interrupted.is_set() and self.preempted_at is None:
            # a second Ctrl-C before the save is done; under torchrun it arrives as SIGTERM (torchrun,
            # interrupted again, shuts its workers down with SIGTERM and kills them 30 s later)
            stop_now(self._step, "second Ctrl-C" if sig == signal.SIGINT else f"{sig.name} after Ctrl-C")
        if sig == signal.SIGINT:
            interrupted.set()
        if self.received is None:  # no printing here: the handler may interrupt a print
            self.received = sig.name

    def install(self) -> None:
        """Our handler for the preemption signals (main thread only; again after Lightning's own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.handled:
            previous = signal.signal(sig, self._on_signal)
            self._before.setdefault(sig, previous)

    def restore(self) -> None:
        """The handlers that were in place before the run (call after fit, also when it failed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._before.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._before.clear()
        interrupted.clear()

    # ---- hooks
    def setup(self, trainer, pl_module, stage: str) -> None:
        self.install()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank calls setup: a collective is fine

    def on_train_start(self, trainer, pl_module) -> None:
        self.install()  # Lightning registered its SIGTERM handler (stop without saving) in between

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step = trainer.global_step
        # NxdtCheckpoint (before this callback) has polled the async save this step
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        signalled, save_failed = self._agree(self.received is not None,
                                             checkpointer is not None and checkpointer.failed_here)
        checkpoint = _checkpoint_callback(trainer)
        if save_failed and checkpoint is not None:
            checkpoint.wait_for_save(trainer)  # raises on every rank (or warns: on_checkpoint_error=continue)
        if signalled and self.preempted_at is None:
            self._stop(trainer, checkpoint)

    def _agree(self, signalled: bool, save_failed: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(signalled), int(save_failed)], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0]), bool(flags[1])

    def _stop(self, trainer, checkpoint: NxdtCheckpoint | None) -> None:
        step, why = trainer.global_step, self.received or "a stop signal on another rank"
        ctrl_c = why == "SIGINT"
        saved = None
        if not ctrl_c:  # the launcher may be ended by the same signal: finish the save (a second Ctrl-C may not)
            preemption_save_in_progress.set()
        try:
            if checkpoint is not None:
                checkpoint.save(trainer)
                checkpoint.wait_for_save(trainer)
                saved = checkpoint.checkpoint_path(trainer)
        finally:
            preemption_save_in_progress.clear()
        trainer.should_stop = True
        self.preempted_at = step
        if trainer.is_global_zero:
            if saved is None:
                where = "no checkpoint (exp_manager.create_checkpoint_callback=false)"
            elif ctrl_c:
                where = f"checkpoint {saved.name} saved; the 'continue' command below resumes from it"
            else:
                where = f"checkpoint {saved.name} saved; a relaunch with exp_manager.resume_if_exists=true continues from it"
            print(f"interrupted (Ctrl-C) at step {step}: {where}" if ctrl_c else
                  f"preempted ({why}) at step {step}: {where}", flush=True)


def stop_now(step: int, why: str = "second Ctrl-C") -> None:
    """A second Ctrl-C: leave at once (no save, no teardown), one line from global rank 0."""
    if os.environ.get("RANK", "0") == "0":
        line = (f"interrupted again ({why}) after step {step}: stopped at once, nothing was saved "
                "(the last complete checkpoint stays the resume point)\n")
        try:
            os.write(2, line.encode())
        except OSError:
            pass
    for child in _children():  # the loader workers ignore the stop signals: they go with the rank
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    os._exit(INTERRUPTED_EXIT)


def _children() -> list[int]:
    """This process's live children (its loader workers), from /proc; none where it cannot be read."""
    try:
        return [int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]
    except OSError:
        return []


def _checkpoint_callback(trainer) -> NxdtCheckpoint | None:
    return next((c for c in trainer.callbacks if isinstance(c, NxdtCheckpoint)), None)


def slurm_batch_job() -> str | None:
    """The id `scontrol requeue` takes, in a Slurm batch job (sbatch sets ENVIRONMENT=BATCH); else None.
    Interactive allocations (salloc, srun alone) are never requeued."""
    if os.environ.get("ENVIRONMENT") != "BATCH" or not os.environ.get("SLURM_JOB_ID"):
        return None
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else os.environ["SLURM_JOB_ID"]


def requeue_slurm_job() -> None:
    """Rank 0, after a preemption save: put this Slurm batch job back in the queue (one line says how it went)."""
    job = slurm_batch_job()
    if job is None:
        return
    # said before the call: a requeue ends this job's processes, often before scontrol has returned here
    print(f"slurm job {job}: requeueing it (scontrol requeue {job})", flush=True)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        failed = None if done.returncode == 0 else " ".join(done.stderr.split())
    except (OSError, subprocess.TimeoutExpired) as err:
        failed = str(err)
    print(f"slurm job {job}: requeued" if failed is None else f"slurm job {job}: not requeued: {failed}", flush=True)
