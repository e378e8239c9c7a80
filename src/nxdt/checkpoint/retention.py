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
import re
import warnings
from pathlib import Path
from typing import Any

from nxdt.checkpoint.checkpointer import TMP_PREFIX, validate_checkpoint
from nxdt.checkpoint.state import write_json
from nxdt.config.errors import ConfigError

SCORE = "monitor.json"
LAST = "last"


def is_validation_metric(name: str) -> bool:
    return name.startswith("val")


def write_score(path: Path, monitor: str, value: float, step: int) -> bool:
    """Record `value` for the checkpoint at `path` (or its `.tmp-` directory while an async save
    is in flight: the file then moves with the rename). False when neither exists any more."""
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


# --------------------------------------------------------------------------- names and listing
_FIELD = re.compile(r"\{(\w+)(:[^}]*)?\}")


def format_checkpoint_name(template: str, **values: Any) -> str:
    """`megatron_llama--{step}-{consumed_samples}` → `megatron_llama--step=200-consumed_samples=204800.0`."""

    def fill(match: re.Match) -> str:
        key, spec = match.group(1), match.group(2) or ""
        if key not in values:
            raise ConfigError(
                f"exp_manager.checkpoint_callback_params.filename: unknown field '{{{key}}}' "
                f"(known: {', '.join('{' + k + '}' for k in values)})"
            )
        return f"{key}=" + format(values[key], spec[1:])

    name = _FIELD.sub(fill, template)
    if "/" in name or name.startswith(".") or name == LAST:
        raise ConfigError(f"exp_manager.checkpoint_callback_params.filename: '{template}' gives an invalid name '{name}'")
    return name


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not), without temporaries and the `last` link."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.iterdir()
                  if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def complete_checkpoints(checkpoint_dir: Path, warn: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of every complete, readable checkpoint, oldest first. Others are skipped with
    a warning and left in place."""
    found = []
    for path in list_checkpoints(checkpoint_dir):
        try:
            meta = validate_checkpoint(path)
        except ConfigError as err:
            if warn:
                warnings.warn(f"skipping checkpoint {path.name}: {err}", stacklevel=2)
            continue
        found.append((int(meta.get("step", 0)), path))
    if warn and checkpoint_dir.is_dir():
        for tmp in checkpoint_dir.glob(f"{TMP_PREFIX}*"):
            warnings.warn(f"skipping {tmp.name}: a save that did not finish (left in place)", stacklevel=2)
    return sorted(found, key=lambda sp: (sp[0], sp[1].stat().st_mtime))
