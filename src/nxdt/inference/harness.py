"""`nxdt evaluate --tasks`: standard benchmarks on a checkpoint through lm-evaluation-harness.

usage: nxdt evaluate --checkpoint CKPT --tasks T1,T2 [--include-path DIR] [--limit N] [--batch-size B]
                     [--num-fewshot K] [--max-gen-toks N] [--log-samples] [--tokenizer DIR] [--base CKPT]
                     [--device D]
       torchrun --nproc_per_node N -m nxdt.cli evaluate --checkpoint CKPT --tasks ...   (tensor parallel)

The checkpoint is loaded as `nxdt generate` loads it (any training layout, LoRA folded in; under
torchrun split over the ranks with tensor parallelism) and put behind the harness's LM interface
(nxdt.inference.harness_lm). Tasks are the harness's own (hellaswag, arc_easy, ...) or task YAMLs
found under --include-path. The results (the harness's JSON; per-example records with
--log-samples) are written beside the checkpoint directory as `<checkpoint>.lm_eval.<tasks>.json`
(rank 0) and a table is printed. lm-evaluation-harness is the optional extra `nxdt[eval]`: without
it, one line and exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nxdt.checkpoint.checkpointer import validate_checkpoint
from nxdt.config.errors import ConfigError
from nxdt.device import accelerator_type
from nxdt.inference.load import load_for_inference, tensor_parallel_group

INSTALL = "lm-evaluation-harness is not installed: install nxdt[eval] (pip install 'nxdt[eval]')"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (main_guard), not argparse's usage block
        raise ConfigError(f"{message} (see nxdt evaluate --tasks --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nxdt evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="an nxdt checkpoint directory")
    g = p.add_argument_group("lm-evaluation-harness")
    g.add_argument("--tasks", required=True, help="comma-separated task (or group) names")
    g.add_argument("--include-path", type=Path, help="a folder of task YAMLs to register as well")
    g.add_argument("--limit", type=float, help="at most N examples per task (a fraction when below 1)")
    g.add_argument("--batch-size", type=int, default=8, help="rows per forward (default 8)")
    g.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's own)")
    g.add_argument("--max-gen-toks", type=int, default=256, help="new tokens when a task does not say (256)")
    g.add_argument("--log-samples", action="store_true", help="also keep each example's requests and responses")
    g.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the checkpoint's)")
    g.add_argument("--base", type=Path, help="base checkpoint of an adapter-only LoRA checkpoint")
    g.add_argument("--device", help="cpu, cuda, ... (default: the accelerator, else cpu)")
    return p


def results_path(checkpoint: Path, tasks: list[str]) -> Path:
    """`<checkpoint>.lm_eval.<t1>+<t2>.json` beside the checkpoint (a long task list: a digest)."""
    name = "+".join(tasks)
    if len(name) > 80:
        name = f"{len(tasks)}tasks-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    checkpoint = checkpoint.absolute()
    return checkpoint.with_name(f"{checkpoint.name}.lm_eval.{name}.json")


def check_args(args: argparse.Namespace) -> list[str]:
    """The task names, after the checks that need nothing loaded."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: give at least one task name")
    if args.include_path is not None and not args.include_path.is_dir():
        raise ConfigError(f"--include-path {args.include_path}: not a directory")
    for flag, value in (("--batch-size", args.batch_size), ("--max-gen-toks", args.max_gen_toks)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be >= 0 (got {args.num_fewshot})")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0 (got {args.limit:g})")
    validate_checkpoint(args.checkpoint)
    return tasks


def _lm_eval():
    """lm_eval and nxdt's LM class, or ConfigError naming the extra."""
    try:
        import lm_eval  # reason: optional extra nxdt[eval], imported only on the --tasks path

        from nxdt.inference.harness_lm import NxdtLM  # reason: it subclasses lm_eval's LM (optional extra)
    except ImportError as err:
        if (err.name or "").split(".")[0] == "lm_eval":
            raise ConfigError(INSTALL) from None
        raise
    return lm_eval, NxdtLM


def task_manager(tasks: list[str], include_path: Path | None = None):
    """The harness's TaskManager that knows `tasks`, or ConfigError naming the unknown ones. When
    --include-path holds every task, the harness's own thousands of YAMLs are not indexed (seconds)."""
    _lm_eval()
    from lm_eval.tasks import TaskManager  # reason: optional extra nxdt[eval]

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):  # tasks, not groups (which may name the harness's tasks)
            return local
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        where = f" (nor under --include-path {include_path})" if include_path is not None else ""
        raise ConfigError(f"--tasks: unknown task {', '.join(missing)}: not one of lm-evaluation-harness's{where}")
    return manager


def evaluate_tasks(lm, tasks: list[str], manager, *, limit: float | None = None, num_fewshot: int | None = None,
                   log_samples: bool = False) -> dict[str, Any]:
    """The harness's results for `lm` (any of its LMs: nxdt's or its own HFLM) on `tasks`, which
    `manager` (task_manager) knows."""
    lm_eval, _ = _lm_eval()
    if limit is not None and limit >= 1:
        limit = int(limit)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                   log_samples=log_samples, bootstrap_iters=0)


def write_results(results: dict[str, Any], path: Path, checkpoint: Path, tasks: list[str]) -> None:
    """The harness's results as JSON (per-example records only when they were asked for)."""
    from lm_eval.utils import handle_non_serializable  # reason: optional extra nxdt[eval]

    kept = dict(results)
    kept["nxdt"] = {"checkpoint": str(checkpoint.absolute()), "tasks": tasks}
    path.write_text(json.dumps(kept, indent=2, default=handle_non_serializable) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    """`nxdt evaluate --tasks ...` (called by nxdt.tools.evaluate under its main_guard)."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    args = build_parser().parse_args([str(a) for a in argv])
    tasks = check_args(args)
    _, NxdtLM = _lm_eval()  # one line before anything loads
    manager = task_manager(tasks, args.include_path)  # an unknown task: said before the model loads
    rank, tp_mesh = tensor_parallel_group()
    device = args.device or accelerator_type() or "cpu"
    if tp_mesh is not None and tp_mesh.device_type == "cpu":
        device = "cpu"
    loaded = load_for_inference(args.checkpoint, device=device, dtype=torch.float32, tokenizer_dir=args.tokenizer,
                                base=args.base, tp_mesh=tp_mesh)
    say = print if rank == 0 else (lambda *a, **k: None)
    for note in loaded.notes:
        say(f"note: {note}", file=sys.stderr)
    lm = NxdtLM(loaded, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks)
    results = evaluate_tasks(lm, tasks, manager, limit=args.limit, num_fewshot=args.num_fewshot,
                             log_samples=args.log_samples)
    if rank == 0:
        from lm_eval.utils import make_table  # reason: optional extra nxdt[eval]

        path = results_path(args.checkpoint, tasks)
        write_results(results, path, args.checkpoint, tasks)
        say(make_table(results))
        say(f"results: {path}")
    if tp_mesh is not None:  # every rank leaves after rank 0 has written
        dist.barrier()
        dist.destroy_process_group()
    return 0
