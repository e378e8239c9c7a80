"""exp_manager: where a run writes: the log dir, the loggers (TensorBoard here; CSV, W&B and MLflow in
`nxdt.exp.loggers`), per-rank log files, the config snapshot.
Which checkpoint a run resumes from, and the checkpoint callbacks, are `nxdt.checkpoint`.

Log dir: `exp_manager.explicit_log_dir`, else `<exp_dir or ./nxdt_experiments>/<name>/<version>`,
with no version sub-folder when `resume_if_exists` (so a rerun of the same command finds its
checkpoints). Checkpoints go to `<log_dir>/checkpoints/` (`ExpDirs.checkpoint_dir`).

The train entry imports this module (`resolve_dirs`) before it sets the config's environment
variables (nxdt.tools.train), so it imports no torch or lightning at module level: the loggers
(nxdt.exp.loggers, lightning) are imported inside `build_loggers` and `setup_exp_manager`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from nxdt.config.typed import to_container, to_yaml
from nxdt.config.load import global_rank as _global_rank


VERSION_ENV = "NXDT_RUN_VERSION"


@dataclass
class ExpDirs:
    log_dir: Path
    checkpoint_dir: Path


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22); None where it
    cannot be read (the process is gone, or not Linux)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _launcher_start_time() -> str | None:
    """When this process's parent (the torchrun agent on this node) started, as a timestamp: the
    same for every local rank, with no communication. None off Linux."""
    start_ticks = process_start_ticks(os.getppid())
    if start_ticks is None:
        return None
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(round(started)))


def _is_random_run_id(run_id: str) -> bool:
    """`torchrun --standalone` (and a launch without --rdzv-id) names its run with a fresh uuid4."""
    try:
        uuid.UUID(run_id)
    except ValueError:
        return False
    return True


def run_version() -> str:
    """One readable, sortable version string (a timestamp) for all ranks of a run.

    Set once in the environment, so processes Lightning launches inherit it. Under torchrun:
    a named rendezvous (`--rdzv-id`) is the version as given; a random one (`--standalone`)
    becomes the start time of the launcher, which every rank of the node reads alike. The
    checkpoint callback also broadcasts rank 0's checkpoint directory once the process group exists.
    """
    version = os.environ.get(VERSION_ENV)
    if not version:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id in ("", "none"):
            version = time.strftime("%Y-%m-%d_%H-%M-%S")
        elif _is_random_run_id(run_id):
            version = _launcher_start_time() or run_id
        else:
            version = run_id
        os.environ[VERSION_ENV] = version
    return version


def resolve_dirs(cfg) -> ExpDirs:
    exp = cfg.exp_manager
    if exp.explicit_log_dir:
        log_dir = Path(exp.explicit_log_dir)
    else:
        base = Path(exp.exp_dir or "nxdt_experiments") / (exp.name or cfg.name)
        version = exp.version or (None if exp.resume_if_exists else run_version())
        log_dir = base / version if version else base
    return ExpDirs(log_dir=log_dir.absolute(), checkpoint_dir=(log_dir / "checkpoints").absolute())


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# --------------------------------------------------------------------------- setup
_LOGGED = ("nxdt", "lightning.pytorch", "lightning.fabric", "py.warnings")
_rank_log_handler: logging.Handler | None = None


def close_rank_log_file() -> None:
    """Detach and close the rank log file a run of this process set up (if any)."""
    global _rank_log_handler
    if _rank_log_handler is not None:
        for name in _LOGGED:
            logging.getLogger(name).removeHandler(_rank_log_handler)
        _rank_log_handler.close()
        _rank_log_handler = None


def setup_rank_log_file(log_dir: Path, log_local_rank_0_only: bool) -> Path | None:
    """Python logging and warnings of this rank → `<log_dir>/nxdt_log_globalrank-G_localrank-L.txt`.

    A second run in the same process (a sweep, a notebook) replaces the first run's file: its
    lines do not also land in the earlier run's log."""
    global _rank_log_handler
    close_rank_log_file()
    if log_local_rank_0_only and _local_rank() != 0:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"nxdt_log_globalrank-{_global_rank()}_localrank-{_local_rank()}.txt"
    handler = _rank_log_handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in _LOGGED:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
    return path


def setup_exp_manager(cfg, dirs: ExpDirs, global_rank: int, loggers: list) -> list:
    """Create the log dir (rank 0 writes the resolved config.yaml there), this rank's log file and
    the loggers (`loggers`: already built by `build_loggers`); returns the loggers. Call after
    `nxdt.checkpoint.resume.setup_checkpointing`, whose checks (a resume that cannot happen) must
    fail before anything is written; the loggers' own checks (a missing package, an unknown
    argument) run in `build_loggers` first, for the same reason."""
    exp = cfg.exp_manager
    if global_rank == 0:
        dirs.log_dir.mkdir(parents=True, exist_ok=True)
        # the resolved YAML, rerunnable with --config-path <log_dir> --config-name config
        (dirs.log_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    setup_rank_log_file(dirs.log_dir, bool(exp.log_local_rank_0_only))
    if exp.create_wandb_logger or exp.create_mlflow_logger:
        from nxdt.exp import loggers as lightning_loggers  # lightning after the env vars: see the docstring

        lightning_loggers.log_config(loggers, to_container(cfg))  # rank 0 starts the W&B / MLflow run here
    return loggers


def build_loggers(cfg, dirs: ExpDirs) -> list:
    """TensorBoard, CSV, W&B, MLflow as `exp_manager` asks (every rank builds them; they write on
    rank 0). The W&B project and MLflow experiment are the experiment's name, the run is named
    after the log dir (its version). Raises ConfigError for a missing package or unknown kwargs."""
    from nxdt.exp import loggers as lightning_loggers  # lightning after the env vars: see the docstring

    exp = cfg.exp_manager
    loggers = []
    if exp.create_tensorboard_logger:
        loggers.append(lightning_loggers.tensorboard_logger(dirs.log_dir))
    if exp.create_csv_logger or exp.create_wandb_logger or exp.create_mlflow_logger:
        lightning_loggers.check_logger_packages(exp)
        experiment, run = exp.name or cfg.name, dirs.log_dir.name
        if exp.create_csv_logger:
            loggers.append(lightning_loggers.NxdtCSVLogger(dirs.log_dir))
        if exp.create_wandb_logger:
            loggers.append(lightning_loggers.wandb_logger(exp, dirs.log_dir, experiment, run))
        if exp.create_mlflow_logger:
            loggers.append(lightning_loggers.mlflow_logger(exp, dirs.log_dir, experiment, run))
    return loggers
