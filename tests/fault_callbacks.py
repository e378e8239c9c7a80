"""Test callbacks for the fault-tolerance tests (`trainer.callbacks`, with tests/ on PYTHONPATH).

`SignalAt`: `trainer.callbacks=[{_target_:fault_callbacks.SignalAt,step:5,signal:SIGTERM,to:launcher}]`:
at the end of training step `step`, global rank 0 sends `signal` to itself (`to: self`), to itself
and every process it started, its loader workers (`to: group`: what `kill -- -PGID` of a run
without torchrun, or Ctrl-C in its terminal, does), to its launcher (`to: launcher`: torchrun
forwards it to every rank's process group, as it does when Slurm or Kubernetes signals it), or to
the launcher's process group (`to: launcher_group`: `kill -TERM -- -PGID` of a torchrun started
with setsid, as `timeout` and many schedulers do). User callbacks run before nxdt's own, so the run
sees the signal at this step (to self) or within a step or two (through the launcher).
"""

from __future__ import annotations

import os
import signal as signals
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class SignalAt(Callback):
    def __init__(self, step: int, signal: str = "SIGTERM", to: str = "self") -> None:
        self.step, self.signal, self.to = int(step), getattr(signals, signal), to

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or not trainer.is_global_zero:
            return
        if self.to == "launcher_group":
            os.killpg(os.getpgid(os.getppid()), self.signal)
        elif self.to == "launcher":
            os.kill(os.getppid(), self.signal)
        else:
            for child in children() if self.to == "group" else []:
                os.kill(child, self.signal)
            os.kill(os.getpid(), self.signal)


def children() -> list[int]:
    """The live child processes of this process (its loader workers), from /proc."""
    return [int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()]


class SlowSteps(Callback):
    """Each training step takes at least `seconds` (a tiny model's steps are too quick for a test
    to signal a real Slurm job in the middle of its run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)
