"""Shared fixtures: a small Megatron dataset tokenized from the bundled corpus, and run helpers."""

from __future__ import annotations

import contextlib
import gzip
import io
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# `make test` runs two pytest workers on two cores, and either may be running torchrun ranks: each
# worker computes on one thread, as the launched runs do (OMP_NUM_THREADS=1). With torch's default
# of a thread per core, the in-process tests' OpenMP threads spin against the other worker's and
# small ops run several times slower (tests/test_generate.py: 9 s alone, 72 s in the suite).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

# tests/xla run only in .venv-xla (`make test-xla`): the main environment deliberately has no
# torch-xla (it needs torch 2.9), so they are not collected here rather than shown as skipped.
collect_ignore_glob = [] if importlib.util.find_spec("torch_xla") else ["xla/*"]

# The CPU matmul peak (MFU's denominator) is measured once per machine and cached; the suite keeps
# its own cache file, so no test reads a figure another program stored, nor writes to ~/.cache.
os.environ.setdefault("NXDT_CPU_PEAK_CACHE", os.path.join(tempfile.gettempdir(), f"nxdt-test-cpu-peak-{os.getpid()}.json"))

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train.py"
TOKENIZER_DIR = REPO / "src" / "nxdt" / "assets" / "tokenizer"
CORPUS = REPO / "src" / "nxdt" / "assets" / "kjv_chapters.jsonl.gz"

# A model small enough that a torchrun launch is dominated by imports, not compute.
TINY_OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=176",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.max_position_embeddings=128",
    "model.encoder_seq_length=32",
    "data.seq_length=32",
    "data.micro_batch_size=2",
    "data.global_batch_size=8",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    # Data workers are forked from a rank whose gloo and queue-feeder threads are running; on
    # CPython 3.11 a fork that races a Python thread's start or exit can leave the child stuck
    # in PyOS_AfterFork_Child (seen twice in 2-rank runs). Loading in the rank itself avoids the
    # fork; tests/test_data_megatron.py keeps a num_workers=1 case (one process).
    "data.num_workers=0",
]


# The longest modules first, in order of their running time (measured in the suite; the rest take
# under 15 s each and follow in name order). Each module runs whole on one pytest worker (`--dist
# loadfile`) and a worker is given the next module when it runs low, so one worker takes the
# parallel layouts while the other runs the checkpoint chains, and the short modules come last:
# the two workers end within seconds of each other. (The Slurm job, mostly waiting on its job,
# was tried beside the layouts: a fresh CI run took 497 s against 480 s in this order, one run
# each; the job's own processes compete with the layouts' ranks.)
LONG_MODULES = ("test_parallel_layouts.py", "test_checkpoint_resume.py", "test_checkpoint_reshard.py", "test_nxdt_release_runs.py",
                "test_fault_tolerance.py", "test_benchmark_scripts.py", "test_tiny_configs_train.py", "test_grpo_runs.py", "test_slurm.py",
                "test_finetuning_runs.py", "test_lm_eval.py", "test_data_arrow.py", "test_parallel_units.py", "test_config.py",
                "test_precision.py", "test_train.py", "test_evaluate.py", "test_lora_parallel.py", "test_data_megatron.py",
                "test_import_config.py", "test_generate_parallel.py", "test_cli_errors.py", "test_precision_parallel.py")


def pytest_configure(config):
    # pytest-xdist 3.x queues `--dist loadfile`'s modules by their number of tests, most first,
    # unless told not to (--no-loadscope-reorder): LONG_MODULES' order was ignored (a suite's second
    # worker began with test_config.py's 116 quick tests; test_checkpoint_resume started 6.5 minutes
    # in), and the two workers ending together was luck.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.fixture(scope="session")
def kjv_prefix(tmp_path_factory) -> str:
    """The first 120 chapters of the bundled corpus as Megatron .bin/.idx (built once per session)."""
    from nxdt.tools.preprocess import main as preprocess

    root = tmp_path_factory.mktemp("kjv")
    small = root / "kjv_small.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as src, small.open("w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= 120:
                break
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    prefix = root / "kjv_small"
    assert preprocess(["--input", str(small), "--tokenizer", str(TOKENIZER_DIR), "--output-prefix", str(prefix)]) == 0
    return str(prefix)


def run_cli(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run examples/train.py: plainly for one process, under torchrun for several."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("NXDT_RUN_VERSION", None)
    if nproc == 1:
        cmd = [sys.executable, str(TRAIN_SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(TRAIN_SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)


def run_cli_here(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`run_cli(args)` of one process, in this one: the entry examples/train.py calls (main_guard(main),
    whose status is the process's exit code), from the repository, `env` set for the call only. For
    bad input (one line, exit 2): a process of its own spends ~1 CPU-s starting Python and importing the
    config side, ~4 s more where the error is found after torch and Lightning are imported."""
    with contextlib.chdir(REPO):
        run = train_in_process(args, env)
    return subprocess.CompletedProcess(args, run.rc, run.out, run.err)


def exit_worker() -> None:
    """End a torchrun test worker whose results are written and whose process group is destroyed:
    flush and leave without interpreter teardown, where a gloo thread can still abort a rank
    ("terminate called without an active exception", exit -6) after a successful run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(script: str, nproc: int, out_path: Path, out_env: str, timeout: int = 600):
    """Run a test file's `__main__` worker under torchrun; it writes JSON results to `out_path`
    (passed in the environment variable `out_env`). Returns the parsed results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", out_env: str(out_path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", script], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out_path).read_text())


# glibc's heap-corruption aborts. Seen twice in about sixteen full suites, each time on one rank of
# a pooled launch, in a late run (cp2_fsdp; dpo_tp2_sp after twenty runs in the same process) and
# inside torch's functional collectives over gloo; never in a run of its own process. Such a
# launch is relaunched once, in fresh processes, from the run that died, and says so on stderr.
HEAP_ABORTS = ("malloc(): ", "free(): ", "double free", "corrupted size")


def run_pool(runs: dict[str, list[str]], nproc: int, out_dir: Path, expect: dict[str, int] | None = None,
             timeout: int = 900, entry: str | None = None,
             env: dict[str, dict[str, str]] | None = None, relaunched: bool = False, freeze: bool = False,
             in_process: bool = True, end_groups: bool = False) -> dict[str, subprocess.CompletedProcess]:
    """Run several examples/train.py command lines (name -> argv) of one world size in one launch,
    in order, in-process on each rank (tests/run_pool.py); each must exit 0, or as `expect` says
    (name -> exit status). Returns, per name, what `run_cli` would: the exit status and every
    rank's stdout and stderr (rank order). `freeze`: after each run, collect garbage and gc.freeze() what is left (tests/run_pool.py). `entry`: another module whose `main(argv)` runs the
    command lines (e.g. "nxdt.tools.evaluate"). `env`: name -> environment variables for that run only.
    `in_process`: one process's runs go in this process (`_pool_here`), not in a launch of their own.
    `end_groups`: each run's process groups are destroyed when it ends (tests/run_pool._end_run_groups)."""
    expect = expect or {}
    run_env = env
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps({"out": str(out_dir), "jobs": [{"name": k, "argv": v, "expect": expect.get(k, 0),
                                                           **({"entry": entry} if entry else {}),
                                                           **({"env": env[k]} if env and k in env else {})}
                                                          for k, v in runs.items()]}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NXDT_POOL_JOBS": str(spec),
           **({"NXDT_POOL_FREEZE": "1"} if freeze else {}), **({"NXDT_POOL_END_GROUPS": "1"} if end_groups else {})}
    env.pop("NXDT_RUN_VERSION", None)
    pool = str(REPO / "tests" / "run_pool.py")
    cmd = ([sys.executable, pool] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", pool])
    log_dirs = {n: Path(a.split("=", 1)[1].strip("'")) for n, argv in runs.items() for a in argv
                if a.startswith("exp_manager.explicit_log_dir=")}
    new_dirs = {n for n, d in log_dirs.items() if not d.exists()}  # a relaunch may clear these
    if nproc == 1 and in_process:
        proc = _pool_here(json.loads(spec.read_text()), env)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    results = {}
    for name in runs:
        run_dir = out_dir / name
        rcs = [int(p.read_text()) for p in sorted(run_dir.glob("rank*.rc"))] if run_dir.is_dir() else []
        text = {kind: "".join(p.read_text() for p in sorted(run_dir.glob(f"rank*.{kind}"))) if run_dir.is_dir() else ""
                for kind in ("out", "err")}
        results[name] = subprocess.CompletedProcess(name, max(rcs) if len(rcs) == nproc else -1,
                                                    text["out"], text["err"])
        if results[name].returncode != expect.get(name, 0):
            died = [e.read_text() for e in sorted(run_dir.glob("rank*.err")) if not e.with_suffix(".rc").exists()]
            if not relaunched and any(mark in text for text in died for mark in HEAP_ABORTS):
                rest = list(runs)[list(runs).index(name):]
                print(f"run_pool: a rank of '{name}' died of a heap-corruption abort; relaunching it and the "
                      f"{len(rest) - 1} run(s) after it once", file=sys.stderr)
                for n in [n for n in rest if n in new_dirs]:
                    shutil.rmtree(log_dirs[n], ignore_errors=True)  # a fresh start for the runs' new log dirs
                results.update(run_pool({n: runs[n] for n in rest}, nproc, out_dir / "relaunch", expect, timeout,
                                        entry, run_env, relaunched=True, freeze=freeze, end_groups=end_groups))
                return results
            # each rank's own tail: the rank that died first (e.g. an abort in a gloo thread) says why,
            # and its lines would be cut off behind the others' tracebacks in one joined tail
            tails = ""
            for err in sorted(run_dir.glob("rank*.err")):
                rc = err.with_suffix(".rc")
                tails += f"--- {err.name} (rc {rc.read_text() if rc.exists() else 'none: the rank died'})\n"
                tails += err.read_text()[-2000:] + "\n"
            raise AssertionError(f"run '{name}' failed\n{text['out'][-2000:]}\n{tails}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


def _pool_here(spec: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The runs of a one-process pool in this process (tests/run_pool.run_jobs), as its launch would run
    them: in the repository, examples/ first on sys.path, one torch thread, the launch's environment.
    A launch of its own mostly imported torch, Lightning and transformers again (~4 CPU-s; the pytest
    worker has them). The environment, sys.path, working directory and thread count are put back, and
    the rank log file and a process group a failed run left are closed."""
    import torch  # reason: conftest imports torch only when a test needs it
    import torch.distributed as dist  # reason: as above

    import run_pool as pool  # reason: tests/run_pool.py imports torch (as above)
    from nxdt.exp.exp_manager import close_rank_log_file  # reason: as above (nxdt.exp imports torch)

    environ, threads, had_group = dict(os.environ), torch.get_num_threads(), dist.is_initialized()
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, pool.EXAMPLES)
    torch.set_num_threads(1)
    try:
        with contextlib.chdir(REPO):
            ok = pool.run_jobs(spec, in_process=True)
    finally:
        close_rank_log_file()
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        sys.path.remove(pool.EXAMPLES)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["run_pool"], 0 if ok else 1, "", "")


def train_and_read(args: list[str], log_dir: Path, nproc: int = 1):
    """Run examples/train.py (logging to `log_dir`), require success; (process, scalars)."""
    proc = run_cli(args, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, read_scalars(log_dir)


def curve(scalars: dict[str, dict[int, float]], tag: str = "reduced_train_loss") -> list[float]:
    """One logged scalar's values in step order."""
    return [v for _, v in sorted(scalars[tag].items())]


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """All TensorBoard scalars under log_dir as {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def tensor_bytes(checkpoint: Path) -> dict[str, int]:
    """Bytes of a checkpoint's tensors per key prefix (`model.`, `master.`, `optim0.`), from its
    DCP index (numel x element size)."""
    import math

    import torch

    from nxdt.checkpoint.state import read_dcp_metadata

    out = {"model.": 0, "master.": 0, "optim0.": 0}
    for key, md in read_dcp_metadata(Path(checkpoint)).state_dict_metadata.items():
        prefix = key.split(".", 1)[0] + "."
        if prefix in out and hasattr(md, "size"):
            out[prefix] += math.prod(md.size) * torch.empty(0, dtype=md.properties.dtype).element_size()
    return out


def train_in_process(argv: list[str], env: dict[str, str] | None = None) -> SimpleNamespace:
    """`nxdt train` in this process, through the entry examples/train.py calls (main_guard(main)):
    exit status, stdout, stderr. The environment is restored afterwards (Lightning leaves
    MASTER_PORT & co. in it, the loggers MLFLOW_ALLOW_FILE_STORE)."""
    from nxdt.config.load import main_guard
    from nxdt.tools.train import main

    environ = dict(os.environ)
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "NXDT_RUN_VERSION"):
        os.environ.pop(name, None)
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = int(main_guard(main)(argv) or 0)
    except SystemExit as stop:
        rc = int(stop.code)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return SimpleNamespace(rc=rc, out=out.getvalue(), err=err.getvalue())
