"""Learning-rate schedules named by `model.optim.sched` (NeMo / NxDT names).

    sched:
      name: CosineAnnealing
      warmup_steps: 100
      constant_steps: 0
      min_lr: 1e-5
      max_steps: ${trainer.max_steps}     # defaults to trainer.max_steps

The formulas are NeMo's (nemo/core/optim/lr_scheduler.py) line for line,
including its quirks; `LinearAnnealingWithWarmUp` is NxDT's (transformers'
linear schedule). `step` is the scheduler's `last_epoch`: the number of
optimizer steps taken, so the lr of optimizer step k (0-based) is lr(k).
The scheduler is stepped once per optimizer step.

One deliberate difference: where NeMo uses the first param group's lr for
every group (CosineAnnealing with constant_steps, WarmupAnnealing), each
group here uses its own. nxdt's groups share one lr, so the values agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from nxdt.config import optim_keys
from nxdt.config.errors import ConfigError


# NeMo's `x_steps` / `x_ratio` resolution, shared with validation's schedule rule
_steps = optim_keys.resolve_steps


class _ClosedFormScheduler(LRScheduler):
    """An LRScheduler whose lr is a function of (step, base lr) alone; subclasses define `lr_at`."""

    def lr_at(self, step: int, base_lr: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, base_lr) for base_lr in self.base_lrs]

    _get_closed_form_lr = get_lr


class WarmupPolicy(_ClosedFormScheduler):
    """Linear warmup to the base lr, then constant; `min_lr` after `max_steps` (None: never)."""

    def __init__(self, optimizer, *, warmup_steps=None, warmup_ratio=None, max_steps=None,
                 min_lr=0.0, last_epoch=-1):
        self.max_steps = max_steps
        self.warmup_steps = _steps(warmup_steps, warmup_ratio, max_steps)
        self.min_lr = min_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step, base_lr):
        if step <= self.warmup_steps and self.warmup_steps > 0:
            return self._warmup_lr(step, base_lr)
        if self.max_steps is not None and step > self.max_steps:
            return self.min_lr
        return self._decay_lr(step, base_lr)

    def _warmup_lr(self, step, base_lr):
        return base_lr * (step + 1) / (self.warmup_steps + 1)

    def _decay_lr(self, step, base_lr):
        return base_lr


class WarmupHoldPolicy(WarmupPolicy):
    """WarmupPolicy that holds the base lr for `hold_steps` after warmup (then, in NeMo, constant too)."""

    def __init__(self, optimizer, *, warmup_steps=None, warmup_ratio=None, hold_steps=None,
                 hold_ratio=None, max_steps=None, min_lr=0.0, last_epoch=-1):
        warmup = _steps(warmup_steps, warmup_ratio, max_steps)
        # NeMo: hold_steps counts from step 0 (warmup included); 0 when neither is given.
        if hold_steps is None and hold_ratio is None:
            self.hold_steps = 0
        else:
            self.hold_steps = _steps(hold_steps, hold_ratio, max_steps) + warmup
        super().__init__(optimizer, warmup_steps=warmup, max_steps=max_steps, min_lr=min_lr,
                         last_epoch=last_epoch)

    def lr_at(self, step, base_lr):
        if step <= self.warmup_steps and self.warmup_steps > 0:
            return self._warmup_lr(step, base_lr)
        if self.warmup_steps <= step < self.hold_steps:
            return base_lr
        if step > self.max_steps:
            return self.min_lr
        return self._decay_lr(step, base_lr)


class WarmupAnnealHoldPolicy(_ClosedFormScheduler):
    """Warmup, decay over `decay_steps`, then `min_lr` for the last `constant_steps` and after `max_steps`."""

    def __init__(self, optimizer, *, warmup_steps=None, warmup_ratio=None, constant_steps=None,
                 constant_ratio=None, max_steps=None, min_lr=0.0, last_epoch=-1):
        self.max_steps = max_steps
        self.warmup_steps = _steps(warmup_steps, warmup_ratio, max_steps)
        self.constant_steps = _steps(constant_steps, constant_ratio, max_steps)
        self.decay_steps = max_steps - (self.constant_steps + self.warmup_steps)
        self.min_lr = min_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step, base_lr):
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self._warmup_lr(step, base_lr)
        if self.constant_steps > 0 and self.warmup_steps + self.decay_steps < step <= self.max_steps:
            return self._constant_lr(step, base_lr)
        if step > self.max_steps:
            return self.min_lr
        return self._decay_lr(step, base_lr)

    def _warmup_lr(self, step, base_lr):
        return base_lr * (step + 1) / (self.warmup_steps + 1)

    def _constant_lr(self, step, base_lr):
        return self.min_lr

    def _decay_lr(self, step, base_lr):
        return base_lr


def _square_annealing(initial_lr, step, max_steps, min_lr):
    mult = ((max_steps - step) / max_steps) ** 2
    return max(initial_lr * mult, min_lr)


def _cosine_annealing(initial_lr, step, max_steps, min_lr):
    mult = 0.5 * (1 + math.cos(math.pi * step / max_steps))
    return (initial_lr - min_lr) * mult + min_lr


def _linear_warmup_with_cosine_annealing(max_lr, warmup_steps, step, decay_steps, min_lr):
    """Megatron-LM's cosine: warmup lr·step/warmup (0 at step 0), cosine over decay_steps, then min_lr."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * float(step) / float(warmup_steps)
    if step > warmup_steps + decay_steps:
        return min_lr
    decay_ratio = float(step - warmup_steps) / float(decay_steps)
    coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


class CosineAnnealing(WarmupAnnealHoldPolicy):
    """NeMo's CosineAnnealing.

    constant_steps == 0: warmup lr·(step+1)/(warmup+1), then cosine from lr to
    min_lr over max_steps − warmup. constant_steps > 0: Megatron's schedule
    (`_linear_warmup_with_cosine_annealing`), min_lr for the last constant_steps.
    min_lr after max_steps either way.
    """

    def __init__(self, optimizer, *, max_steps, min_lr=0.0, last_epoch=-1, **kwargs):
        super().__init__(optimizer, max_steps=max_steps, min_lr=min_lr, last_epoch=last_epoch, **kwargs)

    def _megatron(self, step, base_lr):
        return _linear_warmup_with_cosine_annealing(base_lr, self.warmup_steps, step, self.decay_steps,
                                                    self.min_lr)

    def _warmup_lr(self, step, base_lr):
        if not self.constant_steps:
            return super()._warmup_lr(step, base_lr)
        return self._megatron(step, base_lr)

    def _constant_lr(self, step, base_lr):
        return self._megatron(step, base_lr)

    def _decay_lr(self, step, base_lr):
        if not self.constant_steps:
            return _cosine_annealing(base_lr, step - self.warmup_steps, self.max_steps - self.warmup_steps,
                                     self.min_lr)
        return self._megatron(step, base_lr)


class SquareAnnealing(WarmupPolicy):
    """Warmup, then max(lr·((T − s)/T)², min_lr) with s = step − warmup, T = max_steps − warmup."""

    def __init__(self, optimizer, *, max_steps, min_lr=1e-5, last_epoch=-1, **kwargs):
        super().__init__(optimizer, max_steps=max_steps, min_lr=min_lr, last_epoch=last_epoch, **kwargs)

    def _decay_lr(self, step, base_lr):
        return _square_annealing(base_lr, step - self.warmup_steps, self.max_steps - self.warmup_steps,
                                 self.min_lr)


class WarmupAnnealing(WarmupPolicy):
    """Warmup, then linear from lr down to min_lr at max_steps."""

    def __init__(self, optimizer, *, max_steps, min_lr=0.0, last_epoch=-1, **kwargs):
        super().__init__(optimizer, max_steps=max_steps, min_lr=min_lr, last_epoch=last_epoch, **kwargs)

    def _decay_lr(self, step, base_lr):
        mult = (step - self.warmup_steps) / (self.max_steps - self.warmup_steps)
        return self.min_lr + (1 - mult) * (base_lr - self.min_lr)


class NoamAnnealing(_ClosedFormScheduler):
    """lr · d_model^-0.5 · min(s^-0.5, s · warmup^-1.5), s = max(1, step); floored at min_lr after warmup.

    As in NeMo, max_steps does not end it: the lr keeps decaying (to min_lr).
    """

    def __init__(self, optimizer, *, d_model, warmup_steps=None, warmup_ratio=None, max_steps=None,
                 min_lr=0.0, last_epoch=-1):
        self._normalize = d_model ** (-0.5)
        self.max_steps = max_steps
        self.warmup_steps = _steps(warmup_steps, warmup_ratio, max_steps)
        self.min_lr = min_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step, base_lr):
        step = max(1, step)
        if self.warmup_steps > 0:
            mult = self._normalize * min(step ** (-0.5), step * (self.warmup_steps ** (-1.5)))
        else:
            mult = self._normalize * step ** (-0.5)
        out_lr = base_lr * mult
        if step > self.warmup_steps:
            out_lr = max(out_lr, self.min_lr)
        return out_lr


class LinearAnnealingWithWarmUp(_ClosedFormScheduler):
    """NxDT's schedule (transformers' linear schedule with warmup).

    lr · step / max(1, warmup) while step < warmup (0 at step 0), then
    lr · max(0, (max_steps − step) / max(1, max_steps − warmup)): 0 at and after max_steps.
    """

    def __init__(self, optimizer, *, warmup_steps=0, max_steps, last_epoch=-1):
        self.warmup_steps = int(warmup_steps)
        self.max_steps = int(max_steps)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step, base_lr):
        if step < self.warmup_steps:
            return base_lr * float(step) / float(max(1, self.warmup_steps))
        return base_lr * max(0.0, float(self.max_steps - step) / float(max(1, self.max_steps - self.warmup_steps)))


SCHEDULER_CLASSES: dict[str, type[LRScheduler]] = {
    "LinearAnnealingWithWarmUp": LinearAnnealingWithWarmUp,
    "CosineAnnealing": CosineAnnealing,
    "WarmupPolicy": WarmupPolicy,
    "WarmupHoldPolicy": WarmupHoldPolicy,
    "SquareAnnealing": SquareAnnealing,
    "NoamAnnealing": NoamAnnealing,
    "WarmupAnnealing": WarmupAnnealing,
    "StepLR": torch.optim.lr_scheduler.StepLR,
    "ExponentialLR": torch.optim.lr_scheduler.ExponentialLR,
}

# Schedulers that work without a max_steps (NeMo: WarmupPolicy is constant forever; Noam ignores it).
_MAX_STEPS_OPTIONAL = {"WarmupPolicy", "NoamAnnealing", "StepLR", "ExponentialLR"}
# Schedulers that take no max_steps argument.
_NO_MAX_STEPS_ARG = {"StepLR", "ExponentialLR"}
# NeMo's Lightning keys, accepted and ignored.
_INERT_KEYS = ("name", "monitor", "reduce_on_plateau")


def register_scheduler(name: str, cls: type[LRScheduler], keys: Mapping[str, Any]) -> None:
    """Make `model.optim.sched.name: <name>` build `cls(optimizer, max_steps=..., **keys)`.

    `keys` ({argument: default}) lists the sched keys it takes besides name,
    max_steps and last_epoch; register before the config is validated.
    """
    SCHEDULER_CLASSES[name] = cls
    optim_keys.SCHEDULERS[name] = dict(keys)


def build_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: Mapping | None, max_steps: int,
                    path: str = "model.optim.sched") -> LRScheduler | None:
    """The scheduler `sched_cfg` names, stepped once per optimizer step; None (constant lr) for no sched.

    `sched_cfg.max_steps` defaults to `max_steps` (trainer.max_steps); -1 means none.
    """
    if sched_cfg is None:
        return None
    optim_keys.check_sched(sched_cfg, path)
    name = sched_cfg["name"]
    args = {k: v for k, v in sched_cfg.items() if k not in _INERT_KEYS}
    steps = args.pop("max_steps", None)
    if steps is None:
        steps = max_steps
    if steps is not None and steps < 0:  # trainer.max_steps -1: training by epochs
        steps = None
    if steps is None and name not in _MAX_STEPS_OPTIONAL:
        raise ConfigError(f"{path}.max_steps: scheduler '{name}' needs it; set trainer.max_steps "
                          f"or {path}.max_steps")
    if name not in _NO_MAX_STEPS_ARG:
        args["max_steps"] = steps

    # validation's rule (min_lr vs lr, warmup and constant steps vs max_steps), for schedules
    # built in code; its notices were printed at start
    for group in optimizer.param_groups:  # initial_lr: the base lr, once a scheduler has stepped this optimizer
        optim_keys.sched_rules({"sched": {"name": name, **args}}, steps, group.get("initial_lr", group["lr"]),
                               path.rpartition(".")[0])

    try:
        scheduler = SCHEDULER_CLASSES[name](optimizer, **args)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return scheduler
