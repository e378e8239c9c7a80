"""Per-optimizer-step scalars (loss, lr, gradient norm, throughput, ...) written straight to the loggers.

Why not Lightning's `self.log`: Lightning hands the values a step logged to its loggers only after
every `on_train_batch_end` hook has run, i.e. after that step's checkpoint was written. A run killed
(SIGKILL, preemption, a dead node) right after the checkpoint completes resumes *after* that step,
so the step's loss would be missing from the logs for good. Written here, the values are in the
loggers as soon as they are logged, and `NxdtCheckpoint` flushes the loggers before it saves: every
step a checkpoint covers is on disk in the logs before the checkpoint is.

Same steps as Lightning's `log_every_n_steps` rule, numbered by the optimizer steps done once the
step is (1 for the first; as checkpoint names and `global_step`; Lightning's own axis is one below),
same progress bar and callback metrics (checkpoint monitors read those). On XLA the values are
read in a step closure instead (`StepClosureLogger`).
"""

from __future__ import annotations

from typing import Any

import torch

from nxdt.device import use_xla, xla_model


def logging_step(trainer: Any) -> tuple[int, bool]:
    """The step's number (optimizer steps done once it is: the checkpoint's `step=N`, `global_step`)
    and whether it goes to the loggers (Lightning's rule: every `log_every_n_steps`-th step, the last)."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1  # Lightning's own axis is one below
    every = trainer.log_every_n_steps
    return step, every > 0 and (step % every == 0 or trainer.should_stop)


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


class StepClosureLogger:
    """Per-optimizer-step scalars on XLA, read once the step's graph has run.

    Lightning's `self.log` turns every value into a device tensor and reads it back with
    `.item()`: the progress bar every step and the loggers every `log_every_n_steps`, one small
    graph execution per value (measured on XLA:CPU: 12 of a tiny Llama's 20 executions per step).
    Here the values stay as they are (device tensors are materialized by the next `mark_step`,
    which syncs every live tensor), and the first value of a step registers one step closure that,
    at that next `mark_step`, turns the step's values into floats and writes them where Lightning
    would: loggers (same steps, same `log_every_n_steps` rule), progress bar and callback metrics.
    The step number is taken when the values are logged, so they land on their own step although
    they are written one step later. `NxdtXLAStrategy.on_train_end` runs the last step's closure.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[dict[str, Any], set[str]]] = {}

    def log(self, trainer: Any, name: str, value: Any, prog_bar: bool = False) -> None:
        step, to_loggers = logging_step(trainer)
        if step not in self._pending:
            self._pending[step] = ({}, set())
            xla_model().add_step_closure(self._write, (trainer, step, trainer.current_epoch, to_loggers))
        values, bar = self._pending[step]
        values[name] = value.detach() if hasattr(value, "detach") else value
        if prog_bar:
            bar.add(name)

    def _write(self, trainer: Any, step: int, epoch: int, to_loggers: bool) -> None:
        values, bar = self._pending.pop(step)
        scalars = {k: float(v) for k, v in values.items()}  # device → host copies, no execution
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in scalars.items()})
        trainer.progress_bar_metrics.update({k: v for k, v in scalars.items() if k in bar})
        if to_loggers:
            for logger in trainer.loggers:
                logger.log_metrics({**scalars, "epoch": epoch}, step=step)
                logger.save()


def step_logger(cfg: Any):
    """The step-closure logger on XLA (no graph run mid-step); the direct writer elsewhere."""
    if use_xla(cfg):
        return StepClosureLogger()
    return StepScalarWriter()
