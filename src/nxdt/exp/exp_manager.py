"""exp_manager: where a run writes (log dir, TensorBoard, config snapshot, checkpoints).

Log dir: `exp_manager.explicit_log_dir`, else `<exp_dir or ./nxdt_experiments>/<name>/<version>`,
with no version sub-folder when `resume_if_exists` (so a rerun of the same command finds its
checkpoints). Checkpoints go to `<log_dir>/checkpoints/`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from nxdt.config.errors import ConfigError

VERSION_ENV = "NXDT_RUN_VERSION"


@dataclass
class ExpDirs:
    log_dir: Path
    checkpoint_dir: Path


def run_version() -> str:
    """One version string for all ranks of a run.

    Set once in the environment, so processes Lightning launches inherit it; under torchrun the
    rendezvous run id (shared by all ranks) is used when there is one.
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
        log_dir = base if exp.resume_if_exists else base / run_version()
    return ExpDirs(log_dir=log_dir.absolute(), checkpoint_dir=(log_dir / "checkpoints").absolute())


def find_checkpoints(checkpoint_dir: Path) -> list[Path]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def setup_exp_manager(cfg, global_rank: int):
    """Create the log dir, the loggers and the checkpoint callback; returns (dirs, loggers, callbacks)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    exp = cfg.exp_manager
    dirs = resolve_dirs(cfg)
    if exp.resume_from_checkpoint:
        raise ConfigError("exp_manager.resume_from_checkpoint: resuming is not supported yet")
    existing = find_checkpoints(dirs.checkpoint_dir) if exp.resume_if_exists else []
    if existing:
        raise ConfigError(
            f"exp_manager.resume_if_exists: found {len(existing)} checkpoint(s) in {dirs.checkpoint_dir}, "
            "but resuming is not supported yet; move them away or choose another exp_manager.name"
        )
    if global_rank == 0:
        dirs.log_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, dirs.log_dir / "config.yaml", resolve=True)

    loggers = []
    if exp.create_tensorboard_logger:
        loggers.append(TensorBoardLogger(save_dir=str(dirs.log_dir), name="", version="", default_hp_metric=False))

    callbacks = []
    if exp.create_checkpoint_callback:
        from lightning.pytorch.callbacks import ModelCheckpoint

        params = exp.checkpoint_callback_params
        callbacks.append(
            ModelCheckpoint(
                dirpath=str(dirs.checkpoint_dir),
                filename=params.filename,
                monitor="step",
                mode="max",
                save_top_k=params.save_top_k,
                save_last=params.save_last,
                every_n_train_steps=params.every_n_train_steps,
                auto_insert_metric_name=True,
            )
        )
    return dirs, loggers, callbacks
