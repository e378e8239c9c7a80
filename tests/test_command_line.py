"""Hydra's command line on the training entry: --cfg/--resolve/--package, --info, -m sweeps (run
in-process, one job after another), hydra.run.dir / hydra.sweep.dir, the .hydra/ record; and the
progress bar's step rate and ETA."""

from __future__ import annotations

import os
from types import SimpleNamespace

import sys

import pytest
import yaml

from conftest import REPO, TINY_OVERRIDES, read_scalars
from nxdt.tools.command_line import expand_sweeps, parse_command_line
from nxdt.config.errors import ConfigError
from nxdt.config.load import main_guard
from nxdt.observability.progress import StepRateColumn
from nxdt.tools.train import main


@pytest.fixture
def clean_environ():
    """A run sets environment variables (Lightning's MASTER_*, the run version, precision env):
    each test gets the environment back as it was."""
    saved = dict(os.environ)
    os.environ.pop("NXDT_RUN_VERSION", None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _run(argv: list[str]) -> int:
    try:
        return int(main_guard(main)(argv) or 0)
    except SystemExit as stop:
        return int(stop.code)


def test_cfg_prints_the_composed_config_unresolved_or_resolved(capsys, clean_environ):
    assert _run(["--config-name", "tiny_llama_cpu", "trainer.max_steps=7", "--cfg", "job", "--package", "trainer"]) == 0
    trainer = yaml.safe_load(capsys.readouterr().out)
    assert trainer["max_steps"] == 7 and trainer["devices"] == 2
    assert _run(["--config-name", "tiny_llama_cpu", "--cfg", "job", "-p", "data.seq_length"]) == 0
    assert capsys.readouterr().out.strip() == "${model.encoder_seq_length}"  # kept without --resolve
    assert _run(["-cn", "tiny_llama_cpu", "--cfg", "all", "--resolve", "-p", "data.seq_length"]) == 0
    assert capsys.readouterr().out.strip() == "128"
    assert _run(["-cn", "tiny_llama_cpu", "--cfg", "hydra", "hydra.run.dir=/tmp/x=1"]) == 0
    hydra = yaml.safe_load(capsys.readouterr().out)["hydra"]
    assert hydra["run"]["dir"] == "/tmp/x=1" and hydra["job"]["config_name"] == "tiny_llama_cpu"


def test_info_lists_the_search_path_and_every_sweep_job(capsys, clean_environ):
    assert _run(["-cn", "tiny_llama_cpu", "--info", "-m", "seed=1,2", "model.optim.lr=1e-3,3e-3"]) == 0
    out = capsys.readouterr().out
    assert "Config search path:" in out and "conf" in out
    assert "Sweep: 4 jobs" in out
    assert "#1: seed=1 model.optim.lr=0.003" in out and "#2: seed=2 model.optim.lr=0.001" in out


@pytest.mark.parametrize("argv, message", [
    (["seed=1,2"], "'seed=1,2' is a sweep: add -m"),
    (["--cfg", "jobs"], "--cfg jobs: expected one of job, hydra, all"),
    (["--resolve"], "--resolve needs --cfg"),
    (["--nonsense"], "unknown option '--nonsense'"),
    (["hydra.job.chdir=true"], "'hydra.job.chdir=true': not supported yet"),
    (["--cfg", "job", "-p", "trainer.nope"], "--package trainer.nope: 'nope' is not in the config"),
])
def test_bad_hydra_flags_are_one_line(argv, message, capsys, clean_environ):
    assert _run(["-cn", "tiny_llama_cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_sweep_order_is_hydras():
    assert expand_sweeps(["a=1,2", "b=x", "c=p,q"]) == [
        ["a=1", "b=x", "c=p"], ["a=1", "b=x", "c=q"], ["a=2", "b=x", "c=p"], ["a=2", "b=x", "c=q"]]
    cl = parse_command_line(["-cd", "confs", "-cn", "x", "--multirun", "k=v", "hydra.sweep.dir=s"])
    assert cl.config_args == ["--config-path", "confs", "--config-name", "x"]
    assert cl.multirun and cl.overrides == ["k=v"] and cl.hydra == {"hydra.sweep.dir": "s"}


def _tiny(prefix: str) -> list[str]:
    return ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=2",
            "model.optim.sched.warmup_steps=0", "model.optim.sched.min_lr=0", f"data.data_prefix=[1.0,{prefix}]",
            "exp_manager.create_checkpoint_callback=false"]


def test_multirun_trains_every_job_in_its_own_dir_with_a_hydra_record(kjv_prefix, tmp_path, capsys, clean_environ):
    sweep = tmp_path / "sweep"
    assert _run([*_tiny(kjv_prefix), "-m", "model.optim.lr=0.0,1e-2", f"hydra.sweep.dir={sweep}"]) == 0
    out = capsys.readouterr().out
    assert "[sweep] 2 jobs" in out
    losses = {}
    for num, lr in enumerate((0.0, 1e-2)):
        job = sweep / str(num)
        assert yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[-1] == f"model.optim.lr={lr}"
        hydra = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        assert hydra["job"]["num"] == num and hydra["mode"] == "MULTIRUN"
        composed = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert composed["model"]["optim"]["lr"] == lr and composed["exp_manager"]["checkpoint_callback_params"]["model_parallel_size"].startswith("${multiply:")
        losses[lr] = read_scalars(job)["reduced_train_loss"]
    # the same data and init: the first step's loss is the same; on the second batch the job that
    # learned (lr 1e-2) has a lower loss than the one that could not (lr 0)
    first, second = sorted(losses[0.0])
    assert losses[0.0][first] == losses[1e-2][first]
    assert losses[1e-2][second] < losses[0.0][second]


def test_a_bad_value_in_the_last_sweep_job_stops_before_the_first_trains(kjv_prefix, tmp_path, capsys, clean_environ):
    sweep = tmp_path / "sweep"
    assert _run([*_tiny(kjv_prefix), "-m", "data.micro_batch_size=2,3", f"hydra.sweep.dir={sweep}"]) == 2
    err = capsys.readouterr().err
    assert "sweep job #1 (data.micro_batch_size=3" in err
    assert not (sweep / "0").exists()


def test_hydra_run_dir_is_the_log_dir(kjv_prefix, tmp_path, clean_environ):
    run_dir = tmp_path / "lr=1e-2,seed=3"  # Hydra's override_dirname style: '=' and ','
    assert _run([*_tiny(kjv_prefix), "trainer.max_steps=1", f"hydra.run.dir={run_dir}"]) == 0
    assert (run_dir / "config.yaml").is_file()
    hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra["run"]["dir"] == str(run_dir) and hydra["mode"] == "RUN"


def test_step_rate_and_eta_count_from_the_first_finished_step():
    column = StepRateColumn()
    task = SimpleNamespace(id=1, completed=0, total=100, elapsed=0.0)
    assert str(column.render(task)) == "-- step/s  ETA --"
    task.completed, task.elapsed = 10, 60.0  # resumed at 10 (or a slow first step): the baseline
    assert str(column.render(task)) == "-- step/s  ETA --"
    task.completed, task.elapsed = 14, 80.0  # 4 steps in 20 s
    assert str(column.render(task)) == "5.0 s/step  ETA 0:07:10"
    task.completed, task.elapsed = 94, 100.0  # 84 steps in 40 s
    assert str(column.render(task)) == "2.10 step/s  ETA 0:00:03"


def test_the_command_line_parser_refuses_package_without_cfg():
    with pytest.raises(ConfigError, match="--package needs --cfg"):
        parse_command_line(["-cn", "x", "-p", "model"])


def test_the_closing_resume_command_pastes_back(tmp_path, monkeypatch):
    """The resume line a run prints ends in a checkpoint folder name with '=' in it: pasted into a
    shell as printed, the override parser reads the path back unchanged."""
    import shlex

    from nxdt.spec import load_config
    from nxdt.tools.next_steps import format_next_steps

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(REPO / ".venv" / "bin" / "nxdt"), "train"])  # launched by nxdt train
    checkpoint = tmp_path / "runs" / "checkpoints" / "tiny_llama--step=3-consumed_samples=48.0"
    text = format_next_steps(checkpoint, tmp_path / "runs", ["--config-name", "tiny_llama_cpu", "trainer.max_steps=3"],
                             3, environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    resume = shlex.split(next(line for line in text.splitlines() if line.startswith("resume"))[len("resume"):])
    assert resume[0].endswith("nxdt") and resume[1:5] == ["train", "--standalone", "--nproc-per-node", "2"]
    assert resume[-1] == "trainer.max_steps=6"
    overrides = resume[resume.index("--config-name"):]
    assert "trainer.max_steps=3" not in overrides
    cfg = load_config(overrides, world_size=2, check_paths=False, quiet=True)
    assert cfg.exp_manager.resume_from_checkpoint == "runs/checkpoints/tiny_llama--step=3-consumed_samples=48.0"
    assert cfg.trainer.max_steps == 6
    assert "sample       " in text and "--checkpoint runs/checkpoints/tiny_llama--step=3" in text
