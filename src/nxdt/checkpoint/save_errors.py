"""Failed saves: every rank learns of a failure on any rank, and the test hooks that cause one.

A save fails when any rank cannot write (disk full, quota, a read-only or vanished filesystem,
an exception in an asynchronous save's background thread). A rank that raised alone would leave
the others waiting in the next collective, so each phase of a save ends with an agreement: every
rank's error (or None) is gathered and, if there is one, every rank raises the same
`CheckpointSaveError`, naming the checkpoint, the rank and the error in one line. The tensors'
own write (DCP) already agrees this way (its `CheckpointException`). What the run then does,
stop or go on, is `exp_manager.on_checkpoint_error` (nxdt.checkpoint.callbacks).

Test hook (`NXDT_TEST_SAVE_HOOK`, read when a save starts): `<step>:<action>[:<seconds>][@<rank>]`
- `pause:<seconds>`: the tensor writer sleeps after this rank's files are written (a kill lands
  inside the save, deterministically);
- `enospc`: this rank's tensor write fails with "No space left on device".
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

SAVE_HOOK_ENV = "NXDT_TEST_SAVE_HOOK"


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank; raised on every rank with the same message."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"checkpoint save to {path} failed: {message}")
        self.path = Path(path)
        self.reason = message


def describe(err: BaseException) -> str:
    """One line: `OSError: [Errno 28] No space left on device`, with DCP's failing ranks unwrapped."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (cause, _trace) = sorted(err.failures.items())[0]
        return f"rank {rank}: {describe(cause)}"
    return " ".join(f"{type(err).__name__}: {err}".split())[:500]


def attempt(action: Callable[[], object]) -> str | None:
    """Run `action`; None if it worked, else its error in one line (raised errors are not lost:
    they go through `agree`)."""
    try:
        action()
    except Exception as err:  # noqa: BLE001 - every failure of a write is a failed save
        return describe(err)
    return None


def agree(path: Path, error: str | None, group=None, rank: int = 0) -> None:
    """Every rank calls this at the same point; raises CheckpointSaveError on every rank if any
    rank's `error` is set (the lowest failing rank's error is named)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (rank, error), group=group)
        failed = [(r, e) for r, e in gathered if e is not None]
        if failed:
            r, e = min(failed)
            raise CheckpointSaveError(path, e if e.startswith("rank ") else f"rank {r}: {e}")
    elif error is not None:
        raise CheckpointSaveError(path, error)


# --------------------------------------------------------------------------- test hook
def _hook(step: int, rank: int) -> tuple[str, float] | None:
    spec = os.environ.get(SAVE_HOOK_ENV)
    if not spec:
        return None
    spec, _, only_rank = spec.partition("@")
    at, action, *seconds = spec.split(":")
    if int(at) != step or (only_rank and int(only_rank) != rank):
        return None
    return action, float(seconds[0]) if seconds else 0.0


class _HookedWriter(FileSystemWriter):
    action = ""
    seconds = 0.0

    def write_data(self, plan, planner):
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        future = super().write_data(plan, planner)
        future.wait()
        time.sleep(self.seconds)  # this rank's shards are on disk; .metadata and COMPLETE are not
        return future


def writer_class(step: int, rank: int) -> type[FileSystemWriter]:
    """DCP's FileSystemWriter, or under the test hook a writer that pauses or fails at `step`."""
    hook = _hook(step, rank)
    if hook is None:
        return FileSystemWriter
    return type("HookedWriter", (_HookedWriter,), {"action": hook[0], "seconds": hook[1]})
