"""`data.dynamic_data_selection`: the domains of a blend, their reference losses, and the checks.

LLaMA-MoE's `--dynamic_data_selection sheared_llama` (Sheared-LLaMA's dynamic batch loading) moves
the blend's weights during training toward the domains whose held-out loss is furthest above a
reference loss. The domains are the entries of the training blend, in order:

    data_prefix: [w1, path1, w2, path2, ...]    (cut into train/validation/test by data.splits_string)
    datasets: [path1, path2], weights: [w1, w2]  (fms-fsdp)

A domain's held-out samples come from its validation range of `data.splits_string`, so the
`{train, validation, test}` form of data_prefix (whole datasets per split, no per-domain held-out
part) is refused. Its name, in logs and reference-loss mappings, is the last component of its path
(`domain_names`). `reference_losses` is parsed here once, for validation and for the run.

This module imports only the standard library, omegaconf and nxdt.config.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nxdt.config.blend import data_blend
from nxdt.config.data_kind import datamodule_kind
from nxdt.config.errors import ConfigError

KEY = "data.dynamic_selection.reference_losses"


def domain_names(paths: Sequence[str]) -> list[str]:
    """A short, unique name per domain: the path's last component (`#i` appended to repeats)."""
    base = [os.path.basename(os.path.normpath(str(p))) or str(p) for p in paths]
    return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]


def domain_paths(data: Any) -> list[str]:
    """The training blend's paths, in order (ConfigError for the per-split form, which has no
    per-domain held-out range)."""
    blend = data_blend(data)
    if blend.blend is None:
        raise ConfigError("data.dynamic_data_selection: each domain's held-out samples come from its validation "
                          "range of data.splits_string; use data_prefix: [w1, path1, w2, path2, ...] or "
                          "data.datasets instead of the {train, validation, test} form")
    return [p for _, p in blend.blend]


def _read_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{KEY}: file not found: {path}")
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as stream:
                return json.load(stream)
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        raise ConfigError(f"{KEY}: cannot read {path}: {' '.join(str(exc).split())}") from None


def _loss(value: Any, where: str) -> float:
    try:
        loss = float(value)
    except (TypeError, ValueError):
        loss = float("nan")
    if isinstance(value, bool) or not math.isfinite(loss) or loss < 0:
        raise ConfigError(f"{where}: a reference loss must be a finite number >= 0, got {value!r}")
    return loss


def reference_losses(value: Any, paths: Sequence[str]) -> list[float]:
    """One reference loss per domain, in blend order, from a list, a {domain: loss} mapping (domain = a
    path as written or its `domain_names` name) or a JSON/YAML file holding either."""
    where = KEY
    if value is None:
        raise ConfigError(f"{KEY}: required with data.dynamic_data_selection=sheared_llama (one loss per "
                          f"domain: {', '.join(domain_names(paths))})")
    if isinstance(value, str):
        where = f"{KEY} ({value})"
        value = _read_file(value)
    names = domain_names(paths)
    if isinstance(value, Mapping):
        by_key = {str(k): v for k, v in value.items()}
        unknown = [k for k in by_key if k not in names and k not in paths]
        if unknown:
            raise ConfigError(f"{where}: unknown domain '{unknown[0]}' (domains: {', '.join(names)})")
        missing = [n for n, p in zip(names, paths) if n not in by_key and p not in by_key]
        if missing:
            raise ConfigError(f"{where}: no reference loss for domain '{missing[0]}' (domains: {', '.join(names)})")
        return [_loss(by_key[n] if n in by_key else by_key[p], f"{where}.{n}") for n, p in zip(names, paths)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != len(paths):
            raise ConfigError(f"{where}: {len(value)} losses for {len(paths)} domains "
                              f"({', '.join(names)}); give one per domain, in blend order")
        return [_loss(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: expected a list of losses, a {{domain: loss}} mapping or a file, got {value!r}")


def check_dynamic_selection(cfg: Any) -> None:
    """The run-independent checks (validation, before any process starts)."""
    data = cfg.data
    if data.dynamic_data_selection == "none":
        return
    data_kind = datamodule_kind(cfg)
    if data_kind != "logical_shards":
        raise ConfigError(f"data.dynamic_data_selection={data.dynamic_data_selection}: needs a blend of "
                          f"domains (data.data_prefix or data.datasets); this config's data is '{data_kind}'")
    paths = domain_paths(data)
    if len(paths) < 2:
        raise ConfigError(f"data.dynamic_data_selection={data.dynamic_data_selection}: needs at least two "
                          f"domains in the blend, got {len(paths)}")
    reference_losses(data.dynamic_selection.reference_losses, paths)
