"""Schema fields and their valid ranges: `doc()` (a field with its default, one line of help and its
metadata), and the range notation the schema, validation and `--help` share.

A schema field gives its range as bounds in `doc(...)` (its field metadata):

    doc(1000, "...", ge=1)                      >= 1
    doc(0.0, "...", ge=0, lt=1)                 in [0, 1)
    doc(-1, "...", ge=0, also=(-1,))            >= 0, or the sentinel -1
    doc(None, "...", ge=1, float_gt=0, float_le=1)
        an int or a float key (a count or a fraction, as trainer.val_check_interval):
        ints >= 1, floats in (0, 1]

`problem(value, bounds)` is the one test (validation's schema walk and `nxdt.config.optim_keys`
call it); `text(bounds)` is how a range reads, in error messages and in `--help`. A list value
has each of its numbers checked. Booleans and non-numbers are the type checker's business.

The reflection the schema's walkers share (`section_class`, `hints`, `type_name`, `type_with_range`:
how a field's type reads in `--help` and errors) lives here too; `nxdt.config.schema` re-exports it.

This module imports only the standard library.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import field, is_dataclass
from typing import Any, Dict, List, Literal, Optional, Union, get_args, get_origin, get_type_hints

BOUNDS = ("ge", "gt", "le", "lt")
_FLOAT = tuple(f"float_{b}" for b in BOUNDS)
KEYS = (*BOUNDS, *_FLOAT, "also")


def doc(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and a one-line description (`help`); `meta` holds its range
    (the bounds above) and flags, read by validation and `--help`."""
    metadata = {"help": help, **meta}
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def has_range(meta: Mapping) -> bool:
    return any(k in meta for k in (*BOUNDS, *_FLOAT))


def bounds_of(meta: Mapping, value: Any = None) -> dict[str, Any]:
    """The bounds that apply to `value`: the float_* ones for a float when the field has them."""
    if isinstance(value, float) and any(k in meta for k in _FLOAT):
        out = {k[len("float_"):]: meta[k] for k in _FLOAT if k in meta}
    else:
        out = {k: meta[k] for k in BOUNDS if k in meta}
    if meta.get("also"):
        out["also"] = tuple(meta["also"])
    return out


def _show(x: Any) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def text(bounds: Mapping) -> str:
    """'>= 1', 'in (0, 1]', '>= 0 or -1'."""
    lo = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    hi = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    if lo and hi:
        out = f"in {lo[0]}{_show(lo[1])}, {_show(hi[1])}{hi[0]}"
    elif lo:
        out = f"{'>=' if lo[0] == '[' else '>'} {_show(lo[1])}"
    elif hi:
        out = f"{'<=' if hi[0] == ']' else '<'} {_show(hi[1])}"
    else:
        out = ""
    extra = " or ".join(_show(a) for a in bounds.get("also", ()))
    return f"{out} or {extra}" if out and extra else out or extra


def _inside(x: float, bounds: Mapping) -> bool:
    if x in bounds.get("also", ()):
        return True
    return not (("ge" in bounds and x < bounds["ge"]) or ("gt" in bounds and x <= bounds["gt"])
                or ("le" in bounds and x > bounds["le"]) or ("lt" in bounds and x >= bounds["lt"]))


def problem(value: Any, meta: Mapping) -> tuple[str, str] | None:
    """(where, 'must be >= 1, got -5') for the first number of `value` outside the range `meta`
    gives (where: '' or, in a list, '[2]'), else None."""
    items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
    for i, x in items:
        if not _number(x):
            continue
        bounds = bounds_of(meta, x)
        if not _inside(x, bounds):
            return ("" if i is None else f"[{i}]"), f"must be {text(bounds)}, got {x}"
    return None


def check(key: str, value: Any, meta: Mapping) -> str | None:
    """The one-line error for `key` ('trainer.max_steps: must be >= 1, got -5'), or None."""
    found = problem(value, meta)
    return None if found is None else f"{key}{found[0]}: {found[1]}"


def describe(type_names: list[tuple[str, bool]], meta: Mapping) -> str:
    """A type with its range for --help: [('int', False), ('float', True), ('null', False)] ->
    'int >= 1 or float in (0, 1] or null' (the flag says: a float)."""
    out = []
    for name, is_float in type_names:
        if name in ("int", "float", "any", "list") and has_range(meta):
            bounds = bounds_of(meta, 0.5 if is_float else 1)
            rng = text(bounds)
            name = f"{name} (each {rng})" if name == "list" else f"{name} {rng}"
        out.append(name)
    return " or ".join(out)


# --------------------------------------------------------------------------- field types
def section_class(hint: Any) -> Optional[type]:
    """The dataclass behind a field type (unwrapping Optional), or None."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint
    if get_origin(hint) is Union:
        for arg in get_args(hint):
            if isinstance(arg, type) and is_dataclass(arg):
                return arg
    return None


_HINTS: Dict[type, Dict[str, Any]] = {}


def hints(cls: type) -> Dict[str, Any]:
    """Resolved type hints of a schema dataclass (cached)."""
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def type_name(hint: Any) -> str:
    """A short human name for a type hint: 'int', 'float or null', 'one of [...]'."""
    origin = get_origin(hint)
    if hint is Any:
        return "any"
    if hint is type(None):
        return "null"
    if origin is Literal:
        return f"one of {list(get_args(hint))}"
    if origin is Union:
        return " or ".join(type_name(a) for a in get_args(hint))
    if origin in (list, List):
        return "list"
    if origin in (dict, Dict):
        return "mapping"
    if isinstance(hint, type) and is_dataclass(hint):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def type_with_range(tname: str, meta: Dict[str, Any]) -> str:
    """'int or null' with the field's range: 'int >= 1 or null' (nxdt.config.ranges)."""
    return describe([(name, name == "float") for name in tname.split(" or ")], meta)
