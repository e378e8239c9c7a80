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

Stop signals. SIGTERM and SIGINT (Ctrl-C in the terminal, `kill -TERM -- -PGID`, `timeout`, a
scheduler) are this launcher's, not torchrun's: torchrun's handler raised its `SignalException`,
shut the ranks down with the signal, killed them 30 s later (a large model's save may take longer)
and exited 1 with a traceback after they had saved and exited 0. Here the signal is passed on to
each rank's process group (the rank and its loader workers, as torchrun does), one line says so,
torchrun's agent keeps watching the ranks, and the launch ends with their exit code: 0 once they
have saved (nxdt.training.fault_tolerance). A second Ctrl-C is passed on too: the ranks stop at
once, rank 0 says that nothing was saved, exit 130. The signals torchrun still handles itself
(SIGHUP, SIGQUIT) end in one line, not its traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

# the options that make `nxdt train` a launcher when they come first (the cheap test: torchrun's
# parser, which imports torch, is read only then)
LAUNCH_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--standalone", "--node-rank",
                  "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                  "--master-addr", "--master_addr", "--master-port", "--master_port", "--max-restarts",
                  "--max_restarts")
# torchrun options nxdt sets itself: the workers run `python -m nxdt.cli train`
OWN = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
# worker exit codes whose one line rank 0 has printed already (bad input, an instability, a second Ctrl-C)
ONE_LINE_CODES = (2, 3, 130)
# the stop signals this launcher passes on to the ranks instead of torchrun's handler
FORWARDED = (signal.SIGTERM, signal.SIGINT)


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
    from torch.distributed.elastic.multiprocessing.api import SignalException  # reason: torch only when launching
    from torch.distributed.run import parse_args, run

    options, train_argv = split_argv(argv)
    args = parse_args([*options, "-m", "nxdt.cli", "train", *train_argv])
    validate(train_argv, world_size(args))
    # torchrun's per-worker failure lines: replaced by the one line below (or by rank 0's own)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        with forwarded_stop_signals(args):
            run(args)
    except SignalException as err:  # SIGHUP, SIGQUIT: torchrun's own handling, its ranks stopped with the signal
        print(f"nxdt train: stopped by {err.sigval.name}; the ranks were stopped with it (their lines are above)",
              file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        if first.exitcode in ONE_LINE_CODES:
            return first.exitcode
        how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
               else f"exited with code {first.exitcode}")
        print(f"error: rank {rank} {how} (pid {first.pid}); its output is above", file=sys.stderr, flush=True)
        return 1
    return 0


def rank_processes() -> list[int]:
    """This launcher's live worker processes (`python -m nxdt.cli train …`, each the leader of a
    process group of its own: torchrun starts them with start_new_session), from /proc."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                if b"nxdt.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                continue  # ended meanwhile
    return pids


class forwarded_stop_signals:
    """While torchrun's launch runs: SIGTERM and SIGINT are passed on to each rank's process group,
    with one line (torchrun, told by its --signals-to-handle, leaves them to this handler)."""

    def __init__(self, args) -> None:
        """`args`: torchrun's parsed arguments; their --signals-to-handle loses SIGTERM and SIGINT."""
        self.received: list[signal.Signals] = []  # the signals passed on so far
        names = {sig.name for sig in FORWARDED}
        args.signals_to_handle = ",".join(n for n in (n.strip() for n in args.signals_to_handle.split(","))
                                          if n and n not in names)

    def __enter__(self):
        # signal handlers belong to the main thread (elsewhere torchrun registers none either)
        main = threading.current_thread() is threading.main_thread()
        self.before = {sig: signal.signal(sig, self.on_signal) for sig in FORWARDED} if main else {}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)

    def on_signal(self, signum, _frame) -> None:
        sig, ranks = signal.Signals(signum), rank_processes()
        self.received = [*self.received, sig]
        for pid in ranks:
            try:
                os.killpg(pid, sig)
            except OSError:  # ended meanwhile
                pass
        how = "Ctrl-C" if sig == signal.SIGINT else sig.name
        # the ranks' rule (nxdt.training.fault_tolerance): any stop signal after a Ctrl-C stops at once
        then = ("they save at the end of the current step and exit" if len(self.received) == 1 else
                "they stop at once, without saving" if signal.SIGINT in self.received[:-1] else
                "their save goes on")
        # os.write: the handler may interrupt a print of the main thread
        os.write(2, f"nxdt train: {'again: ' * (len(self.received) > 1)}{how} passed on to the {len(ranks)} "
                    f"rank(s): {then}\n".encode())
