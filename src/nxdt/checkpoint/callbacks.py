"""NxdtCheckpoint: the Lightning callback that decides when to save and which checkpoints to keep.

The write itself is `nxdt.checkpoint.checkpointer.Checkpointer`, reached through
`trainer.save_checkpoint` → `NxdtStrategy.save_checkpoint`; which to keep is
`nxdt.checkpoint.retention`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from nxdt.checkpoint.lora_merge import save_merged_weights
from nxdt.checkpoint.lora_state import merged_checkpoint_path
from nxdt.checkpoint.retention import (
    LAST,
    complete_checkpoints,
    format_checkpoint_name,
    is_validation_metric,
    to_keep,
    write_score,
)
from nxdt.checkpoint.save_errors import CheckpointSaveError
from nxdt.config.errors import ConfigError


def check_checkpoint_params(params) -> None:
    """`exp_manager.checkpoint_callback_params`: a metric name, a mode that keeps the newest by step, a
    filename template whose fields are known; ConfigError otherwise."""
    monitor = params.monitor or "step"
    if not re.fullmatch(r"\w+", monitor):
        raise ConfigError(f"exp_manager.checkpoint_callback_params.monitor: '{monitor}' is not a metric name "
                          "(e.g. step, val_loss, reduced_train_loss)")
    if monitor == "step" and params.mode != "max":
        raise ConfigError("exp_manager.checkpoint_callback_params.mode: 'min' with monitor 'step' would keep the "
                          "oldest checkpoints; use mode: max (or monitor a metric such as val_loss)")
    fields = {"step": 0, "consumed_samples": 0.0, "epoch": 0, monitor: 0.0}
    format_checkpoint_name(params.filename, **fields)


class NxdtCheckpoint(Callback):
    """Saves every `every_n_train_steps` steps and at the end of training; keeps `save_top_k`
    complete checkpoints (-1: all): the newest by step, or the best by a monitored metric plus
    the newest (`nxdt.checkpoint.retention`); `save_last` keeps a `last` link to the newest.

    The write itself (sharded, atomic, maybe asynchronous) is `nxdt.checkpoint.checkpointer.Checkpointer`,
    reached through `trainer.save_checkpoint` → `NxdtStrategy.save_checkpoint`.

    A save that fails (on any rank: every rank raises the same CheckpointSaveError) stops the run
    (`on_error="stop"`: the error propagates, one line, exit 1) or is reported and training goes
    on (`"continue"`); either way the newest complete checkpoint stays the resume point, since
    pruning only ever runs after a newer checkpoint is complete.
    """

    def __init__(self, dirpath: Path, filename: str, save_top_k: int = 1, save_last: bool = False,
                 every_n_train_steps: int | None = None, monitor: str | None = "step", mode: str = "max",
                 on_error: str = "stop") -> None:
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.save_top_k = int(save_top_k)
        self.save_last = bool(save_last)
        self.every_n_train_steps = every_n_train_steps or 0
        self.monitor = monitor or "step"
        self.mode = mode
        self.on_error = on_error
        self._last_saved_step = -1
        self._unscored: tuple[int, Path] | None = None  # saved, waiting for its step's validation
        self._validated_step = -1
        self._noted_missing = False
        self.owns: Callable[[Path], bool] = lambda path: True  # which checkpoints retention may prune

    @property
    def by_metric(self) -> bool:
        return self.monitor != "step"

    def setup(self, trainer, pl_module, stage: str) -> None:
        # rank 0 decides the directory (its version); every rank writes its shards there
        self.dirpath = Path(trainer.strategy.broadcast(str(self.dirpath)))
        checkpointer = trainer.strategy.checkpointer
        checkpointer.on_complete = self._on_complete

    def checkpoint_path(self, trainer) -> Path:
        module = trainer.lightning_module
        values = {"step": trainer.global_step, "consumed_samples": float(getattr(module, "consumed_samples", 0)),
                  "epoch": trainer.current_epoch}
        named = self.by_metric and re.search(r"\{" + re.escape(self.monitor) + r"[:}]", self.filename)
        if named:  # the last logged value ('nan' before the first); rank 0's, so every rank has one name
            value = self._metric(trainer)
            values[self.monitor] = float("nan") if value is None else value
        name = format_checkpoint_name(self.filename, **values)
        if named:
            name = trainer.strategy.broadcast(name)
        return self.dirpath / name

    def save(self, trainer) -> None:
        if trainer.global_step == self._last_saved_step:
            return
        self._last_saved_step = step = trainer.global_step
        path = self.checkpoint_path(trainer)
        # the logs of every step this checkpoint covers reach the disk before it does: a run killed
        # after the save resumes past them (nxdt.observability.step_scalars writes them as they are logged)
        for logger in trainer.loggers:
            logger.save()
        try:
            trainer.save_checkpoint(str(path), weights_only=False)
        except CheckpointSaveError as err:
            self._failed(trainer, err)
            return
        if not self.by_metric or not trainer.is_global_zero:
            return
        if is_validation_metric(self.monitor) and self._validated_step != step:
            self._unscored = (step, path)  # this step's validation, if any, runs after the save
        else:
            self._score(trainer, step, path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.strategy.checkpointer.poll()
        n = self.every_n_train_steps
        if n > 0 and trainer.global_step % n == 0:
            self.save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._validated_step = trainer.global_step
        if self._unscored is not None and self._unscored[0] == trainer.global_step and trainer.is_global_zero:
            self._score(trainer, *self._unscored)
        self._unscored = None

    def wait_for_save(self, trainer) -> None:
        """Every rank: until the in-flight save is complete; its failure is handled as `on_error` says."""
        try:
            trainer.strategy.checkpointer.wait()
        except CheckpointSaveError as err:
            self._failed(trainer, err)

    def _failed(self, trainer, err: CheckpointSaveError) -> None:
        found = complete_checkpoints(self.dirpath, warn=False)
        point = f"the resume point stays {found[-1][1]}" if found else "there is no complete checkpoint yet"
        if self.on_error != "continue":
            raise CheckpointSaveError(err.path, f"{err.reason}; {point}") from None
        if trainer.is_global_zero:
            print(f"warning: {err}; training goes on (exp_manager.on_checkpoint_error=continue); {point}", flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save(trainer)  # the final checkpoint
        self.wait_for_save(trainer)
        trainer.strategy.barrier("nxdt-final-checkpoint")
        peft = pl_module.spec.alignment.peft  # the run spec's (nxdt.spec.alignment)
        if peft is not None and peft.merge_lora:  # also the merged model, a weights-only start
            save_merged_weights(trainer.strategy, pl_module.cfg, merged_checkpoint_path(self.checkpoint_path(trainer)))

    def _metric(self, trainer) -> float | None:
        value = trainer.callback_metrics.get(self.monitor)
        return None if value is None else float(value)

    def _score(self, trainer, step: int, path: Path) -> None:
        """Rank 0: record the checkpoint's score, then prune with it."""
        value = self._metric(trainer)
        if value is None:
            if not self._noted_missing:
                self._noted_missing = True
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
                print(f"note: exp_manager.checkpoint_callback_params.monitor: metric '{self.monitor}' was not logged "
                      f"by step {step} (logged: {logged}); checkpoints without it are kept only while newest",
                      flush=True)
            return
        if write_score(path, self.monitor, value, step):
            self._prune()

    def _on_complete(self, path: Path) -> None:
        """Rank 0, after `path` was renamed into place: prune and point `last` at it."""
        self._prune()
        if self.save_last:
            link = self.dirpath / LAST
            tmp = self.dirpath / f".{LAST}.tmp"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(path.name, tmp)
            os.replace(tmp, link)

    def _prune(self) -> None:
        # the newest complete checkpoint is always kept (resume needs it); incomplete ones are
        # never in `found`, so never deleted
        if self.save_top_k < 0:
            return  # keep all (and read no checkpoint's run id)
        found = [(step, path) for step, path in complete_checkpoints(self.dirpath, warn=False) if self.owns(path)]
        keep = to_keep(found, self.save_top_k, self.monitor, self.mode)
        for _, old in found:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
