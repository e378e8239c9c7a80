"""A precision section reduced to what the code does with it (torch-free).

`precision_settings(cfg.precision)` turns the preset (`precision.type`), GPT-NeoX fp16
(`precision.fp16.enabled`) and the manual flags into a `PrecisionSettings`, with the compute
dtype as a name ("fp32" | "bf16" | "fp16"); ConfigError on combinations that mean nothing.
Validation calls it, so a bad combination is reported before torch is loaded;
`nxdt.precision` maps the dtype name to torch. This module imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.schema import normalize_precision

# presets fp16 loss scaling can be combined with (fp16 keeps fp32 master weights itself)
FP16_COMBINABLE = ("fp32", "autocast", "mixed_precision", "manual")


@dataclass(frozen=True)
class PrecisionSettings:
    """What a precision preset means for the code."""

    ptype: str
    """The preset, normalised (mixed_precision_SR -> mixed_precisionSR)."""
    mode: str
    """fp32 | autocast | master (low-precision copy + fp32 master weights) | lowp (low precision only)."""
    compute_dtype: str
    """fp32 | bf16 | fp16: the dtype the forward and backward run in."""
    stochastic: bool
    """Round to bf16 stochastically."""
    fp32_grad_acc: bool
    """Accumulate gradients in fp32."""
    fp16: bool
    """GPT-NeoX fp16 with a (dynamic) loss scale."""
    reduce_dtype: str = "fp32"
    """fp32 | bf16: the dtype FSDP reduces gradients in (precision.grad_reduce_dtype)."""


# preset -> (mode, compute dtype, stochastic rounding); gradients accumulate in fp32 for all of them
PRESETS = {
    "fp32": ("fp32", "fp32", False),
    "autocast": ("autocast", "bf16", False),
    "mixed_precision": ("master", "bf16", False),
    "mixed_precisionSR": ("master", "bf16", True),
    "bf16SR": ("lowp", "bf16", True),
}


def precision_settings(pcfg: Any) -> PrecisionSettings:
    """`cfg.precision` -> PrecisionSettings; ConfigError on combinations that mean nothing."""
    settings = _settings(pcfg)
    reduce = str(getattr(pcfg, "grad_reduce_dtype", "fp32"))
    if reduce == "bf16" and settings.fp16:
        raise ConfigError("precision.grad_reduce_dtype=bf16: cannot be combined with precision.fp16.enabled "
                          "(fp16 gradients are unscaled in fp32)")
    return replace(settings, reduce_dtype=reduce)


def _settings(pcfg: Any) -> PrecisionSettings:
    ptype = normalize_precision(str(pcfg.type))
    if pcfg.fp16.enabled:
        if ptype not in FP16_COMBINABLE:
            raise ConfigError(f"precision.fp16.enabled: cannot be combined with precision.type {ptype} "
                              "(fp16 uses fp32 master weights; use type fp32 or mixed_precision)")
        return PrecisionSettings(ptype, "master", "fp16", False, True, True)
    if ptype in PRESETS:
        mode, dtype, stochastic = PRESETS[ptype]
        return PrecisionSettings(ptype, mode, dtype, stochastic, True, False)
    if ptype == "manual":
        low = str(pcfg.xla_use_bf16) == "1" or str(pcfg.xla_downcast_bf16) == "1"
        if not low:
            return PrecisionSettings(ptype, "fp32", "fp32", False, True, False)
        sr = str(pcfg.neuron_rt_stochastic_rounding_en) == "1"
        mode = "master" if pcfg.master_weights else "lowp"
        return PrecisionSettings(ptype, mode, "bf16", sr, bool(pcfg.fp32_grad_acc), False)
    raise ConfigError(f"precision.type: unknown preset '{ptype}'")
