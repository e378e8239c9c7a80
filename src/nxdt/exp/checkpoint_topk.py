"""Which checkpoints a run keeps (`checkpoint_callback_params.save_top_k`, `monitor`, `mode`).

By step (`monitor: step`): the newest k. By a logged metric (`monitor: val_loss`,
`reduced_train_loss`, ...): the k best by `mode` (min or max), plus always the newest complete
checkpoint, which a rerun resumes from even when its score is not among the best (so at most
k + 1 are kept). A checkpoint's score is kept in `<checkpoint>/monitor.json`, written by rank 0
once the value is known, so later runs in the same directory rank the same way:

- a training metric (logged by every training step, e.g. `reduced_train_loss`) scores the
  checkpoint when it is written;
- a validation metric (name starting with `val`) scores the checkpoint of the step the
  validation ran at. Lightning validates after that step's save, so the score arrives then;
  checkpoints of steps without validation stay unscored.

An unscored checkpoint (not validated, metric never logged, run killed before the score was
written) is kept only while it is the newest. `monitor.json` is not part of the completeness
contract: a checkpoint is complete (and loadable) without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nxdt.exp.checkpoint_state import write_json

SCORE = "monitor.json"


def is_validation_metric(name: str) -> bool:
    return name.startswith("val")


def write_score(path: Path, monitor: str, value: float, step: int) -> bool:
    """Record `value` for the checkpoint at `path` (or its `.tmp-` directory while an async save
    is in flight: the file then moves with the rename). False when neither exists any more."""
    from nxdt.exp.checkpoint import TMP_PREFIX

    for target in (path, path.parent / f"{TMP_PREFIX}{path.name}"):
        if target.is_dir():
            write_json(target / SCORE, {"monitor": monitor, "value": value, "step": step})
            return True
    return False


def read_score(path: Path, monitor: str) -> float | None:
    """The recorded score of `path` for `monitor`; None when there is none (or for another metric)."""
    try:
        data = json.loads((path / SCORE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("monitor") != monitor:
        return None
    value = data.get("value")
    return float(value) if isinstance(value, (int, float)) else None


def to_keep(found: list[tuple[int, Path]], save_top_k: int, monitor: str | None, mode: str) -> set[Path]:
    """The checkpoints to keep among `found` ((step, path), oldest first, all complete)."""
    if save_top_k < 0 or not found:
        return {p for _, p in found}
    newest = found[-1][1]
    if monitor in (None, "step"):
        return {p for _, p in found[-max(save_top_k, 1):]}
    scored = []
    for step, path in found:
        value = read_score(path, monitor)
        if value is not None:
            # NaN ranks last; on equal scores the newer checkpoint wins
            bad = math.isnan(value)
            scored.append(((bad, value if mode == "min" else -value, -step) if not bad else (bad, 0.0, -step), path))
    best = [p for _, p in sorted(scored, key=lambda sp: sp[0])[:save_top_k]]
    return {newest, *best}
