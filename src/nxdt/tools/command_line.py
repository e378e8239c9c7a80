"""Hydra's command-line surface for the training entry (examples/train.py, `nxdt train`).

nxdt composes configs with Hydra's compose API rather than `@hydra.main`, so that a config is
validated, and the environment variables it implies are set, before torch is imported. What a
Hydra user types still works:

    examples/train.py --config-name tiny_llama_cpu --cfg job [--resolve] [--package model]
    examples/train.py --config-name tiny_llama_cpu --info
    examples/train.py --config-name tiny_llama_cpu -m model.optim.lr=1e-3,3e-4 seed=1,2
    examples/train.py --config-name tiny_llama_cpu hydra.run.dir=runs/lr3e-4

- `--cfg job|hydra|all` prints the composed config (interpolations kept unless `--resolve`), the
  Hydra settings, or both, and exits; `--package/-p KEY` prints one section.
- `--info` prints where the config came from (search path, defaults list, overrides) and the run
  directory the run would use.
- `-m/--multirun` runs the cartesian product of the sweep overrides (`a=1,2 b=x,y`: 4 jobs, Hydra's
  BasicSweeper order), one after another in one process; every job's config is validated before
  the first one trains. Each job logs to `<sweep dir>/<job number>`.
- `hydra.run.dir=DIR` is the log dir of a run (`exp_manager.explicit_log_dir`); `hydra.sweep.dir=DIR`
  the parent of a sweep's job dirs.
- Every run writes `<log_dir>/.hydra/` as Hydra does: `config.yaml` (the composed config, not
  resolved), `overrides.yaml` (the command-line overrides of this job) and `hydra.yaml`.

This module imports no torch.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from nxdt.config.errors import ConfigError

CFG_CHOICES = ("job", "hydra", "all")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.job.name")

HYDRA_HELP = """Hydra flags nxdt's training entry understands:
  --config-path/-cp DIR, --config-dir/-cd DIR   folder of the config (default: nxdt's conf/)
  --config-name/-cn NAME                        the YAML to compose
  --cfg/-c job|hydra|all [--resolve] [--package/-p KEY]   print the composed config and exit
  --info [all|config|defaults|searchpath]       print where the config comes from and exit
  -m/--multirun key=a,b ...                     a sweep: every combination, one job after another
  hydra.run.dir=DIR  hydra.sweep.dir=DIR  hydra.sweep.subdir=NAME  hydra.job.name=NAME
  key=value  +key=value  ++key=value  ~key      overrides (quote values with spaces or '=': key='a=b')"""


@dataclass
class CommandLine:
    """A training command line, split into what compose() reads and what Hydra's flags ask for."""
    argv: list[str]
    config_args: list[str] = field(default_factory=list)  # --config-path/--config-name and their values
    overrides: list[str] = field(default_factory=list)  # key=value overrides, hydra.* excluded
    hydra: dict[str, str] = field(default_factory=dict)  # hydra.run.dir etc.
    show_cfg: str | None = None
    package: str | None = None
    resolve: bool = False
    info: str | None = None
    multirun: bool = False
    hydra_help: bool = False

    def compose_argv(self, overrides: list[str] | None = None) -> list[str]:
        """The argv of compose()/load_config() for one job (default: the overrides as given)."""
        return [*self.config_args, *(self.overrides if overrides is None else overrides)]


def _value(argv: list[str], i: int, flag: str) -> tuple[str, int]:
    arg = argv[i]
    if "=" in arg and arg.startswith("--"):
        return arg.split("=", 1)[1], i
    if i + 1 >= len(argv):
        raise ConfigError(f"{flag} needs a value")
    return argv[i + 1], i + 1


def parse_command_line(argv: list[str]) -> CommandLine:
    """Split a Hydra command line; unknown flags and unsupported hydra.* keys are one-line errors."""
    cl = CommandLine(argv=list(argv))
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        name = arg.split("=", 1)[0]
        if name in ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"):
            value, i = _value(argv, i, name)
            flag = "--config-name" if name in ("--config-name", "-cn") else "--config-path"
            cl.config_args += [flag, value]
        elif name in ("--cfg", "-c"):
            value, i = _value(argv, i, name)
            if value not in CFG_CHOICES:
                raise ConfigError(f"--cfg {value}: expected one of {', '.join(CFG_CHOICES)}")
            cl.show_cfg = value
        elif name in ("--package", "-p"):
            cl.package, i = _value(argv, i, name)
        elif arg == "--resolve":
            cl.resolve = True
        elif name == "--info":
            if "=" in arg:
                cl.info = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and argv[i + 1] in INFO_CHOICES:
                cl.info, i = argv[i + 1], i + 1
            else:
                cl.info = "all"
            if cl.info not in INFO_CHOICES:
                raise ConfigError(f"--info {cl.info}: expected one of {', '.join(INFO_CHOICES)}")
        elif arg in ("-m", "--multirun"):
            cl.multirun = True
        elif arg in ("-r", "--run"):
            pass  # Hydra's default mode
        elif arg == "--hydra-help":
            cl.hydra_help = True
        elif arg.startswith("-") and not arg.startswith("~"):
            raise ConfigError(f"unknown option '{arg}' (see --hydra-help for the Hydra flags nxdt understands)")
        elif arg.lstrip("+").startswith("hydra."):
            key, eq, value = arg.lstrip("+").partition("=")
            if not eq or key not in HYDRA_KEYS:
                raise ConfigError(f"'{arg}': not supported yet (supported Hydra settings: {', '.join(HYDRA_KEYS)})")
            cl.hydra[key] = value
        else:
            cl.overrides.append(arg)
        i += 1
    if cl.package and not cl.show_cfg:
        raise ConfigError("--package needs --cfg job|hydra|all")
    if cl.resolve and not cl.show_cfg:
        raise ConfigError("--resolve needs --cfg job|hydra|all")
    return cl


# --------------------------------------------------------------------------- sweeps
def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """The jobs of a sweep: one override list per combination (Hydra's BasicSweeper order: the
    last swept key varies fastest). Without sweep overrides: one job, the overrides as given."""
    parser = OverridesParser.create()
    choices: list[list[str]] = []
    for line in overrides:
        try:
            (ov,) = parser.parse_overrides([line])
        except HydraException:
            choices.append([line])  # compose() reports a bad override with its own message
            continue
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={value}" for value in ov.sweep_string_iterator()])
        else:
            choices.append([line])
    return [list(job) for job in itertools.product(*choices)]


def sweep_keys(overrides: list[str]) -> list[str]:
    """The overrides that are sweeps (`key=a,b`, `key=range(...)`, `key=choice(...)`)."""
    parser = OverridesParser.create()
    found = []
    for line in overrides:
        try:
            (ov,) = parser.parse_overrides([line])
        except HydraException:
            continue
        if ov.is_sweep_override():
            found.append(line)
    return found


def override_dirname(overrides: list[str]) -> str:
    """Hydra's `hydra.job.override_dirname`: the sorted overrides joined by commas."""
    return ",".join(sorted(overrides))


# --------------------------------------------------------------------------- printing
def nxdt_version() -> str:
    try:
        return version("nxdt")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"

def _yaml(node: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(node) if not isinstance(node, str) else node)


def hydra_section(cl: CommandLine, log_dir: str | os.PathLike | None, config_dir: str | None,
                  config_name: str | None, job_num: int = 0, job_overrides: list[str] | None = None) -> dict:
    """What Hydra records about a job (the `hydra:` section of --cfg hydra and .hydra/hydra.yaml)."""
    overrides = cl.overrides if job_overrides is None else job_overrides
    return {"hydra": {
        "run": {"dir": cl.hydra.get("hydra.run.dir", str(log_dir) if log_dir else None)},
        "sweep": {"dir": cl.hydra.get("hydra.sweep.dir"), "subdir": cl.hydra.get("hydra.sweep.subdir", "${hydra.job.num}")},
        "mode": "MULTIRUN" if cl.multirun else "RUN",
        "overrides": {"task": list(overrides)},
        "job": {"name": cl.hydra.get("hydra.job.name", "train"), "num": job_num,
                "override_dirname": override_dirname(overrides), "config_name": config_name},
        "runtime": {"version": f"nxdt {nxdt_version()}", "cwd": os.getcwd(),
                    "config_sources": [{"path": config_dir, "schema": "file", "provider": "main"}],
                    "output_dir": str(log_dir) if log_dir else None},
        "argv": list(cl.argv),
    }}


def select_package(node: dict, package: str | None) -> Any:
    if not package:
        return node
    current: Any = node
    for part in package.split("."):
        if not isinstance(current, dict) or part not in current:
            raise ConfigError(f"--package {package}: '{part}' is not in the config")
        current = current[part]
    return current


def print_cfg(cl: CommandLine, job: dict, hydra: dict, stream: Any = None) -> None:
    """--cfg job|hydra|all [--package KEY]."""
    stream = stream or sys.stdout
    if cl.show_cfg == "job":
        node = job
    elif cl.show_cfg == "hydra":
        node = hydra
    else:
        node = {**hydra, **job}
    selected = select_package(node, cl.package)
    print(_yaml(selected) if isinstance(selected, (dict, list)) else selected, end="", file=stream)


def format_info(cl: CommandLine, config_dir: str, config_name: str, defaults: list[str],
                log_dir: str | os.PathLike, jobs: list[list[str]]) -> str:
    """--info: where the config comes from, what overrides it, where the run writes."""
    lines = [f"nxdt {nxdt_version()} (Hydra compose API)"]
    if cl.info in ("all", "searchpath"):
        lines += ["", "Config search path:", f"  file://{config_dir}  (main)"]
    if cl.info in ("all", "defaults", "defaults-tree"):
        lines += ["", "Defaults list:", *[f"  {d}" for d in defaults or [config_name]]]
    if cl.info in ("all", "config"):
        lines += ["", f"Config name: {config_name}", "Overrides:", *[f"  {o}" for o in cl.overrides or ["(none)"]]]
        if cl.hydra:
            lines += ["Hydra settings:", *[f"  {k}={v}" for k, v in cl.hydra.items()]]
    if cl.info in ("all", "plugins"):
        lines += ["", "Launcher: in-process, one job after another (single-process runs); sweeper: basic"]
    lines += ["", f"Run dir: {log_dir}"]
    if len(jobs) > 1:
        lines += [f"Sweep: {len(jobs)} jobs", *[f"  #{n}: {' '.join(job)}" for n, job in enumerate(jobs)]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the .hydra record
def write_hydra_record(log_dir: str | os.PathLike, composed: dict, hydra: dict, job_overrides: list[str]) -> Path:
    """`<log_dir>/.hydra/{config,hydra,overrides}.yaml`, as Hydra writes them for every run."""
    record = Path(log_dir) / ".hydra"
    record.mkdir(parents=True, exist_ok=True)
    (record / "config.yaml").write_text(_yaml(composed), encoding="utf-8")
    (record / "hydra.yaml").write_text(_yaml(hydra), encoding="utf-8")
    (record / "overrides.yaml").write_text(_yaml(list(job_overrides)), encoding="utf-8")
    return record
