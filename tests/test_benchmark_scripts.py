"""The benchmark scripts on their smoke shapes (their numbers are not judged here: speed goals live in
the scripts, not in timed tests): throughput.py end to end and its GPU shapes as configs (Llama-3.2-1B
and Llama-3.1-8B to the parameter, so `--device cuda` on a GPU machine trains what it says); grpo.py;
issue 40's peers.py runner, gpu.sh's arguments, and each job's `--peers-json` table (peer_trl.py,
lora.py, peer_memory.py, generate.py).

The scripts' drivers (argument handling, the table) run in this process through their `main(argv)`,
as `python benchmarks/X.py ARGS` calls it: a driver's own launch would be mostly imports this process
has already paid. So do the ways (`--in-process`: each way's worker in this process, what it changed
put back after it), where a subprocess per way would pay torch's, Lightning's and TRL's imports again;
throughput.py's torchrun launch (`--ranks 2`) is checked as the command line it starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generate as generate_bench  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
import peer_memory  # noqa: E402
import peer_titan  # noqa: E402
import peer_trl  # noqa: E402
import peers  # noqa: E402
import throughput  # noqa: E402
import throughput_runs  # noqa: E402

import nxdt.rl.rollout as rl_rollout  # noqa: E402
import nxdt.training.trainer as nxdt_trainer  # noqa: E402
from nxdt.spec import load_config  # noqa: E402
from nxdt.planner.estimate import plan  # noqa: E402
from nxdt.spec import build_spec



@pytest.fixture(autouse=True)
def _leave_the_process_as_found():
    """The `--in-process` ways run Lightning and nxdt's entry in this pytest worker: whatever they leave
    behind (WORLD_SIZE, MASTER_PORT & co. in the environment, a process group) must not reach the
    modules that run after this one in the same worker (their configs would meet a world of 1)."""
    saved = dict(os.environ)
    verbosity = transformers.logging.get_verbosity()  # generate.py quiets transformers' warnings
    yield
    os.environ.clear()
    os.environ.update(saved)
    transformers.logging.set_verbosity(verbosity)
    if dist.is_initialized():
        dist.destroy_process_group()

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
    row with its MFU; --ranks 2 launches the GPU path's command (torchrun, FSDP) and reports per device."""
    monkeypatch.chdir(REPO)
    text = _bench(kjv_prefix, capfd, "--ways", "nxdt,hf", "--in-process", "--steps", "2", "--warmup-steps", "1")
    assert "all ways trained on the same batches" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["nxdt"], ["hf"])
            and line.split()[-1] == "1"}
    assert set(rows) == {"nxdt", "hf"}, text
    assert all(float(r[1].replace(",", "")) > 0 and r[-2].endswith("%") for r in rows.values()), rows
    launched = []

    def call(cmd, **kwargs):  # torchrun's two ranks as rank 0's result: 2 x 300 tokens/s
        launched.append(cmd)
        out = cmd[cmd.index("--out") + 1]
        Path(out).write_text(json.dumps({"tokens_per_s": 600.0, "step_times": [0.2], "final_loss": 9.0,
                                            "batch_checksum": 7}))
        return 0

    monkeypatch.setattr(throughput.subprocess, "call", call)
    text = _bench(kjv_prefix, capfd, "--ways", "nxdt", "--ranks", "2")
    [cmd] = launched
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       throughput.__file__], cmd
    assert cmd[6:8] == ["--worker", "nxdt"] and cmd[-3:] == ["--ranks", "2", "--fsdp"], cmd
    assert "2 rank(s) FSDP" in text and any(line.split()[:2] == ["nxdt", "300"] and line.rstrip().endswith(" 1")
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
    rc, out, err = _main(throughput.main, [*script, "--ranks", "2", "--in-process"], capfd)
    assert rc == 2 and "--in-process runs one rank (--ranks 1)" in err


def test_grpo_benchmark_runs_nxdt_and_trl_side_by_side(capfd, monkeypatch, tmp_path):
    """benchmarks/grpo.py on its smoke model (one repeat, one timed step): a row per way with its steps/s
    and rollout tokens/s, the ratio and the goal's verdict (not judged here)."""
    monkeypatch.chdir(REPO)
    table = tmp_path / "grpo.json"  # issue 40's --peers-json table, from the same run
    # the workers' timing hooks and exp_manager's run version: put back after each way
    before = (rl_rollout.generate, nxdt_trainer.build_trainer, os.environ.get("NXDT_RUN_VERSION"))
    rc, out, err = _main(grpo.main, ["--quick", "--steps", "1", "--completion-length", "8", "--ways", "nxdt,trl",
                                     "--in-process", "--peers-json", str(table)], capfd)
    assert rc == 0, out[-3000:] + err[-3000:]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["nxdt"], ["trl"]) and line.split()[-1] == "1"}  # the table's rows: 1 run
    assert set(rows) == {"nxdt", "trl"} and all(float(r[1]) > 0 and float(r[2].replace(",", "")) > 0
                                                 for r in rows.values()), out
    assert out.startswith("cpu: ") and "nxdt / trl: steps/s" in out
    assert (rl_rollout.generate, nxdt_trainer.build_trainer, os.environ.get("NXDT_RUN_VERSION")) == before
    assert not throughput_runs._PATCHES and not torch.distributed.is_initialized()
    assert "goal: nxdt >= 2x TRL's steps/s:" in out
    doc = json.loads(table.read_text())
    assert doc["job"] == "grpo" and doc["skipped"] is None and [r["what"] for r in doc["rows"]] == [
        "steps/s, nxdt", "rollout tokens/s, nxdt (no goal of its own: > 1 = faster)"]
    assert all(r["ratio"] == pytest.approx(r["nxdt"] / r["peer"]) and r["pass"] == (r["ratio"] >= 2 - (i == 1))
               for i, r in enumerate(doc["rows"])), doc
    rc, out, err = _main(grpo.main, ["--ways", "nxdt,vllm"], capfd)
    assert rc == 2 and err.strip().splitlines() == [
        "error: --ways: from nxdt, nxdt-compiled, nxdt-nocache, trl (got nxdt,vllm)"]


# ------------------------------------------------------------------ benchmarks/peers.py (issue 40)
# The runner's table, its FAILED / skipped handling and --json on fake job scripts (each a short
# subprocess, as the real jobs are); the real titan job through the runner where its venv is missing.



_FAKE_JOB = """import json, sys
out = sys.argv[sys.argv.index("--peers-json") + 1]
quick = "--quick" in sys.argv
rows = [{"what": "tokens/s", "nxdt": 1200.0, "peer": 1000.0, "ratio": 1.2, "goal": ">= 1.1", "pass": True,
         "note": "quick" if quick else "full"},
        {"what": "loss step 1 |diff|", "nxdt": 2.5, "peer": 2.5001, "ratio": 1e-4, "goal": "<= 1e-5", "pass": False},
        {"what": "tokens/s bf16", "nxdt": None, "peer": None, "ratio": None, "goal": ">= 1.0", "pass": None,
         "note": "skipped: no native bf16"}]
json.dump({"job": "fake-job", "peer": "FakePeer 1.0", "rows": rows, "skipped": None}, open(out, "w"))
"""


def _fake_jobs(tmp_path, monkeypatch):
    scripts = {
        "ok": _FAKE_JOB,
        "skip": "import json, sys\njson.dump({'job': 'skip-job', 'peer': 'Other 2', 'rows': [], 'skipped': "
                "\"No module named 'other'\"}, open(sys.argv[sys.argv.index('--peers-json') + 1], 'w'))\n",
        "fail": "import sys\nprint('working', flush=True)\nprint('Traceback ...', file=sys.stderr)\n"
                "print('RuntimeError: boom', file=sys.stderr)\nsys.exit(3)\n",
        "silent": "pass\n",  # exits 0 without a table
    }
    jobs = {}
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(text)
        jobs[name] = (str(tmp_path / f"{name}.py"), ())
    jobs["gone"] = (str(tmp_path / "gone.py"), ())
    monkeypatch.setattr(peers, "JOBS", jobs)


def test_peers_runner_prints_one_table_and_goes_on_past_failed_jobs(tmp_path, capfd, monkeypatch):
    """Machine line first; every job's rows with PASS / MISS / skipped; a skipped job with its reason;
    a failing, a silent and a missing script as FAILED with their last stderr line; exit 1 for those,
    exit 0 where the only bad news is a MISS; --quick reaches the jobs; --json holds the merged table."""
    _fake_jobs(tmp_path, monkeypatch)
    merged = tmp_path / "peers.json"
    md = tmp_path / "peers.md"
    rc, out, err = _main(peers.main, ["--jobs", "ok,skip,fail,silent,gone", "--quick", "--probe-seconds", "0.05",
                                      "--json", str(merged), "--markdown", str(md)], capfd)
    assert rc == 1, out + err
    assert out.startswith("cpu: ") and "matmul peak fp32" in out.splitlines()[0]
    table = out[out.index("nxdt vs its peers"):]
    rows = [[c.strip() for c in line.split(" | ")] for line in table.splitlines() if line.startswith("fake-job ")]
    assert [r[2] for r in rows] == ["tokens/s", "loss step 1 |diff|", "tokens/s bf16"]
    assert rows[0][1] == "FakePeer 1.0" and rows[0][3:7] == ["1,200.0", "1,000.0", "1.2", ">= 1.1"]
    assert rows[0][7] == "PASS  quick" and rows[1][7] == "MISS" and rows[2][7] == "skipped  skipped: no native bf16"
    assert "skip-job: skipped: No module named 'other'" in table
    assert "fail: FAILED: exit 3: RuntimeError: boom" in table and "   working" in out
    assert "silent: FAILED: exit 0, no --peers-json table" in table
    assert f"gone: FAILED: {tmp_path / 'gone.py'} not found" in table
    assert table.rstrip().endswith("jobs failed: fail, silent, gone")
    saved = json.loads(merged.read_text())
    assert saved["machine"].startswith("cpu: ") and saved["quick"] is True
    assert [j["job"] for j in saved["jobs"]] == ["fake-job", "skip-job", "fail", "silent", "gone"]
    assert saved["jobs"][0]["rows"][1]["pass"] is False
    # the Markdown table docs/performance.md holds, written by the run and rendered again from its JSON
    lines = md.read_text().splitlines()
    assert lines[0].startswith(f"Measured {saved['date']} (--quick) by one run of `benchmarks/peers.py`; `cpu: ")
    assert lines[4:7] == ["| fake-job | FakePeer 1.0 | tokens/s | 1,200.0 | 1,000.0 | 1.2 | >= 1.1 | PASS |",
                          "|  |  | loss step 1 \\|diff\\| | 2.5 | 2.5 | 0.0001 | <= 1e-5 | MISS |",
                          "|  |  | tokens/s bf16 | - | - | - | >= 1.0 | skipped |"]
    assert lines[-4:] == ["- skip-job: skipped: No module named 'other'", "- fail: FAILED: exit 3: RuntimeError: boom",
                          "- silent: FAILED: exit 0, no --peers-json table", f"- gone: FAILED: {tmp_path / 'gone.py'} not found"]
    rc, out, err = _main(peers.main, ["--render", str(merged)], capfd)
    assert rc == 0 and out == md.read_text()
    rc, out, err = _main(peers.main, ["--render", str(md)], capfd)
    assert rc == 2 and err.strip().startswith(f"peers.py: --render {md}: not a saved run (JSONDecodeError")
    rc, out, err = _main(peers.main, ["--jobs", "ok,skip", "--probe-seconds", "0.05"], capfd)
    assert rc == 0 and "| MISS" in out and "PASS  full" in out  # a MISS is a result, not a failure
    rc, out, err = _main(peers.main, ["--jobs", "ok,nope"], capfd)
    assert rc == 2 and err.strip().splitlines()[-1].endswith("error: --jobs: from ok,skip,fail,silent,gone (got ok,nope)")


def test_peers_titan_job_says_skipped_without_its_venv(tmp_path, capfd, monkeypatch):
    """The real pre-training job through the runner, where torchtitan's venv is missing (CI): skipped
    with the reason and what to run, exit 0; peer_titan.py's bad arguments: one line, exit 2."""
    monkeypatch.setenv("NXDT_TITAN_VENV", str(tmp_path / "no-venv"))
    rc, out, err = _main(peers.main, ["--jobs", "titan", "--quick", "--probe-seconds", "0.05"], capfd)
    assert rc == 0, out + err
    assert f"pre-training: skipped: torchtitan's venv {tmp_path / 'no-venv'} is missing: run make bench-peers" in out
    rc, out, err = _main(peer_titan.main, ["--shapes", "debugmodel,huge"], capfd)
    assert rc == 2 and err.strip().splitlines()[-1].endswith(
        "error: --shapes: from debugmodel, reference, tiny (got debugmodel,huge)")


def test_gpu_script_prints_its_commands_and_refuses_bad_arguments():
    """benchmarks/gpu.sh --dry-run: the card, nxdt's 1B and 8B-cut runs (bf16, compiled, fused loss) and
    torchtitan's 1B figure, run nothing; bad arguments: one line, exit 2."""

    def gpu(*args):
        return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), *args], capture_output=True, text=True,
                              timeout=60)

    done = gpu("--dry-run", "--steps", "7", "--python", "PY", "--titan-python", "TPY")
    assert done.returncode == 0, done.stderr
    cmds = done.stdout.splitlines()
    assert [c.split()[1] for c in cmds] == ["nvidia-smi", "env", "env", "TPY"], cmds
    for cmd, shape in zip(cmds[1:3], ("llama-3.2-1b", "llama-3.1-8b-8l")):
        assert f"PY benchmarks/throughput.py --device cuda --shape {shape} --ways nxdt-mixed-chunks-compile" in cmd
        assert "--steps 7" in cmd and shape in throughput_runs.SHAPES
    assert "--titan-flavor 1B --titan-seq 2048 --titan-batch 4 --titan-compile --device cuda" in cmds[3]
    only = gpu("--dry-run", "--only", "titan", "--titan-python", "TPY").stdout.splitlines()
    assert len(only) == 2 and only[1].startswith("+ TPY benchmarks/peer_titan.py")
    for bad, line in [(["--steps", "0"], "gpu.sh: --steps: a whole number >= 1 (got '0')"),
                      (["--only", "1b,70b"], "gpu.sh: --only: from 1b,8b,titan (got '1b,70b')"),
                      (["--python"], "gpu.sh: --python needs a path")]:
        done = gpu(*bad)
        assert done.returncode == 2 and done.stderr.splitlines() == [line] and not done.stdout, (bad, done)
    done = gpu("--bogus")
    assert done.returncode == 2 and done.stderr.startswith("gpu.sh: unknown argument '--bogus'")
# ---------------------------------------------------------------- issue 40: SFT and DPO against TRL (peer_trl.py)
@pytest.mark.parametrize("job, ways, rows", [
    ("sft", "nxdt,trl", ["tokens/s (packed, real tokens)"]),
    # TRL's default mode is left out here (a third subprocess); its rows are the precomputed mode's
    ("dpo", "nxdt,trl-precompute", ["training pairs/s vs TRL precompute_ref_log_probs=True",
                                    "reference pass pairs/s vs TRL precompute_ref_log_probs=True",
                                    "loss step 1 |diff|", "loss step 2 |diff|"]),
])
def test_peer_trl_quick_writes_the_shared_json_rows(job, ways, rows, tmp_path, capfd, monkeypatch):
    """benchmarks/peer_trl.py --quick (smoke model, one timed step, one repeat): the peers-json file has
    the job's rows with finite figures, in benchmarks/peers.py's format (the ratios are not judged here)."""

    monkeypatch.chdir(REPO)
    out_json = tmp_path / f"{job}.json"
    rc, out, err = _main(peer_trl.main, ["--job", job, "--quick", "--ways", ways, "--in-process", "--peers-json",
                                         str(out_json)], capfd)
    assert rc == 0, out[-3000:] + err[-3000:]
    body = json.loads(out_json.read_text())
    assert body["skipped"] is None and body["peer"].startswith("TRL ") and body["job"] in ("sft-packing", "dpo")
    assert [r["what"] for r in body["rows"]] == rows, body
    for r in body["rows"]:
        assert all(math.isfinite(r[k]) for k in ("nxdt", "peer", "ratio")) and isinstance(r["pass"], bool), r
        assert r["goal"].split()[0] in (">=", "<=") and r["nxdt"] > 0 and r["peer"] > 0, r
    assert out.startswith("cpu: ") and "trl 1." in out
    rc, out, err = _main(peer_trl.main, ["--job", job, "--ways", "nxdt,vllm"], capfd)
    assert rc == 2 and "error: --ways:" in err
# ---- issue 40, the LoRA and large-vocabulary memory rows (helper peers-lora-mem) -------------------------



@pytest.mark.parametrize("script", ["lora", "peer_memory"])
def test_issue40_lora_and_memory_peers_json(script, kjv_prefix, tmp_path, capfd, monkeypatch):
    """`--quick --peers-json` of benchmarks/lora.py (nxdt's LoRA through its training entry vs peft +
    transformers.Trainer) and benchmarks/peer_memory.py (one step's peak bytes vs the Trainer), the ways
    run in this process: the protocol's JSON with finite numbers, the ratios nxdt / peer, and the
    trainable state equal on both sides (the same adapters, grads and AdamW moments)."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "rows.json"
    main = {"lora": lora.main, "peer_memory": peer_memory.main}[script]
    rc, text, err = _main(main, ["--quick", "--in-process", "--data-prefix", kjv_prefix, "--peers-json", str(out)],
                          capfd)
    assert rc == 0, text[-3000:] + err[-3000:]
    got = json.loads(out.read_text())
    assert got["skipped"] is None and got["machine"].startswith("cpu: "), got
    rows = {r["what"]: r for r in got["rows"]}
    want = {"lora": {"tokens/s", "trainable-state bytes (adapters + grads + optimizer state)", "peak bytes of one step"},
            "peer_memory": {"peak bytes of one step vs Trainer"}}[script]
    assert set(rows) == want, rows
    for r in rows.values():
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("nxdt", "peer", "ratio")), r
        assert r["ratio"] == pytest.approx(r["nxdt"] / r["peer"]) and r["pass"] in (True, False), r
    if script == "lora":  # rank 16 on the seven linears of 2 blocks of hidden 128: params + grads + 2 moments
        adapters = 2 * 16 * (2 * (128 + 128) + 2 * (128 + 64) + 2 * (128 + 352) + (352 + 128))
        trainable = rows["trainable-state bytes (adapters + grads + optimizer state)"]
        assert trainable["nxdt"] == trainable["peer"] == 16 * adapters + 4 * 28  # + 28 fp32 `step` scalars


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
