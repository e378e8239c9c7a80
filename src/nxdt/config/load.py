"""Compose a config from a Hydra-style command line; every failure is a one-line ConfigError.

    examples/train.py --config-path conf --config-name tiny_llama_cpu trainer.max_steps=20 +foo=1 ~bar

Arguments: `--config-path/-cp DIR` (relative to the working directory), `--config-name/-cn NAME`
(with or without .yaml), then overrides `key=value`, `+key=value`, `++key=value`, `~key`.
Hydra's compose API reads the YAML (and its defaults list); overrides of config groups go to
Hydra, all other overrides are applied here, after the YAML is merged over the schema defaults,
so any schema key can be set without `+` and a typo is reported by the validator with a
did-you-mean. `~key` on a schema key resets it to its default.

The composed config is resolved, validated by `check_schema` and put in struct mode (reading a
key that is not in the schema raises). `load_config` adds the full `validate` and returns the
config typed: an `nxdt.config.schema.NxdtConfig` (see nxdt.config.typed).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader
from omegaconf.errors import OmegaConfBaseException

from nxdt.config import resolvers, schema
from nxdt.config.errors import ConfigError, ConfigErrors
from nxdt.config.typed import to_typed
from nxdt.config.validate import check_schema

# Mappings that a config gives as a whole: the user's value replaces the default (no key merge).
OPEN_PATHS = ("model.optim", "model.rope_scaling")

_USAGE = ("expected --config-path/-cp DIR, --config-name/-cn NAME, key=value, +key=value, "
          "++key=value or ~key")


def _one_line(text: Any, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def error_text(err: ConfigError, limit: int = 2000) -> str:
    """What an entry prints for `err` after `error: `: one line; several problems found together
    (ConfigErrors) as their first line and one indented line each."""
    if isinstance(err, ConfigErrors):
        return "\n".join([_one_line(err.headline, limit), *(f"  {_one_line(p, limit)}" for p in err.problems)])
    return _one_line(err, limit=limit)


def _show(path: Path) -> str:
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except (ValueError, OSError):
        return str(path)


def parse_argv(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(config dir, config name, overrides) from a Hydra-like command line."""
    config_dir = config_name = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        for long, short in (("--config-path", "-cp"), ("--config-name", "-cn")):
            if arg in (long, short) or arg.startswith(long + "=") or arg.startswith(short + "="):
                if "=" in arg:
                    value = arg.split("=", 1)[1]
                else:
                    if i + 1 >= len(argv):
                        raise ConfigError(f"{arg} needs a value")
                    i += 1
                    value = str(argv[i])
                if long == "--config-path":
                    config_dir = value
                else:
                    config_name = value
                break
        else:
            if arg.startswith("-"):
                raise ConfigError(f"unknown option '{arg}' ({_USAGE})")
            overrides.append(arg)
        i += 1
    return config_dir, config_name, overrides


def _available(config_dir: Path) -> str:
    names = sorted(p.stem for p in config_dir.glob("*.yaml"))
    return ", ".join(names) if names else "none"


def _check_yaml(path: Path) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{_show(path)}: cannot read: {_one_line(err)}") from None
    try:
        data = yaml.load(text, Loader=get_yaml_loader())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f" at line {mark.line + 1}" if mark is not None else ""
        problem = err.problem or err.context or "syntax error"
        raise ConfigError(f"{_show(path)}: malformed YAML{line}: {_one_line(problem)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{_show(path)}: malformed YAML: {_one_line(err)}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{_show(path)}: the top level must be a mapping of keys, got {type(data).__name__}")


def quote_value(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar, which reads it back unchanged: inside
    quotes a backslash is literal, except the ones before a quote (or the closing quote), which
    are doubled; quotes are escaped."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"'{escaped}'"


# key=value with a plain key (and + / ++), whose value is not already quoted or a list / mapping
_PLAIN_KEY_VALUE = re.compile(r"(\+{0,2}[A-Za-z_][\w.\-]*)=([^'\"\[{].*)", re.DOTALL)


def _requoted(line: str) -> str | None:
    """A path pasted as printed (`resume_from_checkpoint=/r/tiny_llama--step=2-consumed_samples=8.0`,
    `explicit_log_dir=/runs/it's`) is not valid unquoted in Hydra's grammar, which stops at '='
    and quotes: the same override with its value quoted, or None when that is not what went wrong."""
    m = _PLAIN_KEY_VALUE.fullmatch(line)
    if m is None or not any(c in m.group(2) for c in "='\""):
        return None
    return f"{m.group(1)}={quote_value(m.group(2))}"


def _parse_requoted(parser: Any, line: str) -> Any:
    """The override `_requoted` makes of `line`, parsed, or None."""
    retry = _requoted(line)
    if retry is None:
        return None
    try:
        (ov,) = parser.parse_overrides([retry])
    except HydraException:
        return None
    return ov


_QUOTE_HINT = "quote a value that holds '=': key='a=b', in the shell \"key='a=b'\""


def _parse_overrides(overrides: list[str]) -> list:
    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            (ov,) = parser.parse_overrides([line])
        except HydraException as err:
            ov = _parse_requoted(parser, line)
            if ov is None:
                msg = str(err).splitlines()
                detail = next((m for m in msg if m.strip() and not m.startswith("Error parsing override")),
                              msg[0] if msg else "")
                hint = _QUOTE_HINT if "=" in line.partition("=")[2] else _USAGE
                raise ConfigError(f"bad override '{line}': {_one_line(detail)} ({hint})") from None
        if ov.is_sweep_override():
            raise ConfigError(f"bad override '{line}': sweeps (a=1,2) are not supported")
        if ov.package is not None:
            raise ConfigError(f"bad override '{line}': '@package' overrides are not supported")
        parsed.append(ov)
    return parsed


def _is_group(config_dir: Path, key: str) -> bool:
    d = config_dir / key.replace(".", "/")
    return d.is_dir() and any(d.glob("*.yaml"))


def _merge(base: Any, over: Any, path: str = "") -> Any:
    """Deep merge of plain containers; mappings merge key by key except OPEN_PATHS (replaced)."""
    if isinstance(base, dict) and isinstance(over, dict) and path not in OPEN_PATHS:
        out = dict(base)
        for k, v in over.items():
            sub = f"{path}.{k}" if path else str(k)
            out[k] = _merge(base[k], v, sub) if k in base else v
        return out
    return over


def _apply_overrides(cfg: DictConfig, parsed: list) -> None:
    for ov in parsed:
        key, line = ov.key_or_group, ov.input_line
        try:
            value = ov.value()
            if ov.is_delete():
                parent_key, _, leaf = key.rpartition(".")
                parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
                if not isinstance(parent, DictConfig) or leaf not in parent:
                    raise ConfigError(f"bad override '{line}': '{key}' is not in the config")
                del parent[leaf]
                continue
            existing = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
            # a mapping merges into a mapping (as in Hydra), except open mappings such as
            # model.optim, which a mapping value replaces as a whole
            merge = isinstance(value, dict) and isinstance(existing, DictConfig) and key not in OPEN_PATHS
            OmegaConf.update(cfg, key, value, merge=merge, force_add=True)
        except ConfigError:
            raise
        except (OmegaConfBaseException, ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"bad override '{line}': {_one_line(str(err).splitlines()[0])}") from None


def compose(argv: list[str], default_config_dir: str | os.PathLike | None = None,
            default_config_name: str | None = None, notices: list[str] | None = None,
            record: dict | None = None) -> DictConfig:
    """Compose, merge over the schema defaults, apply overrides, resolve and schema-check a config.

    `default_config_dir`: used when argv has no --config-path (default: nxdt's shipped conf/).
    `notices`: if given, one-line notices (e.g. a setting turned off) are appended to it.
    `record`: if given, receives what Hydra would record of the composition (`config_dir`,
    `config_name`, `defaults`, and `composed`: the config before interpolations are resolved).
    """
    config_path, config_name, overrides = parse_argv(list(argv))
    if config_path is not None:
        config_dir = Path(config_path).expanduser()
    elif default_config_dir is not None:
        config_dir = Path(default_config_dir)
    else:
        config_dir = resolvers.shipped_conf_dir()
    config_dir = config_dir.resolve()
    if not config_dir.is_dir():
        raise ConfigError(f"config directory not found: {config_dir}")
    config_name = config_name or default_config_name
    if not config_name:
        raise ConfigError(f"no config given: pass --config-name NAME (available in {config_dir}: {_available(config_dir)})")
    if config_name.endswith((".yaml", ".yml")):
        config_name = config_name.rsplit(".", 1)[0]
    config_file = config_dir / f"{config_name}.yaml"
    if not config_file.is_file():
        raise ConfigError(f"config '{config_name}' not found in {config_dir} (available: {_available(config_dir)})")
    _check_yaml(config_file)

    parsed = _parse_overrides(overrides)
    group_ovs = [ov.input_line for ov in parsed if _is_group(config_dir, ov.key_or_group)]
    key_ovs = [ov for ov in parsed if not _is_group(config_dir, ov.key_or_group)]

    resolvers.register()
    resolvers.set_config_dir(config_dir)
    user = _hydra_compose(config_dir, config_name, group_ovs, config_file)

    base = schema.defaults()
    cfg = OmegaConf.create(_merge(base, user))
    _apply_overrides(cfg, key_ovs)
    # restore schema keys removed by `~key` (a deleted key reads as its default); the config is built
    # again only when that adds something (building it costs ~15% of a compose, paid by every run)
    plain = OmegaConf.to_container(cfg, resolve=False)
    merged = _merge(base, plain)
    if merged != plain:
        cfg = OmegaConf.create(merged)
    if record is not None:
        record.update(config_dir=str(config_dir), config_name=config_name,
                      defaults=_defaults_list(config_file), composed=OmegaConf.to_container(cfg, resolve=False))
    found = check_schema(cfg)
    if notices is not None:
        notices.extend(found)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _defaults_list(config_file: Path) -> list[str]:
    """The YAML's Hydra defaults list as lines (`_self_`, `group: option`), for --info."""
    data = yaml.load(config_file.read_text(encoding="utf-8"), Loader=get_yaml_loader()) or {}
    entries = data.get("defaults") or []
    lines = [", ".join(f"{k}: {v}" for k, v in e.items()) if isinstance(e, dict) else str(e) for e in entries]
    return lines or [config_file.stem]


def _hydra_compose(config_dir: Path, config_name: str, overrides: list[str], config_file: Path) -> dict:
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base=None, config_dir=str(config_dir)):
            composed = hydra_compose(config_name=config_name, overrides=overrides)
        user = OmegaConf.to_container(composed, resolve=False)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - Hydra raises many types; all become one line
        first = next((m for m in str(err).splitlines() if m.strip()), type(err).__name__)
        raise ConfigError(f"{_show(config_file)}: cannot compose: {_one_line(first)}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{_show(config_file)}: the top level must be a mapping of keys")
    return user


def global_rank(environ: Any = None) -> int:
    """This process's global rank, from its launcher's environment (before any process group exists).

    torchrun sets RANK. Lightning's own launcher (`trainer.devices=2` without torchrun) sets only
    LOCAL_RANK (and NODE_RANK) in the processes it starts, and nothing in the first one: there the
    rank is LOCAL_RANK + NODE_RANK, exact on one node and zero only for rank 0 on several."""
    environ = os.environ if environ is None else environ
    for name in ("RANK", "GLOBAL_RANK"):
        if environ.get(name, "") != "":
            return int(environ[name])
    return int(environ.get("LOCAL_RANK", "") or 0) + int(environ.get("NODE_RANK", "") or 0)


def started_by_launcher(environ: Any = None) -> bool:
    """Started by a launcher whose process is our parent: torchrun, or Lightning's own subprocess
    launcher (both set LOCAL_RANK; a plain `python examples/train.py` has none)."""
    return "LOCAL_RANK" in (os.environ if environ is None else environ)


def is_rank_zero(environ: Any = None) -> bool:
    return global_rank(environ) == 0


def report(message: str, stream: Any = None) -> None:
    """Print a one-line notice once (global rank 0 only)."""
    if is_rank_zero():
        print(f"notice: {message}", file=stream or sys.stderr)


def config_from_dict(values: dict) -> schema.NxdtConfig:
    """A typed config from a (partial) mapping, as from a YAML without Hydra: merged over the
    schema defaults, resolved and schema-checked (nxdt.spec.config_from_dict cross-checks too).
    For tools reading a saved config.yaml and for tests building small configs."""
    resolvers.register()
    base = schema.defaults()
    cfg = OmegaConf.create(_merge(base, OmegaConf.to_container(OmegaConf.create(values), resolve=False)))
    check_schema(cfg)
    return to_typed(OmegaConf.to_container(cfg, resolve=True))


def load_saved_config(path: str | os.PathLike) -> schema.NxdtConfig:
    """The typed config of a saved config.yaml (a run's or a checkpoint's): schema-checked, not
    cross-checked (the files it names may have moved)."""
    path = Path(path)
    _check_yaml(path)
    resolvers.register()
    try:
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{_show(path)}: {_one_line(str(err).splitlines()[0])}") from None
    return config_from_dict(values or {})


def full_error_requested(environ: Any = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("HYDRA_FULL_ERROR") == "1" or environ.get("NXDT_FULL_ERROR") == "1"


RANK_ZERO_GRACE_S = 3.0


def main_guard(fn: Callable) -> Callable:
    """Wrap an entry point: a ConfigError prints `error: <msg>` (rank 0 only) and exits 2 on every rank.

    With HYDRA_FULL_ERROR=1 or NXDT_FULL_ERROR=1 the error is re-raised (full traceback).
    Use as a decorator or as `main_guard(main)(argv)`.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            if full_error_requested():
                raise
            if is_rank_zero():
                print(f"error: {error_text(err)}", file=sys.stderr, flush=True)
            else:
                # Every rank finds the same error; torchrun stops all ranks as soon as one exits.
                # The others give rank 0 a moment to say why, so the one line is never lost.
                time.sleep(RANK_ZERO_GRACE_S)
            sys.exit(ConfigError.exit_code)

    return wrapper
