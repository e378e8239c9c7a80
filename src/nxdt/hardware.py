"""What the machine can do: the peak matmul TFLOP/s of one device, the denominator of MFU.

`device_peak(device, compute_dtype, override)` picks, in this order:
  1. `trainer.peak_tflops` when set (any device);
  2. on CUDA / Neuron, the published dense (no sparsity) figure of the device for the run's
     compute dtype (`PEAK_TFLOPS`, by name);
  3. on CPU, a measured matmul peak (`cpu_matmul_peak`): a short square matmul in the compute
     dtype with this process's threads, cached per machine.
None when nothing applies (an unknown GPU): the run then logs no `mfu`.

The compute dtype is the precision preset's (nxdt.spec.precision: fp32 | bf16 | fp16).
fp32 on CUDA runs on TF32 tensor cores only if torch allows it (`torch.get_float32_matmul_precision()`
"high" or "medium"; nxdt leaves torch's default "highest"), else on the plain FP32 units.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nxdt.config.env import neuron_hinted
from nxdt.device import bf16_native, cuda_available, device_name, native_neuron_available

# Dense TFLOP/s per device by compute dtype ("tf32": fp32 matmuls on tensor cores). Sources:
# - NVIDIA H100 / H200 datasheets (sparsity figures halved): SXM 989.4 bf16/fp16, 494.7 TF32,
#   66.9 FP32; PCIe 756 / 378 / 51; NVL 835 / 418 / 60 (H200 NVL as H100 NVL); H200 SXM = H100 SXM.
# - NVIDIA A100 datasheet: 312 bf16/fp16, 156 TF32, 19.5 FP32 (SXM and PCIe alike).
# - AWS Neuron docs, "Trainium Architecture": a Trainium chip (2 NeuronCore-v2) delivers 190
#   FP16/BF16/TF32 TFLOPS and 47.5 FP32: per NeuronCore (one XLA device on trn1) 95 and 23.75.
# - AWS Neuron docs, "Trainium2 Architecture": a Trainium2 chip (8 NeuronCore-v3) delivers 667
#   BF16/FP16/TF32 TFLOPS and 181 FP32: per physical core 83.4 and 22.6; one XLA device is
#   trainer.lnc cores (LNC=2 by default on trn2).
# Matched in order, first hit wins (more specific names first).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("trn1", {"bf16": 95.0, "fp16": 95.0, "tf32": 95.0, "fp32": 23.75}),
    ("trn2", {"bf16": 83.4, "fp16": 83.4, "tf32": 83.4, "fp32": 22.6}),
]

CACHE_ENV = "NXDT_CPU_PEAK_CACHE"
"""`0` (or `off`): measure every time, keep no file; a path: the cache file to use."""

PROBE_SECONDS = 0.25
"""Wall-clock budget of one CPU probe (sizes grow until a matmul takes ~20 ms, then repeat)."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Peak:
    tflops: float
    """Peak dense TFLOP/s of one device (one rank) for the run's compute dtype."""
    source: str
    """Where the figure comes from, for the start summary."""
    measured: str | None = None
    """The dtype of a CPU figure measured on this machine (cpu_matmul_peak), None for a table's."""


def local_device_type(accelerator: str) -> str | None:
    """The device `trainer.accelerator` means on this machine: "cuda" (gpu / cuda / auto with a GPU),
    "neuron" (neuron, or auto on a Neuron machine, where TorchNeuron provides the native device), "cpu"
    (cpu, or auto without either), None for anything else (a GPU asked for and none here, xla)."""
    if accelerator in ("neuron", "auto") and native_neuron_available() and (accelerator == "neuron" or neuron_hinted()):
        return "neuron"
    if accelerator in ("gpu", "cuda", "auto") and cuda_available():
        return "cuda"
    return "cpu" if accelerator in ("cpu", "auto") else None


def table_peak(name: str, dtype: str) -> float | None:
    """The table's TFLOP/s for a device name (nxdt.device.device_name, or "trn1" / "trn2")
    and a compute dtype (fp32 | tf32 | bf16 | fp16); None for a device not in the table."""
    for key, figures in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return figures[dtype]
    return None


def _cuda_dtype(compute_dtype: str) -> str:
    if compute_dtype != "fp32":
        return compute_dtype
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _neuron_name() -> str | None:
    """trn1 / trn2 from the EC2 instance type (DMI product name), None elsewhere."""
    try:
        product = Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip().lower()
    except OSError:
        return None
    return next((kind for kind in ("trn2", "trn1") if product.startswith(kind)), None)


def device_peak(device: torch.device | str, compute_dtype: str, override: float | None = None,
                lnc: int | None = None) -> Peak | None:
    """The peak TFLOP/s of one rank's device (see the module docstring)."""
    if override:
        return Peak(float(override), "trainer.peak_tflops")
    kind = torch.device(device).type
    if kind == "cuda":
        name = device_name(device)
        dtype = _cuda_dtype(compute_dtype)
        tflops = table_peak(name, dtype)
        return Peak(tflops, f"{name}, dense {dtype}") if tflops else None
    if kind == "xla":
        name = _neuron_name()
        tflops = table_peak(name, compute_dtype) if name else None
        if tflops is None:
            return None
        cores = (lnc or 2) if name == "trn2" else 1  # one XLA device = one logical NeuronCore
        return Peak(tflops * cores, f"{name} NeuronCore x{cores}, dense {compute_dtype}")
    if kind == "cpu":
        tflops = cpu_matmul_peak(compute_dtype)
        threads = torch.get_num_threads()
        return Peak(tflops, f"measured {compute_dtype} matmul on {cpu_model()}, "
                            f"{threads} thread{'s' if threads != 1 else ''}", measured=compute_dtype)
    return None


# --------------------------------------------------------------------------- CPU probe


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cache_path() -> Path | None:
    """$NXDT_CPU_PEAK_CACHE, else $XDG_CACHE_HOME/nxdt/cpu_peak.json (~/.cache by default);
    None when the cache is switched off."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "false", "no") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nxdt" / "cpu_peak.json"


def probe_matmul_tflops(dtype: str, budget_s: float = PROBE_SECONDS) -> float:
    """Best TFLOP/s of square n x n matmuls in `dtype` with this process's threads.

    The size doubles from 128 while the next one is predicted (at the best rate so far) to take
    under 50 ms, up to n = 2048; that size is then repeated until the budget is spent, and the
    best rate counts (the first call of a size warms it up). Time-boxed: a CPU without fast
    bf16 kernels (AVX2 only: ~1 GFLOP/s) stops after a few small matmuls instead of minutes.
    """
    torch_dtype = _DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    # the first matmul of a process starts the thread pool and picks kernels (0.3 s here, longer
    # than the budget): done before the clock starts, else it is the only, far too slow, sample
    warm = torch.randn(256, 256, generator=gen).to(torch_dtype)
    torch.mm(warm, warm)
    deadline = time.perf_counter() + budget_s
    n, best = 128, 0.0

    def timed_mm(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return max(time.perf_counter() - start, 1e-9)

    while True:
        a = torch.randn(n, n, generator=gen).to(torch_dtype)
        b = torch.randn(n, n, generator=gen).to(torch_dtype)
        timed_mm(a, b)  # a new size's first call picks its kernel and blocking: not a sample
        best = max(best, 2 * n**3 / timed_mm(a, b))
        if n >= 2048 or 2 * (2 * n) ** 3 / best > 0.05 or time.perf_counter() >= deadline:
            break
        n *= 2
    while time.perf_counter() + 2 * n**3 / best < deadline:
        best = max(best, 2 * n**3 / timed_mm(a, b))
    return best / 1e12


def _cache_key(dtype: str) -> str:
    # the capability too: VMs often name only the family ("AMD EPYC"), and one family holds CPUs
    # with and without native bf16 (70x apart)
    return (f"{cpu_model()} | {cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads | {dtype}")


def _read_cache(path: Path | None) -> dict[str, float]:
    if path is None or not path.is_file():
        return {}
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a torn or foreign file: measure and rewrite it
    return cached if isinstance(cached, dict) else {}


def _write_cache(path: Path | None, cached: dict[str, float]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks writing at once: each renames whole
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the figure is still right, only not remembered


def cpu_matmul_peak(dtype: str, remeasure: bool = False) -> float:
    """TFLOP/s of one process's matmuls in `dtype`, read from the cache or measured and stored.
    The key is the CPU model and capability, torch version, thread count and dtype: anything that
    changes the kernels or their parallelism measures again. A new measurement never lowers a
    stored one (ranks of one run measure at once; a probe slowed by other load is the lower one);
    `remeasure=True` probes even when a figure is stored (and keeps the higher)."""
    key, path = _cache_key(dtype), cache_path()
    cached = _read_cache(path)
    if not remeasure and isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key])
    tflops = probe_matmul_tflops(dtype)
    latest = _read_cache(path)  # another rank may have written meanwhile
    best = max(tflops, float(latest.get(key, 0) or 0))
    _write_cache(path, {**latest, key: best})
    return best


def forget_cpu_peak(dtype: str) -> None:
    """Drop this machine's stored figure for `dtype` (a run went faster than it: it was measured
    under other load), so that the next run measures again."""
    path = cache_path()
    cached = _read_cache(path)
    if cached.pop(_cache_key(dtype), None) is not None:
        _write_cache(path, cached)


# --------------------------------------------------------------------------- what a CPU runs natively
# /proc/cpuinfo flags of the matmul units that compute each low-precision dtype natively
NATIVE_FLAGS = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_capability() -> str:
    """torch's CPU kernel level (`AVX2`, `AVX512`, ...) and the native low-precision units found,
    e.g. `AVX512 + AMX-BF16, AVX512-BF16` or `AVX2 (no native bf16)`."""
    level = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    units = [flag.upper().replace("_", "-") for flags_of in NATIVE_FLAGS.values() for flag in flags_of if flag in flags]
    return f"{level} + {', '.join(units)}" if units else f"{level} (no native bf16)"


def _rate(tflops: float) -> str:
    return f"{tflops:,.4g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:,.4g} GFLOP/s"


def machine_line(dtypes: tuple[str, ...] = ("fp32", "bf16"), peaks: dict[str, float] | None = None) -> str:
    """One line for the top of a benchmark table: the CPU, its capability, this process's threads
    and its measured matmul peak per dtype (cached per machine, like MFU's; `peaks`: TFLOP/s per
    dtype the caller measured itself)."""
    peaks = peaks or {dtype: cpu_matmul_peak(dtype) for dtype in dtypes}
    text = ", ".join(f"{dtype} {_rate(tflops)}" for dtype, tflops in peaks.items())
    if "fp32" in peaks and "bf16" in peaks and peaks["bf16"] < peaks["fp32"]:
        text += f" (bf16 {peaks['fp32'] / peaks['bf16']:.3g}x slower)"
    threads = torch.get_num_threads()
    return f"cpu: {cpu_model()} | {cpu_capability()} | {threads} thread{'s' if threads != 1 else ''} | matmul peak {text}"


def low_precision_notice(device: torch.device | str, compute_dtype: str, preset: str) -> str | None:
    """One line when the precision preset computes in bf16/fp16 on a device that runs it slower than
    fp32 (a CPU without AMX/AVX512-BF16 kernels: measured, both dtypes; a GPU without native bf16),
    with the numbers and what to use instead; None when the preset fits the device."""
    if compute_dtype == "fp32":
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        fp32, low = cpu_matmul_peak("fp32"), cpu_matmul_peak(compute_dtype)
        if low < fp32:  # before telling a user to change the preset: is the stored figure a probe
            low = cpu_matmul_peak(compute_dtype, remeasure=True)  # slowed by other load? (half a second)
        if low >= fp32:
            return None
        native = any(flag in cpu_flags() for flag in NATIVE_FLAGS.get(compute_dtype, ()))
        return (f"notice: precision.type={preset} computes in {compute_dtype}, which this CPU ({cpu_model()}, "
                f"{cpu_capability()}) runs {'slower than fp32' if native else 'without native kernels'}: measured "
                f"matmul {compute_dtype} {_rate(low)} vs fp32 {_rate(fp32)}, {fp32 / low:.3g}x slower; expect the "
                f"steps to be up to that much slower than with precision.type=fp32 (the run goes on as configured)")
    if kind == "cuda" and compute_dtype == "bf16" and not bf16_native(device):
        name = device_name(device)
        return (f"notice: precision.type={preset} computes in bf16, which {name} has no native support for "
                f"(compute capability < 8.0): expect it to be slower than fp16 or fp32; use precision.type=fp32 "
                f"(or an fp16 preset) here (the run goes on as configured)")
    return None
