"""Checks a composed config; every problem is a one-line ConfigError naming the dotted key.

Stages (in this order):
1. `check_schema`: unknown keys (with did-you-mean), types, enumerations, then the range of
   every number (the schema's `ge=`/`gt=`/... , `nxdt.config.ranges`; keys given directly before
   keys filled by an interpolation, so the key the user set is the one named); coerces values
   in place (ints and numeric strings such as "3e-4" to floats for float keys) and normalises
   (the string 'None' -> null, fms-fsdp's comma strings and data.eos_token, vpp null -> 1,
   sequence_parallel off when tp == 1, megatron defaults,
   NxDT's recompute class names, sched.max_steps);
   `model.optim` by `nxdt.config.optim_keys` (names, keys, ranges, the schedule's steps).
2. `NOT_SUPPORTED_YET` (`nxdt.config.inert`): values the schema accepts but nxdt does not build yet.
3. Cross-checks: world size, parallel layout and batch sizes, attention heads, sequence length.
4. Paths named by the config (`check_paths`): files exist, log dirs can be made.

`validate` returns the config as an `NxdtConfig` (stages 2-4 read typed attributes) and appends
the notices (one line each) the caller should print once to its `notices` list, among them the
settings that have no effect in this run (`nxdt.config.inert.inert_notice`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nxdt.config import ranges, resolvers, schema
from nxdt.config.errors import ConfigError
from nxdt.config.schema import canonical_gate_type, canonical_recompute_classes
from nxdt.config.inert import NOT_SUPPORTED_YET
from nxdt.config.optim_keys import check_optim, sched_rules
from nxdt.config.typed import select, to_typed



def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, ListConfig)):
        return "list"
    if isinstance(value, (dict, DictConfig)):
        return "mapping"
    return type(value).__name__


# --------------------------------------------------------------------------- type checking
_FAIL = object()


def _coerce(value: Any, hint: Any) -> Any:
    """`value` converted to `hint`, or _FAIL."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if hint is type(None):
        return None if value is None else _FAIL
    if origin is Union:
        args = get_args(hint)
        # typing caches a Union by its set of types: Union[int, float] may come back as a
        # Union[float, int] some other module made first (seen with torch 2.11 / transformers 5 on
        # a GPU machine: val_check_interval 100 read as 100.0). A value of one of the types is kept
        # as it is before any conversion is tried, whatever the order.
        exact = tuple(a for a in args if isinstance(a, type) and type(value) is a)
        for arg in (*exact, *args):
            out = _coerce(value, arg)
            if out is not _FAIL:
                return out
        return _FAIL
    if origin is Literal:
        choices = get_args(hint)
        if isinstance(value, str) and value in choices:
            return value
        if isinstance(value, bool) and all(isinstance(c, str) for c in choices):
            alt = "1" if value else "0"
            return alt if alt in choices else _FAIL
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value in choices and not isinstance(value, str):
                return value
            alt = str(int(value)) if float(value).is_integer() else str(value)
            return alt if alt in choices else _FAIL
        return _FAIL
    if hint is bool:
        return value if isinstance(value, bool) else _FAIL
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _FAIL
    if hint is float:
        if isinstance(value, bool):
            return _FAIL
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                return _FAIL
        return _FAIL
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return _FAIL
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _FAIL
        (elem,) = get_args(hint) or (Any,)
        out = []
        for item in value:
            c = _coerce(item, elem)
            if c is _FAIL:
                return _FAIL
            out.append(c)
        return out
    if origin is dict:
        return value if isinstance(value, dict) else _FAIL
    return value  # unknown hint kinds are not checked


def _check_value(value: Any, hint: Any, path: str) -> Any:
    plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    out = _coerce(plain, hint)
    if out is _FAIL:
        # element-level message for lists of a simple type
        if get_origin(hint) is Union and type(None) in get_args(hint):
            inner = [a for a in get_args(hint) if a is not type(None)]
            hint_for_msg = inner[0] if len(inner) == 1 else hint
        else:
            hint_for_msg = hint
        if get_origin(hint_for_msg) is list and isinstance(plain, list):
            (elem,) = get_args(hint_for_msg) or (Any,)
            for i, item in enumerate(plain):
                if _coerce(item, elem) is _FAIL:
                    raise ConfigError(f"{path}[{i}]: expected {schema.type_name(elem)}, got {item!r} ({_type_of(item)})")
        raise ConfigError(f"{path}: expected {schema.type_name(hint_for_msg)}, got {plain!r} ({_type_of(plain)})")
    return out


def _walk(node: DictConfig, cls: type, path: str, free_extra: bool = False, numbers: list | None = None) -> None:
    """Check `node` against the schema class `cls`; collect (dotted key, value, field metadata) of
    every value with a range into `numbers` (checked by `_check_ranges` once all types are known)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if not schema.is_internal(f)}
    hints = schema.hints(cls)
    prefix = f"{path}." if path else ""
    for key in list(node.keys()):
        key = str(key)
        dotted = prefix + key
        if key not in fields:
            if free_extra:
                continue
            if path == "model.moe" and key in schema.LLAMA_MOE_NOT_BUILT:
                raise ConfigError(f"'{dotted}' (LLaMA-MoE's {key}) is not supported yet: {schema.LLAMA_MOE_NOT_BUILT[key]}")
            raise ConfigError(f"unknown key '{dotted}'{did_you_mean(key, fields, prefix)}")
        hint = hints[key]
        value = node[key]
        sub = schema.section_class(hint)
        if sub is not None:
            if value is None and _optional(hint):
                continue
            if not isinstance(value, DictConfig):
                raise ConfigError(f"{dotted}: expected a mapping of {sub.__name__} keys, got {value!r} ({_type_of(value)})"
                                  + section_value_hint(dotted, value, sub))
            _walk(value, sub, dotted, numbers=numbers)
            continue
        new = _check_value(value, hint, dotted)
        old = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
        if new is not None and (type(new) is not type(old) or new != old):
            node[key] = new
        if numbers is not None and ranges.has_range(fields[key].metadata):
            numbers.append((dotted, new, fields[key].metadata))


def _check_ranges(numbers: list, interpolated: set[str]) -> None:
    """The first number out of its range, as one ConfigError; a key the user set is named before
    a key that merely follows it by interpolation (data.seq_length follows model.encoder_seq_length)."""
    for dotted, value, meta in sorted(numbers, key=lambda n: n[0] in interpolated):
        message = ranges.check(dotted, value, meta)
        if message:
            raise ConfigError(message)


def check_typed_ranges(cfg: schema.NxdtConfig) -> None:
    """The range of every number of a typed config (one built or changed in code, not composed)."""
    _check_ranges([(key, select(cfg, key), meta) for key, _t, _d, _h, meta in schema.iter_fields()
                   if ranges.has_range(meta)], set())


def _interpolated(node: Any, prefix: str = "") -> set[str]:
    """Dotted keys whose value is an interpolation (before resolving)."""
    out: set[str] = set()
    if not isinstance(node, DictConfig):
        return out
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key):
            out.add(dotted)
        else:
            try:
                child = node[key]
            except OmegaConfBaseException:  # a missing value (???): the type check reports it
                continue
            if isinstance(child, DictConfig):
                out |= _interpolated(child, dotted + ".")
    return out


def _resolve(cfg: DictConfig) -> None:
    resolvers.register()
    try:
        OmegaConf.resolve(cfg)
    except (OmegaConfBaseException, ValueError, TypeError, ArithmeticError) as err:
        key = getattr(err, "full_key", None) or _bad_interpolation_key(cfg)
        where = f" at '{key}'" if key else ""
        raise ConfigError(f"cannot resolve interpolation{where}: {_one_line(str(err).splitlines()[0])}") from None


def _bad_interpolation_key(node: Any, prefix: str = "") -> str | None:
    """Dotted key of the first value whose interpolation fails to resolve."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        dotted = f"{prefix}.{key}" if prefix else str(key)
        try:
            value = node[key]
        except Exception:  # noqa: BLE001 - any failure locates the key
            return dotted
        if isinstance(value, (DictConfig, ListConfig)):
            found = _bad_interpolation_key(value, dotted)
            if found:
                return found
    return None


_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _numbers_from_strings(node: DictConfig) -> None:
    """In model.optim / sched, a number written as a string ("3e-4") becomes a float."""
    for key in list(node.keys()):
        value = node[key]
        if isinstance(value, DictConfig):
            _numbers_from_strings(value)
        elif isinstance(value, ListConfig):
            for i, item in enumerate(value):
                if isinstance(item, str) and _NUMBER.fullmatch(item):
                    value[i] = float(item)
        elif isinstance(value, str) and key != "name" and _NUMBER.fullmatch(value):
            node[key] = float(value)


def _none_strings(node: DictConfig | ListConfig) -> None:
    """A value written `None` (NxDT's configs: `sinkhorn_tol: None`) is YAML's string 'None'; NxDT's
    Python reads it as None, so it becomes null here, once, before the types are checked."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in list(keys):
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            _none_strings(value)
        elif isinstance(value, str) and value.strip() == "None":
            node[key] = None


def _set(node: DictConfig, key: str, value: Any) -> None:
    with open_dict(node):
        node[key] = value


def _comma_list(node: DictConfig, key: str, kind: type) -> None:
    """fms-fsdp's comma-string form of a list ('a,b,c', '7725,500', '' = empty) -> the list."""
    value = node.get(key)
    if not isinstance(value, str):
        return
    items = [item.strip() for item in value.split(",") if item.strip()]
    if kind is str:
        _set(node, key, items)
        return
    out = []
    for i, item in enumerate(items):
        try:
            number = kind(float(item)) if kind is int else float(item)
            if kind is int and float(item) != number:
                raise ValueError(item)
        except ValueError:
            raise ConfigError(f"data.{key}: item {i} of '{value}' is not {'an integer' if kind is int else 'a number'}"
                              f": '{item}'") from None
        out.append(number)
    _set(node, key, out)


def _fms_data_forms(data: DictConfig) -> None:
    """fms-fsdp's comma strings under data: datasets, weights, strip_tokens."""
    _comma_list(data, "datasets", str)
    _comma_list(data, "weights", float)
    _comma_list(data, "strip_tokens", int)


def _eos_alias(data: DictConfig) -> None:
    """data.eos_token (fms-fsdp's name of sep_token, range-checked already) -> data.sep_token."""
    eos, sep = data.get("eos_token"), data.get("sep_token")
    if eos is None or isinstance(eos, bool) or not isinstance(eos, int):
        return  # absent, or the type check names it
    if sep is None:
        _set(data, "sep_token", eos)
    elif sep != eos:
        raise ConfigError(f"data.eos_token ({eos}) and data.sep_token ({sep}) differ: eos_token is fms-fsdp's name "
                          "of sep_token; give one of them")


def check_schema(cfg: DictConfig) -> list[str]:
    """Unknown keys, types and enumerations; coerces and normalises `cfg` in place. Returns notices."""
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config must be a mapping, got {_type_of(cfg)}")
    interpolated = _interpolated(cfg)
    _resolve(cfg)
    _none_strings(cfg)
    data = cfg.get("data")
    if isinstance(data, DictConfig):
        _fms_data_forms(data)
    free_data = isinstance(data, DictConfig) and data.get("data_module") is not None
    # with a custom data module, extra keys under data are free (known keys are still checked)
    numbers: list = []
    _walk_top(cfg, free_data, numbers)
    _check_ranges(no_step_limit(cfg, numbers), interpolated)
    if isinstance(data, DictConfig):
        _eos_alias(data)
    notices: list[str] = []

    ds = cfg.distributed_strategy
    if ds.virtual_pipeline_model_parallel_size is None:
        ds.virtual_pipeline_model_parallel_size = 1
    if ds.sequence_parallel and ds.tensor_model_parallel_size == 1:
        ds.sequence_parallel = False
        notices.append("distributed_strategy.sequence_parallel needs tensor_model_parallel_size > 1: turned off")

    model = cfg.model
    if cfg.model_source == "megatron":
        if model.max_position_embeddings is None:
            model.max_position_embeddings = model.encoder_seq_length
        if model.num_kv_heads is None and model.num_attention_heads is not None:
            model.num_kv_heads = model.num_attention_heads
    if model.moe.num_selects is not None:
        model.moe.top_k = model.moe.num_selects
    model.moe.gate_type = canonical_gate_type(model.moe.gate_type)
    if model.activations_checkpoint_recompute:
        model.activations_checkpoint_recompute = canonical_recompute_classes(model.activations_checkpoint_recompute)

    steps_from_tokens(cfg.trainer, cfg.data, notices)

    optim = model.optim
    _numbers_from_strings(optim)
    sched = optim.get("sched")
    if isinstance(sched, DictConfig) and sched.get("max_steps") is None:
        _set(sched, "max_steps", cfg.trainer.max_steps)
    plain_optim = OmegaConf.to_container(optim, resolve=True)
    _check_optim(plain_optim)
    notices.extend(sched_rules(plain_optim, path="model.optim"))
    return notices


def no_step_limit(cfg: DictConfig, numbers: list) -> list:
    """trainer.max_steps=-1 (Lightning's "no step limit") beside trainer.max_tokens: the token budget
    ends the run (steps_from_tokens sets max_steps), so -1 is not checked as a step count; without
    a budget it is refused, saying what -1 needs. `numbers`: less max_steps where it is -1."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig) or trainer.get("max_steps") != -1:
        return numbers
    if trainer.get("max_tokens") is None:
        raise ConfigError("trainer.max_steps: must be >= 1, got -1 (Lightning's 'no step limit': nxdt runs need "
                          "an end it can plan the lr schedule and the ETA from; give trainer.max_steps=N, or "
                          "trainer.max_tokens=T with max_steps -1 or left out)")
    return [n for n in numbers if n[0] != "trainer.max_steps"]


def steps_from_tokens(trainer, data, notices: list[str]) -> None:
    """trainer.max_tokens -> trainer.max_steps = ceil(max_tokens / tokens per global batch), with a notice
    (LLaMA-MoE plans in tokens: 10^11 / (block_size x global batch)). The token budget wins over a
    max_steps given beside it, which the notice names."""
    if trainer.max_tokens is None:
        return
    if any(n.startswith(f"trainer.max_tokens={trainer.max_tokens}:") for n in notices):
        return  # validation runs the schema stage again on the composed config: said once
    per_step = int(data.global_batch_size) * int(data.seq_length)
    steps = -(-int(trainer.max_tokens) // per_step)
    replaced = (" (max_steps -1: no step limit, the token budget ends the run)" if trainer.max_steps == -1 else
                f" (instead of {trainer.max_steps})" if trainer.max_steps != steps else "")
    trainer.max_steps = steps
    notices.append(f"trainer.max_tokens={trainer.max_tokens}: max_steps {steps}{replaced} = ceil(max_tokens / "
                   f"(global batch {data.global_batch_size} x seq_length {data.seq_length} = {per_step} tokens/step))")


def _walk_top(cfg: DictConfig, free_data: bool, numbers: list) -> None:
    fields = {f.name: f for f in dataclasses.fields(schema.NxdtConfig)}
    hints = schema.hints(schema.NxdtConfig)
    for key in list(cfg.keys()):
        key = str(key)
        if key not in fields:
            raise ConfigError(f"unknown key '{key}'{did_you_mean(key, fields)}")
        sub = schema.section_class(hints[key])
        value = cfg[key]
        if sub is None:
            new = _check_value(value, hints[key], key)
            if not isinstance(value, (DictConfig, ListConfig)) and new is not None and (
                    type(new) is not type(value) or new != value):
                cfg[key] = new
            if ranges.has_range(fields[key].metadata):
                numbers.append((key, new, fields[key].metadata))
            continue
        if value is None and _optional(hints[key]):
            continue
        if not isinstance(value, DictConfig):
            raise ConfigError(f"{key}: expected a mapping, got {value!r} ({_type_of(value)})"
                              + section_value_hint(key, value, sub))
        _walk(value, sub, key, free_extra=(key == "data" and free_data), numbers=numbers)


def section_value_hint(dotted: str, value: Any, sub: type) -> str:
    """A value given to a section (`precision=bf16`): the section's key meant, by its choices: its
    `type` or `name` key (`did you mean precision.type=bf16SR?` and the choices), else a key whose
    choices hold the value; "" when none fits."""
    hints = schema.hints(sub)
    literal = {}
    for f in dataclasses.fields(sub):
        hint = hints.get(f.name)
        if hint is not None and _optional(hint):
            hint = next(a for a in get_args(hint) if a is not type(None))
        if not schema.is_internal(f) and get_origin(hint) is Literal:  # Literal[TUPLE] too
            literal[f.name] = [str(c) for a in get_args(hint) for c in (a if isinstance(a, tuple) else (a,))]
    for name in ("type", "name"):
        if name in literal:
            close = difflib.get_close_matches(str(value), literal[name], n=1, cutoff=0.5)
            meant = f"did you mean {dotted}.{name}={close[0]}? " if close else ""
            return f"; {dotted} is a section: {meant}{dotted}.{name} is one of {', '.join(literal[name])}"
    for name, choices in literal.items():
        if str(value) in choices:
            return f"; {dotted} is a section: did you mean {dotted}.{name}={value}?"
    return ""


def _optional(hint: Any) -> bool:
    return get_origin(hint) is Union and type(None) in get_args(hint)


def _check_optim(optim: Any) -> None:
    check_optim(optim, path="model.optim")


# --------------------------------------------------------------------------- not supported yet
def check_not_supported(cfg: Any) -> None:
    """Raise `'<key>' is not supported yet` for the first NOT_SUPPORTED_YET entry that matches."""
    for key, predicate in NOT_SUPPORTED_YET.items():
        value = select(cfg, key)
        if predicate(value):
            shown = value if not isinstance(value, (dict, list)) else _one_line(value)
            raise ConfigError(f"'{key}' is not supported yet (got {shown})")


# --------------------------------------------------------------------------- entry
def validate(cfg: DictConfig | schema.NxdtConfig, check_supported: bool = True,
             notices: list[str] | None = None) -> schema.NxdtConfig:
    """The schema's checks of a composed config (stages 1-2 above); raise ConfigError on the first
    problem; return it typed. The cross-checks and paths (stages 3-4) are the spec's
    (`nxdt.spec.validate`), which calls this first.

    A DictConfig is schema-checked (coerced/normalised in place) and converted to an
    `NxdtConfig` (nxdt.config.typed); an `NxdtConfig` has its ranges re-checked as is.
    `notices`: if given, one-line notices (e.g. sequence_parallel turned off) are appended to it,
    for the caller to print once.
    """
    if isinstance(cfg, schema.NxdtConfig):
        typed = cfg
        check_typed_ranges(typed)
    elif isinstance(cfg, DictConfig):
        found = check_schema(cfg)
        if notices is not None:
            notices.extend(found)
        typed = to_typed(OmegaConf.to_container(cfg, resolve=True))
    else:
        raise ConfigError("validate() expects an OmegaConf DictConfig")
    if check_supported:
        check_not_supported(typed)
    return typed
