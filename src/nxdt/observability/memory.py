"""The measured peak memory of a training step, per rank: bytes of live tensors, not the process's RSS.

CUDA: the caching allocator's own count, `max_memory_allocated` (nxdt.device) since fit start
(reset then): every step is covered, for free.

CPU: torch keeps no allocation statistics for CPU tensors (torch.cpu has none; the
torch.accelerator memory API refuses the CPU), so a sampled step runs under torch.profiler with
profile_memory=True, which reports every allocation and free of torch's CPU allocator with its
size. The peak of the step = the bytes live when it starts (every CPU tensor Python can reach,
found through the garbage collector, storages counted once) + the highest running sum of the
allocation events. The previous step's gradients are left out of the starting bytes: the step
frees them first (`optimizer.zero_grad(set_to_none=True)` in nxdt.training.step), and the
profiler cannot report frees of blocks allocated before it started. torch prints one warning
about exactly that ("Memory block of unknown size was allocated before the profiling started")
at the first sampled step. A sampled step runs ~10-20% slower on the tiny demo model (the
profiler records every op); the others are not touched.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterable

import torch
from torch._C._profiler import _ExtraFields_Allocation
from torch.profiler import ProfilerActivity, profile


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage is what this rank holds), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a CPU tensor's storage; None for other devices and storage-less tensors."""
    try:
        t = _local(t)
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):  # meta, sparse, wrapper subclasses
        return None


def live_cpu_storages() -> dict[int, int]:
    """{address: bytes} of every CPU tensor storage reachable from Python now (views and shared
    storages once). Objects frozen by gc.freeze() are not listed: those of the imports before a
    run (nxdt.tools.train.startup_imports); the run's own tensors are made after them."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some module proxies warn about;
        # torch.compile's fake tensors (left for the collector) hold no memory and warn when read
        if issubclass(type(obj), torch.Tensor) and type(obj).__name__ != "FakeTensor":
            found = _storage(obj)
            if found is not None and found[0]:
                storages[found[0]] = max(storages.get(found[0], 0), found[1])
    return storages


def _allocations(profiler) -> list[tuple[int, int, int]]:
    """(time, address, bytes) of the CPU allocator's events in time order (bytes < 0: a free)."""
    found, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    return sorted(found)


def peak_of(start: dict[int, int], events: list[tuple[int, int, int]]) -> int:
    """The highest live bytes over `events`, starting from the storages `start` {address: bytes}.

    A free is matched by address: of a block allocated in the window (its size comes back), of a
    starting storage (its bytes leave), or of neither (ignored: a block the start does not count,
    such as a gradient already left out). Frees of starting blocks the profiler knows no size of
    are not reported at all; those blocks stay counted (the step's own outputs of the previous
    step are small; the previous gradients are left out of `start` by the caller)."""
    live = dict(start)
    window: dict[int, int] = {}
    running = highest = sum(live.values())
    for _, address, nbytes in events:
        if nbytes > 0:
            window[address] = nbytes
            running += nbytes
        elif address in window:
            running -= window.pop(address)
        elif address in live:
            running -= live.pop(address)
        highest = max(highest, running)
    return highest


_primed = False


def _silence_unknown_block_warning() -> None:
    """torch warns once per process, from C++ straight to stderr, when a memory-profiled region
    frees a block allocated before it ("Memory block of unknown size ..."): every sampled step
    does, by design (the start's live bytes are counted separately). Trigger that one warning
    here with stderr pointed at /dev/null, so a run's console does not show it."""
    global _primed
    if _primed:
        return
    _primed = True
    block = torch.empty(1024)
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            del block
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class CpuStepPeak:
    """`begin()` before a step, `end()` after it: the step's peak of live CPU tensor bytes."""

    def __init__(self) -> None:
        self._profiler = None
        self._start: dict[int, int] = {}

    def begin(self, freed_first: Iterable[torch.Tensor] = ()) -> bool:
        """Start measuring; False (nothing started) while another profiler runs (exp_manager.profiler):
        there can be one at a time. `freed_first`: tensors the step frees before it allocates
        anything (the previous gradients): not counted."""
        if torch._C._autograd._profiler_enabled():
            return False
        # kineto prints a "USDT ... profiler_start/stop" line at every start and stop otherwise
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._start = live_cpu_storages()
        for found in map(_storage, freed_first):
            if found is not None:
                self._start.pop(found[0], None)
        _silence_unknown_block_warning()
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return True

    def end(self) -> int | None:
        """Stop; the step's peak bytes (None when begin() started nothing)."""
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        return peak_of(self._start, _allocations(profiler))
