"""`exp_manager.preemption_signals`: signal names → numbers, one parser for validation and the run.

Names as Slurm and `kill -l` spell them, with or without the SIG prefix, any case ("SIGTERM",
"term", "USR1"). SIGKILL and SIGSTOP cannot be caught, so they are refused rather than listed
and never acted on. Standard library only.
"""

from __future__ import annotations

import signal

from nxdt.config.errors import ConfigError

KEY = "exp_manager.preemption_signals"
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def parse_signals(names, key: str = KEY) -> list[signal.Signals]:
    """The signals named in `names` (in order, without repeats); ConfigError naming the key otherwise."""
    known = {s.name: s for s in signal.Signals if not s.name.startswith("CTRL_")}
    found: list[signal.Signals] = []
    for i, name in enumerate(names or []):
        text = str(name).strip().upper()
        full = text if text.startswith("SIG") else "SIG" + text
        if full in UNCATCHABLE:
            raise ConfigError(f"{key}[{i}]: {full} cannot be caught by a process (it ends it at once); "
                              "use SIGTERM or SIGUSR1 (Slurm: --signal=USR1@120)")
        if full not in known:
            from difflib import get_close_matches

            close = get_close_matches(full, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}[{i}]: '{name}' is not a signal name{hint} (e.g. SIGTERM, SIGUSR1)")
        if known[full] not in found:
            found.append(known[full])
    return found
