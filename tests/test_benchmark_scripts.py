"""benchmarks/throughput.py end to end on the smoke shape (its numbers are not judged here: speed
goals live in the script, not in timed tests), and its GPU shapes as configs: Llama-3.2-1B and
Llama-3.1-8B to the parameter, so `--device cuda` on a GPU machine trains what it says.

The scripts' drivers (argument handling, the table) run in this process through their `main(argv)`,
as `python benchmarks/X.py ARGS` calls it: a driver's own launch would be mostly imports this process
has already paid. Each way still trains in the subprocess the script starts for it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generate as generate_bench  # noqa: E402
import grpo  # noqa: E402
import throughput  # noqa: E402
import throughput_runs  # noqa: E402

from nxdt.spec import load_config  # noqa: E402
from nxdt.planner.estimate import plan  # noqa: E402
from nxdt.spec import build_spec


@pytest.mark.parametrize("shape, parameters, gflop_per_token", [
    ("llama-3.2-1b", 1_235_814_400, 7.82),   # HF's Llama-3.2-1B (tied embeddings)
    ("llama-3.1-8b", 8_030_261_248, 51.47),  # HF's Llama-3.1-8B
])
def test_gpu_shapes_are_the_llama_3_models(shape, parameters, gflop_per_token):
    argv = throughput_runs.common_overrides(throughput_runs.SHAPES[shape], "/data/prefix", "/tmp/unused", 10, "cuda", 8, True)
    cfg = load_config(argv, world_size=8, default_config_dir=throughput_runs.CONF_DIR, check_paths=False, quiet=True)
    p = plan(build_spec(cfg))
    assert p["parameters"] == parameters and p["sharding"] == "fsdp" and cfg.trainer.accelerator == "gpu"
    assert p["flops_per_token"] / 1e9 == pytest.approx(gflop_per_token, abs=0.01)


def _main(main, argv: list[str], capfd) -> tuple[int, str, str]:
    """`python benchmarks/X.py ARGV` in this process: (exit status, stdout, stderr), file descriptors 1
    and 2 included; the torch thread count the driver sets is put back."""
    threads = torch.get_num_threads()
    capfd.readouterr()
    try:
        rc = main(argv)
    except SystemExit as stop:  # argparse's errors; a failed way's message
        rc = stop.code if isinstance(stop.code, int) else print(stop.code, file=sys.stderr) or 1
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    return rc, out, err


def _bench(data_prefix: str, capfd, *args: str) -> str:
    # the prefix relative to the working directory, as a user types it (the workers run elsewhere)
    rc, out, err = _main(throughput.main, ["--shape", "tiny", "--quick", "--probe-seconds", "0.05", "--data-prefix",
                                           os.path.relpath(data_prefix, REPO), *args], capfd)
    assert rc == 0, out[-3000:] + err[-3000:]
    return out


def test_throughput_runs_every_runner_on_the_same_batches_and_fsdp_over_two_ranks(kjv_prefix, capfd, monkeypatch):
    """nxdt and the Trainer train on the same batches (the script's token checksum) and each gets a
    row with its MFU; --ranks 2 is the GPU path's launcher (torchrun, FSDP) on CPU ranks."""
    monkeypatch.chdir(REPO)
    text = _bench(kjv_prefix, capfd, "--ways", "nxdt,hf")
    assert "all ways trained on the same batches" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["nxdt"], ["hf"])
            and line.split()[-1] == "1"}
    assert set(rows) == {"nxdt", "hf"}, text
    assert all(float(r[1].replace(",", "")) > 0 and r[-2].endswith("%") for r in rows.values()), rows
    text = _bench(kjv_prefix, capfd, "--ways", "nxdt", "--ranks", "2")
    assert "2 rank(s) FSDP" in text and any(line.startswith("nxdt ") and line.rstrip().endswith(" 1")
                                            for line in text.splitlines()), text


def test_bad_input_is_one_line_exit_2(tmp_path, capfd):
    """A data prefix without its files: one line naming the key and the file, exit 2, before any run."""
    script = ["--shape", "tiny", "--probe-seconds", "0.05"]
    rc, out, err = _main(throughput.main, [*script, "--data-prefix", str(tmp_path / "missing")], capfd)
    assert rc == 2 and err.splitlines() == [
        f"error: data.data_prefix: indexed dataset file not found: {tmp_path / 'missing'}.bin (make them with: nxdt "
        "preprocess --input CORPUS.jsonl --tokenizer DIR --output-prefix PREFIX; the bundled corpus: make data)"]
    assert "repeat 1/" not in out
    rc, out, err = _main(throughput.main, [*script, "--ranks", "0"], capfd)
    assert rc == 2 and "--ranks and --repeats must be >= 1" in err


def test_grpo_benchmark_runs_nxdt_and_trl_side_by_side(capfd, monkeypatch, tmp_path):
    """benchmarks/grpo.py on its smoke model (one repeat, one timed step): a row per way with its steps/s
    and rollout tokens/s, the ratio and the goal's verdict (not judged here)."""
    monkeypatch.chdir(REPO)
    table = tmp_path / "grpo.json"  # issue 40's --peers-json table, from the same run
    rc, out, err = _main(grpo.main, ["--quick", "--steps", "1", "--completion-length", "8", "--ways", "nxdt,trl",
                                     "--peers-json", str(table)], capfd)
    assert rc == 0, out[-3000:] + err[-3000:]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["nxdt"], ["trl"]) and line.split()[-1] == "1"}  # the table's rows: 1 run
    assert set(rows) == {"nxdt", "trl"} and all(float(r[1]) > 0 and float(r[2].replace(",", "")) > 0
                                                 for r in rows.values()), out
    assert out.startswith("cpu: ") and "nxdt / trl: steps/s" in out
    assert "goal: nxdt >= 2x TRL's steps/s:" in out
    doc = json.loads(table.read_text())
    assert doc["job"] == "grpo" and doc["skipped"] is None and [r["what"] for r in doc["rows"]] == [
        "steps/s, nxdt", "rollout tokens/s, nxdt (no goal of its own: > 1 = faster)"]
    assert all(r["ratio"] == pytest.approx(r["nxdt"] / r["peer"]) and r["pass"] == (r["ratio"] >= 2 - (i == 1))
               for i, r in enumerate(doc["rows"])), doc
    rc, out, err = _main(grpo.main, ["--ways", "nxdt,vllm"], capfd)
    assert rc == 2 and err.strip().splitlines() == [
        "error: --ways: from nxdt, nxdt-compiled, nxdt-nocache, trl (got nxdt,vllm)"]


# ---------------------------------------------------------------- issue 40: benchmarks/generate.py --peers-json
def test_generate_benchmark_writes_the_peers_table(capfd, tmp_path):
    """benchmarks/generate.py --quick --peers-json (the eager ways; the compiled ones compile for tens of
    seconds and are measured, not tested): a speed row per batch against transformers' generate() with
    the ratio of the two speeds, and a same-tokens row that passes (nxdt = transformers, greedy)."""
    table = tmp_path / "sampling.json"
    rc, out, err = _main(generate_bench.main, ["--quick", "--ways", "nxdt,hf", "--batches", "2", "--new-tokens", "8",
                                               "--peers-json", str(table)], capfd)
    assert rc == 0, out[-3000:] + err[-3000:]
    doc = json.loads(table.read_text())
    assert doc["job"] == "sampling" and doc["skipped"] is None
    speed = [r for r in doc["rows"] if r["what"].startswith("tokens/s")]
    same = [r for r in doc["rows"] if r["what"].startswith("same greedy tokens")]
    assert [r["what"].split(",")[0] for r in speed] == ["tokens/s batch 2"]
    assert all(r["goal"] == ">= 2" and r["nxdt"] > 0 and r["peer"] > 0 and r["ratio"] == pytest.approx(
        r["nxdt"] / r["peer"]) for r in speed), speed
    assert len(same) == 1 and all(r["pass"] is True and r["ratio"] == 0 for r in same), same
