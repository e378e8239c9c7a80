"""Activation checkpointing: recompute chosen modules in the backward instead of keeping their activations.

Config keys (all under `model.`):

    activations_checkpoint_granularity: full       each decoder block (LlamaDecoderLayer)
    activations_checkpoint_granularity: selective  the attention core (CoreAttention, as NxDT; the
                                                   whole LlamaAttention for transformers models),
                                                   + LlamaMLP when activations_checkpoint_recompute_mlp
    activations_checkpoint_recompute: [names]      selective: exactly these classes instead
    selective_checkpointing: p                     fms-fsdp: only a fraction p of the blocks, evenly spaced
                                                   (alone it means full granularity on those blocks)

A checkpointed module keeps its name and parameters (state dicts and plans are unchanged):
its `forward` is replaced by a non-reentrant `torch.utils.checkpoint` of the original, and
`module._nxdt_checkpointed` is set. Apply after tensor parallel and before FSDP (torchtitan's order).
"""

from __future__ import annotations

import functools
import math

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from nxdt.config.errors import ConfigError

# Module classes that `activations_checkpoint_recompute` may name (native names; the aliases
# below map NxDT names onto transformers' classes).
HF_ALIASES = {"CoreAttention": "LlamaAttention"}


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make `module` recompute its forward in the backward (idempotent)."""
    if getattr(module, "_nxdt_checkpointed", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._nxdt_checkpointed = True
    return module


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules `apply_activation_checkpointing` wrapped (for tests and the run summary)."""
    return [name for name, m in model.named_modules() if getattr(m, "_nxdt_checkpointed", False)]


def selected_blocks(num_blocks: int, fraction: float | None) -> list[int]:
    """Indices of the blocks to checkpoint: all (fraction None or 1), else round(n·p) evenly spaced
    (fms-fsdp's rule: block i is picked when (i + 1)·p crosses the next half-integer)."""
    if fraction is None or fraction >= 1:
        return list(range(num_blocks))
    return [i for i in range(num_blocks) if math.floor((i + 1) * fraction + 0.5) > math.floor(i * fraction + 0.5)]


def recompute_classes(cfg) -> list[str] | None:
    """Class names to recompute for the config, or None when nothing is checkpointed.

    ["LlamaDecoderLayer"] means whole blocks (full granularity)."""
    m = cfg.model
    granularity = m.get("activations_checkpoint_granularity")
    fraction = m.get("selective_checkpointing")
    if granularity is None and fraction is None:
        return None
    if granularity == "selective":
        names = m.get("activations_checkpoint_recompute")
        if names:
            return [str(n) for n in names]
        return ["CoreAttention", "LlamaMLP"] if m.get("activations_checkpoint_recompute_mlp") else ["CoreAttention"]
    return ["LlamaDecoderLayer"]


def apply_activation_checkpointing(model: nn.Module, cfg) -> nn.Module:
    """Checkpoint the modules the config asks for, in the blocks of `model.model.layers` it selects."""
    classes = recompute_classes(cfg)
    if not classes:
        return model
    blocks = list(model.model.layers)
    # A pipeline stage holds a subset: select by the block's global index when it has one.
    fraction = cfg.model.get("selective_checkpointing")
    total = cfg.model.get("num_layers") or len(blocks)
    chosen = set(selected_blocks(max(total, len(blocks)), fraction))
    valid = sorted({type(m).__name__ for b in blocks for m in b.modules()} | set(HF_ALIASES))
    unknown = [c for c in classes if c not in valid]
    if unknown:
        raise ConfigError(f"model.activations_checkpoint_recompute: unknown module class {unknown[0]!r}; "
                          f"valid: {', '.join(valid)}")
    present = {type(m).__name__ for b in blocks for m in b.modules()}
    wanted = {HF_ALIASES[c] if c not in present and c in HF_ALIASES else c for c in classes}
    for i, block in enumerate(blocks):
        index = getattr(block, "layer_idx", getattr(getattr(block, "self_attn", None), "layer_idx", i))
        if index not in chosen:
            continue
        if type(block).__name__ in wanted:
            checkpoint_module(block)
            continue
        for sub in block.modules():
            if type(sub).__name__ in wanted:
                checkpoint_module(sub)
    return model
