"""Exact resume after a real SIGKILL of a 2-rank torchrun run, resharding dp2 → dp1, bf16
checkpoints (with and without fp32 master weights), bad checkpoints.

One uninterrupted dp=2 run (saving every 2 steps) is the reference; the killed-and-rerun runs
must log the same reduced_train_loss at every step, bit for bit (CPU, fp32). The runs that are
killed are real torchrun launches; the runs that finish share launches (conftest.run_pool: one of
2 ranks, one single-process), each through the entry examples/train.py calls.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_OVERRIDES, TRAIN_SCRIPT, read_scalars, run_pool, tensor_bytes

STEPS = 8
pytestmark = pytest.mark.slow


def _args(prefix: str, log_dir, devices: int = 2, extra: list[str] = ()) -> list[str]:
    return [
        "--config-name", "tiny_llama_cpu", *TINY_OVERRIDES,
        f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
        "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=2",
        f"data.data_prefix=[1.0,{prefix}]",
        f"exp_manager.explicit_log_dir={log_dir}",
        "exp_manager.create_checkpoint_callback=true",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
        "exp_manager.resume_if_exists=true",
        "exp_manager.resume_ignore_no_checkpoint=true",
        *extra,
    ]


def _popen(args: list[str], nproc: int = 2, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("NXDT_RUN_VERSION", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TRAIN_SCRIPT), *args]
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                            start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc): torchrun starts each rank in a session of
    its own, so killing torchrun's process group would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGKILL torchrun and both ranks at once, as a lost node would, once ready() is true; return
    when all of them are gone (nothing of the run writes after this)."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.05)
    victims = [*_descendants(proc.pid), proc.pid]
    assert len(victims) >= 3, victims  # torchrun and its two ranks
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in victims):
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _losses(log_dir) -> dict[int, float]:
    return read_scalars(log_dir)["reduced_train_loss"]


def _ckpt(log_dir, step: int) -> Path:
    return Path(log_dir) / "checkpoints" / f"tiny_llama--step={step}-consumed_samples={8.0 * step}"


ASYNC_BF16 = ["exp_manager.async_checkpointing=true", "exp_manager.save_bf16=true",
              "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=true"]


@pytest.fixture(scope="module")
def killed(kjv_prefix, tmp_path_factory):
    """Two real 2-rank torchrun launches, each SIGKILLed (torchrun and both ranks) mid-run:
    - between saves: once the step-4 checkpoint is complete;
    - during an async save: the step-4 save is made slow and the run killed while it is in flight
      (training has gone on meanwhile), once step 2's checkpoint is complete. This run saves with
      save_bf16 + use_master_weights_in_ckpt.
    What the kill left on disk is recorded before anything reruns."""
    between, during = tmp_path_factory.mktemp("killed_between_saves"), tmp_path_factory.mktemp("killed_during_save")
    proc = _popen(_args(kjv_prefix, between), log=between / "killed.log")
    _kill_when(proc, lambda: (_ckpt(between, 4) / "COMPLETE").is_file())
    left = {"between": {"step8_exists": _ckpt(between, 8).exists()}}

    tmp4 = _ckpt(during, 4).parent / (".tmp-" + _ckpt(during, 4).name)
    proc = _popen(_args(kjv_prefix, during, extra=ASYNC_BF16), env={"NXDT_TEST_SLOW_ASYNC_SAVE": "4:600"},
                  log=during / "killed.log")
    _kill_when(proc, lambda: len(list(tmp4.glob("rank_*.json"))) == 2 and (_ckpt(during, 2) / "COMPLETE").is_file())
    left["during"] = {"step4_exists": _ckpt(during, 4).exists(), "tmp4_is_dir": tmp4.is_dir()}
    return {"between": between, "during": during, "left": left}


@pytest.fixture(scope="module")
def runs(killed, kjv_prefix, tmp_path_factory):
    """One 2-rank launch (conftest.run_pool): the uninterrupted reference (dp=2, a checkpoint every
    2 steps), then the reruns of the two killed runs, which resume from what the kill left."""
    log_dir = tmp_path_factory.mktemp("reference")
    argv = {"reference": _args(kjv_prefix, log_dir),
            "rerun_between": _args(kjv_prefix, killed["between"]),
            "rerun_during": _args(kjv_prefix, killed["during"], extra=ASYNC_BF16)}
    return {"reference_dir": log_dir, **run_pool(argv, 2, tmp_path_factory.mktemp("pool"))}


@pytest.fixture(scope="module")
def reference(runs):
    return runs["reference_dir"], _losses(runs["reference_dir"])


def test_reference_writes_complete_checkpoints(reference):
    log_dir, losses = reference
    assert sorted(losses) == list(range(STEPS))
    for step in (2, 4, 6, 8):
        path = _ckpt(log_dir, step)
        assert (path / "COMPLETE").is_file(), path
        assert sorted(p.name for p in path.glob("rank_*.json")) == ["rank_00000.json", "rank_00001.json"]
        assert (path / "config.yaml").is_file() and (path / ".metadata").is_file()
    assert not list((Path(log_dir) / "checkpoints").glob(".tmp-*"))


def test_sigkill_between_saves_resumes_bit_for_bit(reference, killed, runs):
    _, expected = reference
    assert not killed["left"]["between"]["step8_exists"]
    assert "resuming from" in runs["rerun_between"].stdout
    got = _losses(killed["between"])
    assert got == expected  # every step, exactly


def test_sigkill_during_async_save_resumes_from_previous(reference, killed, runs):
    """The rerun skips the unfinished step-4 save and resumes from step 2, bit for bit. With
    save_bf16 + use_master_weights_in_ckpt the model tensors take half the bytes and the resume
    from the fp32 masters beside them is still exact."""
    ref_dir, expected = reference
    run_dir = killed["during"]
    assert killed["left"]["during"] == {"step4_exists": False, "tmp4_is_dir": True}
    assert f"resuming from {_ckpt(run_dir, 2)}" in runs["rerun_during"].stdout
    assert _losses(run_dir) == expected
    assert (_ckpt(run_dir, 8) / "COMPLETE").is_file() and (_ckpt(run_dir, 4) / "COMPLETE").is_file()
    fp32, bf16 = tensor_bytes(_ckpt(ref_dir, 2)), tensor_bytes(_ckpt(run_dir, 2))
    assert bf16["model."] * 2 == fp32["model."] == bf16["master."] > 0, (fp32, bf16)
    files32, files16 = _file_bytes(_ckpt(ref_dir, 2), "model."), _file_bytes(_ckpt(run_dir, 2), "model.")
    assert files16 < 0.51 * files32, (files16, files32)  # on disk too (plus DCP's per-tensor header)
    print(f"save_bf16 model tensors: {bf16['model.']:,} B vs {fp32['model.']:,} B fp32 ({files16:,} vs {files32:,} "
          "on disk); resumed losses equal bit for bit")


@pytest.fixture(scope="module")
def one_process(reference, kjv_prefix, tmp_path_factory):
    """The single-process runs from the reference's checkpoints, in one launch (conftest.run_pool):
    dp2 → dp1 saving bf16 without masters, a resume from that, and two bad checkpoints (a
    truncated shard; a model of another shape), which must exit 2 and stay as they were."""
    ref_dir, _ = reference
    root = tmp_path_factory.mktemp("one_process")
    dp1, again = root / "dp1", root / "again"
    (dp1 / "checkpoints").mkdir(parents=True)
    shutil.copytree(_ckpt(ref_dir, 4), _ckpt(dp1, 4))
    truncated, good = root / "truncated", root / "good"
    shutil.copytree(_ckpt(ref_dir, 4), truncated)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    shutil.copytree(_ckpt(ref_dir, 4), good)
    argv = {
        "dp1": _args(kjv_prefix, dp1, devices=1, extra=["exp_manager.save_bf16=true"]),
        "again": _args(kjv_prefix, again, devices=1, extra=[f"exp_manager.resume_from_checkpoint='{_ckpt(dp1, 6)}'"]),
        "truncated": _args(kjv_prefix, root / "a", devices=1, extra=[f"exp_manager.resume_from_checkpoint={truncated}"]),
        "other_shape": _args(kjv_prefix, root / "b", devices=1,
                             extra=[f"exp_manager.resume_from_checkpoint={good}", "model.ffn_hidden_size=160"]),
    }
    procs = run_pool(argv, 1, root / "pool", expect={"truncated": 2, "other_shape": 2})
    return {"dirs": {"dp1": dp1, "again": again, "truncated": truncated, "good": good, "shard": shard}, **procs}


def test_reshard_dp2_to_dp1_then_bf16_without_masters(reference, one_process):
    """A dp=2 checkpoint continues on one process: same losses (dp2 vs dp1 sums differ in rounding
    only). That run saves with save_bf16 and no master weights (one notice line); a second run
    resuming from its step-6 checkpoint starts from bf16-rounded weights: not exact (one line),
    the gap is measured."""
    _, expected = reference
    dp1, again = one_process["dirs"]["dp1"], one_process["dirs"]["again"]
    proc = one_process["dp1"]
    got = _losses(dp1)
    assert sorted(got) == [4, 5, 6, 7]
    assert max(abs(got[s] - expected[s]) for s in got) < 1e-5, (got, expected)
    assert [line for line in proc.stdout.splitlines() if line.startswith("note:") and "save_bf16" in line] == [
        "note: exp_manager.save_bf16: checkpoints hold the fp32 weights rounded to bf16 and no fp32 copy "
        "(checkpoint_callback_params.use_master_weights_in_ckpt is false): resuming from them is not exact"]
    assert tensor_bytes(_ckpt(dp1, 6))["master."] == 0

    proc = one_process["again"]
    assert len([line for line in proc.stdout.splitlines() if "not an exact resume" in line]) == 1
    got = _losses(again)
    gap = max(abs(got[s] - expected[s]) for s in got)
    assert sorted(got) == [6, 7] and 1e-5 < gap < 1e-2, (got, expected)
    print(f"resume from bf16 weights without masters: steps 6..7, max loss gap {gap:.2e}")


def _file_bytes(path: Path, prefix: str) -> int:
    """Bytes the shard files spend on the tensors under `prefix`."""
    from nxdt.checkpoint.state import read_dcp_metadata

    return sum(info.length for index, info in read_dcp_metadata(path).storage_data.items() if index.fqn.startswith(prefix))


def test_bad_checkpoints_exit_2_and_are_kept(one_process):
    dirs = one_process["dirs"]
    # truncated shard, named with its file and key (exit 2: run_pool checked)
    proc, shard = one_process["truncated"], dirs["shard"]
    assert f"checkpoint file {shard} is truncated: key '" in proc.stderr
    assert shard.is_file() and (dirs["truncated"] / "COMPLETE").is_file()
    # a model whose shape does not match the checkpoint
    proc = one_process["other_shape"]
    assert "key 'model.layers.0.mlp.gate_proj.weight' has shape [176, 64] in the checkpoint but [160, 64]" in proc.stderr
    assert (dirs["good"] / "COMPLETE").is_file()
