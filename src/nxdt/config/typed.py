"""The run-time config: a validated, resolved container turned into the schema's dataclasses.

    to_typed(values) -> NxdtConfig       field by field; section mappings become section
                                         instances, everything else is kept as given (plain
                                         lists and dicts: the values are already validated)
    to_container(cfg) -> dict            the inverse, with `data.custom` put back under `data:`
    to_yaml(cfg) -> str                  the YAML a user can rerun with --config-path/--config-name
    select(cfg, "a.b.c")                 a dotted read that fails on a typo (for key tables)

OmegaConf's structured configs are not used: they support neither `Literal` nor `Union`.
This module imports only the standard library and omegaconf (for the YAML dump).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import OmegaConf

from nxdt.config import schema
from nxdt.config.errors import ConfigError

T = TypeVar("T")


def to_typed(values: Mapping[str, Any], cls: type[T] = schema.NxdtConfig, path: str = "") -> T:
    """An instance of schema class `cls` from a plain (resolved) mapping.

    A key left out takes the schema default. A key the schema does not know goes to
    `DataConfig.custom` under `data`, and is a ConfigError anywhere else (validation has
    reported it before, so this only guards hand-made values)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if not schema.is_internal(f)}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in values.items():
        key = str(key)
        if key not in fields:
            extra[key] = value
            continue
        sub = schema.section_class(schema.hints(cls)[key])
        if sub is not None and value is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}{key}: expected a mapping of {sub.__name__} keys, got {value!r}")
            value = to_typed(value, sub, f"{path}{key}.")
        kwargs[key] = value
    if extra:
        if cls is not schema.DataConfig:
            raise ConfigError(f"unknown key '{path}{next(iter(extra))}'")
        kwargs["custom"] = extra
    return cls(**kwargs)


def to_container(cfg: Any) -> dict[str, Any]:
    """`cfg` as plain containers, as the YAML has it (`data.custom` keys back under `data:`)."""
    out = dataclasses.asdict(cfg)
    data = out.get("data")
    if isinstance(data, dict):
        data.update(data.pop("custom", None) or {})
    return out


def to_yaml(cfg: Any) -> str:
    """The resolved YAML of `cfg`; rerunnable with --config-path DIR --config-name NAME."""
    return OmegaConf.to_yaml(OmegaConf.create(to_container(cfg)))


def select(cfg: Any, dotted: str) -> Any:
    """`cfg.a.b.c` for a dotted key (attributes of sections, items of open dicts); a missing
    section attribute raises (a typo in a key table must not read as null). A missing item of
    an open dict, or a null on the way, reads as None."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return None
        if isinstance(node, Mapping):
            node = node.get(part)  # open sections (plain dicts): an absent key is null
        else:
            node = getattr(node, part)
    return node
