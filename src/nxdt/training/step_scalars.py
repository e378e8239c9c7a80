"""Per-optimizer-step scalars (loss, lr, gradient norm, throughput, ...) written straight to the loggers.

Why not Lightning's `self.log`: Lightning hands the values a step logged to its loggers only after
every `on_train_batch_end` hook has run, i.e. after that step's checkpoint was written. A run killed
(SIGKILL, preemption, a dead node) right after the checkpoint completes resumes *after* that step,
so the step's loss would be missing from the logs for good. Written here, the values are in the
loggers as soon as they are logged, and `NxdtCheckpoint` flushes the loggers before it saves: every
step a checkpoint covers is on disk in the logs before the checkpoint is.

Same steps as Lightning (`log_every_n_steps`, step numbers = optimizer steps finished before this
one), same progress bar and callback metrics (checkpoint monitors read those). On XLA the values are
read in a step closure instead (`nxdt.training.xla.StepClosureLogger`).
"""

from __future__ import annotations

from typing import Any

import torch

from nxdt.device import use_xla


def logging_step(trainer: Any) -> tuple[int, bool]:
    """Lightning's logging step (batches finished before this one) and whether it goes to the loggers."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    every = trainer.log_every_n_steps
    return step, every > 0 and ((step + 1) % every == 0 or trainer.should_stop)  # Lightning's rule


class StepScalarWriter:
    def __init__(self) -> None:
        self._epoch_logged_at = -1  # the step whose 'epoch' scalar was written (once per step)

    def log(self, trainer: Any, name: str, value: Any, prog_bar: bool = False) -> None:
        value = float(value)
        trainer.callback_metrics[name] = torch.tensor(value)
        if prog_bar:
            trainer.progress_bar_metrics[name] = value
        step, to_loggers = logging_step(trainer)
        if not to_loggers:
            return
        scalars = {name: value}
        if self._epoch_logged_at != step:
            self._epoch_logged_at = step
            scalars["epoch"] = trainer.current_epoch
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)


def step_logger(cfg: Any):
    """The step-closure logger on XLA (no graph run mid-step); the direct writer elsewhere."""
    if use_xla(cfg):
        from nxdt.training.xla import StepClosureLogger

        return StepClosureLogger()
    return StepScalarWriter()
