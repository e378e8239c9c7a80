"""One writer per experiment directory: `<log_dir>/nxdt.lock`, held while a run lives.

A job submitted twice, or a resume launched while the first run still trains, would otherwise
write checkpoints and logs into the same folders. So before a run writes anything, global rank 0
takes the lock: a JSON file naming the holder (host, pid and the pid's start time, the launcher's
pid and run id, when it started, the command). A background thread refreshes the file's mtime
(the heartbeat) every `lease / 4` seconds; the lock is removed when the run ends.

A second launch finds the lock and exits 2 with one line naming the holder, unless the holder
is gone:
- on this host: its pid is no longer running (or is another process that reuses the number:
  the recorded start time tells them apart), e.g. after `kill -9`;
- on another host: no heartbeat for `exp_manager.run_lock_lease` seconds.
Such a stale lock is taken over with a one-line notice. The other ranks only read the lock:
they refuse a live holder that is not their own launch (another run id, another launcher), so
no rank of a second launch writes anything either.

Taking the lock is serialized by an flock on the log dir (two launches starting at once on one
host: one wins), and the lock file is written whole (tmp + rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.load import started_by_launcher
from nxdt.exp.exp_manager import process_start_ticks

LOCK = "nxdt.lock"


def _pid_alive(pid: int, start: int | None) -> bool:
    if start is not None and Path("/proc").is_dir():
        return process_start_ticks(pid) == start  # gone, or the number reused by a later process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "none") or "none"


def holder_record(command: list[str] | None = None) -> dict[str, Any]:
    """What a lock taken by this process says about its holder."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": process_start_ticks(pid),
        "launcher_pid": os.getppid() if started_by_launcher() else None,
        "run_id": _run_id(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join(command if command is not None else [sys.executable, *sys.argv]),
    }


def describe(holder: dict[str, Any]) -> str:
    command = str(holder.get("command"))
    command = command if len(command) <= 160 else command[:157] + "..."
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: {command}"


@dataclass
class LockState:
    holder: dict[str, Any]
    age_s: float  # seconds since the last heartbeat

    def held_by_me(self) -> bool:
        return self.holder.get("host") == socket.gethostname() and self.holder.get("pid") == os.getpid()

    def same_launch(self) -> bool:
        """Taken under the same launcher run id: this launch, an earlier attempt of it (torchrun's
        restarts), or an earlier instance of the same Slurm job (requeued; --rdzv-id=$SLURM_JOB_ID)."""
        return self.holder.get("run_id") not in (None, "none") and self.holder.get("run_id") == _run_id()

    def is_ours(self) -> bool:
        """Held by this process, or by a rank of the launch this process belongs to."""
        h, here = self.holder, socket.gethostname()
        if self.held_by_me() or self.same_launch():
            return True
        # the holder is our launcher's rank 0 (torchrun on this host), or our parent (Lightning's launcher)
        return h.get("host") == here and started_by_launcher() and os.getppid() in (h.get("launcher_pid"), h.get("pid"))

    def is_stale(self, lease_s: float) -> bool:
        h = self.holder
        if h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int):
            return not _pid_alive(h["pid"], h.get("pid_start"))
        return self.age_s > lease_s


def read_lock(log_dir: Path) -> LockState | None:
    """The lock in `log_dir`, None when there is none; ConfigError when it cannot be parsed."""
    path = Path(log_dir) / LOCK
    try:
        text = path.read_text(encoding="utf-8")
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"run lock {path} cannot be read: {err}") from None
    try:
        holder = json.loads(text)
        if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
            raise ValueError("not a holder record")
    except ValueError as err:
        raise ConfigError(f"run lock {path} cannot be parsed ({err}); if no run uses {log_dir}, delete "
                          f"{LOCK} and launch again") from None
    return LockState(holder, age)


def check_run_lock(log_dir: Path, lease_s: float) -> None:
    """Ranks other than 0: refuse (ConfigError) a live lock held by another launch; write nothing."""
    state = read_lock(log_dir)
    if state is not None and not state.is_ours() and not state.is_stale(lease_s):
        raise _busy(log_dir, state)


def _busy(log_dir: Path, state: LockState) -> ConfigError:
    return ConfigError(f"log dir {log_dir} is in use by another run ({describe(state.holder)}); wait for it to "
                       f"end, or set exp_manager.explicit_log_dir to another directory")


class RunLock:
    """The lock rank 0 holds on a log dir (`acquire`), with its heartbeat; `release()` at the end."""

    def __init__(self, log_dir: Path, lease_s: float) -> None:
        self.path = Path(log_dir) / LOCK
        self.lease_s = float(lease_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, log_dir: Path, lease_s: float, command: list[str] | None = None,
                notice=print) -> "RunLock":
        """Take the lock (ConfigError: held by a live run, unreadable, or the log dir not writable)."""
        log_dir = Path(log_dir)
        lock = cls(log_dir, lease_s)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            with _guarded(log_dir):
                state = read_lock(log_dir)
                if state is not None and not state.held_by_me():
                    if state.same_launch():
                        notice(f"note: taking over the run lock of an earlier attempt of run {_run_id()} "
                               f"({describe(state.holder)})")
                    elif state.is_stale(lease_s):
                        notice(f"note: taking over the run lock of a run that is gone ({describe(state.holder)})")
                    else:
                        raise _busy(log_dir, state)
                tmp = lock.path.with_name(f".{LOCK}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(holder_record(command), indent=1) + "\n", encoding="utf-8")
                os.replace(tmp, lock.path)
        except OSError as err:
            raise ConfigError(f"exp_manager: cannot write to the log dir {log_dir}: {err.strerror or err} "
                              f"(set exp_manager.explicit_log_dir or exp_manager.exp_dir to a writable place)") from None
        lock._start_heartbeat()
        return lock

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(max(self.lease_s / 4, 1.0)):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="nxdt-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError, ConfigError):
            state = read_lock(self.path.parent)
            if state is not None and state.holder.get("pid") == os.getpid():
                self.path.unlink()


@contextlib.contextmanager
def _guarded(directory: Path):
    """An exclusive flock on the directory itself (Linux allows flock on a directory's fd; where the
    filesystem or OS does not, no guard)."""
    try:  # fcntl is POSIX only
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock
