"""Apply parallelism to a Llama (native or transformers) from the outside, in one visible order.

torchtitan's order: tensor parallel → expert parallel → context parallel → activation checkpointing → compile → data parallel
(FSDP2 / replicate) → (meta-device models) materialise the local shards. What each step does to
which module is decided beforehand, as data, by the run's plan (nxdt.parallel.plan: `make_plan`);
each step is a small function in its own module that applies its part of it; a step the plan has
nothing for leaves the model unchanged. The model file itself knows nothing of any of this.

`parallelize_llama` takes the whole model or one pipeline stage of it (a subset of the blocks, maybe
without embedding or lm_head, under the whole model's names), every block type of the native model
(pre_ln, post_ln, normformer, gpt_j) and transformers models; what differs between the sources is
asked of the model's adapter (nxdt.models.adapter). Validation refuses tp / pp / cp for
transformers' GPT-NeoX (its blocks at `gpt_neox.layers`: activation checkpointing and data parallel).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._triton import has_triton

from nxdt.device import compile_backend
from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing
from nxdt.parallel.context_parallel import apply_context_parallel
from nxdt.parallel.data_parallel import (
    apply_data_parallel,
    is_meta,
    materialize,
    set_gradient_sync,
    transformer_blocks,
)
from nxdt.parallel.expert_parallel import apply_expert_parallel
from nxdt.parallel.mesh import expert_mesh
from nxdt.parallel.plan import TP_COMPILED_PARTS, ParallelPlan, make_plan
from nxdt.parallel.tensor_parallel import apply_tensor_parallel
from nxdt.spec import build_spec
from nxdt.spec.layout import Layout

__all__ = ["parallelize_llama", "apply_data_parallel", "set_gradient_sync", "transformer_blocks"]


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, cfg, device: torch.device | str | None = None,
                      plan: ParallelPlan | None = None) -> nn.Module:
    """Apply `plan` (made for the whole model: nxdt.parallel.plan.make_plan) to `model`, the whole
    model or one of its pipeline stages. Without a plan: `model`'s own, as one stage on `mesh`'s tp."""
    if plan is None:  # a caller without a run (tests, benchmarks): its spec on this mesh's tp
        plan = make_plan(model, build_spec(cfg, layout=Layout(tp=mesh["tp"].size())), pipeline=False)
    stage = plan.stage_for(model)
    # 1. tensor (+ sequence) parallel over the tp axis
    apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel, stage.tensor_parallel)
    # 1b. expert parallel: each MoE layer's experts sharded over the ep axis, tokens sent by all-to-all
    apply_expert_parallel(model, expert_mesh(mesh, "ep"))
    # 1c. context parallel: attention becomes ring attention over the cp axis
    apply_context_parallel(model, mesh["cp"])
    # 2. activation checkpointing (model.activations_checkpoint_*, model.selective_checkpointing)
    apply_activation_checkpointing(model, groups=stage.checkpoint)
    # 3. torch.compile each block, after AC and before FSDP (per-block compile keeps FSDP's
    #    per-block hooks outside the compiled graphs, and identical blocks share one graph);
    #    model.fusions.torch_compile (or fms-fsdp's model.use_torch_compile)
    apply_compile(model, paths=stage.compile, backend=compile_backend(mesh.device_type))
    # 4. data parallel over (dp_replicate, dp_shard): replicate / FSDP2 / HSDP
    apply_data_parallel(model, mesh, plan.data_parallel, units=stage.data_parallel)
    # 5. a model built on the meta device gets its local shards allocated and initialised now
    if is_meta(model):
        materialize(model, device if device is not None else mesh.device_type)
    return model


def apply_compile(model: nn.Module, tensor_parallel: bool = False, paths: tuple[str, ...] | None = None,
                  backend: str = "inductor") -> None:
    """torch.compile the modules at `paths` (a plan's: each decoder block, torchtitan's unit; under
    tensor parallelism each block's attention and MLP, see nxdt.parallel.plan.TP_COMPILED_PARTS);
    None: every block of `model` (or its attention and MLP with `tensor_parallel`). `backend`: the
    device's (nxdt.device.compile_backend: TorchNeuron's `neuron`, else inductor)."""
    if paths is None:
        parts = TP_COMPILED_PARTS if tensor_parallel else None
        modules = [getattr(block, name, None) for block in transformer_blocks(model)
                   for name in parts] if parts else transformer_blocks(model)
    else:
        modules = [model.get_submodule(path) for path in paths]
    for module in modules:
        if module is not None:
            module.compile(backend=backend)


def compile_backend_missing(device_type: str) -> str | None:
    """Why torch.compile cannot compile for `device_type` here, or None: inductor needs a C++ compiler
    on CPU and triton on CUDA; on TorchNeuron's native device its own `neuron` backend must be registered."""
    if device_type == "cpu":
        candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(name and shutil.which(name) for name in candidates):
            return "torch's inductor needs a C++ compiler to compile for the CPU (g++, clang++ or $CXX); none found"
    elif device_type == "cuda":
        if not has_triton():
            return "torch's inductor needs triton to compile for CUDA (pip install triton); it is not installed"
    elif device_type == "neuron" and "neuron" not in torch._dynamo.list_backends(exclude_tags=()):
        return "TorchNeuron registers no `neuron` backend for torch.compile in this torch-neuronx"
    return None
