"""exp_manager: where a run writes (log dir, TensorBoard, per-rank logs, config snapshot,
checkpoints) and which checkpoint it resumes from.

Log dir: `exp_manager.explicit_log_dir`, else `<exp_dir or ./nxdt_experiments>/<name>/<version>`,
with no version sub-folder when `resume_if_exists` (so a rerun of the same command finds its
checkpoints). Checkpoints go to `<log_dir>/checkpoints/`; their format is `nxdt.exp.checkpoint`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from nxdt.config.errors import ConfigError
from nxdt.exp.checkpoint_topk import is_validation_metric, to_keep, write_score

VERSION_ENV = "NXDT_RUN_VERSION"
LAST = "last"


@dataclass
class ExpDirs:
    log_dir: Path
    checkpoint_dir: Path
    resume_path: Path | None = None  # checkpoint to resume (or to take weights from)
    weights_only: bool = False  # model.weight_init_only: load weights, start training fresh


def run_version() -> str:
    """One version string for all ranks of a run.

    Set once in the environment, so processes Lightning launches inherit it; under torchrun the
    rendezvous run id (shared by all ranks) is used when there is one. The checkpoint callback
    also broadcasts rank 0's checkpoint directory once the process group exists.
    """
    version = os.environ.get(VERSION_ENV)
    if not version:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        version = run_id if run_id not in ("", "none") else time.strftime("%Y-%m-%d_%H-%M-%S")
        os.environ[VERSION_ENV] = version
    return version


def resolve_dirs(cfg) -> ExpDirs:
    exp = cfg.exp_manager
    if exp.explicit_log_dir:
        log_dir = Path(exp.explicit_log_dir)
    else:
        base = Path(exp.exp_dir or "nxdt_experiments") / (exp.name or cfg.name)
        version = exp.get("version") or (None if exp.resume_if_exists else run_version())
        log_dir = base / version if version else base
    return ExpDirs(log_dir=log_dir.absolute(), checkpoint_dir=(log_dir / "checkpoints").absolute())


# --------------------------------------------------------------------------- checkpoint names
_FIELD = re.compile(r"\{(\w+)(:[^}]*)?\}")


def format_checkpoint_name(template: str, **values: Any) -> str:
    """`megatron_llama--{step}-{consumed_samples}` → `megatron_llama--step=200-consumed_samples=204800.0`."""

    def fill(match: re.Match) -> str:
        key, spec = match.group(1), match.group(2) or ""
        if key not in values:
            raise ConfigError(
                f"exp_manager.checkpoint_callback_params.filename: unknown field '{{{key}}}' "
                f"(known: {', '.join('{' + k + '}' for k in values)})"
            )
        return f"{key}=" + format(values[key], spec[1:])

    name = _FIELD.sub(fill, template)
    if "/" in name or name.startswith(".") or name == LAST:
        raise ConfigError(f"exp_manager.checkpoint_callback_params.filename: '{template}' gives an invalid name '{name}'")
    return name


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not), without temporaries and the `last` link."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.iterdir()
                  if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def complete_checkpoints(checkpoint_dir: Path, warn: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of every complete, readable checkpoint, oldest first. Others are skipped with
    a warning and left in place."""
    from nxdt.exp.checkpoint import TMP_PREFIX, validate_checkpoint

    found = []
    for path in list_checkpoints(checkpoint_dir):
        try:
            meta = validate_checkpoint(path)
        except ConfigError as err:
            if warn:
                warnings.warn(f"skipping checkpoint {path.name}: {err}", stacklevel=2)
            continue
        found.append((int(meta.get("step", 0)), path))
    if warn and checkpoint_dir.is_dir():
        for tmp in checkpoint_dir.glob(f"{TMP_PREFIX}*"):
            warnings.warn(f"skipping {tmp.name}: a save that did not finish (left in place)", stacklevel=2)
    return sorted(found, key=lambda sp: (sp[0], sp[1].stat().st_mtime))


def find_resume_checkpoint(cfg, dirs: ExpDirs) -> tuple[Path | None, bool]:
    """(checkpoint to load, weights_only) from resume_from_checkpoint / resume_if_exists."""
    exp = cfg.exp_manager
    weights_only = bool(cfg.model.get("weight_init_only", False))
    if exp.resume_from_checkpoint:
        from nxdt.exp.checkpoint import validate_checkpoint

        path = Path(exp.resume_from_checkpoint).absolute()
        validate_checkpoint(path)  # an explicit path must be good: ConfigError otherwise
        return path, weights_only
    if weights_only:
        raise ConfigError("model.weight_init_only: needs exp_manager.resume_from_checkpoint (the weights to load)")
    if not exp.resume_if_exists:
        return None, False
    found = complete_checkpoints(dirs.checkpoint_dir)
    if found:
        return found[-1][1], False
    if exp.resume_ignore_no_checkpoint:
        if _global_rank() == 0:
            print(f"note: no complete checkpoint in {dirs.checkpoint_dir}; starting from scratch", flush=True)
        return None, False
    raise ConfigError(
        f"exp_manager.resume_if_exists: no complete checkpoint in {dirs.checkpoint_dir} "
        "(set exp_manager.resume_ignore_no_checkpoint: true to start from scratch)"
    )


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("GLOBAL_RANK", "0")))


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# --------------------------------------------------------------------------- setup
def check_exp_keys(cfg) -> None:
    params = cfg.exp_manager.checkpoint_callback_params
    monitor = params.monitor or "step"
    if not re.fullmatch(r"\w+", monitor):
        raise ConfigError(f"exp_manager.checkpoint_callback_params.monitor: '{monitor}' is not a metric name "
                          "(e.g. step, val_loss, reduced_train_loss)")
    if monitor == "step" and params.mode != "max":
        raise ConfigError("exp_manager.checkpoint_callback_params.mode: 'min' with monitor 'step' would keep the "
                          "oldest checkpoints; use mode: max (or monitor a metric such as val_loss)")
    fields = {"step": 0, "consumed_samples": 0.0, "epoch": 0, monitor: 0.0}
    format_checkpoint_name(params.filename, **fields)


def setup_rank_log_file(log_dir: Path, log_local_rank_0_only: bool) -> Path | None:
    """Python logging and warnings of this rank → `<log_dir>/nxdt_log_globalrank-G_localrank-L.txt`."""
    if log_local_rank_0_only and _local_rank() != 0:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"nxdt_log_globalrank-{_global_rank()}_localrank-{_local_rank()}.txt"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in ("nxdt", "lightning.pytorch", "lightning.fabric", "py.warnings"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
    return path


def setup_exp_manager(cfg, global_rank: int):
    """Create the log dir, the loggers and the checkpoint callback; returns (dirs, loggers, callbacks)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    exp = cfg.exp_manager
    check_exp_keys(cfg)
    dirs = resolve_dirs(cfg)
    dirs.resume_path, dirs.weights_only = find_resume_checkpoint(cfg, dirs)
    if global_rank == 0:
        dirs.log_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, dirs.log_dir / "config.yaml", resolve=True)
    setup_rank_log_file(dirs.log_dir, bool(exp.log_local_rank_0_only))

    loggers = []
    if exp.create_tensorboard_logger:
        loggers.append(TensorBoardLogger(save_dir=str(dirs.log_dir), name="", version="", default_hp_metric=False))

    callbacks: list = [ResumeHelper(dirs)]
    if exp.create_checkpoint_callback:
        params = exp.checkpoint_callback_params
        callbacks.append(
            NxdtCheckpoint(
                dirpath=dirs.checkpoint_dir,
                filename=params.filename,
                save_top_k=params.save_top_k,
                save_last=params.save_last,
                every_n_train_steps=params.every_n_train_steps,
                monitor=params.monitor,
                mode=params.mode,
            )
        )
    return dirs, loggers, callbacks


# --------------------------------------------------------------------------- callbacks

class ResumeHelper(Callback):
    """Weights-only start (model.weight_init_only) and the saved RNG states, applied just before
    the first training step after a resume."""

    def __init__(self, dirs: ExpDirs) -> None:
        self.dirs = dirs
        self._rng: dict | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.dirs.resume_path is not None and self.dirs.weights_only:
            from nxdt.exp.checkpoint import load_checkpoint

            load_checkpoint(trainer.strategy, self.dirs.resume_path, pl_module.cfg, weights_only=True)
            if trainer.is_global_zero:
                print(f"loaded weights from {self.dirs.resume_path}", flush=True)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._rng = checkpoint.pop("pending_rng", None)
        if trainer.is_global_zero:
            print(f"resuming from {self.dirs.resume_path} (step {checkpoint.get('global_step')}, "
                  f"consumed_samples {checkpoint.get('consumed_samples')})", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._rng is not None:
            from nxdt.exp.checkpoint_state import set_rng_state

            set_rng_state(self._rng)
            self._rng = None


class NxdtCheckpoint(Callback):
    """Saves every `every_n_train_steps` steps and at the end of training; keeps `save_top_k`
    complete checkpoints (-1: all): the newest by step, or the best by a monitored metric plus
    the newest (`nxdt.exp.checkpoint_topk`); `save_last` keeps a `last` link to the newest.

    The write itself (sharded, atomic, maybe asynchronous) is `nxdt.exp.checkpoint.Checkpointer`,
    reached through `trainer.save_checkpoint` → `NxdtStrategy.save_checkpoint`.
    """

    def __init__(self, dirpath: Path, filename: str, save_top_k: int = 1, save_last: bool = False,
                 every_n_train_steps: int | None = None, monitor: str | None = "step", mode: str = "max") -> None:
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.save_top_k = int(save_top_k)
        self.save_last = bool(save_last)
        self.every_n_train_steps = every_n_train_steps or 0
        self.monitor = monitor or "step"
        self.mode = mode
        self._last_saved_step = -1
        self._unscored: tuple[int, Path] | None = None  # saved, waiting for its step's validation
        self._validated_step = -1
        self._noted_missing = False

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
        trainer.save_checkpoint(str(path), weights_only=False)
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

    def on_train_end(self, trainer, pl_module) -> None:
        self.save(trainer)  # the final checkpoint
        trainer.strategy.checkpointer.wait()
        trainer.strategy.barrier("nxdt-final-checkpoint")

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
        found = complete_checkpoints(self.dirpath, warn=False)
        keep = to_keep(found, self.save_top_k, self.monitor, self.mode)
        for _, old in found:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
