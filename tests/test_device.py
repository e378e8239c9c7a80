"""The device layer (nxdt.device): every device call nxdt makes goes through it, by device type.

- no module of nxdt but nxdt/device.py names `torch.cuda.` (read with `ast` and as text, nothing of
  nxdt imported for it): the rest of the code asks for "the run's device" (`torch.accelerator`
  underneath, `torch.cuda` only as its fallback inside nxdt.device);
- what those calls answer on this CPU-only machine, and with a fake accelerator.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import train_in_process

from nxdt import device
from nxdt.config import env, inert
from nxdt.config.errors import ConfigError
from nxdt.hardware import local_device_type
from nxdt.parallel.parallelize import apply_compile, compile_backend_missing
from nxdt.spec import load_config
from nxdt.spec.layout import Layout
from nxdt.spec.parallel import check_xla_devices
from nxdt.training import trainer as trainer_mod
from nxdt.training.strategy import NeuronAccelerator, native_neuron_strategy

SRC = Path(__file__).resolve().parents[1] / "src" / "nxdt"
DEVICE_MODULE = SRC / "device.py"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def cuda_calls(path: Path) -> list[str]:
    """`file:line torch.cuda...` for each use of torch.cuda in a file: an attribute chain, an import
    of torch.cuda, or the text `torch.cuda.` (a docstring naming one counts too: the grep sees it)."""
    text = path.read_text()
    rel = path.relative_to(SRC.parent)
    hits = set()
    for node in ast.walk(ast.parse(text)):
        name = _dotted(node) if isinstance(node, ast.Attribute) else None
        if name is not None and (name == "torch.cuda" or name.startswith("torch.cuda.")):
            hits.add((node.lineno, name))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            hits.add((node.lineno, f"from {node.module} import"))
        if isinstance(node, ast.Import):
            hits.update((node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("torch.cuda"))
    hits.update((n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if "torch.cuda." in line)
    return [f"{rel}:{n} {what}" for n, what in sorted(hits)]


def test_only_the_device_module_calls_torch_cuda():
    offending = [hit for path in sorted(SRC.rglob("*.py")) if path != DEVICE_MODULE for hit in cuda_calls(path)]
    assert offending == [], ("device calls go through nxdt.device (by device type), not torch.cuda:\n"
                             + "\n".join(offending))
    assert cuda_calls(DEVICE_MODULE), "nxdt.device is where the torch.cuda fallback lives"


def test_the_checker_sees_a_cuda_call(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)  # relative paths from the temp tree
    f = tmp_path / "nxdt" / "m.py"
    f.parent.mkdir()
    f.write_text("import torch\nfrom torch.cuda import amp\nn = torch.cuda.device_count()\nm = torch.cuda\n")
    hits = cuda_calls(f)
    assert any(":2 from torch.cuda import" in h for h in hits)
    assert any(":3 torch.cuda.device_count" in h for h in hits)
    assert any(":4 torch.cuda" in h for h in hits)


def test_cpu_only_machine():
    if torch.accelerator.is_available():  # a GPU machine: the CPU answers do not apply
        return
    assert device.accelerator_type() is None
    assert not device.accelerator_available() and not device.cuda_available()
    assert device.accelerator_rng_state() is None
    device.set_accelerator_rng_state("cuda", [])  # no CUDA here: nothing to restore, no error
    assert device.bf16_native("cpu")


def test_process_group_backend_by_device_type():
    assert device.process_group_backend("cuda") == "nccl"
    assert device.process_group_backend("neuron") == "neuron"  # TorchNeuron's own backend
    assert device.process_group_backend("cpu") == "gloo"


def test_calls_go_to_the_accelerator_of_the_device_type(monkeypatch):
    """A fake accelerator of a type other than CUDA, as TorchNeuron's `neuron` is (here `hpu`: a
    `neuron` device string needs TorchNeuron's PrivateUse1 registration, once per process): memory
    and the current device come from torch.accelerator, the RNG from torch.<type>; torch.cuda is
    not asked."""
    calls = []
    fake_acc = SimpleNamespace(
        is_available=lambda: True, current_accelerator=lambda: torch.device("hpu"),
        current_device_index=lambda: 3, set_device_index=lambda i: calls.append(f"set {i}"),
        reset_peak_memory_stats=lambda d: calls.append(f"reset {d}"), max_memory_allocated=lambda d: 123)
    fake_neuron = SimpleNamespace(is_initialized=lambda: True, get_rng_state_all=lambda: ["state"],
                                  set_rng_state_all=lambda s: calls.append(f"rng {s}"))
    monkeypatch.setattr(torch, "accelerator", fake_acc)
    monkeypatch.setattr(torch, "hpu", fake_neuron, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append("torch.cuda asked"))
    assert device.accelerator_type() == "hpu" and not device.cuda_available()
    assert device.current_device("hpu") == torch.device("hpu", 3)
    device.set_device(1)
    device.reset_peak_memory(torch.device("hpu", 1))
    assert device.max_memory_allocated(torch.device("hpu", 1)) == 123
    assert device.accelerator_rng_state() == ("hpu", ["state"])
    device.set_accelerator_rng_state("hpu", ["saved"])
    device.set_accelerator_rng_state("cuda", ["not here"])  # a CUDA checkpoint on another accelerator: skipped
    assert calls == ["set 1", "reset hpu:1", "rng ['saved']"]


# --------------------------------------------------------------------------- trainer.accelerator neuron
def _installed(monkeypatch, *names: str) -> None:
    """Only `names` of torch_neuronx / torch_xla are importable (importlib.util.find_spec is faked)."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("torch_neuronx", "torch_xla"):
            return ModuleSpec(name, None) if name in names else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _cfg(accelerator: str):
    return SimpleNamespace(trainer=SimpleNamespace(accelerator=accelerator))


def test_neuron_selects_torchneuron_native_device_where_it_is_registered(monkeypatch):
    _installed(monkeypatch, "torch_neuronx", "torch_xla")
    monkeypatch.setattr(device, "_neuron_registered", lambda: True)  # TorchNeuron autoloaded at import torch
    assert device.neuron_device("neuron") == "neuron"
    assert not device.use_xla(_cfg("neuron"))  # native device preferred over torch-xla
    device.check_neuron("neuron")  # no refusal
    assert device.use_xla(_cfg("xla"))  # xla still means torch-xla


def test_neuron_imports_torchneuron_when_autoload_is_off(monkeypatch):
    _installed(monkeypatch, "torch_neuronx")
    registered = []
    monkeypatch.setattr(device, "_neuron_registered", lambda: bool(registered))
    fake = ModuleType("torch_neuronx")
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    assert not device.native_neuron_available()  # the import registered nothing
    registered.append(True)
    assert device.native_neuron_available()


def test_neuron_keeps_the_torch_xla_path_without_torchneuron(monkeypatch):
    _installed(monkeypatch, "torch_xla")
    assert device.neuron_device("neuron") == "xla"
    assert device.use_xla(_cfg("neuron"))
    device.check_neuron("neuron")


def test_neuron_with_an_xla_era_torch_neuronx_and_no_torch_xla_is_refused(monkeypatch):
    _installed(monkeypatch, "torch_neuronx")
    monkeypatch.setattr(device, "_neuron_registered", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_neuronx", ModuleType("torch_neuronx"))
    with pytest.raises(ConfigError, match="provides no native `neuron` device .* torch-xla is not installed"):
        device.check_neuron("neuron")


def test_other_accelerators_are_not_neuron(monkeypatch):
    _installed(monkeypatch)
    for acc in ("auto", "cpu", "gpu", "xla"):
        assert device.neuron_device(acc) is None
        device.check_neuron(acc)


def test_neuron_trainer_on_the_native_device(monkeypatch):
    """build_trainer with TorchNeuron there: nxdt's NeuronAccelerator, NxdtStrategy on the `neuron`
    process group backend (the Trainer is not built: there is no neuron device here)."""
    built = {}
    monkeypatch.setattr(trainer_mod, "uses_native_neuron", lambda cfg: True)
    monkeypatch.setattr(trainer_mod, "use_xla", lambda cfg: False)
    monkeypatch.setattr(trainer_mod.pl, "Trainer", lambda **kwargs: built.update(kwargs))
    cfg = SimpleNamespace(trainer=SimpleNamespace(
        accelerator="neuron", devices=2, num_nodes=1, max_epochs=1, max_steps=1, log_every_n_steps=1,
        val_check_interval=1, check_val_every_n_epoch=1, num_sanity_val_steps=0, limit_val_batches=1,
        limit_test_batches=1, enable_progress_bar=False))
    layout = SimpleNamespace(world_size=2, tp=1)
    trainer_mod.build_trainer(cfg, layout, [], [])
    assert isinstance(built["accelerator"], NeuronAccelerator)
    assert built["strategy"].process_group_backend == "neuron"
    assert NeuronAccelerator.parse_devices(2) == [0, 1] and NeuronAccelerator.parse_devices([3]) == [3]
    assert native_neuron_strategy(layout).mesh_shape is layout


def test_neuron_without_torchneuron_or_torch_xla_stops_in_one_line(monkeypatch, kjv_prefix):
    """Through the training entry, in this process: exit 2, one line, before anything starts."""
    _installed(monkeypatch)
    run = train_in_process(["--config-name", "tiny_llama_cpu", f"data.data_prefix=[1.0,{kjv_prefix}]",
                            "trainer.accelerator=neuron"])
    errors = [line for line in run.err.splitlines() if line.startswith("error:")]
    assert run.rc == 2, (run.out[-2000:], run.err[-2000:])
    assert "Traceback" not in run.err
    assert len(errors) == 1, run.err
    assert "trainer.accelerator neuron: neither torch_neuronx (TorchNeuron, the native `neuron` device) nor " \
           "torch-xla is installed" in errors[0]


# --------------------------------------------------------------------------- the torch-free side of Neuron
def _torch_neuronx_version(monkeypatch, version: str | None) -> None:
    """importlib.metadata answers `version` for torch-neuronx (None: no metadata, a source tree)."""
    real = importlib.metadata.version

    def fake(name):
        if name == "torch-neuronx":
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)


def _run_cfg(accelerator: str, **top):
    """The typed config of a tiny run on `accelerator` with top-level keys `top` (Neuron's knobs)."""
    overrides = [f"trainer.accelerator={accelerator}"] + [f"{k}={v}" for k, v in top.items()]
    return load_config(["--config-name", "tiny_llama_cpu", *overrides], check_paths=False, quiet=True)


@pytest.mark.parametrize("version, installed, expected", [
    ("2.14.0", ("torch_neuronx",), "neuron"),                # TorchNeuron (Neuron 2.33+)
    ("2.14.0", ("torch_neuronx", "torch_xla"), "neuron"),    # preferred over torch-xla
    ("2.9.0.2.11.19965", ("torch_neuronx", "torch_xla"), "xla"),  # the XLA-era package (Neuron <= 2.28)
    (None, ("torch_neuronx",), "neuron"),                    # no metadata, no torch-xla: TorchNeuron
    (None, ("torch_neuronx", "torch_xla"), "xla"),
])
def test_config_layer_tells_torchneuron_from_the_xla_era_package(monkeypatch, version, installed, expected):
    """Before torch is imported (env vars, inert notices, the one-device rule), trainer.accelerator
    neuron means the native device where TorchNeuron is installed, torch-xla otherwise."""
    _installed(monkeypatch, *installed)
    _torch_neuronx_version(monkeypatch, version)
    cfg = _cfg("neuron")
    assert env.neuron_runtime(cfg, {}) == expected
    assert env.detect_xla(cfg, {}) is (expected == "xla")
    assert inert.backend_of(cfg, {}) == expected


def test_auto_on_a_neuron_machine_picks_torchneuron(monkeypatch):
    _installed(monkeypatch, "torch_neuronx")
    _torch_neuronx_version(monkeypatch, "2.14.0")
    hinted = {"NEURON_RT_VISIBLE_CORES": "0-31"}
    assert env.neuron_runtime(_cfg("auto"), hinted) == "neuron" and inert.backend_of(_cfg("auto"), hinted) == "neuron"
    assert env.neuron_runtime(_cfg("auto"), {**hinted, "PJRT_DEVICE": "TPU"}) is None  # another XLA device asked for
    assert env.detect_xla(_cfg("auto"), {**hinted, "PJRT_DEVICE": "TPU"})
    monkeypatch.setattr(device, "_neuron_registered", lambda: True)
    monkeypatch.setattr(env, "neuron_hinted", lambda environ=None: True)
    assert device.uses_native_neuron(_cfg("auto"), hinted) and device.uses_native_neuron(_cfg("neuron"))
    assert not device.use_xla(_cfg("auto"), hinted)
    assert local_device_type("neuron") == "neuron"


def test_torchneuron_gets_the_runtime_knobs_not_the_xla_precision_variables(monkeypatch):
    """apply_env on the native device: NEURON_RT_* / cache / compiler flags set, XLA_* and the presets'
    compiler flags not (precision is nxdt's own there); on torch-xla both."""
    _installed(monkeypatch, "torch_neuronx")
    _torch_neuronx_version(monkeypatch, "2.14.0")
    cfg = _run_cfg("neuron", neuron_rt_exec_timeout=600, compiler_flags="'--model-type=transformer'")
    environ: dict[str, str] = {}
    env.apply_env(cfg, environ)
    assert environ == {"NEURON_RT_EXEC_TIMEOUT": "600", "NEURON_EXPERIMENTAL_COMPRESS_RG": "0",
                       "NEURON_CC_FLAGS": "--model-type=transformer"}
    environ = {}
    env.apply_env(cfg, environ, is_xla=True)
    assert {"XLA_USE_BF16", "XLA_DOWNCAST_BF16"} <= set(environ) and environ["NEURON_RT_EXEC_TIMEOUT"] == "600"


def test_torchneuron_reports_the_xla_only_keys_inert_and_allows_several_devices(monkeypatch):
    _installed(monkeypatch, "torch_neuronx")
    _torch_neuronx_version(monkeypatch, "2.14.0")
    cfg = _run_cfg("neuron", compiler_cache_url="/tmp/cache", **{"exp_manager.save_xser": "true",
                                                                 "exp_manager.create_checkpoint_callback": "true",
                                                                 "model.fusions.torch_compile": "true",
                                                                 "trainer.devices": 2})
    keys = [key for key, _value, _why in inert.inert_keys(cfg)]
    assert keys == ["exp_manager.save_xser"]  # compile runs (TorchNeuron's backend); the cache URL is read
    check_xla_devices(cfg, Layout(pp=2, dp_shard=1))  # 2 devices, pp: the SPMD rule is torch-xla's
    monkeypatch.setattr(env, "torchneuron_installed", lambda: False)
    _installed(monkeypatch, "torch_neuronx", "torch_xla")
    check_xla_devices(cfg, Layout(dp_shard=2))  # SPMD trains and checkpoints (nxdt.parallel.xla_spmd)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size = 2 is not supported yet on XLA"):
        check_xla_devices(cfg, Layout(pp=2))


def test_compile_uses_torchneuron_backend_on_its_device(monkeypatch):
    assert device.compile_backend("neuron") == "neuron" and device.compile_backend("cpu") == "inductor"
    block = torch.nn.Linear(2, 2)
    seen = []
    monkeypatch.setattr(block, "compile", lambda **kwargs: seen.append(kwargs))
    model = torch.nn.Module()
    model.block = block
    apply_compile(model, paths=("block",), backend=device.compile_backend("neuron"))
    assert seen == [{"backend": "neuron"}]
    assert "TorchNeuron registers no `neuron` backend" in compile_backend_missing("neuron")
