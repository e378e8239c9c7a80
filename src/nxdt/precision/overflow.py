"""One skip-or-apply decision for all ranks.

Each rank sees only its own part of the numbers: a pipeline rank its stages' gradients, a
tensor-parallel rank its shards, an FSDP rank its gradient shards. If one rank's fp16 gradients
overflow and another's do not, and each decided alone, one rank would skip the update and lower
its loss scale while the other applied it: the weights and the scalers would diverge for the
rest of the run. So the "all finite" verdict is a MAX all-reduce of an overflow flag over the
whole world, and every rank then updates its scaler with the same flag (the scaler state stays
identical everywhere, which is also what makes every rank's checkpoint copy of it the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nxdt.device import current_device


def all_ranks_finite(finite: bool, device: torch.device) -> bool:
    """True when `finite` is True on every rank of the default group (one tiny all-reduce);
    `finite` unchanged without torch.distributed or in a single process. Every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return finite
    if dist.get_backend() == "nccl" and device.type != "cuda":  # NCCL only reduces CUDA tensors
        device = current_device("cuda")
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() == 0.0)
