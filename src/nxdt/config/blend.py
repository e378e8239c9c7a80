"""The data blend of a config: `data.data_prefix` (NxDT/Megatron) or `data.datasets` + `data.weights`
(fms-fsdp), parsed once into a `DataBlend`. Validation calls `data_blend` (its ConfigError is the
user's message) and the data modules consume the same value, so the two cannot disagree.

    data_prefix: [w1, p1, w2, p2, ...]        weighted paths (without .bin/.idx), split by splits_string
    data_prefix: p   or   [p]                 one path, weight 1
    data_prefix: {train: ..., validation: ..., test: ...}
                                              a blend per split (whole datasets, splits_string unused);
                                              `valid` / `val` are accepted for validation
    datasets: [p1, p2], weights: [w1, w2]     weighted paths (weights default to 1 each)

This module imports only the standard library.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nxdt.config.errors import ConfigError

SPLIT_NAMES = ("train", "validation", "test")
# spellings of a split in the {train, validation, test} form -> the split
SPLIT_ALIASES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                 "test": "test"}

Pairs = tuple[tuple[float, str], ...]


@dataclass(frozen=True)
class DataBlend:
    """A parsed blend: `blend` (weight, path) pairs cut into splits by data.splits_string, or
    `split_blends` (split name -> pairs) for the {train, validation, test} form. Exactly one is set."""

    blend: Pairs | None = None
    split_blends: Mapping[str, Pairs] | None = None

    @property
    def paths(self) -> list[str]:
        """Every path prefix named, in order (a path named twice appears twice)."""
        if self.blend is not None:
            return [p for _, p in self.blend]
        return [p for pairs in (self.split_blends or {}).values() for _, p in pairs]

    def pairs(self, split: str) -> Pairs:
        """The (weight, path) pairs that feed `split` (the whole blend when it is cut by splits_string)."""
        if self.blend is not None:
            return self.blend
        return (self.split_blends or {}).get(split, ())


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _weight(value: Any) -> float | None:
    """A finite non-negative weight (numbers and numeric strings), else None."""
    if isinstance(value, bool):
        return None
    try:
        w = float(value)
    except (TypeError, ValueError):
        return None
    return w if math.isfinite(w) and w >= 0 else None


def _pairs(value: Any, key: str) -> Pairs:
    """A path, [path] or [w, p, w, p, ...] -> (weight, path) pairs with a positive weight sum."""
    if _is_path(value):
        return ((1.0, str(value)),)
    items = list(value) if isinstance(value, Sequence) else None
    if items is not None and len(items) == 1 and _is_path(items[0]):
        return ((1.0, str(items[0])),)
    ok = items is not None and len(items) >= 2 and len(items) % 2 == 0
    pairs = []
    for i in range(0, len(items), 2) if ok else ():
        w, p = _weight(items[i]), items[i + 1]
        if w is None or not _is_path(p):
            ok = False
            break
        pairs.append((w, str(p)))
    if not ok:
        raise ConfigError(f"{key}: expected [weight, path, weight, path, ...], a path, or "
                          f"{{train, validation, test}}, got {_one_line(value)}")
    if sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"{key}: the weights sum to zero")
    return tuple(pairs)


def parse_data_prefix(data_prefix: Any, key: str = "data.data_prefix") -> DataBlend:
    """Parse `data.data_prefix` (see the module docstring); ConfigError naming `key` when malformed.

    Accepts plain containers and OmegaConf ones (anything Mapping / Sequence)."""
    if data_prefix is None:
        raise ConfigError(f"{key}: required for the megatron data module (paths without .bin/.idx)")
    if isinstance(data_prefix, Mapping):
        split_blends: dict[str, Pairs] = {}
        for name, value in data_prefix.items():
            name = str(name)
            if name not in SPLIT_ALIASES:
                close = difflib.get_close_matches(name, SPLIT_NAMES, n=1, cutoff=0.6)
                hint = f" (did you mean '{key}.{close[0]}'?)" if close else ""
                raise ConfigError(f"unknown key '{key}.{name}'{hint}")
            if value is not None:
                split_blends[SPLIT_ALIASES[name]] = _pairs(value, f"{key}.{name}")
        if "train" not in split_blends:
            raise ConfigError(f"{key}.train: the dict form needs a train entry")
        return DataBlend(split_blends=split_blends)
    return DataBlend(blend=_pairs(data_prefix, key))


def parse_datasets(datasets: Sequence[Any] | None, weights: Sequence[Any] | None) -> DataBlend:
    """fms-fsdp's `data.datasets` + `data.weights` (default: 1 each) -> a blend cut by splits_string.

    With `datasets` null only the weights are checked (there is nothing to weigh: empty blend)."""
    names = None if datasets is None else [str(p) for p in datasets]
    if names is not None and weights is not None and len(weights) != len(names):
        raise ConfigError(f"data.weights has {len(weights)} entries but data.datasets has {len(names)}")
    if weights is not None:
        ws = [_weight(w) for w in weights]
        if any(w is None for w in ws) or sum(ws) <= 0:
            raise ConfigError(f"data.weights: {list(weights)} must be non-negative with a positive sum")
    if names is None:
        return DataBlend(blend=())
    if not names:
        raise ConfigError("data.datasets: give at least one dataset (Megatron prefixes without .bin/.idx)")
    ws = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    return DataBlend(blend=tuple(zip(ws, names)))


def data_blend(data: Any) -> DataBlend:
    """The blend a `data` section trains on: `datasets` (+ `weights`) when set, else `data_prefix`
    (ConfigError when neither is set)."""
    if data.datasets is not None:
        return parse_datasets(data.datasets, data.weights)
    return parse_data_prefix(data.data_prefix)
