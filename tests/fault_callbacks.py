"""Test callbacks for the fault-tolerance tests (`trainer.callbacks`, with tests/ on PYTHONPATH).

`SignalAt`: `trainer.callbacks=[{_target_:fault_callbacks.SignalAt,step:5,signal:SIGTERM,to:launcher}]`:
at the end of training step `step`, global rank 0 sends `signal` to itself (`to: self`) or to its
launcher (`to: launcher`: torchrun forwards it to every rank, as it does when Slurm or Kubernetes
signals it). User callbacks run before nxdt's own, so the run
sees the signal at this step (to self) or within a step or two (through the launcher).
"""

from __future__ import annotations

import os
import signal as signals

from lightning.pytorch.callbacks import Callback


class SignalAt(Callback):
    def __init__(self, step: int, signal: str = "SIGTERM", to: str = "self") -> None:
        self.step, self.signal, self.to = int(step), getattr(signals, signal), to

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getppid() if self.to == "launcher" else os.getpid(), self.signal)


class SlowSteps(Callback):
    """Each training step takes at least `seconds` (a tiny model's steps are too quick for a test
    to signal a real Slurm job in the middle of its run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)
