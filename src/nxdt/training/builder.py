"""The training parts a step needs, built in one order for every caller: the model (build →
LoRA adapters → precision.convert_model → the caller's parallelization → precision.attach), the
optimizer (ZeRO-1 over the data-parallel group when asked) and the learning-rate schedule.

NxdtLightningModule builds its parts here (configure_model, configure_optimizers), and so do the
tests, benchmarks and workers that drive nxdt.training.step.train_step without Lightning
(`build_harness`). The Lightning side of a run (Trainer, data module, module, callbacks) is
nxdt.training.trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxdt.models import build_model, count_parameters
from nxdt.optim.optimizers import build_optimizer, capturable_where_supported, param_groups, resolve_optimizer
from nxdt.optim.schedulers import build_scheduler
from nxdt.parallel.data_parallel import zero1_optimizer
from nxdt.parallel.expert_parallel import expert_parameters
from nxdt.precision.precision import Precision
from nxdt.spec import build_spec
from nxdt.training.finetuning import add_lora


@dataclass
class BaseModel:
    """A built model before parallelization, and what the run summary says of it."""

    model: nn.Module
    num_parameters: int
    """All parameters of the whole model (counted before LoRA and parallelization)."""
    lora_summary: str | None
    """LoRA: trainable vs total, for the run summary (None without adapters)."""


def build_base_model(spec, vocab_size: int | None, precision: Precision, *, meta: bool = False) -> BaseModel:
    """`model.*` built (on the meta device with `meta`: only this rank's shards are ever allocated),
    LoRA adapters added on the frozen base (before precision and parallelism), and the parameters
    converted to the precision's dtype."""
    model = build_model(spec.cfg, vocab_size, device="meta" if meta else None)
    num_parameters = count_parameters(model)
    lora_summary = add_lora(model, spec.alignment.peft) if spec.alignment.peft is not None else None
    return BaseModel(precision.convert_model(model), num_parameters, lora_summary)


def build_optimizer_and_scheduler(spec, model: nn.Module, dp_mesh=None, max_steps: int | None = None,
                                  schedule: bool = True):
    """The optimizer of `model.optim` over `model`'s parameters (ZeRO-1 over `dp_mesh`, the mesh's
    data-parallel axis, when it has more than one rank and `distributed_strategy.zero1` is set) and,
    with `schedule`, the schedule of `model.optim.sched` over `max_steps` (None when it names none)."""
    cfg = spec.cfg
    optim_cfg = cfg.model.optim
    if cfg.distributed_strategy.zero1 and dp_mesh is not None and dp_mesh.size() > 1:
        # ZeRO-1: each dp rank keeps the optimizer state of its part of the parameters
        cls, kwargs = resolve_optimizer(optim_cfg)
        groups = param_groups(model, kwargs.get("weight_decay", 0.0), cfg.model.do_layer_norm_weight_decay)
        kwargs = capturable_where_supported(kwargs, [p for g in groups for p in g["params"]])
        optimizer = zero1_optimizer(groups, cls, kwargs, dp_mesh.get_group(),
                                    rank_local=expert_parameters(model) if spec.layout.ep > 1 else None)
    else:
        optimizer = build_optimizer(model, optim_cfg, cfg.model.do_layer_norm_weight_decay)
    scheduler = build_scheduler(optimizer, optim_cfg.get("sched"), max_steps) if schedule else None
    return optimizer, scheduler


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
    """`cfg.model` built under `torch.manual_seed(seed)` (None: the caller seeds) as the
    LightningModule builds it (`build_base_model`), moved to `device`, `parallelize`d (e.g.
    parallelize_llama over a mesh), attached; the optimizer of `cfg.model.optim` and, with
    `max_steps`, its scheduler. `rank` decorrelates stochastic rounding as $RANK does in a run.
    An entry: the run spec (nxdt.spec.build_spec) is built here, once."""
    spec = build_spec(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    precision = Precision.from_spec(spec, rank=rank, on_xla=on_xla)
    model = build_base_model(spec, vocab_size, precision).model
    if device is not None:
        model = model.to(device)
    if parallelize is not None:
        model = parallelize(model)
    precision.attach(model)
    optimizer, scheduler = build_optimizer_and_scheduler(spec, model, max_steps=max_steps,
                                                         schedule=max_steps is not None)
    return Harness(model, precision, optimizer, scheduler)
