"""Apply parallelism to a Llama (native or transformers) from the outside, in one visible order.

torchtitan's order: tensor parallel → expert parallel → context parallel → activation checkpointing → compile → data parallel
(FSDP2 / replicate) → (meta-device models) materialise the local shards. Each step is a small
function in its own module; a step whose config asks for nothing leaves the model unchanged.
The model file itself knows nothing of any of this.

`parallelize_llama` takes any module whose decoder blocks are `model.model.layers`, so a
pipeline stage (a subset of the blocks, maybe without embedding or lm_head) goes through the
same function; every block type of the native model (pre_ln, post_ln, normformer, gpt_j). A
transformers model with another tree (GPTNeoXForCausalLM: `model.gpt_neox.layers`) gets
activation checkpointing and data parallelism (`data_parallel.transformer_blocks` finds its
blocks through `base_model`); validation refuses tp / pp / cp for it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from nxdt.spec.model import wants_compile
from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing
from nxdt.parallel.context_parallel import apply_context_parallel
from nxdt.parallel.data_parallel import (
    apply_data_parallel,
    data_parallel_config,
    is_meta,
    materialize,
    set_gradient_sync,
    transformer_blocks,
)
from nxdt.parallel.expert_parallel import apply_expert_parallel
from nxdt.parallel.mesh import expert_mesh
from nxdt.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["parallelize_llama", "apply_data_parallel", "set_gradient_sync", "transformer_blocks"]


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, cfg, device: torch.device | str | None = None) -> nn.Module:
    ds = cfg.distributed_strategy
    # 1. tensor (+ sequence) parallel over the tp axis
    apply_tensor_parallel(model, mesh["tp"], ds.sequence_parallel)
    # 1b. expert parallel: each MoE layer's experts sharded over the ep axis, tokens sent by all-to-all
    apply_expert_parallel(model, expert_mesh(mesh, "ep"))
    # 1c. context parallel: attention becomes ring attention over the cp axis
    apply_context_parallel(model, mesh["cp"])
    # 2. activation checkpointing (model.activations_checkpoint_*, model.selective_checkpointing)
    apply_activation_checkpointing(model, cfg.model)
    # 3. torch.compile each block, after AC and before FSDP (per-block compile keeps FSDP's
    #    per-block hooks outside the compiled graphs, and identical blocks share one graph)
    if wants_compile(cfg):  # model.fusions.torch_compile (or fms-fsdp's model.use_torch_compile)
        apply_compile(model, tensor_parallel=mesh["tp"].size() > 1)
    # 4. data parallel over (dp_replicate, dp_shard): replicate / FSDP2 / HSDP
    apply_data_parallel(model, mesh, data_parallel_config(ds, cfg.precision))
    # 5. a model built on the meta device gets its local shards allocated and initialised now
    if is_meta(model):
        materialize(model, device if device is not None else mesh.device_type)
    return model


# Under tensor parallelism a block's attention and MLP are compiled, each whole, and its norms and
# residual adds stay eager: with torch 2.13 a whole compiled block loses the gradient of a tp-
# replicated norm weight under sequence parallel, and without it the backward fails in DTensor's
# redistribution of the block's input. Attention and MLP compiled alone give eager's gradients
# (every parameter within 1e-5, with and without sequence parallel).
TP_COMPILED_PARTS = ("self_attn", "mlp")


def apply_compile(model: nn.Module, tensor_parallel: bool = False) -> None:
    """torch.compile each decoder block (torchtitan's unit); under tensor parallelism each block's
    attention and MLP (see TP_COMPILED_PARTS)."""
    for block in transformer_blocks(model):
        parts = [getattr(block, name, None) for name in TP_COMPILED_PARTS] if tensor_parallel else [block]
        for part in parts:
            if part is not None:
                part.compile()


def compile_backend_missing(device_type: str) -> str | None:
    """Why torch.compile's default backend (inductor) cannot compile for `device_type` here, or None:
    on CPU it needs a C++ compiler, on CUDA triton."""
    if device_type == "cpu":
        import os
        import shutil

        candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(name and shutil.which(name) for name in candidates):
            return "torch's inductor needs a C++ compiler to compile for the CPU (g++, clang++ or $CXX); none found"
    elif device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch's inductor needs triton to compile for CUDA (pip install triton); it is not installed"
    return None
