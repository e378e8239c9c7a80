"""GPT-NeoX's own optimizers: Lion and SM3 (`model.optim.name: lion | sm3`).

NeoX imports Lion from lion-pytorch and ships SM3 in megatron/optimizers.py; neither package
is an nxdt dependency, so both are written here, small, with the same defaults and update:

    lion  lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0          (Chen et al. 2023)
    sm3   lr=0.1,  momentum=0.0, beta=0.0, eps=1e-30            (Anil et al. 2019, SM3-II)

NeoX's other optimizer names (OneBitAdam, CPU_Adam) need DeepSpeed and are refused by
`nxdt.config.optim_keys.check_optim`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from nxdt.config import optim_keys
from nxdt.config.errors import ConfigError
from nxdt.optim.base import ParameterwiseOptimizer


def _check_betas(betas) -> tuple[float, float]:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas {tuple(betas)}: two numbers, each in [0, 1)")
    return tuple(betas)


class Lion(ParameterwiseOptimizer):
    """Lion (EvoLved Sign Momentum), as lion-pytorch's `Lion` that NeoX uses.

    Per parameter, with momentum m (zeros at first):
        p ← p·(1 − lr·wd)                       decoupled weight decay
        p ← p − lr·sign(β1·m + (1 − β1)·g)      the update is a sign: every entry moves by lr
        m ← β2·m + (1 − β2)·g
    Only elementwise ops, so a DTensor parameter (tensor parallel, FSDP) steps its shard exactly.
    The momentum has the parameter's dtype, as in lion-pytorch (sign() is insensitive to rounding).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"invalid Lion argument: lr={lr}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=_check_betas(betas), weight_decay=weight_decay))

    def update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        grad = p.grad
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg = state["exp_avg"]
        if wd != 0:
            p.mul_(1 - lr * wd)
        update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def sm3_accumulator_shapes(shape: torch.Size | tuple[int, ...]) -> list[tuple[int, ...]]:
    """One accumulator per dimension, broadcastable against the parameter: (n1, n2, n3) →
    (n1, 1, 1), (1, n2, 1), (1, 1, n3). A vector gets one of its own size (Adagrad), a scalar ()."""
    rank = len(shape)
    if rank == 0:
        return [()]
    return [tuple(n if d == i else 1 for d, n in enumerate(shape)) for i in range(rank)]


class SM3(ParameterwiseOptimizer):
    """SM3-II, as NeoX's `SM3` (megatron/optimizers.py), dense gradients.

    Per parameter of shape (n1, ..., nk) the state is one accumulator per dimension (n1 + ... + nk
    numbers, not n1·...·nk). Each step:
        ν  = β·min_i(acc_i) + (1 − β)·g²        min over the accumulators broadcast to g's shape
        acc_i ← max(acc_i, max of ν over every dimension but i)   (β = 0: acc_i ← that max,
                                                                    which is ≥ acc_i anyway)
        u  = g / √(ν + eps)                     eps inside the root, as NeoX
        u  ← (1 − momentum)·u + momentum·u_prev (when momentum > 0; u_prev starts at 0)
        p  ← p − lr·u
    For a vector or a scalar this is Adagrad (β = 0). No weight decay (NeoX's has none).

    State is fp32 (fp64 for fp64 parameters) whatever the parameter dtype: eps = 1e-30 underflows to 0 in fp16 (0/0 where a
    gradient entry has always been 0), and the accumulators are small. The accumulators of a
    parameter couple all its rows and columns, so a sharded DTensor (tensor parallel, FSDP,
    expert parallel) would need a max over ranks; such parameters are refused at construction.
    A DTensor replicated on every mesh dimension (DDP) is stepped on its local copy: exact.
    """

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.0, beta: float = 0.0, eps: float = 1e-30):
        if lr < 0:
            raise ValueError(f"invalid SM3 lr: {lr}")
        if not 0.0 <= momentum < 1.0 or not 0.0 <= beta < 1.0:
            raise ValueError(f"invalid SM3 momentum={momentum} / beta={beta}: each must be in [0, 1)")
        if not eps > 0:  # a never-seen entry has ν = 0 and g = 0: 0/√0 is NaN
            raise ValueError(f"invalid SM3 eps={eps}: must be > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, beta=beta, eps=eps))
        for group in self.param_groups:
            for p in group["params"]:
                if _is_sharded(p):
                    raise ConfigError(optim_keys.SM3_SHARDED + f" (parameter {tuple(p.shape)} is {p.placements})")

    def update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        momentum, beta, eps = group["momentum"], group["beta"], group["eps"]
        param = _local(p)
        dtype = torch.promote_types(param.dtype, torch.float32)  # fp32, or fp64 for fp64 params
        grad = _local(p.grad).to(dtype)
        if not state:
            state["step"] = 0
            for i, shape in enumerate(sm3_accumulator_shapes(param.shape)):
                state[f"accumulator_{i}"] = torch.zeros(shape, dtype=dtype, device=param.device)
            if momentum > 0:
                state["momentum_buffer"] = torch.zeros_like(param, dtype=dtype)
        accs = [state[f"accumulator_{i}"] for i in range(max(param.dim(), 1))]

        nu = accs[0]
        for acc in accs[1:]:
            nu = torch.minimum(nu, acc)  # broadcasts up to the full shape
        nu = nu.mul(beta).addcmul_(grad, grad, value=1 - beta) if beta > 0 else nu + grad * grad
        for i, acc in enumerate(accs):
            nu_max = _max_except(nu, i)
            if beta > 0:
                torch.maximum(acc, nu_max, out=acc)
            else:
                acc.copy_(nu_max)
        update = grad / (nu + eps).sqrt()
        if momentum > 0:
            buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(update, alpha=1 - momentum)
            update = buf
        param.sub_(update.to(param.dtype), alpha=group["lr"])
        state["step"] += 1


def _is_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a (replicated) DTensor, sharing its storage; a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _max_except(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Max of `t` over every dimension but `dim`, keeping them as size 1 (a scalar as is)."""
    others = [d for d in range(t.dim()) if d != dim]
    return t.amax(dim=others, keepdim=True) if others else t.clone()
