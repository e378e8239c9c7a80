"""The device layer under every package that touches tensors: is this run on torch-xla, and the
few torch-xla calls nxdt makes (graph cut, step closures, xser serialization).

torch-xla is optional and lives in its own environment (`make test-xla` builds `.venv-xla` with
torch==2.9.0 + torch-xla==2.9.0); nothing here imports it at module import time. The Lightning
side of XLA (accelerator, strategy, step-closure logger) is `nxdt.training.xla`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from nxdt.config.env import detect_xla


def xla_available() -> bool:
    """torch_xla is importable (without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def use_xla(cfg: Any, environ: MutableMapping[str, str] | None = None) -> bool:
    """This run goes through torch-xla: trainer.accelerator xla/neuron/tpu, or (auto) torch_xla is
    installed and PJRT_DEVICE / Neuron hints are present (nxdt.config.env.detect_xla)."""
    environ = os.environ if environ is None else environ
    if cfg.trainer.accelerator in ("xla", "neuron", "tpu"):
        return True
    return detect_xla(cfg, environ) and xla_available()


def xla_model():
    """`torch_xla.core.xla_model`, imported on first use (torch-xla is optional and needs its own
    torch build; importing it at module level would make every nxdt import need it)."""
    import torch_xla.core.xla_model as xm  # torch-xla is optional

    return xm


def xla_device():
    import torch_xla  # torch-xla is optional

    return torch_xla.device()


def mark_step() -> None:
    """Cut and run the lazily traced graph (end of an optimizer step)."""
    import torch_xla  # torch-xla is optional

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # older torch-xla
        xla_model().mark_step()


def is_xla_tensor(t: Any) -> bool:
    return getattr(getattr(t, "device", None), "type", None) == "xla"


def in_step_closure(fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` once the current step's graph has executed (XLA tensors in `args` are then
    materialized without forcing a sync); off XLA, run it now."""
    if any(is_xla_tensor(a) for a in args):
        xla_model().add_step_closure(fn, args)
    else:
        fn(*args)


def save_xser(obj: Any, path: str | os.PathLike, master_only: bool = True) -> None:
    """Save a (nested) state dict with torch_xla's serialization: tensors are written one file
    each under `<path>.tensors/` and `path` holds the structure. Works for CPU tensors too.
    `master_only`: only the master ordinal writes (all ranks must call it)."""
    from torch_xla.utils.serialization import save  # torch-xla is optional

    save(obj, str(path), master_only=master_only)


def load_xser(path: str | os.PathLike) -> Any:
    """Load what `save_xser` wrote; tensors come back on the CPU (move them to the device after)."""
    from torch_xla.utils.serialization import load  # torch-xla is optional

    return load(str(path))
