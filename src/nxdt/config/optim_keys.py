"""Names and keys of `model.optim` and `model.optim.sched`, checked before torch is imported.

This module imports only the standard library: `nxdt.config.validate` calls
`check_optim` while the environment (Neuron / precision variables) is still
being prepared, before torch may be loaded.

`OPTIMIZERS[name]` and `SCHEDULERS[name]` map every key a name accepts to its
default (the default of the torch / NeMo class it builds). `REQUIRED` marks a
key without a default. The builders in `nxdt.optim.optimizers` and
`nxdt.optim.schedulers` use these same tables, so a key that passes here is
a key the builder knows. `VALUE_RANGES` gives the valid range of a numeric key
(`nxdt.config.ranges`' notation), so `model.optim.lr=-1` stops here, in one line,
rather than as torch's ValueError. `sched_rules` relates the schedule's steps to
max_steps and its min_lr to the lr: validation and `build_scheduler` call it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from nxdt.config import ranges
from nxdt.config.errors import ConfigError

REQUIRED = "???"  # OmegaConf's own "missing value" marker

# Keys every `model.optim` may hold besides the optimizer's own arguments.
# `capturable` is accepted for every optimizer because NxDT's shipped configs
# always write it; the builder passes it only to classes that take it.
OPTIM_COMMON_KEYS = ("name", "sched", "capturable")

_BETAS = (0.9, 0.999)

# name -> {argument: default}; defaults are those of the class it builds.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {
        "lr": 1e-3, "betas": _BETAS, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
        "maximize": False, "foreach": None, "fused": None,
    },
    # AdamW whose moments (and a master copy of bf16/fp16 params) stay fp32.
    "adamw_fp32OptState": {
        "lr": 1e-3, "betas": _BETAS, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
        "maximize": False,
    },
    "adam": {
        "lr": 1e-3, "betas": _BETAS, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
        "maximize": False, "foreach": None, "fused": None, "decoupled_weight_decay": False,
    },
    "sgd": {
        "lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
        "maximize": False, "foreach": None, "fused": None,
    },
    "adadelta": {
        "lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0, "maximize": False, "foreach": None,
    },
    "adamax": {
        "lr": 2e-3, "betas": _BETAS, "eps": 1e-8, "weight_decay": 0.0, "maximize": False, "foreach": None,
    },
    "adagrad": {
        "lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
        "eps": 1e-10, "maximize": False, "foreach": None, "fused": None,
    },
    "rmsprop": {
        "lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0,
        "centered": False, "maximize": False, "foreach": None,
    },
    # torch's Rprop has no weight decay.
    "rprop": {
        "lr": 1e-2, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50.0), "maximize": False, "foreach": None,
    },
    # NeMo's Novograd (nemo/core/optim/novograd.py), defaults included.
    "novograd": {
        "lr": 1e-3, "betas": (0.95, 0.98), "eps": 1e-8, "weight_decay": 0.0,
        "grad_averaging": False, "amsgrad": False, "luc": False, "luc_trust": 1e-3, "luc_eps": 1e-8,
    },
    "adafactor": {
        "lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.0,
        "maximize": False, "foreach": None,
    },
    # GPT-NeoX's (nxdt.optim.neox), NeoX's defaults.
    "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    "sm3": {"lr": 0.1, "momentum": 0.0, "beta": 0.0, "eps": 1e-30},
}

# NeoX optimizer names that need DeepSpeed, by their spelling lower-cased without '_' / '-'.
_ADAMW_INSTEAD = "use adamw (fused on CPU/CUDA)"
NEEDS_DEEPSPEED = {
    "onebitadam": f"DeepSpeed's 1-bit Adam (compressed all-reduce) needs DeepSpeed, which nxdt does not use; "
                  f"{_ADAMW_INSTEAD}, with distributed_strategy.zero1 or FSDP to shard its state",
    "cpuadam": f"DeepSpeed's CPU Adam (ZeRO-Offload) needs DeepSpeed, which nxdt does not use; {_ADAMW_INSTEAD}, "
               f"and FSDP with distributed_strategy.cpu_offload=true to keep its state in host memory",
    "cputorchadam": f"NeoX's torch Adam on CPU runs under DeepSpeed's ZeRO-Offload, which nxdt does not use; "
                    f"{_ADAMW_INSTEAD}, and FSDP with distributed_strategy.cpu_offload=true to keep its state "
                    f"in host memory",
}

# SM3 couples every row and column of a parameter through its accumulators, so a sharded
# parameter would need a max over ranks at each step; nxdt refuses it instead.
SM3_SHARDED = ("model.optim.name: sm3 keeps one accumulator per row and per column of a parameter, which a "
               "sharded parameter cannot keep exactly; use sm3 with tensor_model_parallel_size=1, "
               "expert_model_parallel_size=1 and no FSDP/HSDP (DDP or ZeRO-1 are fine), or use adagrad")

# Keys every `model.optim.sched` may hold. `monitor` and `reduce_on_plateau`
# are NeMo's Lightning keys: accepted so NeMo configs load, and ignored
# (nxdt always steps the scheduler once per optimizer step).
SCHED_COMMON_KEYS = ("name", "max_steps", "last_epoch", "monitor", "reduce_on_plateau")

_WARMUP = {"warmup_steps": None, "warmup_ratio": None}

# name -> {argument: default}, from NeMo's nemo/core/optim/lr_scheduler.py
# (LinearAnnealingWithWarmUp from NxDT, StepLR / ExponentialLR from torch).
SCHEDULERS: dict[str, dict[str, Any]] = {
    "LinearAnnealingWithWarmUp": {"warmup_steps": 0},
    "CosineAnnealing": {**_WARMUP, "constant_steps": None, "constant_ratio": None, "min_lr": 0.0},
    "WarmupPolicy": {**_WARMUP, "min_lr": 0.0},
    "WarmupHoldPolicy": {**_WARMUP, "hold_steps": None, "hold_ratio": None, "min_lr": 0.0},
    "SquareAnnealing": {**_WARMUP, "min_lr": 1e-5},
    "NoamAnnealing": {"d_model": REQUIRED, **_WARMUP, "min_lr": 0.0},
    "WarmupAnnealing": {**_WARMUP, "min_lr": 0.0},
    "StepLR": {"step_size": REQUIRED, "gamma": 0.1},
    "ExponentialLR": {"gamma": REQUIRED},
}


# key of model.optim or model.optim.sched -> its valid range (torch's and NeMo's own checks, and
# what a value means: lr 0 freezes the weights, a legitimate run; a negative lr ascends the loss)
_UNIT = {"ge": 0, "lt": 1}
VALUE_RANGES: dict[str, dict[str, Any]] = {
    "lr": {"ge": 0}, "weight_decay": {"ge": 0}, "eps": {"gt": 0}, "betas": _UNIT, "momentum": {"ge": 0},
    "dampening": {"ge": 0}, "rho": {"ge": 0, "le": 1}, "alpha": {"ge": 0}, "lr_decay": {"ge": 0},
    "initial_accumulator_value": {"ge": 0}, "etas": {"gt": 0}, "step_sizes": {"gt": 0}, "luc_trust": {"ge": 0},
    "luc_eps": {"ge": 0}, "beta2_decay": {"le": 0}, "d": {"gt": 0}, "beta": _UNIT,
    # sched
    "warmup_steps": {"ge": 0}, "warmup_ratio": {"ge": 0, "le": 1}, "constant_steps": {"ge": 0},
    "constant_ratio": {"ge": 0, "le": 1}, "hold_steps": {"ge": 0}, "hold_ratio": {"ge": 0, "le": 1},
    "min_lr": {"ge": 0}, "max_steps": {"ge": 1, "also": (-1,)}, "d_model": {"ge": 1}, "step_size": {"ge": 1},
    "gamma": {"gt": 0}, "last_epoch": {"ge": -1},
}


def _check_ranges(cfg: Mapping, path: str) -> None:
    for key, value in cfg.items():
        if key in VALUE_RANGES and value is not None:
            message = ranges.check(f"{path}.{key}", value, VALUE_RANGES[key])
            if message:
                raise ConfigError(message)


def _did_you_mean(word: str, choices) -> str:
    choices = list(choices)
    close = [c for c in choices if c.lower() == word.lower()]  # AdamW -> adamw
    close = close or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_name(name: Any, table: Mapping[str, Any], path: str, what: str) -> None:
    if name is None or name == "":
        raise ConfigError(f"{path}: missing; valid {what}s: {', '.join(table)}")
    if name not in table:
        hint = _did_you_mean(str(name), table)
        raise ConfigError(f"{path}: unknown {what} '{name}'{hint}; valid: {', '.join(table)}")


def _check_keys(cfg: Mapping, allowed, path: str, owner: str) -> None:
    for key in cfg:
        if key not in allowed:
            hint = _did_you_mean(str(key), allowed) or f"; {owner} takes: {', '.join(allowed)}"
            raise ConfigError(f"{path}.{key}: unknown key{hint}")


def check_optim(optim: Mapping, path: str = "model.optim") -> None:
    """Raise ConfigError (one line, naming the dotted key) if `optim` has a bad name or key.

    `optim.sched` may be absent or None (constant learning rate).
    """
    if not isinstance(optim, Mapping):
        raise ConfigError(f"{path}: expected a mapping with at least 'name' and 'lr', got {optim!r}")
    name = optim.get("name")
    spelling = str(name).lower().replace("_", "").replace("-", "")  # OneBitAdam, CPU_Adam, cpu_adam
    if spelling in NEEDS_DEEPSPEED:
        raise ConfigError(f"{path}.name: '{name}': {NEEDS_DEEPSPEED[spelling]}")
    _check_name(name, OPTIMIZERS, f"{path}.name", "optimizer")
    _check_keys(optim, (*OPTIM_COMMON_KEYS, *OPTIMIZERS[name]), path, f"optimizer '{name}'")
    _check_ranges(optim, path)

    check_sched(optim.get("sched"), f"{path}.sched")


def check_optim_parallel(optim: Mapping, *, tp: int, ep: int, fsdp_ways: int) -> None:
    """Raise ConfigError if `optim` names sm3 and parameters will be sharded: tensor parallel
    (tp > 1), expert parallel (ep > 1), or FSDP/HSDP over more than one rank (fsdp_ways =
    dp x cp under a sharding strategy, else 1). nxdt.optim.neox.SM3 also refuses
    a sharded parameter when it is built; this check says so before anything is built."""
    if optim.get("name") == "sm3" and (tp > 1 or ep > 1 or fsdp_ways > 1):
        raise ConfigError(f"{SM3_SHARDED} (got tensor_model_parallel_size={tp}, "
                          f"expert_model_parallel_size={ep}, FSDP over {fsdp_ways} ranks)")


def check_sched(sched: Mapping | None, path: str = "model.optim.sched") -> None:
    """Raise ConfigError if `sched` names an unknown scheduler or key; None (constant lr) passes."""
    if sched is None:
        return
    if not isinstance(sched, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'name' (or null for a constant lr), got {sched!r}")
    name = sched.get("name")
    _check_name(name, SCHEDULERS, f"{path}.name", "scheduler")
    allowed = SCHEDULERS[name]
    _check_keys(sched, (*SCHED_COMMON_KEYS, *allowed), path, f"scheduler '{name}'")
    for key, default in allowed.items():
        if default == REQUIRED and sched.get(key) in (None, REQUIRED):
            raise ConfigError(f"{path}.{key}: required by scheduler '{name}'")
    for a, b in (("warmup_steps", "warmup_ratio"), ("hold_steps", "hold_ratio"),
                 ("constant_steps", "constant_ratio")):
        if sched.get(a) is not None and sched.get(b) is not None:
            raise ConfigError(f"{path}: set {a} or {b}, not both")
    _check_ranges(sched, path)


def resolve_steps(steps: int | None, ratio: float | None, max_steps: int | None) -> int:
    """NeMo's `x_steps` / `x_ratio` resolution: an explicit count, else int(ratio x max_steps), else 0."""
    if steps is not None:
        return int(steps)
    if ratio is not None:
        if max_steps is None:
            raise ConfigError("a *_ratio in model.optim.sched needs max_steps")
        return int(ratio * max_steps)
    return 0


# schedulers whose lr follows warmup, then decays to min_lr at max_steps (NeMo)
_DECAYING = ("CosineAnnealing", "SquareAnnealing", "WarmupAnnealing", "WarmupHoldPolicy", "LinearAnnealingWithWarmUp")
# schedulers that raise mid-run (NeMo) when the lr starts below min_lr
_NEEDS_LR_ABOVE_MIN = ("CosineAnnealing", "NoamAnnealing")


def sched_rules(optim: Mapping, max_steps: int | None = None, lr: float | None = None,
                path: str = "model.optim") -> list[str]:
    """The one rule between the schedule and the run's length and lr, for validation (before
    anything starts) and `nxdt.optim.schedulers.build_scheduler`.

    `max_steps`: the schedule's (default: optim.sched.max_steps; -1 or None = training by epochs);
    `lr`: the optimizer's (default: optim.lr, else the optimizer's default). Raises ConfigError for
    a schedule that cannot run: min_lr above the lr (NeMo fails at the first step after warmup),
    or CosineAnnealing with constant_steps and neither warmup nor decay steps (a division by
    zero at step 0). Returns notices for a schedule that runs but not as it reads: warmup not
    over by max_steps, or warmup + constant steps beyond it (the lr drops to min_lr after warmup
    without decaying, as NeMo does).
    """
    sched = optim.get("sched")
    if not isinstance(sched, Mapping) or sched.get("name") not in SCHEDULERS:
        return []
    name, spath = sched["name"], f"{path}.sched"
    if lr is None:
        lr = optim.get("lr", OPTIMIZERS.get(optim.get("name"), {}).get("lr"))
    min_lr = sched.get("min_lr", SCHEDULERS[name].get("min_lr", 0.0))
    if name in _NEEDS_LR_ABOVE_MIN and lr is not None and min_lr is not None and lr < min_lr:
        raise ConfigError(f"{spath}.min_lr: {min_lr} is above the learning rate {lr} ({path}.lr)")
    if max_steps is None:
        max_steps = sched.get("max_steps")
    if name not in _DECAYING or max_steps is None or max_steps < 0:
        return []
    warmup = resolve_steps(sched.get("warmup_steps"), sched.get("warmup_ratio"), max_steps)
    constant = resolve_steps(sched.get("constant_steps"), sched.get("constant_ratio"), max_steps)
    if name != "CosineAnnealing":
        constant = 0
    if constant > 0 and warmup == 0 and warmup + constant == max_steps:
        raise ConfigError(f"{spath}: constant_steps ({constant}) = max_steps ({max_steps}) with no warmup_steps "
                          "leaves no steps to decay over; lower constant_steps")
    if warmup >= max_steps:
        return [f"{spath}.warmup_steps ({warmup}) >= max_steps ({max_steps}): the run ends before the warmup "
                f"does, the lr never reaches {path}.lr"]
    if warmup + constant > max_steps:
        return [f"{spath}: warmup_steps ({warmup}) + constant_steps ({constant}) > max_steps ({max_steps}): "
                "the lr drops to min_lr right after the warmup, with no decay (as NeMo)"]
    return []
