"""Workers end with their launcher.

torchrun starts each rank in a session of its own, so a `kill -9` of torchrun (an OOM killer, a
careless `kill` of its process group) ends the launcher but not the ranks: they live on as
orphans, holding memory and the run's files, asleep in a collective or still training. A relaunch
into the same directory would then share it with them.

So every rank started by a launcher (torchrun, or Lightning's own subprocess launcher: `LOCAL_RANK`
is set) watches its parent: a daemon thread compares `os.getppid()` with the launcher's pid once a
second. When the launcher is gone the rank was re-parented (to init, or a subreaper), and it
exits at once with `os._exit`: no cleanup handlers, nothing further written (a checkpoint it was
writing stays a `.tmp-` directory, which no resume picks up). A rank that is saving for a
preemption signal finishes that save first: the launcher of a preempted job may be ended by the
same signal (nxdt.training.fault_tolerance). A rank stopping for Ctrl-C does not: the launcher
gone after a Ctrl-C means a second one ended torchrun, which asks to stop at once; rank 0 says
that nothing was saved.
"""

from __future__ import annotations

import os
import threading

from nxdt.config.load import started_by_launcher

POLL_S = 1.0
_started = False
preemption_save_in_progress = threading.Event()
interrupted = threading.Event()  # a Ctrl-C (SIGINT) reached this rank during the run


def watch_launcher() -> bool:
    """Start the watchdog once per process (ranks started by a launcher only); True if it runs."""
    global _started
    if _started or not started_by_launcher():
        return _started
    launcher = os.getppid()
    if launcher <= 1:  # already orphaned (or started by init): nothing to watch
        return False

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if os.getppid() != launcher and not preemption_save_in_progress.is_set():
                rank = os.environ.get("RANK", "?")
                line = f"nxdt rank {rank}: the launcher (pid {launcher}) is gone; exiting\n"
                if interrupted.is_set():
                    line = "" if rank != "0" else ("interrupted again (second Ctrl-C; the launcher is gone): stopped "
                                                   "at once, nothing was saved\n")
                try:
                    os.write(2, line.encode())
                except OSError:
                    pass
                os._exit(130 if interrupted.is_set() else 1)

    threading.Thread(target=watch, name="nxdt-launcher-watchdog", daemon=True).start()
    _started = True
    return True
