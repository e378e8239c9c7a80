"""Config-derived environment variables, set BEFORE torch / torch-xla is imported.

On XLA (Neuron's XLA-era path, TPU) `apply_env` sets the runtime/compiler knobs (interface §1) and the
precision preset's variables (§7). On TorchNeuron's native `neuron` device it sets the Neuron runtime,
cache and compiler knobs only: precision there is nxdt's own (autocast, master weights, stochastic
rounding in the optimizer step), as on CUDA, so the XLA_* variables and the presets' compiler flags
would mean nothing. A variable the user already set is never overwritten; `NEURON_CC_FLAGS` is
appended to, skipping any flag whose option is already present. Elsewhere nothing is set: the
Neuron-only keys that were given are returned so the caller can report them once, in one line
(`format_inert`).

Which path a run takes is told here without importing torch (`neuron_runtime`): TorchNeuron is
torch-neuronx 2.10 or later (the XLA-era torch-neuronx was last built for torch 2.9, Neuron 2.28;
TorchNeuron ships for torch 2.13+), preferred over torch-xla where both are installed.
nxdt.device.native_neuron_available checks the same at run time, once torch is imported.

`COMPILE=1` in the environment (NxDT's graph pre-compilation run) is kept everywhere as a
smoke mode: trainer.max_steps = 10, no TensorBoard, no checkpoints.

`cfg` is the typed config (`nxdt.config.schema.NxdtConfig`). Only the standard library is imported here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
from collections.abc import MutableMapping
from typing import Any

from nxdt.config import schema
from nxdt.config.schema import normalize_precision
from nxdt.config.typed import select

MIXED_FLAGS = ["--enable-mixed-precision-accumulation"]

# precision.type -> (env vars, flags appended to NEURON_CC_FLAGS); "manual" reads the config.
PRECISION_PRESETS: dict[str, tuple[dict[str, str], list[str]]] = {
    "mixed_precision": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
                        MIXED_FLAGS),
    "mixed_precisionSR": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
                          MIXED_FLAGS),
    "bf16SR": ({"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
               MIXED_FLAGS),
    "fp32": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0"}, ["--auto-cast", "none"]),
    "autocast": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
                 MIXED_FLAGS + ["--auto-cast", "none"]),
}
PRECISION_PRESETS["mixed_precision_SR"] = PRECISION_PRESETS["mixed_precisionSR"]

# top-level key -> environment variable
KNOB_ENV = {
    "compiler_cache_url": "NEURON_COMPILE_CACHE_URL",
    "aync_exec_max_inflight_requests": "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
    "bucket_size_collectives": "BUCKET_CAP_MB",
    "neuron_rt_exec_timeout": "NEURON_RT_EXEC_TIMEOUT",
    "neuron_experimental_compress_rg": "NEURON_EXPERIMENTAL_COMPRESS_RG",
}


def precision_env(cfg: Any) -> tuple[dict[str, str], list[str]]:
    """(env vars, NEURON_CC_FLAGS tokens) of cfg.precision on XLA."""
    p = cfg.precision
    ptype = normalize_precision(p.type)
    if ptype == "manual":
        env = {
            "XLA_USE_BF16": str(p.xla_use_bf16),
            "XLA_DOWNCAST_BF16": str(p.xla_downcast_bf16),
            "NEURON_RT_STOCHASTIC_ROUNDING_EN": str(p.neuron_rt_stochastic_rounding_en),
        }
        return env, []
    env, flags = PRECISION_PRESETS[ptype]
    return dict(env), list(flags)


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _flag_groups(tokens: list[str]) -> list[list[str]]:
    """['--a', 'x', '--b=1'] -> [['--a', 'x'], ['--b=1']] (an option with its value tokens)."""
    groups: list[list[str]] = []
    for tok in tokens:
        if tok.startswith("-") or not groups:
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def _option(group: list[str]) -> str:
    return group[0].split("=", 1)[0]


def merge_cc_flags(existing: str, extra: list[str]) -> str:
    """Append the option groups of `extra` whose option is not already in `existing`."""
    have = {_option(g) for g in _flag_groups(shlex.split(existing))}
    out = existing.strip()
    for group in _flag_groups(extra):
        if _option(group) in have:
            continue
        have.add(_option(group))
        out = f"{out} {shlex.join(group)}".strip()
    return out


NEURON_HINTS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_RT_ROOT_COMM_ID")
# torch-neuronx versions from this one on are TorchNeuron (native `neuron` device); the XLA-era
# package's versions start with the torch they were built for, 2.9 the last (Neuron 2.28)
TORCHNEURON_FIRST = (2, 10)


def torchneuron_installed() -> bool:
    """TorchNeuron, the native `neuron` device, is installed (told without importing torch): torch_neuronx
    of version 2.10 or later. Without version metadata (a source tree on the path), an installed
    torch_neuronx without torch-xla is taken as TorchNeuron (the XLA-era package needs torch-xla)."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    try:
        version = importlib.metadata.version("torch-neuronx")
    except importlib.metadata.PackageNotFoundError:
        return importlib.util.find_spec("torch_xla") is None
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return len(parts) == 2 and tuple(parts) >= TORCHNEURON_FIRST


def neuron_hinted(environ: MutableMapping[str, str] | None = None) -> bool:
    """This machine has Neuron devices, or the launcher set Neuron's runtime variables."""
    environ = os.environ if environ is None else environ
    return any(k in environ for k in NEURON_HINTS) or os.path.exists("/dev/neuron0")


def neuron_runtime(cfg: Any, environ: MutableMapping[str, str] | None = None) -> str | None:
    """How this run reaches Neuron: "neuron" (TorchNeuron's native device), "xla" (torch-xla: the
    XLA-era path), or None (not a Neuron run). trainer.accelerator neuron takes TorchNeuron where it
    is installed, else torch-xla (None when neither is: `neuron_missing` refuses it); auto takes
    Neuron when the machine or the launcher says so (`neuron_hinted`) and PJRT_DEVICE does not name
    another XLA device."""
    environ = os.environ if environ is None else environ
    acc = cfg.trainer.accelerator
    if acc == "auto" and not environ.get("PJRT_DEVICE") and neuron_hinted(environ):
        return "neuron" if torchneuron_installed() else "xla"
    if acc != "neuron":
        return None
    if torchneuron_installed():
        return "neuron"
    return "xla" if importlib.util.find_spec("torch_xla") is not None else None


def detect_xla(cfg: Any, environ: MutableMapping[str, str] | None = None) -> bool:
    """True when this run uses torch-xla: trainer.accelerator xla/tpu, neuron without TorchNeuron, or
    (auto) PJRT_DEVICE / Neuron hints without TorchNeuron (`neuron_runtime`)."""
    environ = os.environ if environ is None else environ
    acc = cfg.trainer.accelerator
    if acc in ("xla", "tpu"):
        return True
    if acc == "auto" and environ.get("PJRT_DEVICE"):
        return True
    return acc in ("auto", "neuron") and neuron_runtime(cfg, environ) == "xla"


NEURON_MISSING = ("trainer.accelerator neuron: neither torch_neuronx (TorchNeuron, the native `neuron` device) nor "
                  "torch-xla is installed; install torch-neuronx matching this torch (TorchNeuron, Neuron >= 2.33, "
                  "trn2 / trn3), or set trainer.accelerator=cpu (or gpu)")


def neuron_missing(accelerator: str) -> str | None:
    """The one line for trainer.accelerator neuron where neither package that runs it can be imported
    (found without importing torch: nxdt.spec refuses it before anything starts); None otherwise.
    Which of the two a run takes is nxdt.device.neuron_device."""
    if accelerator != "neuron":
        return None
    if any(importlib.util.find_spec(name) is not None for name in ("torch_neuronx", "torch_xla")):
        return None
    return NEURON_MISSING


def inert_keys(cfg: Any) -> list[str]:
    """Neuron-only keys given a non-default value (they have no effect off XLA)."""
    out = []
    for key, _tname, default, _help, meta in schema.iter_fields():
        if not meta.get("neuron"):
            continue
        value = select(cfg, key)
        if value is None or value is False or value == default:
            continue
        if key.startswith("precision.") and cfg.precision.type != "manual":
            continue
        out.append(key)
    return out


def format_inert(keys: list[str]) -> str:
    return "Neuron-only settings have no effect on this device: " + ", ".join(keys)


def apply_smoke_mode(cfg: Any, environ: MutableMapping[str, str] | None = None) -> bool:
    """COMPILE=1: max_steps 10, no TensorBoard, no checkpoints. Returns True when applied."""
    environ = os.environ if environ is None else environ
    if environ.get("COMPILE") != "1":
        return False
    cfg.trainer.max_steps = 10
    cfg.exp_manager.create_tensorboard_logger = False
    cfg.exp_manager.create_checkpoint_callback = False
    return True


def apply_env(cfg: Any, environ: MutableMapping[str, str] | None = None, is_xla: bool | None = None) -> list[str]:
    """Set the config's Neuron/precision environment variables (XLA; the runtime ones on TorchNeuron);
    returns the Neuron-only keys given where nothing reads them.

    Call before torch is imported. Never overwrites a variable already in `environ`
    (NEURON_CC_FLAGS is appended to). Also applies the COMPILE=1 smoke mode.
    """
    environ = os.environ if environ is None else environ
    apply_smoke_mode(cfg, environ)
    if is_xla is None:
        is_xla = detect_xla(cfg, environ)
    native = not is_xla and neuron_runtime(cfg, environ) == "neuron"
    if not is_xla and not native:
        return inert_keys(cfg)

    wanted: dict[str, str] = {}
    for key, var in KNOB_ENV.items():
        value = getattr(cfg, key)
        if value is not None:
            wanted[var] = _env_value(value)
    pflags: list[str] = []
    if is_xla:  # the XLA graph's fusions and precision; on the native device precision is nxdt's own
        if cfg.model.fusions.softmax is True:
            wanted["NEURON_FUSE_SOFTMAX"] = "1"
        penv, pflags = precision_env(cfg)
        wanted.update(penv)
    for var, value in wanted.items():
        if var not in environ:
            environ[var] = value

    flags = shlex.split(cfg.compiler_flags or "") + pflags
    if flags:
        merged = merge_cc_flags(environ.get("NEURON_CC_FLAGS", ""), flags)
        if merged:
            environ["NEURON_CC_FLAGS"] = merged
    return []
