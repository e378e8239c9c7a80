"""Build the optimizer named by `model.optim` (NeMo / NxDT names).

    optim:
      name: adamw_fp32OptState
      lr: 3e-4
      weight_decay: 0.01
      betas: [0.9, 0.999]
      capturable: false
      sched: {...}            # read by nxdt.optim.schedulers, not here

Names map onto `OPTIMIZER_CLASSES`; `register_optimizer` adds more. Two
classes live here because torch has none like them: `AdamWFP32OptState`
(AdamW with fp32 moments and an fp32 master copy of low-precision params) and
`Novograd` (NeMo's formula); GPT-NeoX's `lion` and `sm3` are in `neox_optimizers`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from nxdt.config import optim_keys
from nxdt.config.errors import ConfigError
from nxdt.optim.neox import SM3, Lion
from nxdt.optim.base import ParameterwiseOptimizer

log = logging.getLogger(__name__)


def _fp32_zeros_like(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


class AdamWFP32OptState(ParameterwiseOptimizer):
    """AdamW whose state is fp32 whatever the parameter dtype.

    For fp32 parameters this is torch's AdamW (single-tensor path) step for step.
    For bf16/fp16 parameters the state also holds `master`, an fp32 copy of the
    weights: the update is applied to it and the parameter is the rounded copy,
    so small updates are not lost to bf16 rounding.
    """

    _FP32_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid AdamW argument: lr={lr}, eps={eps}, weight_decay={weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = _fp32_zeros_like(p)
            state["exp_avg_sq"] = _fp32_zeros_like(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = _fp32_zeros_like(p)
            if p.dtype != torch.float32:
                state["master"] = p.detach().to(torch.float32, copy=True)
        weights = state.get("master", p)
        grad = p.grad.to(torch.float32)
        if group["maximize"]:
            grad = -grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        # Same operations, in the same order, as torch.optim.AdamW's single-tensor path.
        state["step"] += 1
        step = state["step"].item()
        if wd != 0:
            weights.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        if group["amsgrad"]:
            max_sq = state["max_exp_avg_sq"]
            torch.maximum(max_sq, exp_avg_sq, out=max_sq)
            denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        weights.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        if weights is not p:
            p.copy_(weights)


class Novograd(ParameterwiseOptimizer):
    """NeMo's Novograd (nemo/core/optim/novograd.py), same defaults and update.

    Per parameter tensor: v = ||g||² on the first step, else β2·v + (1−β2)·||g||²;
    g' = g / (√v + eps) + wd·p; (g' ·= 1−β1 with grad_averaging); m = β1·m + g';
    p −= lr·m (with `luc`, lr is min(lr, luc_trust·||p|| / (||m|| + luc_eps))).
    Unlike NeMo, p.grad is left untouched.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.95, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_averaging: bool = False, amsgrad: bool = False,
                 luc: bool = False, luc_trust: float = 1e-3, luc_eps: float = 1e-8):
        if lr < 0 or eps < 0:
            raise ValueError(f"invalid Novograd argument: lr={lr}, eps={eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, amsgrad=amsgrad,
                        luc=luc, luc_trust=luc_trust, luc_eps=luc_eps)
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        grad = p.grad
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros([], device=p.device)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros([], device=p.device)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1

        norm = grad.norm().pow(2)
        if exp_avg_sq == 0:
            exp_avg_sq.copy_(norm)
        else:
            exp_avg_sq.mul_(beta2).add_(norm, alpha=1.0 - beta2)
        if group["amsgrad"]:
            max_sq = state["max_exp_avg_sq"]
            torch.max(max_sq, exp_avg_sq, out=max_sq)
            denom = max_sq.sqrt().add_(group["eps"])
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])

        grad = grad.div(denom)
        if group["weight_decay"] != 0:
            grad.add_(p, alpha=group["weight_decay"])
        if group["grad_averaging"]:
            grad.mul_(1 - beta1)
        exp_avg.mul_(beta1).add_(grad)

        step_lr = group["lr"]
        if group["luc"]:
            # Clip the update so that it is at most luc_trust × the weights' norm.
            luc_factor = group["luc_trust"] * torch.norm(p) / (torch.norm(exp_avg) + group["luc_eps"])
            step_lr = min(float(luc_factor), group["lr"])
        p.add_(exp_avg, alpha=-step_lr)


OPTIMIZER_CLASSES: dict[str, type[Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adamw_fp32OptState": AdamWFP32OptState,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "rprop": torch.optim.Rprop,
    "novograd": Novograd,
    "adafactor": torch.optim.Adafactor,
    "lion": Lion,  # GPT-NeoX's two (neox_optimizers.py)
    "sm3": SM3,
}


def _init_args(cls: type) -> dict[str, Any]:
    """Keyword arguments of `cls.__init__` (besides `params`) with their defaults."""
    sig = inspect.signature(cls.__init__)
    return {n: (p.default if p.default is not p.empty else optim_keys.REQUIRED)
            for n, p in sig.parameters.items()
            if n not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def register_optimizer(name: str, cls: type[Optimizer], keys: Mapping[str, Any] | None = None) -> None:
    """Make `model.optim.name: <name>` build `cls(param_groups, **args)`.

    `keys` ({argument: default}) lists what `model.optim` may hold for it; by
    default the keyword arguments of `cls.__init__`. Register before the config
    is validated (validation checks keys against `nxdt.config.optim_keys.OPTIMIZERS`).
    """
    OPTIMIZER_CLASSES[name] = cls
    optim_keys.OPTIMIZERS[name] = dict(keys) if keys is not None else _init_args(cls)


def _plain(value: Any) -> Any:
    """YAML lists (ListConfig) become tuples: betas, etas, step_sizes, adafactor's eps."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(_plain(v) for v in value)
    return value


def resolve_optimizer(optim_cfg: Mapping, path: str = "model.optim") -> tuple[type[Optimizer], dict[str, Any]]:
    """(class, keyword arguments) for `optim_cfg`, e.g. to hand to a ZeRO-1 wrapper."""
    optim_keys.check_optim(optim_cfg, path)
    name = optim_cfg["name"]
    if name not in OPTIMIZER_CLASSES:
        raise ConfigError(f"{path}.name: optimizer '{name}' has keys but no class; use register_optimizer")
    cls = OPTIMIZER_CLASSES[name]
    accepted = _init_args(cls)
    kwargs = {k: _plain(v) for k, v in optim_cfg.items() if k not in ("name", "sched")}
    if "capturable" in kwargs and "capturable" not in accepted:
        if kwargs.pop("capturable"):
            log.warning("%s.capturable: %s does not support it; ignored", path, cls.__name__)
    for key in kwargs:
        if key not in accepted:
            raise ConfigError(f"{path}.{key}: not an argument of {cls.__module__}.{cls.__name__} "
                              f"in this torch version ({torch.__version__})")
    return cls, kwargs


def capturable_where_supported(kwargs: dict[str, Any], params) -> dict[str, Any]:
    """`kwargs` without `capturable: true` unless every parameter is on a device torch's capturable
    kernels run on (CUDA, XLA, a private-use backend such as Neuron): NxDT's configs set it for XLA, and
    on CPU torch's Adam(W) asserts at the first step. Reported inert once (nxdt.config.inert)."""
    if not kwargs.get("capturable"):
        return kwargs
    supported = ("cuda", "xla", torch._C._get_privateuse1_backend_name())
    if all(p.device.type in supported for p in params):
        return kwargs
    return {**kwargs, "capturable": False}


def param_groups(model: nn.Module, weight_decay: float,
                 do_layer_norm_weight_decay: bool = False) -> list[dict[str, Any]]:
    """Split trainable parameters into a decay group and a no-decay group (weight_decay 0).

    No decay: every parameter with ndim ≤ 1 (biases, norm weights); with
    `do_layer_norm_weight_decay`, only biases (names ending in `.bias`). A
    parameter shared by several modules (tied embeddings) appears once. Empty
    groups are left out.
    """
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if do_layer_norm_weight_decay:
            exempt = name == "bias" or name.endswith(".bias")
        else:
            exempt = p.ndim <= 1
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, optim_cfg: Mapping,
                    do_layer_norm_weight_decay: bool = False) -> Optimizer:
    """The optimizer `optim_cfg` (`model.optim`) names, over `model`'s trainable parameters."""
    cls, kwargs = resolve_optimizer(optim_cfg)
    defaults = _init_args(cls)
    groups = param_groups(model, kwargs.get("weight_decay", defaults.get("weight_decay", 0.0)),
                          do_layer_norm_weight_decay)
    if not groups:
        raise ConfigError("model.optim: the model has no trainable parameters")
    if "weight_decay" not in defaults:  # e.g. rprop, which has no weight decay: one group
        groups = [{"params": [p for g in groups for p in g["params"]]}]
    kwargs = capturable_where_supported(kwargs, [p for g in groups for p in g["params"]])
    if _can_fuse(cls, kwargs, groups):
        # torch's default Adam(W) on CPU walks the tensors one by one; the fused kernel is several
        # times faster and what transformers.Trainer uses. Same math, rounding-level differences.
        kwargs = {**kwargs, "fused": True}
    return cls(groups, **kwargs)


def _can_fuse(cls: type[Optimizer], kwargs: Mapping, groups: list[dict]) -> bool:
    """Fused Adam(W) when the config chose no implementation and every parameter is a float tensor on
    CPU or CUDA: all plain, or all DTensors of one mesh (tensor parallel, FSDP2 shards: the kernel runs
    on each local shard). The fused op takes no mix of the two (e.g. tp's replicated norms beside its
    shards under pipelining), nor DTensors of several meshes (experts on the ep mesh)."""
    if cls not in (torch.optim.Adam, torch.optim.AdamW) or "fused" in kwargs or "foreach" in kwargs:
        return False
    if kwargs.get("capturable") or kwargs.get("differentiable"):
        return False
    params = [p for g in groups for p in g["params"]]
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if meshes and (len(meshes) > 1 or not all(isinstance(p, DTensor) for p in params)):
        return False
    return all(
        (type(p) in (torch.Tensor, nn.Parameter) or isinstance(p, DTensor))
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16) and p.device.type in ("cpu", "cuda")
        for p in params
    )
