"""Step-closure logging on XLA:CPU (`make test-xla`): the product path (nxdt.training.trainer.train,
Lightning, one XLA device) logs the same numbers at the same steps as Lightning's own `self.log`,
without the graph executions that `self.log` costs on XLA.

Three runs of the same tiny Llama (tests/xla/log_worker.py, each in its own process, run side by
side): `closures` (as shipped), `direct` (the step-closure logger switched off: Lightning's
`self.log` on device tensors) and `silent` (per-step scalars dropped: what the step itself
executes). The count is torch-xla's ExecuteTime samples between consecutive batch starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="torch-xla is only in .venv-xla (make test-xla)")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 5
MODES = ("closures", "direct", "silent")


def _data_prefix() -> Path:
    data = REPO / "data" / "kjv" / "kjv_text_document"
    if not Path(str(data) + ".idx").exists():
        subprocess.run([sys.executable, "-m", "nxdt.tools.preprocess", "--input",
                        str(REPO / "src/nxdt/assets/kjv_chapters.jsonl.gz"), "--tokenizer",
                        str(REPO / "src/nxdt/assets/tokenizer"), "--output-prefix", str(data)], check=True)
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    data = _data_prefix()
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for mode in MODES:  # side by side: each is mostly one-off compilation
        log_dir = tmp_path_factory.mktemp(mode)
        cmd = [sys.executable, str(HERE / "log_worker.py"), mode, str(log_dir), str(data), str(STEPS)]
        procs[mode] = (log_dir, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                 env=env, cwd=REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import read_scalars

    out = {}
    for mode, (log_dir, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"{mode}: " + stdout[-3000:] + stderr[-3000:]
        out[mode] = {**json.loads(lines[-1][len("RESULT "):]), "scalars": read_scalars(log_dir)}
    return out


def test_logging_adds_no_graph_execution(runs):
    ex = {mode: runs[mode]["executions"] for mode in MODES}
    print(f"\ngraph executions per step: {ex}; transfers from device: "
          f"{ {m: runs[m]['transfers_from_device'] for m in MODES} }")
    assert len(ex["closures"]) == STEPS - 1
    # the step itself (no logging) and the step with its scalars logged through closures: same count
    assert ex["closures"] == ex["silent"]
    # Lightning's self.log reads each device scalar with its own execution: the counter sees it
    assert all(d > c for d, c in zip(ex["direct"], ex["closures"])), ex


def test_logged_values_and_steps_match_lightning_self_log(runs):
    closures, direct = runs["closures"]["scalars"], runs["direct"]["scalars"]
    for tag in ("reduced_train_loss", "gradient_norm", "parameter_norm", "lr", "consumed_samples", "global_step"):
        assert sorted(closures[tag]) == list(range(1, STEPS + 1)), (tag, closures[tag])  # optimizer steps done
        assert closures[tag] == direct[tag], (tag, closures[tag], direct[tag])  # same numbers, same steps
    losses = closures["reduced_train_loss"]
    assert losses[STEPS] < losses[1]
    assert set(closures["throughput"]) == set(range(1, STEPS + 1))  # ThroughputMonitor goes through the closures too
