"""A real Slurm job (issue 20): examples/train.sbatch as documented, preempted and requeued.

Runs where a Slurm cluster answers (`sinfo`); `.ci/run` starts a one-node cluster first
(.ci/start-local-slurm.sh, or `make slurm-local` as root). The job is submitted as the docs say,
without NPROC_PER_NODE (on this CPU node the script starts one process), its steps slowed to a
second so that `scancel --signal=TERM` lands mid-run, its data read by a loader worker
(data.num_workers=1, the default). Slurm signals every process of the job step (torchrun, its rank
and the rank's loader worker, which ignores it); the rank finishes the step, saves, and rank 0
requeues the job. The requeued job (its begin
time brought forward: Slurm delays requeued jobs by two minutes) resumes from that checkpoint and
finishes; its losses equal an uninterrupted run's, step by step, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process


def _slurm_answers() -> bool:
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    try:
        return "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _slurm_cluster():
    """Skip where no Slurm cluster answers. Asked when the test runs, not at collection: `sinfo` waits 9 s
    for a controller that is not there, and every pytest worker collects this module."""
    if not _slurm_answers():
        pytest.skip("no Slurm cluster answers (start one as root: make slurm-local)")


def _job(job: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def _wait(what: str, ready, timeout: float) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sbatch_example_is_preempted_saves_requeues_and_continues_bit_for_bit(kjv_prefix, tmp_path):
    log_dir, out = tmp_path / "run", tmp_path / "job.out"
    args = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.max_steps=8", "model.optim.lr=1e-2",
            "model.optim.sched.warmup_steps=2", f"data.data_prefix=[1.0,{kjv_prefix}]",
            f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.create_checkpoint_callback=true",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    reference = train_in_process([*args, "trainer.devices=1", f"exp_manager.explicit_log_dir={tmp_path / 'ref'}"])
    assert reference.rc == 0, reference.err[-3000:]
    expected = read_scalars(tmp_path / "ref")["reduced_train_loss"]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("NPROC_PER_NODE", None)
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={REPO}", f"--output={out}", "examples/train.sbatch",
                          *args, "data.num_workers=1",
                          "trainer.callbacks=[{_target_:fault_callbacks.SlowSteps,seconds:1.0}]"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    try:
        step2 = log_dir / "checkpoints" / "tiny_llama--step=2-consumed_samples=16.0" / "COMPLETE"
        _wait("the step-2 checkpoint", step2.is_file, 240)
        subprocess.run(["scancel", "--signal=TERM", job], check=True)
        _wait("the requeue", lambda: _job(job).get("Restarts") == "1" and _job(job).get("JobState") == "PENDING", 120)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
        _wait("the requeued job's end", lambda: _job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = out.read_text()
    assert _job(job)["JobState"] == "COMPLETED", text[-3000:]
    assert "no GPU found: one process per node (set NPROC_PER_NODE to start more)" in text
    said = [line for line in text.splitlines() if line.startswith("preempted (SIGTERM) at step ")]
    assert len(said) == 1 and "DataLoader worker" not in text, text[-3000:]
    step = int(said[0].split("at step ")[1].split(":")[0])
    # "requeued" after scontrol returns is not always printed: the requeue may end the process first
    assert f"slurm job {job}: requeueing it (scontrol requeue {job})" in text and "not requeued" not in text
    assert f"job {job} (restart 1): 1 node(s) x 1 process(es)" in text
    assert f"resuming from {log_dir / 'checkpoints' / f'tiny_llama--step={step}-consumed_samples={8.0 * step}'}" in text
    assert read_scalars(log_dir)["reduced_train_loss"] == expected
