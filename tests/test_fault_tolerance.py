"""Crash safety in one process (issue 20): preemption signals, failed saves, the run lock, bad input.

The multi-process faults (a dead launcher, two launches into one directory, SIGTERM to torchrun,
kill -9 inside a save, a seeded random-kill loop) are in tests/test_checkpoint_resume.py, which
shares their reference runs; a real Slurm job is in tests/test_slurm.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process

from nxdt.config.errors import ConfigError
from nxdt.spec import load_config
from nxdt.spec.exp import parse_signals
from nxdt.exp.exp_manager import close_rank_log_file, process_start_ticks
from nxdt.exp.run_lock import LOCK, RunLock, check_run_lock, holder_record, read_lock
from nxdt.training import fault_tolerance

STEPS = 8
sys.path.insert(0, str(REPO / "tests"))  # fault_callbacks.SignalAt, for trainer.callbacks


def _args(log_dir: Path, prefix: str, *extra: str) -> list[str]:
    return ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={STEPS}",
            "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=2", f"data.data_prefix=[1.0,{prefix}]",
            f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.create_checkpoint_callback=true",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "exp_manager.resume_if_exists=true", "exp_manager.resume_ignore_no_checkpoint=true", *extra]


def _ckpt(log_dir: Path, step: int) -> Path:
    return log_dir / "checkpoints" / f"tiny_llama--step={step}-consumed_samples={8.0 * step}"


@pytest.fixture(autouse=True)
def _close_log_file():
    yield
    close_rank_log_file()  # the in-process runs' log files (and warnings routed to them)
    logging.captureWarnings(False)


@pytest.fixture(scope="module")
def reference(kjv_prefix, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ft") / "reference"
    result = train_in_process(_args(log_dir, kjv_prefix, "exp_manager.checkpoint_callback_params.save_top_k=-1"))
    assert result.rc == 0, result.err[-3000:]
    losses = read_scalars(log_dir)["reduced_train_loss"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


# --------------------------------------------------------------------------- preemption
def test_preemption_signal_saves_exits_0_and_the_relaunch_continues_bit_for_bit(reference, kjv_prefix, tmp_path):
    """SIGUSR1 (Slurm's --signal=USR1@120) at step 3, between two periodic saves: the step is
    finished, a complete step-3 checkpoint saved, exit 0; the relaunch resumes from it and logs
    every step's loss exactly as the uninterrupted run; the handlers before the run are back."""
    log_dir = tmp_path / "preempted"
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    callback = "trainer.callbacks=[{_target_:fault_callbacks.SignalAt,step:3,signal:SIGUSR1}]"
    first = train_in_process(_args(log_dir, kjv_prefix, callback))
    assert first.rc == 0, first.err[-3000:]
    assert f"preempted (SIGUSR1) at step 3: checkpoint {_ckpt(log_dir, 3).name} saved" in first.out
    assert (_ckpt(log_dir, 3) / "COMPLETE").is_file() and not _ckpt(log_dir, 4).exists()
    assert sorted(read_scalars(log_dir)["reduced_train_loss"]) == [1, 2, 3]
    relaunch = [line for line in first.out.splitlines() if line.startswith("continue     ")]
    assert len(relaunch) == 1 and relaunch[0].endswith(f"exp_manager.resume_from_checkpoint={_ckpt(log_dir, 3)} "
                                                       f"trainer.max_steps={STEPS}"), relaunch  # not 2 x max_steps
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    assert not (log_dir / LOCK).exists()  # released

    second = train_in_process(_args(log_dir, kjv_prefix))
    assert second.rc == 0, second.err[-3000:]
    assert f"resuming from {_ckpt(log_dir, 3)}" in second.out
    assert read_scalars(log_dir)["reduced_train_loss"] == reference  # every step, bit for bit


def _continue_args(out: str) -> list[str]:
    """The printed `continue` command's arguments (from --config-name on), as a user would paste them."""
    lines = [line for line in out.splitlines() if line.startswith("continue     ")]
    assert len(lines) == 1, out[-3000:]
    words = shlex.split(lines[0].removeprefix("continue"))
    return words[words.index("--config-name"):]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_the_run_and_its_four_loader_workers_saves_and_the_printed_continue_is_bit_exact(
        sig, reference, kjv_prefix, tmp_path):
    """Ctrl-C (SIGINT) or SIGTERM to the process and its 4 loader workers at once (its terminal, or
    `kill -- -PGID`) at step 3: the workers ignore it, the run finishes the step, saves it, says so in
    one line, prints the continue command and exits 0, with no traceback; pasting that command
    resumes from the step-3 checkpoint and logs every step as the uninterrupted run (whose loader
    ran in the process: the data are the same)."""
    log_dir = tmp_path / sig
    callback = f"trainer.callbacks=[{{_target_:fault_callbacks.SignalAt,step:3,signal:{sig},to:group}}]"
    first = train_in_process(_args(log_dir, kjv_prefix, "data.num_workers=4", callback))
    assert first.rc == 0, first.err[-3000:]
    said = (f"interrupted (Ctrl-C) at step 3: checkpoint {_ckpt(log_dir, 3).name} saved; the 'continue' command "
            "below resumes from it" if sig == "SIGINT" else
            f"preempted (SIGTERM) at step 3: checkpoint {_ckpt(log_dir, 3).name} saved; a relaunch with "
            "exp_manager.resume_if_exists=true continues from it")
    assert [line for line in first.out.splitlines() if line.startswith(("interrupted", "preempted"))] == [said]
    assert "Traceback" not in first.err and "DataLoader worker" not in first.err, first.err[-3000:]
    assert (_ckpt(log_dir, 3) / "COMPLETE").is_file() and not _ckpt(log_dir, 4).exists()
    pasted = _continue_args(first.out)
    assert "data.num_workers=4" in pasted
    second = train_in_process(pasted)
    assert second.rc == 0, second.err[-3000:]
    assert f"resuming from {_ckpt(log_dir, 3)}" in second.out
    assert read_scalars(log_dir)["reduced_train_loss"] == reference


def test_a_moe_run_stopped_at_step_3_continues_bit_for_bit_with_the_printed_command(kjv_prefix, tmp_path):
    """tiny_mixtral_cpu (4 experts, top-2, the router's load-balancing loss): SIGTERM at step 3, the
    printed continue command pasted; every step's loss equals the uninterrupted run's."""
    def args(log_dir: Path, *extra: str) -> list[str]:
        return ["--config-name", "tiny_mixtral_cpu", *_args(log_dir, kjv_prefix, "model.ffn_hidden_size=88",
                                                             *extra)[2:]]

    assert train_in_process(args(tmp_path / "reference")).rc == 0
    callback = "trainer.callbacks=[{_target_:fault_callbacks.SignalAt,step:3,signal:SIGTERM}]"
    first = train_in_process(args(tmp_path / "stopped", callback))
    assert first.rc == 0 and "preempted (SIGTERM) at step 3: checkpoint tiny_mixtral--step=3-" in first.out, first.err
    second = train_in_process(_continue_args(first.out))
    assert second.rc == 0, second.err[-3000:]
    assert "resuming from " in second.out
    losses = read_scalars(tmp_path / "stopped")["reduced_train_loss"]
    assert losses == read_scalars(tmp_path / "reference")["reduced_train_loss"] and len(losses) == STEPS


def test_a_second_ctrl_c_before_the_save_stops_at_once_and_says_nothing_was_saved(monkeypatch, capfd):
    """The first SIGINT is recorded (the step's end saves); a second one (or, under torchrun, the
    SIGTERM torchrun sends when it is interrupted again) before that save is done leaves at once
    with exit 130 and one line; after the save, a further one changes nothing."""
    cfg = load_config(["--config-path", str(REPO / "conf"), "--config-name", "tiny_llama_cpu"], check_paths=False,
                      quiet=True)
    tolerance, exits = fault_tolerance.FaultTolerance(cfg), []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(fault_tolerance.os, "_exit", exits.append)
    monkeypatch.setattr(fault_tolerance, "_children", lambda: [])  # (it kills the rank's loader workers)
    try:
        tolerance._step = 7
        tolerance._on_signal(signal.SIGINT, None)
        assert (tolerance.received, exits) == ("SIGINT", [])
        tolerance._on_signal(signal.SIGINT, None)
        assert exits == [130]
        assert capfd.readouterr().err == ("interrupted again (second Ctrl-C) after step 7: stopped at once, nothing "
                                          "was saved (the last complete checkpoint stays the resume point)\n")
        # under torchrun the second Ctrl-C reaches the ranks as torchrun's SIGTERM
        tolerance._on_signal(signal.SIGTERM, None)
        assert exits == [130, 130]
        assert capfd.readouterr().err.startswith("interrupted again (SIGTERM after Ctrl-C) after step 7: stopped at once")
        tolerance.preempted_at = 7  # saved: a further signal is ignored
        tolerance._on_signal(signal.SIGINT, None)
        assert exits == [130, 130]
    finally:
        fault_tolerance.interrupted.clear()


def test_preemption_signal_names_are_checked():
    assert [s.name for s in parse_signals(["SIGTERM", "usr1", "TERM"])] == ["SIGTERM", "SIGUSR1"]
    conf = str(REPO / "conf")
    for value, says in (("[SIGTREM]", "exp_manager.preemption_signals[0]: 'SIGTREM' is not a signal name; "
                                      "did you mean SIGTERM?"),
                        ("[SIGTERM,KILL]", "exp_manager.preemption_signals[1]: SIGKILL cannot be caught")):
        with pytest.raises(ConfigError) as err:
            load_config(["--config-path", conf, "--config-name", "tiny_llama_cpu",
                         f"exp_manager.preemption_signals={value}"], check_paths=False, quiet=True)
        assert str(err.value).startswith(says), str(err.value)


# --------------------------------------------------------------------------- reruns
def test_a_rerun_that_would_start_over_is_refused_and_retention_prunes_only_its_own_run(kjv_prefix, tmp_path):
    """A run into a fixed log dir without resume_if_exists leaves step 3; the same command again
    exits 2 with one line naming that checkpoint and the two ways on, writing nothing. A run
    resumed there from another run's checkpoint (save_top_k=1) prunes its own step 4 after its
    step 6, never the earlier run's step 3."""
    fixed, other = tmp_path / "fixed", tmp_path / "other"

    def args(log_dir: Path, steps: int, *extra: str) -> list[str]:
        return [*_args(log_dir, kjv_prefix)[:-2], f"trainer.max_steps={steps}",  # no resume_if_exists
                "exp_manager.checkpoint_callback_params.save_top_k=1", *extra]

    assert train_in_process(args(fixed, 3)).rc == 0
    before = {p.name: p.stat().st_mtime_ns for p in fixed.rglob("*")}
    again = train_in_process(args(fixed, 3))
    assert again.rc == 2, again.err[-3000:]
    assert again.err.strip().splitlines() == [
        f"error: exp_manager: log dir {fixed} holds a complete checkpoint of an earlier run ({_ckpt(fixed, 3).name}); "
        "starting over there would lose it: continue that run with exp_manager.resume_if_exists=true, or start a new "
        "one in a new folder (exp_manager.explicit_log_dir=NEW_DIR)"]
    assert {p.name: p.stat().st_mtime_ns for p in fixed.rglob("*")} == before  # nothing written

    assert train_in_process(args(other, 2)).rc == 0
    resumed = train_in_process(args(fixed, 6, f"exp_manager.resume_from_checkpoint={_ckpt(other, 2)}"))
    assert resumed.rc == 0, resumed.err[-3000:]
    assert sorted(p.name for p in (fixed / "checkpoints").iterdir()) == [_ckpt(fixed, 3).name, _ckpt(fixed, 6).name]


# --------------------------------------------------------------------------- failed saves
def test_a_failed_save_stops_the_run_keeps_the_previous_checkpoint_and_names_path_and_error(kjv_prefix, tmp_path):
    """The step-4 write fails with ENOSPC (save_top_k=1, so step 2 is the only other checkpoint):
    one line naming the checkpoint, the rank and the error, and the resume point; exit 1; no step-4
    directory or marker, its partial write removed; step 2 kept and complete; the lock released."""
    log_dir = tmp_path / "enospc"
    result = train_in_process(_args(log_dir, kjv_prefix), env={"NXDT_TEST_SAVE_HOOK": "4:enospc"})
    assert result.rc == 1, result.err[-3000:]
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: checkpoint save to {_ckpt(log_dir, 4)} failed: rank 0: OSError: [Errno 28] No space "
                      f"left on device: '{_ckpt(log_dir, 4).parent / ('.tmp-' + _ckpt(log_dir, 4).name)}'; "
                      f"the resume point stays {_ckpt(log_dir, 2)}"], result.err[-2000:]
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == [_ckpt(log_dir, 2).name]
    assert (_ckpt(log_dir, 2) / "COMPLETE").is_file()
    assert sorted(read_scalars(log_dir)["reduced_train_loss"]) == [1, 2, 3, 4]
    assert not (log_dir / LOCK).exists()


def test_an_async_save_error_surfaces_at_the_next_step_and_continue_keeps_training(kjv_prefix, tmp_path):
    """async_checkpointing: the step-4 write fails in the background thread. With the default
    (stop) the run ends at a later step's end with the error, never silently; with
    on_checkpoint_error=continue it says so once and trains on, and the next save (step 6) is
    complete, while retention (save_top_k=1) kept step 2 until then."""
    env = {"NXDT_TEST_SAVE_HOOK": "4:enospc"}
    stopped = train_in_process(_args(tmp_path / "stop", kjv_prefix, "exp_manager.async_checkpointing=true"), env)
    assert stopped.rc == 1 and "error: checkpoint save to" in stopped.err and "No space left" in stopped.err
    steps = sorted(read_scalars(tmp_path / "stop")["reduced_train_loss"])
    assert 5 <= steps[-1] < STEPS, steps  # stopped after the step that saw it, before the end
    assert (_ckpt(tmp_path / "stop", 2) / "COMPLETE").is_file() and not _ckpt(tmp_path / "stop", 4).exists()

    log_dir = tmp_path / "continue"
    went_on = train_in_process(_args(log_dir, kjv_prefix, "exp_manager.async_checkpointing=true",
                                     "exp_manager.on_checkpoint_error=continue"), env)
    assert went_on.rc == 0, went_on.err[-3000:]
    warnings = [line for line in went_on.out.splitlines() if line.startswith("warning: checkpoint save")]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"training goes on (exp_manager.on_checkpoint_error=continue); the resume point stays {_ckpt(log_dir, 2)}")
    assert sorted(read_scalars(log_dir)["reduced_train_loss"]) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == [_ckpt(log_dir, 8).name]


# --------------------------------------------------------------------------- the run lock
def _write_lock(log_dir: Path, **holder) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / LOCK
    path.write_text(json.dumps({**holder_record(["train.py"]), "run_id": "other-run", "launcher_pid": None,
                                **holder}))
    return path


@contextlib.contextmanager
def _live_process():
    """Another live process on this host, and its start time (as a lock records it)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(100):  # its /proc entry is there once it runs
            if process_start_ticks(live.pid) is not None:
                break
            time.sleep(0.05)
        yield live.pid, process_start_ticks(live.pid)
    finally:
        live.kill()
        live.wait()


def test_run_lock_is_taken_released_and_refuses_a_live_holder(tmp_path):
    lock = RunLock.acquire(tmp_path / "run", lease_s=600, command=["train.py", "a=1"])
    holder = json.loads((tmp_path / "run" / LOCK).read_text())
    assert (holder["host"], holder["pid"], holder["command"]) == (socket.gethostname(), os.getpid(), "train.py a=1")
    lock.release()
    assert not (tmp_path / "run" / LOCK).exists()

    with _live_process() as (pid, started):
        path = _write_lock(tmp_path / "busy", pid=pid, pid_start=started)
        text = path.read_text()
        for take in (lambda: RunLock.acquire(tmp_path / "busy", 600), lambda: check_run_lock(tmp_path / "busy", 600)):
            with pytest.raises(ConfigError) as err:
                take()
            assert str(err.value).startswith(f"log dir {tmp_path / 'busy'} is in use by another run (pid {pid} "
                                              f"on {socket.gethostname()}, started ")
        assert path.read_text() == text  # nothing changed


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path / "dead", pid=gone.pid, pid_start=12345)
    notes = []
    RunLock.acquire(tmp_path / "dead", 600, notice=notes.append).release()
    assert len(notes) == 1 and notes[0].startswith(f"note: taking over the run lock of a run that is gone (pid {gone.pid}")

    # another host: alive while its heartbeat is younger than the lease, stale after
    path = _write_lock(tmp_path / "remote", host="another-node", pid=1)
    with pytest.raises(ConfigError, match="in use by another run .pid 1 on another-node"):
        RunLock.acquire(tmp_path / "remote", 600)
    os.utime(path, (time.time() - 700, time.time() - 700))
    check_run_lock(tmp_path / "remote", 600)  # the other ranks see it stale too
    notes.clear()
    RunLock.acquire(tmp_path / "remote", 600, notice=notes.append).release()
    assert len(notes) == 1 and "pid 1 on another-node" in notes[0]


def test_bad_lock_and_unwritable_log_dir_are_one_line_and_nothing_is_deleted(tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / LOCK).write_text("{not json")
    with pytest.raises(ConfigError) as err:
        RunLock.acquire(bad, 600)
    assert str(err.value).startswith(f"run lock {bad / LOCK} cannot be parsed (")
    assert str(err.value).endswith(f"if no run uses {bad}, delete {LOCK} and launch again")
    assert (bad / LOCK).read_text() == "{not json"

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError) as err:
        RunLock.acquire(tmp_path / "ro" / "run", 600)
    assert str(err.value) == (f"exp_manager: cannot write to the log dir {tmp_path / 'ro' / 'run'}: Read-only file "
                              "system (set exp_manager.explicit_log_dir or exp_manager.exp_dir to a writable place)")


def test_a_second_launch_into_a_live_runs_log_dir_exits_2_and_writes_nothing(kjv_prefix, tmp_path):
    log_dir = tmp_path / "taken"
    with _live_process() as (pid, started):
        _write_lock(log_dir, pid=pid, pid_start=started, command="python examples/train.py x=1")
        result = train_in_process(_args(log_dir, kjv_prefix))
    assert result.rc == 2
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"is in use by another run (pid {pid}" in errors[0]
    assert errors[0].endswith("python examples/train.py x=1); wait for it to end, or set "
                              "exp_manager.explicit_log_dir to another directory")
    assert sorted(p.name for p in log_dir.iterdir()) == [LOCK]  # no config.yaml, logs or checkpoints
    assert read_lock(log_dir).holder["pid"] == pid


# --------------------------------------------------------------------------- progress after a resume
def test_the_progress_bar_after_a_resume_counts_the_run_and_its_eta_this_launchs_rate():
    """Resumed at step 59 of 100 (this launch's loader has 41 batches, Lightning's restored batch
    index is 61): the bar shows 59/100 before the first step and 60/100 after it, not 62/59; 10
    steps later in 10 s the rate is this launch's (1 step/s) and the ETA the 30 steps left."""
    from io import StringIO

    from rich.console import Console
    from rich.progress import Progress

    from nxdt.observability.progress import StepProgressBar, StepRateColumn

    trainer = SimpleNamespace(max_steps=100, global_step=59, num_training_batches=41, current_epoch=0,
                              is_global_zero=True)
    bar = StepProgressBar()
    bar._trainer = trainer
    bar.progress = Progress(console=Console(file=StringIO()), auto_refresh=False)
    bar._update_metrics = bar.refresh = lambda *args, **kwargs: None  # the drawing is Rich's
    assert bar.total_train_batches == 100
    bar.on_train_epoch_start(trainer, None)
    task = bar.progress.tasks[0]
    assert (task.completed, task.total) == (59, 100)
    trainer.global_step = 60
    bar.on_train_batch_end(trainer, None, None, None, batch_idx=61)
    assert (task.completed, task.total) == (60, 100)

    column = StepRateColumn()
    first = SimpleNamespace(id=task.id, completed=60, total=100, elapsed=42.0)  # 42 s of imports and warm-up
    assert str(column.render(first)) == "-- step/s  ETA --"
    assert str(column.render(SimpleNamespace(id=task.id, completed=70, total=100, elapsed=52.0))) == \
        "1.00 step/s  ETA 0:00:30"
    # an epoch-bounded run (max_steps -1) keeps Lightning's count of this epoch's batches
    trainer.max_steps = -1
    assert bar.total_train_batches == 41


def test_a_slurm_requeue_is_announced_before_scontrol_and_a_failed_one_says_why(monkeypatch, tmp_path, capsys):
    """Rank 0 after a preemption save in a Slurm batch job: the line that it requeues comes before
    `scontrol requeue` (which may end the process before it returns), then the outcome; a failed requeue
    says why; outside a batch job nothing is said or run."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho \"scontrol $*\" >> \"$0.calls\"\n[ \"$2\" = 41 ] || { echo 'Invalid job id' >&2; exit 1; }\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ENVIRONMENT", "BATCH")
    for job, outcome in (("41", "slurm job 41: requeued"), ("42", "slurm job 42: not requeued: Invalid job id")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        fault_tolerance.requeue_slurm_job()
        assert capsys.readouterr().out.splitlines() == [f"slurm job {job}: requeueing it (scontrol requeue {job})",
                                                        outcome]
    monkeypatch.delenv("ENVIRONMENT")
    fault_tolerance.requeue_slurm_job()
    assert capsys.readouterr().out == ""
    assert (tmp_path / "scontrol.calls").read_text().splitlines() == ["scontrol requeue 41", "scontrol requeue 42"]
