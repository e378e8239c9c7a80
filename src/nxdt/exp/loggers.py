"""The loggers of `exp_manager` (NeMo's names): TensorBoard, and the optional CSV, Weights & Biases and MLflow.

TensorBoard is Lightning's logger as it is. The other three are Lightning's own loggers with two
changes, in a shared mixin:
- one row per step: nxdt writes a step's scalars to the loggers one at a time, as they are
  computed (`nxdt.observability.step_scalars`), so Lightning's CSV logger would write a row per scalar,
  W&B a history row per scalar and MLflow a request per scalar. The mixin gathers a step's
  scalars and hands them on together when the next step begins or the loggers are flushed
  (`NxdtCheckpoint` flushes them before every checkpoint, so every step a checkpoint covers is
  in the logs before the checkpoint is);
- the CSV file is `<log_dir>/metrics.csv`, written one row per logged step, and appended to by a
  resumed run (Lightning's deletes an existing file).

Lightning's loggers are built on every rank and write on global rank 0 only (`rank_zero_only`);
the W&B and MLflow runs start on rank 0 at the first write (here: the config, logged once as
hyperparameters by `exp_manager.setup_exp_manager`).
"""

from __future__ import annotations

import csv
import importlib.util
import inspect
import os
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from nxdt.config.errors import ConfigError

# MLflow keeps parameter values up to 6000 characters, but Lightning cuts them at 250; a longer
# value (a long data blend, sample prompts) is cut here visibly. config.yaml has the whole config.
MLFLOW_PARAM_CHARS = 250
PACKAGES = {"wandb": ("create_wandb_logger", "wandb", "nxdt[wandb]"),
            "mlflow": ("create_mlflow_logger", "mlflow", "nxdt[mlflow]")}


class _OneRowPerStep:
    """Gathers the scalars of one step and hands them to the logger in one call (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._row: dict[str, Any] = {}
        self._row_step: int | None = None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if step is None or step != self._row_step:
            self._hand_on()
        if step is None:
            super().log_metrics(metrics, step)
            return
        self._row.update(metrics)
        self._row_step = step

    def _hand_on(self) -> None:
        if self._row:
            row, self._row = self._row, {}
            super().log_metrics(row, self._row_step)

    @rank_zero_only
    def save(self) -> None:
        self._hand_on()
        super().save()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._hand_on()
        super().finalize(status)


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, appending to an existing metrics.csv (a resumed run) instead of
    deleting it; its columns are kept and new ones widen the file."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="", encoding="utf-8") as file:
                self.metrics_keys = next(csv.reader(file), [])


class NxdtCSVLogger(_OneRowPerStep, CSVLogger):
    """`<log_dir>/metrics.csv`: a row per logged step, written when the step is complete."""

    def __init__(self, log_dir: Path) -> None:
        # name="" and version="": no sub-folders. Each row is written as soon as its step is
        # complete (one appended line), so a killed run keeps every step but at most the last.
        super().__init__(save_dir=str(log_dir), name="", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class NxdtWandbLogger(_OneRowPerStep, WandbLogger):
    """Lightning's WandbLogger whose W&B run is finished when the fit ends, so a next run in the
    same process (a sweep, a notebook, tests/run_pool.py) starts its own instead of reusing it."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None


class NxdtMLFlowLogger(_OneRowPerStep, MLFlowLogger):
    """Lightning's MLFlowLogger, a row per step."""


# --------------------------------------------------------------------------- building
def tensorboard_logger(log_dir: Path) -> TensorBoardLogger:
    """Lightning's TensorBoardLogger writing its event files into the log dir itself."""
    return TensorBoardLogger(save_dir=str(log_dir), name="", version="", default_hp_metric=False)


def check_logger_packages(exp) -> None:
    """A logger whose package is missing: one line naming the key and the install command, before
    anything is written (a look-up, not an import)."""
    for module, (key, package, extra) in PACKAGES.items():
        if getattr(exp, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"exp_manager.{key}=true needs the {package} package, which is not installed: "
                              f"pip install '{extra}'")


def _check_kwargs(kwargs: Mapping[str, Any], key: str, functions: Mapping[str, Any]) -> None:
    """Every key of `kwargs` is a parameter of one of `functions` (name -> function), else one line naming it."""
    known: set[str] = set()
    for function in functions.values():
        known |= {name for name, p in inspect.signature(function).parameters.items()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}
    for name in kwargs:
        if name not in known:
            raise ConfigError(f"exp_manager.{key}.{name}: not an argument of {' or '.join(functions)}; "
                              f"known: {', '.join(sorted(known))}")


def _wandb_kwargs(exp) -> dict[str, Any]:
    """exp_manager.wandb_logger_kwargs, each a parameter of WandbLogger or wandb.init (ConfigError)."""
    import wandb  # optional extra: wandb (nxdt[wandb]); check_logger_packages said so before

    kwargs = dict(exp.wandb_logger_kwargs)
    # WandbLogger passes its other keyword arguments to wandb.init, which would reject unknown ones
    # only when the run starts, on rank 0, with a traceback: check both signatures now, on every rank
    _check_kwargs(kwargs, "wandb_logger_kwargs", {"WandbLogger": WandbLogger.__init__, "wandb.init": wandb.init})
    return kwargs


def _mlflow_kwargs(exp) -> dict[str, Any]:
    """exp_manager.mlflow_logger_kwargs, each a parameter of MLFlowLogger (ConfigError)."""
    kwargs = dict(exp.mlflow_logger_kwargs)
    _check_kwargs(kwargs, "mlflow_logger_kwargs", {"MLFlowLogger": MLFlowLogger.__init__})
    return kwargs


def check_loggers(exp) -> None:
    """The loggers `exp` (exp_manager) asks for: their packages installed, their keyword arguments
    taken by their classes; one line, before anything is written (nxdt.training.trainer.check_run)."""
    if exp.create_csv_logger or exp.create_wandb_logger or exp.create_mlflow_logger:
        check_logger_packages(exp)
    if exp.create_wandb_logger:
        _wandb_kwargs(exp)
    if exp.create_mlflow_logger:
        _mlflow_kwargs(exp)


def wandb_logger(exp, log_dir: Path, experiment: str, run: str) -> NxdtWandbLogger:
    """W&B run `run` in project `experiment` (unless WANDB_PROJECT or the kwargs say otherwise),
    files under the log dir (unless WANDB_DIR says otherwise); WANDB_MODE=offline needs no network."""
    kwargs = _wandb_kwargs(exp)
    kwargs.setdefault("project", os.environ.get("WANDB_PROJECT") or experiment)
    kwargs.setdefault("name", run)
    if "save_dir" not in kwargs and "dir" not in kwargs:
        kwargs["save_dir"] = os.environ.get("WANDB_DIR") or str(log_dir)
    return NxdtWandbLogger(**kwargs)


def mlflow_logger(exp, log_dir: Path, experiment: str, run: str) -> NxdtMLFlowLogger:
    """MLflow run `run` in experiment `experiment`; tracking at MLFLOW_TRACKING_URI, else the local
    file store `<log_dir>/mlruns`."""
    kwargs = _mlflow_kwargs(exp)
    kwargs.setdefault("experiment_name", experiment)
    kwargs.setdefault("run_name", run)
    if not kwargs.get("tracking_uri"):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri and "save_dir" not in kwargs:
            uri = f"file:{log_dir / 'mlruns'}"
        kwargs["tracking_uri"] = uri or f"file:{kwargs['save_dir']}"
    if str(kwargs["tracking_uri"]).startswith("file:"):
        # MLflow 3 refuses its file store unless asked: a local store in the log dir needs no
        # server and no database (mlflow-skinny has no sqlite backend)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return NxdtMLFlowLogger(**kwargs)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'trainer.max_steps': 1000, ...}: the config's keys as dotted paths (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def log_config(loggers: list, config: dict[str, Any]) -> None:
    """The resolved config, once, as the W&B run's config (nested, as W&B shows it) and the MLflow
    run's parameters (dotted keys; values over MLflow's length cut with '…')."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.log_hyperparams(config)
        elif isinstance(logger, MLFlowLogger):
            logger.log_hyperparams({key: _cut(value) for key, value in flat_params(config).items()})


def _cut(value: Any) -> Any:
    text = str(value)
    return value if len(text) <= MLFLOW_PARAM_CHARS else text[:MLFLOW_PARAM_CHARS - 1] + "…"
