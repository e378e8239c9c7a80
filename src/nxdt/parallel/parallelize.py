"""Apply parallelism to a Llama (native or transformers) from the outside, in one visible order.

torchtitan's order: tensor parallel → activation checkpointing → compile → data parallel
(FSDP2 / replicate). Each step is a small function; a step whose config asks for nothing
returns the model unchanged. The model file itself knows nothing of any of this.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from nxdt.parallel.mesh import submesh


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: `model.model.layers` for both model sources (same tree as transformers)."""
    return list(model.model.layers)


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, cfg) -> nn.Module:
    # 1. tensor / sequence parallel, 2. activation checkpointing, 3. compile: later issues;
    #    their config keys are refused by nxdt.config.validate until they land.
    # 4. data parallel
    apply_data_parallel(model, mesh)
    return model


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the model over dp with FSDP2's replicate (DDP semantics, per-block buckets).

    Gradients are all-reduced (averaged) during the backward of the last micro-batch; the
    training step turns the sync off for the earlier ones with `set_requires_gradient_sync`.
    Wrapping each block separately lets the reduction of block i overlap the backward of
    block i-1.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    dp_mesh = submesh(mesh, "dp")
    if dp_mesh.size() == 1:
        return
    for block in transformer_blocks(model):
        replicate(block, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn dp gradient reduction on/off (no-op for a model without data parallelism)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)
