"""Loggers (CSV, W&B offline, MLflow's file store), user callbacks (`trainer.callbacks`) and the
profiler (`exp_manager.profiler`), from one tiny training run in this process (`nxdt train`'s entry):
- metrics.csv has one row per step, and its losses are the TensorBoard scalars (float32 of them);
- one step number everywhere: TensorBoard's and the CSV's `step`, `global_step` and the checkpoint
  names (`step=N`, saved every 2 steps) all count the optimizer steps done;
- the W&B offline run (its `run-<id>.wandb` record log: offline runs keep history, summary and
  config there, `wandb sync` uploads them) has one history row per step with the same losses, the
  final summary's loss is the last one, the config is the run's, and the run was finished;
- MLflow's file store has the loss history (5 entries, steps 1..5, same values), the config as
  parameters (a long value cut with '…'), the run named after the log dir, FINISHED;
- the user's callback was built with its arguments and saw every step, after nxdt's callbacks
  (the profiler first), before the checkpoint callback;
- the profiler (wait 1, warmup 1, active 2) wrote one rank-0 trace holding ProfilerStep#2 and #3 only;
- bad input (a `_target_` that cannot be built, a profiler rank outside the world, an unknown W&B
  or MLflow argument, a missing package) is one line, exit 2, before anything is written.
Without training: metrics.csv gets a step's row when the step ends and a resumed run appends to it;
the CUDA memory snapshot spans the first active window (the allocator calls recorded, no GPU needed).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY_OVERRIDES, read_scalars, train_in_process
from lightning.pytorch.callbacks import Callback

from nxdt.exp.exp_manager import close_rank_log_file

STEPS = 5
LONG_TAG = "t" * 300  # longer than MLflow's parameter values (as Lightning logs them): cut with '…'
# nothing may reach the network or the home directory
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
             "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off"}


class RecordingCallback(Callback):
    """The user callback of the run: its arguments, the steps it saw and the callback order."""

    built: list["RecordingCallback"] = []

    def __init__(self, tag: str, every: int = 1) -> None:
        self.tag, self.every, self.steps, self.order = tag, every, [], []
        RecordingCallback.built.append(self)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.order = [type(callback).__name__ for callback in trainer.callbacks]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)


def _args(log_dir: Path, prefix: str, *extra: str) -> list[str]:
    return ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={STEPS}",
            "model.optim.sched.warmup_steps=1", f"data.data_prefix=[1.0,{prefix}]",
            f"exp_manager.explicit_log_dir={log_dir}", *extra]


@pytest.fixture(scope="module")
def run(kjv_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("loggers")
    log_dir = root / "run"
    home = root / "wandb_home"  # W&B's settings, cache and artifacts: not the user's home
    env = {**WANDB_ENV, "WANDB_CONFIG_DIR": str(home), "WANDB_CACHE_DIR": str(home), "WANDB_DATA_DIR": str(home)}
    RecordingCallback.built.clear()
    result = train_in_process(_args(log_dir, kjv_prefix,
                          "exp_manager.create_csv_logger=true", "exp_manager.create_wandb_logger=true",
                          "exp_manager.create_mlflow_logger=true", "exp_manager.create_checkpoint_callback=true",
                          "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
                          "exp_manager.checkpoint_callback_params.save_top_k=-1",
                          "exp_manager.profiler.enabled=true", "exp_manager.profiler.wait=1",
                          "exp_manager.profiler.warmup=1", "exp_manager.profiler.active=2",
                          f"trainer.callbacks=[{{_target_:test_loggers_profiler.RecordingCallback,"
                          f"tag:{LONG_TAG},every:3}}]"), env)
    assert result.rc == 0, result.out[-3000:] + result.err[-3000:]
    yield SimpleNamespace(log_dir=log_dir, out=result.out, tb=read_scalars(log_dir))
    # the in-process run's log file (and warnings routed to it) end with this module
    close_rank_log_file()
    logging.captureWarnings(False)


def _csv_rows(log_dir: Path) -> list[dict[str, str]]:
    with (log_dir / "metrics.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def test_csv_has_a_row_per_step_equal_to_tensorboard(run):
    rows = _csv_rows(run.log_dir)
    assert [int(row["step"]) for row in rows] == list(range(1, STEPS + 1))  # the step's scalars in one row
    tb = run.tb["reduced_train_loss"]
    assert sorted(tb) == list(range(1, STEPS + 1))
    for row in rows:  # TensorBoard keeps float32
        assert np.float32(float(row["reduced_train_loss"])) == np.float32(tb[int(row["step"])])
        assert np.float32(float(row["lr"])) == np.float32(run.tb["lr"][int(row["step"])])
    assert [float(row["consumed_samples"]) for row in rows] == [8.0 * s for s in range(1, STEPS + 1)]


def test_tensorboard_csv_and_checkpoint_names_number_a_step_alike(run):
    """Issue 39 item 8: a step's number is the optimizer steps done in every writer. TensorBoard's
    step of every scalar, the CSV's `step` and `global_step` columns, the `global_step` scalar and
    the checkpoint names (`step=N`, saved every 2 steps and at the end) agree."""
    import re

    rows = _csv_rows(run.log_dir)
    steps = list(range(1, STEPS + 1))
    assert [(int(row["step"]), float(row["global_step"])) for row in rows] == [(s, float(s)) for s in steps]
    assert run.tb["global_step"] == {s: float(s) for s in range(1, STEPS + 1)}
    for tag in ("reduced_train_loss", "lr", "consumed_samples"):
        assert sorted(run.tb[tag]) == list(range(1, STEPS + 1)), tag
    names = [p.name for p in run.log_dir.rglob("*step=*") if p.is_dir()]
    saved = sorted({int(re.search(r"step=(\d+)", name).group(1)) for name in names})
    assert saved == [2, 4, STEPS], names
    by_step = {int(row["step"]): row for row in rows}
    for step in saved:  # the checkpoint's step is the row's step, its global_step, its consumed samples
        assert float(by_step[step]["global_step"]) == step == run.tb["global_step"][step]
        assert any(f"step={step}-consumed_samples={8.0 * step}" in name for name in names), (step, names)


def test_stdout_in_a_file_gets_one_plain_line_per_logged_step(run):
    """stdout is not a terminal here (a Slurm .out, `make demo > demo.log`): no bar, but one plain,
    flushed line per `trainer.log_every_n_steps` step (1 in this run) on rank 0, with step/max, loss,
    lr, tokens/s, MFU and, from the second step on, the rate and the ETA; never a carriage return."""
    assert "\r" not in run.out
    lines = [line for line in run.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)], run.out[-3000:]
    tb = run.tb["reduced_train_loss"]
    for i, line in enumerate(lines):
        fields = line.split("  ")
        names = [f.split()[0] for f in fields]
        assert names[:5] == ["step", "loss", "lr", "tok/s", "MFU"], line
        assert f"loss {tb[i + 1]:.4f}" in fields, (line, tb[i + 1])
        assert (fields[-1].startswith("ETA ") and fields[-2].endswith(("s/step", "step/s"))) == (i > 0), line


def test_progress_lines_come_every_log_every_n_steps_and_at_the_last_step_on_rank_0_only(capsys):
    """log_every_n_steps 3 of 7 steps: steps 3, 6 and 7 (the last); nothing on another rank."""
    from nxdt.observability.progress import ProgressLines

    for rank0, expected in ((True, ["step 3/7", "step 6/7", "step 7/7"]), (False, [])):
        trainer = SimpleNamespace(log_every_n_steps=3, max_steps=7, is_global_zero=rank0, global_step=0,
                                  progress_bar_metrics={"reduced_train_loss": 2.5}, callback_metrics={"lr": 1e-3})
        lines = ProgressLines()
        for step in range(1, 8):
            trainer.global_step = step
            lines.on_train_batch_end(trainer, None, None, None, step - 1)
        printed = capsys.readouterr().out.splitlines()
        assert [" ".join(line.split()[:2]) for line in printed] == expected, printed
        assert all("loss 2.5000  lr 1.00e-03" in line and "ETA " in line for line in printed), printed


def _wandb_records(path: Path):
    """The records of a W&B run file: LevelDB's log format (32 KiB blocks of chunks with a 7-byte
    header: crc32, length, type full=1/first=2/middle=3/last=4) after a 7-byte ':W&B' header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def _key(item) -> str:
    """A history or summary item's name ('trainer/global_step' is stored as a nested key)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_history_summary_and_config(run):
    (run_file,) = (run.log_dir / "wandb").glob("offline-run-*/run-*.wandb")  # save_dir = the log dir
    history, summary, config, exits = [], {}, {}, []
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "exit":
            exits.append(record.exit.exit_code)
        elif kind == "run":
            name, project = record.run.display_name, record.run.project
    csv_loss = [float(row["reduced_train_loss"]) for row in _csv_rows(run.log_dir)]
    assert [row["trainer/global_step"] for row in history] == list(range(1, STEPS + 1))  # one history row per step
    assert [row["reduced_train_loss"] for row in history] == csv_loss
    assert summary["reduced_train_loss"] == csv_loss[-1]
    assert config["trainer"]["max_steps"] == STEPS and config["exp_manager"]["create_wandb_logger"] is True
    assert config["trainer"]["callbacks"][0]["tag"] == LONG_TAG  # W&B keeps whole values
    assert (name, project) == ("run", "tiny_llama")  # the log dir's name, the experiment's name
    assert exits == [0]  # finished when the fit ended


def test_mlflow_file_store_holds_the_metric_history_and_params(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked
    client = MlflowClient(tracking_uri=f"file:{run.log_dir / 'mlruns'}")
    experiment = client.get_experiment_by_name("tiny_llama")
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_name == "run" and mlflow_run.info.status == "FINISHED"
    history = client.get_metric_history(mlflow_run.info.run_id, "reduced_train_loss")
    csv_loss = [float(row["reduced_train_loss"]) for row in _csv_rows(run.log_dir)]
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == list(enumerate(csv_loss, start=1))
    params = mlflow_run.data.params
    assert params["trainer.max_steps"] == str(STEPS) and params["exp_manager.profiler.active"] == "2"
    callbacks = params["trainer.callbacks"]
    assert len(callbacks) == 250 and callbacks.endswith("…") and callbacks.startswith("[{'_target_': ")


def test_user_callback_built_with_its_arguments_saw_every_step_in_order(run):
    (callback,) = RecordingCallback.built
    assert (callback.tag, callback.every) == (LONG_TAG, 3)
    assert callback.steps == list(range(1, STEPS + 1))
    order = callback.order
    # the profiler first (its step boundary outside the measured step time), the user's last but the
    # checkpoint and the fault tolerance (a preemption save after the step's own)
    assert order[0] == "StepProfiler" and order[-3:] == ["RecordingCallback", "NxdtCheckpoint", "FaultTolerance"], order


def test_profiler_trace_holds_exactly_the_active_steps(run):
    (trace,) = (run.log_dir / "profiler").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # step 0 waits, 1 warms up, 2 and 3 are recorded
    assert f"profiler: traces of rank(s) 0 in {run.log_dir / 'profiler'}: tensorboard --logdir {run.log_dir}" in run.out


@pytest.mark.parametrize("override, message", [
    ("trainer.callbacks=[{_target_:no_such_module.Thing}]",
     "error: trainer.callbacks[0]: cannot import module 'no_such_module'"),
    ("trainer.callbacks=[{_target_:test_loggers_profiler.RecordingCallback,tag:x,bogus:1}]",
     "error: trainer.callbacks[0]: test_loggers_profiler.RecordingCallback: "
     "got an unexpected keyword argument 'bogus'"),
    ("trainer.callbacks=[{_target_:collections.OrderedDict}]",
     "error: trainer.callbacks[0]: collections.OrderedDict built a OrderedDict, not a lightning.pytorch.Callback"),
    ("exp_manager.profiler.ranks=[0,1]",
     "error: exp_manager.profiler.ranks: [0, 1] has [1] outside the world of 1 ranks (0..0)"),
    ("+exp_manager.wandb_logger_kwargs.projekt=x",
     "error: exp_manager.wandb_logger_kwargs.projekt: not an argument of WandbLogger or wandb.init; known: "),
    ("+exp_manager.mlflow_logger_kwargs.uri=x",
     "error: exp_manager.mlflow_logger_kwargs.uri: not an argument of MLFlowLogger; known: "),
])
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, kjv_prefix, override, message):
    log_dir = tmp_path / "run"
    extra = ["exp_manager.profiler.enabled=true", "exp_manager.create_wandb_logger=true",
             "exp_manager.create_mlflow_logger=true"]
    result = train_in_process(_args(log_dir, kjv_prefix, *extra, override), WANDB_ENV)
    assert result.rc == 2, result.err[-2000:]
    lines = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), result.err[-2000:]
    assert "Traceback" not in result.err
    assert not log_dir.exists()


def test_a_missing_logger_package_names_the_key_and_the_extra(monkeypatch):
    from nxdt.config.errors import ConfigError
    from nxdt.exp import loggers

    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec",
                        lambda name, *args: None if name == "mlflow" else real(name, *args))
    exp = SimpleNamespace(create_wandb_logger=True, create_mlflow_logger=True)
    with pytest.raises(ConfigError, match=r"^exp_manager.create_mlflow_logger=true needs the mlflow package, which "
                                          r"is not installed: pip install 'nxdt\[mlflow\]'$"):
        loggers.check_logger_packages(exp)


def test_csv_rows_reach_the_file_when_their_step_ends_and_a_resumed_run_appends(tmp_path):
    from nxdt.exp.loggers import NxdtCSVLogger

    first = NxdtCSVLogger(tmp_path)
    first.log_metrics({"loss": 1.0}, step=0)
    first.log_metrics({"lr": 0.5}, step=0)  # the same step: the same row
    assert not (tmp_path / "metrics.csv").exists()
    first.log_metrics({"loss": 0.75}, step=1)  # step 0 is complete: on disk now (a kill keeps it)
    assert [r["loss"] for r in _csv_rows(tmp_path)] == ["1.0"]
    first.save()  # what NxdtCheckpoint does before a checkpoint
    resumed = NxdtCSVLogger(tmp_path)  # Lightning's writer would delete the file here
    resumed.log_metrics({"loss": 0.5, "val_loss": 0.6}, step=2)
    resumed.finalize("success")
    assert [(r["step"], r["loss"], r["lr"], r["val_loss"]) for r in _csv_rows(tmp_path)] == [
        ("0", "1.0", "0.5", ""), ("1", "0.75", "", ""), ("2", "0.5", "", "0.6")]


def test_cuda_memory_snapshot_spans_the_first_active_window(tmp_path, monkeypatch):
    """The snapshot's bookkeeping without a GPU: the allocator calls are recorded, in step order."""
    import torch

    from nxdt.config.schema import ProfilerConfig
    from nxdt.observability.profiler import StepProfiler

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: calls.append(f"record {enabled}"))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(f"dump {Path(path).name}"))
    settings = ProfilerConfig(enabled=True, wait=1, warmup=1, active=2, ranks=[0], cuda_memory_snapshot=True)
    profiler = StepProfiler(settings, tmp_path, world_size=1, global_rank=0)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")), is_global_zero=True)
    profiler.on_train_start(trainer, None)
    with pytest.warns(UserWarning), contextlib.redirect_stdout(io.StringIO()) as out:  # no CUDA to trace here
        for step in range(6):
            calls.append(f"step {step}")
            profiler.on_train_batch_start(trainer, None, None, step)
        profiler.on_train_end(trainer, None)
    assert calls == ["step 0", "step 1", "step 2", "record all", "step 3", "step 4",
                     "dump memory_snapshot_rank0.pickle", "record None", "step 5"]
    assert "memory_snapshot_rank<R>.pickle, in https://pytorch.org/memory_viz" in out.getvalue()
    assert len(list(tmp_path.glob("rank0.*.pt.trace.json"))) == 1


def test_the_profilers_kineto_lines_and_cycle_warning_stay_out_of_stderr(tmp_path, capfd):
    """libkineto's `USDT: ... profiler_start` / `profiler_stop` lines (fd 2) and torch's cycle
    warning are dropped from the profiler's calls; the trace is written; other stderr is kept."""
    import sys

    import torch

    from nxdt.observability.profiler import StepProfiler, quiet_profiler

    settings = SimpleNamespace(wait=0, warmup=1, active=1, repeat=2, ranks=[0], record_shapes=False,
                               profile_memory=False, with_stack=False, cuda_memory_snapshot=False)
    profiler = StepProfiler(settings, tmp_path, 1, 0)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), is_global_zero=True)
    for step in range(5):
        profiler.on_train_batch_start(trainer, None, None, step)
        torch.randn(16, 16) @ torch.randn(16, 16)
    profiler.on_train_end(trainer, None)
    with quiet_profiler():
        print("kept line", file=sys.stderr)
    err = capfd.readouterr().err
    assert "USDT:" not in err and "clears events" not in err and "kept line" in err, err
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 2
