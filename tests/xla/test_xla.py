"""The XLA path on XLA:CPU (PJRT_DEVICE=CPU): run by `make test-xla` in .venv-xla
(torch==2.9.0 + torch-xla==2.9.0). Skipped where torch_xla is not installed (the main
environment deliberately lacks it); the parts that need no torch-xla are tested in
tests/test_precision.py.

Each preset runs in its own process: the XLA env vars are read once, at import.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="torch-xla is only in .venv-xla (make test-xla)")

WORKER = Path(__file__).with_name("xla_worker.py")
PRESETS = ["fp32", "autocast", "mixed_precision", "mixed_precisionSR", "mixed_precision_SR", "bf16SR", "manual", "fp16"]
EXPECTED_ENV = {  # interface.md §7, as set by nxdt.config.env before torch_xla is imported
    "fp32": {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_CC_FLAGS": "--auto-cast none"},
    "mixed_precision": {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
    "bf16SR": {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
}
STEPS = 8


def _run(ptype: str, ckpt_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_RT_STOCHASTIC_ROUNDING_EN", "NEURON_CC_FLAGS")}
    env.update(PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(WORKER), ptype, str(STEPS)] + ([str(ckpt_dir)] if ckpt_dir else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def fp32_run():
    return _run("fp32")


@pytest.mark.parametrize("ptype", PRESETS)
def test_tiny_llama_trains_on_xla_with_each_preset(ptype, fp32_run):
    out = fp32_run if ptype == "fp32" else _run(ptype)
    losses = out["losses"]
    print(f"\n{ptype} on {out['device']}: losses {[round(v, 3) for v in losses]} env {out['env']}")
    assert out["device"].startswith("xla")
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1
    gap = max(abs(a - b) for a, b in zip(losses, fp32_run["losses"]))
    assert gap < 0.15, gap
    for var, value in EXPECTED_ENV.get(ptype, {}).items():
        assert out["env"].get(var) == value, (var, out["env"])


def test_xser_checkpoint_loads_back(tmp_path):
    out = _run("mixed_precision", ckpt_dir=tmp_path)
    assert out["ckpt_equal"], out
    assert out["loss_before"] == out["loss_after_load"]
    assert out["opt_state_len"] > 0
    assert any(name.endswith(".tensors") for name in out["ckpt_files"]), out["ckpt_files"]


REPO = Path(__file__).resolve().parents[2]


def test_examples_train_runs_on_xla(tmp_path):
    """The product path: examples/train.py with trainer.accelerator=xla (Lightning, one XLA:CPU device)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import TINY_OVERRIDES, read_scalars

    data = REPO / "data" / "kjv" / "kjv_text_document"
    if not Path(str(data) + ".idx").exists():
        subprocess.run([sys.executable, "-m", "nxdt.tools.preprocess", "--input",
                        str(REPO / "src/nxdt/assets/kjv_chapters.jsonl.gz"), "--tokenizer",
                        str(REPO / "src/nxdt/assets/tokenizer"), "--output-prefix", str(data)], check=True)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), "--config-name", "tiny_llama_cpu",
                           *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=4", "trainer.accelerator=xla",
                           "model.optim.sched.warmup_steps=1", "model.optim.lr=1e-2", "trainer.val_check_interval=4",
                           "trainer.limit_val_batches=1", "precision.type=mixed_precision",
                           f"data.data_prefix=[1.0,{data}]", f"exp_manager.explicit_log_dir={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = read_scalars(tmp_path)["reduced_train_loss"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("accelerator, key", [("xla", "distributed_strategy.pipeline_model_parallel_size"),
                                              ("auto", "distributed_strategy.context_parallel_size"),
                                              ("xla", "trainer.num_nodes"), ("xla", "WORLD_SIZE")])
def test_pipeline_context_parallel_or_hosts_over_xla_devices_refused_in_one_line(accelerator, key):
    """Several XLA devices are SPMD (tests/xla/test_xla_spmd.py); pipeline and context parallel have no
    SPMD form yet, and several hosts (torch-xla's multi-host SPMD) are not built: one line, exit 2,
    before any work. With torch-xla installed and PJRT_DEVICE set, `auto` is XLA too and is refused
    the same way."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    if key == "WORLD_SIZE":  # as torchrun sets it for each of its processes (one per host, as multi-host SPMD runs)
        env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        key = "torchrun's WORLD_SIZE"
    override = [f"{key}=2"] if "." in key else []
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), "--config-name", "tiny_llama_cpu",
                           f"trainer.accelerator={accelerator}", "trainer.devices=2", *override],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: trainer.accelerator {accelerator}"), lines
    devices = 4 if key == "trainer.num_nodes" else 2
    assert f"with {devices} devices: {key} = 2" in lines[0] and "is not supported yet on XLA" in lines[0], lines[0]
