"""The device layer under every package that touches tensors: the run's accelerator and every call
nxdt makes to it by device type (memory, RNG, current device: `torch.accelerator`, `torch.cuda` only
as its fallback, here and nowhere else), is this run on torch-xla, and the few torch-xla calls nxdt
makes (graph cut, step closures, xser serialization).

torch-xla is optional and lives in its own environment (`make test-xla` builds `.venv-xla` with
torch==2.9.0 + torch-xla==2.9.0); nothing here imports it at module import time. The Lightning
side of XLA (accelerator, strategy, step-closure logger) is `nxdt.training.xla`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from nxdt.config.env import NEURON_MISSING, detect_xla, neuron_runtime
from nxdt.config.errors import ConfigError


def xla_available() -> bool:
    """torch_xla is importable (without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def use_xla(cfg: Any, environ: MutableMapping[str, str] | None = None) -> bool:
    """This run goes through torch-xla: trainer.accelerator xla/tpu, neuron where TorchNeuron's native
    `neuron` device is not there (`neuron_device`), or (auto) torch_xla is installed and PJRT_DEVICE /
    Neuron hints are present (nxdt.config.env.detect_xla)."""
    environ = os.environ if environ is None else environ
    if cfg.trainer.accelerator in ("xla", "tpu"):
        return True
    if cfg.trainer.accelerator == "neuron":
        return not native_neuron_available()  # neither installed: check_neuron refuses before the run
    return detect_xla(cfg, environ) and xla_available()


def _neuron_registered() -> bool:
    """torch knows a `neuron` device: TorchNeuron's PrivateUse1 backend is registered."""
    return torch._C._get_privateuse1_backend_name() == "neuron" or hasattr(torch, "neuron")


def native_neuron_available() -> bool:
    """TorchNeuron (the `torch_neuronx` package of Neuron >= 2.33) is installed and provides the native
    `neuron` device. PyTorch autoloads it at `import torch`; with TORCH_DEVICE_BACKEND_AUTOLOAD=0 it is
    imported here. An XLA-era torch-neuronx has the same package name and registers no such device."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    if not _neuron_registered():
        try:
            import torch_neuronx  # noqa: F401  optional extra: TorchNeuron registers `neuron` on import
        except ImportError:  # an XLA-era torch-neuronx without its torch-xla
            return False
    return _neuron_registered()


def neuron_device(accelerator: str) -> str | None:
    """What trainer.accelerator `neuron` runs on here: "neuron" (TorchNeuron's native device, preferred),
    "xla" (torch-xla, the XLA-era Neuron path), or None when neither is installed; None for any other
    accelerator value too."""
    if accelerator != "neuron":
        return None
    if native_neuron_available():
        return "neuron"
    return "xla" if xla_available() else None


def uses_native_neuron(cfg: Any, environ: MutableMapping[str, str] | None = None) -> bool:
    """This run is on TorchNeuron's native `neuron` device: trainer.accelerator neuron, or auto on a
    Neuron machine (nxdt.config.env.neuron_runtime), where TorchNeuron provides the device."""
    acc = cfg.trainer.accelerator
    if acc == "neuron":
        return neuron_device(acc) == "neuron"
    return acc == "auto" and neuron_runtime(cfg, environ) == "neuron" and native_neuron_available()


def compile_backend(device_type: str) -> str:
    """torch.compile's backend for a device type: TorchNeuron's `neuron` on its native device (its
    dynamo backend: FX graph → StableHLO → neuronx-cc), inductor elsewhere."""
    return "neuron" if device_type == "neuron" else "inductor"


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check_neuron(accelerator: str) -> None:
    """trainer.accelerator neuron that nothing here can run: one line (exit 2), before anything is
    written or any process group starts. Neither package: nxdt.spec said it already (NEURON_MISSING);
    here also an XLA-era torch-neuronx (no native device) without torch-xla."""
    if accelerator != "neuron" or neuron_device(accelerator) is not None:
        return
    if importlib.util.find_spec("torch_neuronx") is None:
        raise ConfigError(NEURON_MISSING)
    raise ConfigError("trainer.accelerator neuron: torch_neuronx is installed but provides no native `neuron` "
                      "device (an XLA-era torch-neuronx) and torch-xla is not installed; install torch-neuronx "
                      f"{_torch_minor()}.* (TorchNeuron, Neuron >= 2.33, trn2 / trn3), or set trainer.accelerator=cpu "
                      "(or gpu)")


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


# --------------------------------------------------------------------------- the run's accelerator
# Every device call nxdt makes goes through here, by device type: `torch.accelerator` (torch >= 2.6;
# CUDA, TorchNeuron's `neuron`, any PrivateUse1 backend), with `torch.cuda` only as the fallback for
# what `torch.accelerator` lacks (CUDA's RNG, memory snapshots, device names). tests/test_device_calls.py
# asserts that no other module of nxdt names `torch.cuda.`.
def _torch_accelerator():
    """`torch.accelerator`, or None on a torch that has none (< 2.6)."""
    return getattr(torch, "accelerator", None)


def accelerator_type() -> str | None:
    """The type of this process's accelerator ("cuda", "neuron", ...), None when there is none."""
    acc = _torch_accelerator()
    if acc is not None:
        if not acc.is_available():
            return None
        current = acc.current_accelerator()
        return None if current is None else current.type
    return "cuda" if torch.cuda.is_available() else None


def accelerator_available() -> bool:
    """An accelerator is there (what pinned host memory needs)."""
    return accelerator_type() is not None


def cuda_available() -> bool:
    """This process has a CUDA device (trainer.accelerator gpu / cuda / auto)."""
    return accelerator_type() == "cuda"


def device_module(kind: str):
    """`torch.cuda`, `torch.neuron`, ...: the backend module of a device type, None when torch has none."""
    return torch.cuda if kind == "cuda" else getattr(torch, kind, None)


def process_group_backend(kind: str) -> str:
    """torch.distributed's backend for a device type: NCCL on CUDA, TorchNeuron's `neuron` on its
    native device, gloo on the CPU."""
    return {"cuda": "nccl", "neuron": "neuron"}.get(kind, "gloo")


def current_device(kind: str) -> torch.device:
    """This process's current device of type `kind` (e.g. cuda:LOCAL_RANK once set)."""
    acc = _torch_accelerator()
    if acc is not None and accelerator_type() == kind:
        return torch.device(kind, acc.current_device_index())
    return torch.device(kind, device_module(kind).current_device())


def device_count() -> int:
    """How many devices this process's accelerator has (0 without one)."""
    acc = _torch_accelerator()
    if acc is not None:
        return int(acc.device_count()) if acc.is_available() else 0
    return torch.cuda.device_count()


def memory_stats(device: torch.device) -> dict[str, Any]:
    """The allocator's statistics of an accelerator ({} where its backend keeps none)."""
    acc = _torch_accelerator()
    if acc is not None and hasattr(acc, "memory_stats"):
        return dict(acc.memory_stats(device))
    mod = device_module(device.type)
    return dict(mod.memory_stats(device)) if mod is not None and hasattr(mod, "memory_stats") else {}


def set_device(index: int) -> None:
    """Make device `index` of this process's accelerator the current one."""
    acc = _torch_accelerator()
    if acc is not None:
        acc.set_device_index(index)
    else:
        torch.cuda.set_device(index)


def reset_peak_memory(device: torch.device) -> None:
    """Start counting an accelerator's peak allocated memory afresh."""
    acc = _torch_accelerator()
    if acc is not None and hasattr(acc, "reset_peak_memory_stats"):
        acc.reset_peak_memory_stats(device)
    else:
        device_module(device.type).reset_peak_memory_stats(device)


def max_memory_allocated(device: torch.device) -> int:
    """An accelerator's peak allocated bytes since the last `reset_peak_memory`."""
    acc = _torch_accelerator()
    if acc is not None and hasattr(acc, "max_memory_allocated"):
        return int(acc.max_memory_allocated(device))
    return int(device_module(device.type).max_memory_allocated(device))


def device_name(device: torch.device | str) -> str:
    """The marketing name of an accelerator (what the peak TFLOP/s table is keyed by)."""
    device = torch.device(device)
    return device_module(device.type).get_device_name(device)


def bf16_native(device: torch.device | str) -> bool:
    """The accelerator computes bf16 natively (CUDA: compute capability >= 8.0); True off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.is_bf16_supported(including_emulation=False)


def record_memory_history(on: bool, max_entries: int = 0) -> None:
    """Start (or stop) recording the CUDA caching allocator's history for a memory snapshot."""
    if on:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str | os.PathLike) -> None:
    """Write the recorded CUDA allocator history (pytorch.org/memory_viz reads it)."""
    torch.cuda.memory._dump_snapshot(str(path))


def accelerator_rng_state() -> tuple[str, Any] | None:
    """(device type, the RNG states of all its devices) of an accelerator this process has used;
    None when there is none, or it has not been initialized (no state worth saving)."""
    kind = accelerator_type()
    mod = device_module(kind) if kind else None
    if mod is None or not hasattr(mod, "get_rng_state_all"):
        return None
    is_initialized = getattr(mod, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return None
    return kind, mod.get_rng_state_all()


def set_accelerator_rng_state(kind: str, states: Any) -> None:
    """Restore what `accelerator_rng_state` returned, where that accelerator is here."""
    mod = device_module(kind) if accelerator_type() == kind else None
    if mod is not None and hasattr(mod, "set_rng_state_all"):
        mod.set_rng_state_all(states)
