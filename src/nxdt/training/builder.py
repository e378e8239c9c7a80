"""A model with its Precision, optimizer and scheduler, built in the order NxdtLightningModule
builds them (build → precision.convert_model → parallelize → precision.attach → optimizer), for
the tests, benchmarks and workers that drive nxdt.training.step.train_step without Lightning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxdt.models import build_model
from nxdt.precision.precision import Precision
from nxdt.optim.optimizers import build_optimizer
from nxdt.optim.schedulers import build_scheduler
from nxdt.spec import build_spec


@dataclass
class Harness:
    model: nn.Module
    precision: Precision
    optimizer: torch.optim.Optimizer
    scheduler: Any | None  # None without max_steps, or for a config without a schedule


def build_harness(cfg, vocab_size: int, *, rank: int = 0, seed: int | None = 0, on_xla: bool = False,
                  device: torch.device | str | None = None,
                  parallelize: Callable[[nn.Module], nn.Module] | None = None,
                  max_steps: int | None = None) -> Harness:
    """`cfg.model` built under `torch.manual_seed(seed)` (None: the caller seeds), converted to
    the precision's parameter dtype, moved to `device`, `parallelize`d (e.g. parallelize_llama
    over a mesh), attached; the optimizer of `cfg.model.optim` and, with `max_steps`, its
    scheduler. `rank` decorrelates stochastic rounding as $RANK does in a run. An entry: the run
    spec (nxdt.spec.build_spec) is built here, once."""
    spec = build_spec(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    model = build_model(cfg, vocab_size)
    precision = Precision.from_spec(spec, rank=rank, on_xla=on_xla)
    model = precision.convert_model(model)
    if device is not None:
        model = model.to(device)
    if parallelize is not None:
        model = parallelize(model)
    precision.attach(model)
    optimizer = build_optimizer(model, cfg.model.optim, cfg.model.do_layer_norm_weight_decay)
    scheduler = build_scheduler(optimizer, cfg.model.optim.get("sched"), max_steps) if max_steps is not None else None
    return Harness(model, precision, optimizer, scheduler)
