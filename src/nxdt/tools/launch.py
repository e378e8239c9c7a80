"""`nxdt train --nproc-per-node N …`: torchrun's launch, after the config is validated here.

    nxdt train --standalone --nproc-per-node 2 --config-name tiny_llama_cpu trainer.max_steps=100
    nxdt train --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --config-name NAME …

torchrun's options come first (any of them: they are torchrun's own parser's), then the training
command line as for `nxdt train` in one process. The config is composed and validated in this
process for the launch's world size (nnodes × nproc-per-node), so a bad key or value is one line
and exit 2 before any worker starts. Then `torch.distributed.run` (torchrun itself, its rendezvous,
restarts and signal handling) starts the workers as `python -m nxdt.cli train …`. A worker that
stops on bad input (exit 2) or a numerical instability (exit 3) has printed its one line (rank 0):
the launcher ends with the same exit code and no report of its own; any other failure is one line
naming the rank and its exit code (the worker's traceback is above it).
"""

from __future__ import annotations

import logging
import signal
import sys

# the options that make `nxdt train` a launcher when they come first (the cheap test: torchrun's
# parser, which imports torch, is read only then)
LAUNCH_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--standalone", "--node-rank",
                  "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                  "--master-addr", "--master_addr", "--master-port", "--master_port", "--max-restarts",
                  "--max_restarts")
# torchrun options nxdt sets itself: the workers run `python -m nxdt.cli train`
OWN = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
# worker exit codes whose one line rank 0 has printed already
ONE_LINE_CODES = (2, 3)


def is_launch(argv: list[str]) -> bool:
    """The command line starts with a torchrun option: launch workers."""
    return bool(argv) and argv[0].split("=", 1)[0] in LAUNCH_OPTIONS


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the training command line): the leading arguments torchrun's parser knows."""
    from torch.distributed.run import get_args_parser  # reason: torch only when launching

    actions = get_args_parser()._option_string_actions
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name = argv[i].split("=", 1)[0]
        action = actions.get(name)
        if action is None or name in OWN or name in ("-h", "--help"):
            break
        i += 1 if (action.nargs == 0 or "=" in argv[i]) else 2
    return argv[:i], argv[i:]


def world_size(torchrun_args) -> int | None:
    """nnodes × nproc-per-node when both are fixed numbers (torchrun's default nnodes is "1:1"; an elastic
    range or `auto`: not known here)."""
    low, _, high = str(torchrun_args.nnodes).partition(":")
    per_node = str(torchrun_args.nproc_per_node)
    if not low.isdigit() or (high and high != low) or not per_node.isdigit():
        return None
    return int(low) * int(per_node)


def launch(argv: list[str], validate) -> int:
    """Validate the training command line with `validate(train_argv, world_size)` (ConfigError: one
    line, exit 2, nothing started), then torchrun's launch of `nxdt train train_argv` on every rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # reason: torch only when launching
    from torch.distributed.run import parse_args, run

    options, train_argv = split_argv(argv)
    args = parse_args([*options, "-m", "nxdt.cli", "train", *train_argv])
    validate(train_argv, world_size(args))
    # torchrun's per-worker failure lines: replaced by the one line below (or by rank 0's own)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        if first.exitcode in ONE_LINE_CODES:
            return first.exitcode
        how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
               else f"exited with code {first.exitcode}")
        print(f"error: rank {rank} {how} (pid {first.pid}); its output is above", file=sys.stderr, flush=True)
        return 1
    return 0
