"""Many examples/train.py command lines in one launch: imports are paid once, not per run.

A torchrun launch of a tiny model here is mostly imports (torch, Lightning, transformers: ~4 s per
process, 10-20 s for 2-4 ranks on 2 cores); the training itself takes a few seconds. So the
parity tests give one launch a list of runs of the same world size, and each rank runs them one
after another in-process through the product's own entry (`nxdt.tools.train.main` under
`main_guard`, exactly what examples/train.py calls). The launch starts the process group once;
each run's NxdtStrategy finds it started, builds its own mesh on it and leaves it for the next.
One process's runs need no launch at all: conftest runs them in the pytest worker
(`run_jobs(..., in_process=True)`).

Each run's stdout and stderr (file descriptors 1 and 2, so C++ and logging output too) go to
`<out>/<name>/rank<R>.{out,err}`, and its exit status to `rank<R>.rc`. A run that exits other
than expected (0 unless the job says, e.g. 2 for bad input) ends the launch: the other ranks
would wait in a collective for it; torchrun then stops them and `run_pool` names the run.

Used by `conftest.run_pool`; run as `torchrun ... tests/run_pool.py` with NXDT_POOL_JOBS naming
a JSON file {"jobs": [{"name": ..., "argv": [...], "expect": 0}, ...], "out": dir}. A job's
optional "entry" names another module whose `main(argv)` runs it (e.g. "nxdt.tools.evaluate"),
its optional "env" environment variables set for that run only.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from nxdt.parallel import mesh

# as under `python examples/train.py`: the script's directory comes first on sys.path (the
# custom-data-module example is imported from there)
EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


@contextlib.contextmanager
def _captured(out: Path, err: Path, in_process: bool = False):
    """Point file descriptors 1 and 2 (and so sys.stdout/err, logging, C++ prints) at files.
    `in_process` (a pytest worker, whose sys.stdout/err write to pytest's capture files, not to 1
    and 2): sys.stdout/err are writers on descriptors 1 and 2 meanwhile, never closed (a logging
    handler made during the run may keep one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr
    with out.open("w") as o, err.open("w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        if in_process:
            sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                                      for fd in (1, 2))
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _run_one(argv: list[str], entry: str = "nxdt.tools.train", env: dict | None = None) -> int:
    import importlib

    from nxdt.config.load import main_guard

    main = importlib.import_module(entry).main
    environ = dict(os.environ)  # a run's config may set environment variables (apply_env)
    os.environ.update(env or {})
    try:
        return int(main_guard(main)(argv) or 0)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the run's stderr file
        traceback.print_exc()
        return 1
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _end_run_groups() -> None:
    """Destroy the process groups the finished run made on the launch's (its DeviceMesh's axes, its
    checkpointer's and fault tolerance's gloo groups): a run leaves the process group it found, and what
    it built on it, to the caller (nxdt.training.strategy); left alive, every later run carried them
    all (~20 more threads per rank a run: each gloo group has its threads and sockets), and each run of
    a launch took longer than the one before (30 equal tp2 runs: 0.7 CPU-s each at the start, 1.0 at
    the end; 53.5 CPU-s in all against 44.6 with this). DTensor's sharding caches, which match meshes by
    value and would hand a later run this run's meshes (their groups gone), are cleared first; each run
    then fills them again, which is why only the long layouts pool asks for this (measured: layouts
    274.5 -> 243.1 CPU-s; reshard 61.1 -> 64.6 and release 48.1 -> 51.8, within their noise or worse)."""
    world = dist.group.WORLD
    _clear_sharding_prop_cache()
    for group in [g for g in c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)
    mesh._FLAT.clear()  # the runs' meshes (nxdt.parallel.mesh keeps each run's flattened axes)


def run_jobs(spec: dict, rank: int = 0, world: int = 1, in_process: bool = False) -> bool:
    """Run the jobs of `spec` in order on this rank, each one's output and exit status in its folder.
    False as soon as one exits other than expected (the rest are not run). `in_process`: in the
    pytest worker (conftest.run_pool of one process), which the garbage collector's freeze would outlive."""
    for job in spec["jobs"]:
        run_dir = Path(spec["out"]) / job["name"]
        run_dir.mkdir(parents=True, exist_ok=True)
        t0, c0 = time.time(), time.process_time()
        with _captured(run_dir / f"rank{rank}.out", run_dir / f"rank{rank}.err", in_process):
            if os.environ.get("NXDT_POOL_PROFILE") == "cprofile":  # development: each run's cProfile per rank
                import cProfile  # reason: development only

                prof = cProfile.Profile()
                rc = prof.runcall(_run_one, job["argv"], job.get("entry", "nxdt.tools.train"), job.get("env"))
                prof.dump_stats(run_dir / f"rank{rank}.prof")
            else:
                rc = _run_one(job["argv"], job.get("entry", "nxdt.tools.train"), job.get("env"))
        (run_dir / f"rank{rank}.rc").write_text(str(rc))
        if os.environ.get("NXDT_POOL_PROFILE"):
            (run_dir / f"rank{rank}.time").write_text(f"{t0} {time.time()} {c0} {time.process_time()}")
        if rc != job.get("expect", 0):
            sys.stderr.write(f"run_pool: run '{job['name']}' exited {rc} on rank {rank}\n")
            sys.stderr.flush()
            return False
        if world > 1:
            dist.barrier()
            if os.environ.get("NXDT_POOL_END_GROUPS"):  # conftest.run_pool(end_groups=True)
                _end_run_groups()
        if os.environ.get("NXDT_POOL_FREEZE") and not in_process:  # conftest.run_pool(freeze=True)
            # what the run left alive (module caches, compiled graphs, ...) out of the collector's sight: the
            # later runs' full collections scanned it again and again (the 2-rank layouts launch's last 27 runs
            # took 8% less wall and CPU time with this, its first 26 4% less; measured once each). Garbage first.
            gc.collect()
            gc.freeze()
    return True


def main() -> None:
    sys.path.insert(0, EXAMPLES)
    spec = json.loads(Path(os.environ["NXDT_POOL_JOBS"]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    if os.environ.get("NXDT_POOL_PROFILE"):
        Path(spec["out"]).mkdir(parents=True, exist_ok=True)
        (Path(spec["out"]) / f"rank{rank}.start").write_text(f"{time.time()} {time.process_time()}")
    if not run_jobs(spec, rank, world):
        os._exit(1)  # the other ranks may be waiting in a collective: torchrun ends them
    if world > 1:
        dist.destroy_process_group()
    # every run's output is in its files: skip interpreter teardown, where a gloo thread can still
    # abort the process ("terminate called without an active exception") after a successful run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
