"""Activation checkpointing: recompute chosen modules in the backward instead of keeping their activations.

Config keys (all under `model.`):

    activations_checkpoint_granularity: full       each decoder block (LlamaDecoderLayer: every block
                                                   type; a transformers model's block class, e.g. GPTNeoXLayer)
    activations_checkpoint_granularity: selective  the attention core (CoreAttention, as NxDT; the
                                                   whole LlamaAttention / GPTNeoXAttention for transformers
                                                   models), + LlamaMLP (GPTNeoXMLP) when
                                                   activations_checkpoint_recompute_mlp
    activations_checkpoint_recompute: [names]      selective: exactly these classes instead
    selective_checkpointing: p                     fms-fsdp: only a fraction p of the blocks, evenly spaced
                                                   (alone it means full granularity on those blocks)
    checkpoint_num_layers: N                       GPT-NeoX, with full granularity: chunks of N consecutive
                                                   blocks, each recomputed under one checkpoint

A checkpointed module keeps its name and parameters (state dicts and plans are unchanged):
its `forward` is replaced by a non-reentrant `torch.utils.checkpoint` of the original, and
`module._nxdt_checkpointed` is set. Apply after tensor parallel and before FSDP (torchtitan's order).
Chunks of several blocks (`checkpoint_num_layers > 1`) are built from forward hooks instead, see
`checkpoint_chunk`: no module is wrapped or renamed either.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, checkpoint

from nxdt.config.errors import ConfigError
from nxdt.models.adapter import adapter_of

# Module classes that `activations_checkpoint_recompute` may name: the native names (a model
# source's adapter maps them onto its own classes: the first one a model has is used).
NXDT_CLASSES = ("CoreAttention", "LlamaMLP")
# NxDT's rotary embeddings sit in every attention layer; nxdt's models (and transformers') compute the
# rotary tables once per forward, outside the blocks: accepted, with no per-layer activations to recompute.
SHARED_ONCE = ("LlamaRotaryEmbedding", "MixtralRotaryEmbedding")
# Whole decoder blocks, whatever the block's class (transformers: LlamaDecoderLayer, MixtralDecoderLayer,
# GPTNeoXLayer); `full` granularity asks for it.
BLOCK = "LlamaDecoderLayer"


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


class _Chunk:
    """What the hooks of one chunk share: its blocks, the open checkpoint, each block's arguments."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks
        self.enabled = True  # False while the backward recomputes the chunk (no nested checkpoint)
        self.generator = None
        self.calls: list[tuple[tuple, dict]] = []  # per block of the open region: (args after x, kwargs)
        self.last_out = None

    @staticmethod
    def run(blocks, calls, *args, **kwargs):
        """The chunk's forward as the model's loop ran it: block i's output is block i+1's input,
        with the other arguments each block was given (`calls`, recorded by the forward's hooks)."""
        out = blocks[0](*args, **kwargs)
        for block, (rest, kw) in zip(blocks[1:], calls[1:]):
            out = block(out, *rest, **kw)
        return out

    @contextmanager
    def hooks_off(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def _same_input(x, previous_output) -> bool:
    """Is `x` the previous block's output? FSDP2's pre-forward hook (it runs before ours) hands the
    block an alias of it (same storage), or a cast copy under a mixed-precision policy."""
    if x is previous_output:
        return True
    if type(x) is not torch.Tensor or type(previous_output) is not torch.Tensor:
        return True  # DTensors: not checked
    if x.dtype != previous_output.dtype:
        return True  # FSDP2 cast the input to its param_dtype
    return x.shape == previous_output.shape and x.data_ptr() == previous_output.data_ptr()


def checkpoint_chunk(blocks: list[nn.Module]) -> None:
    """Recompute the consecutive decoder `blocks` in the backward under one checkpoint (GPT-NeoX's
    `checkpoint_num_layers`): the forward keeps only the chunk's input, not one input per block.

    Why hooks and not a wrapper: the model's own loop (`for layer in self.layers`, native and
    transformers alike) calls every block; each block stays its own FSDP2 / replicate unit (its
    gradient reduction still overlaps the backward of the block before it) and keeps its
    tensor-parallel hooks and its name (`model.layers.N`: checkpoints, plans and pipeline cuts
    unchanged). A chunk module, or one FSDP unit per chunk, would have renamed parameters or
    changed the data-parallel layout. So a chunk is a *region* of that loop: a pre-hook on its
    first block opens a non-reentrant checkpoint (the generator behind torch.utils.checkpoint, as
    torch.distributed._composable.checkpoint does for one module; private, so the chunk tests are
    what tells when torch changes it), a hook after its last block closes it. The recomputation calls the blocks again through `__call__`, with the arguments the
    forward gave each of them, so their tp and FSDP hooks run as in the forward; FSDP2 supports
    this ("module-hook-based activation checkpointing"): a block recomputed during the backward
    gathers its parameters and stays unsharded until its own backward.

    Hook order: FSDP2 prepends its pre-forward hook when data parallel is applied (after this), so
    it runs first, outside the region (it saves no tensors; the recomputation runs it again). Ours
    is prepended too, so it runs before the tp input hooks (sequence parallel's
    PrepareModuleInput): the recomputation applies those to the same input again. The closing
    hook runs after the last block's tp output hooks, before FSDP2's post-forward (no saved
    tensors either).
    """
    if len(blocks) == 1:
        checkpoint_module(blocks[0])
        return
    chunk = _Chunk(list(blocks))
    first, last = chunk.blocks[0], chunk.blocks[-1]

    def open_region(module, args, kwargs):
        if not chunk.enabled or not torch.is_grad_enabled():
            return
        chunk.calls = [(args[1:], kwargs)]  # a new list per forward: each region replays its own
        fn = functools.partial(_Chunk.run, chunk.blocks, chunk.calls)
        chunk.generator = _checkpoint_without_reentrant_generator(
            fn, True, lambda: (nullcontext(), chunk.hooks_off()), "default", False, True, *args, **kwargs)
        next(chunk.generator)

    def record_arguments(module, args, kwargs):
        if chunk.generator is None or not chunk.enabled:
            return
        # The recomputation feeds each block the previous one's output: refuse a model whose loop
        # changes the hidden states between blocks (the gradients would be wrong, silently).
        if not _same_input(args[0], chunk.last_out):
            raise RuntimeError("model.checkpoint_num_layers > 1 needs a model whose decoder loop passes each "
                               "block's output to the next block unchanged")
        chunk.calls.append((args[1:], kwargs))

    def keep_output(module, args, output):
        if chunk.generator is not None and chunk.enabled:
            chunk.last_out = output

    def close_region(module, args, output):
        if not chunk.enabled:  # the recomputation's own call
            return
        generator, chunk.generator, chunk.last_out = chunk.generator, None, None
        if generator is None:  # no_grad forward (validation)
            return
        try:
            next(generator)
        except StopIteration:
            return
        raise RuntimeError("activation checkpoint of a chunk did not close")

    first.register_forward_pre_hook(open_region, prepend=True, with_kwargs=True)
    for block in chunk.blocks[:-1]:
        block.register_forward_hook(keep_output)
    for block in chunk.blocks[1:]:
        block.register_forward_pre_hook(record_arguments, prepend=True, with_kwargs=True)
    last.register_forward_hook(close_region, always_call=True)
    for block in chunk.blocks:
        block._nxdt_checkpoint_chunk = chunk


def checkpointed_chunks(model: nn.Module) -> list[list[str]]:
    """Names of the blocks of each chunk `checkpoint_chunk` made (for tests and the run summary)."""
    chunks: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        chunk = getattr(m, "_nxdt_checkpoint_chunk", None)
        if chunk is not None:
            chunks.setdefault(id(chunk), []).append(name)
    return list(chunks.values())


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules `apply_activation_checkpointing` wrapped (for tests and the run summary)."""
    return [name for name, m in model.named_modules() if getattr(m, "_nxdt_checkpointed", False)]


def selected_blocks(num_blocks: int, fraction: float | None) -> list[int]:
    """Indices of the blocks to checkpoint: all (fraction None or 1), else round(n·p) evenly spaced
    (fms-fsdp's rule: block i is picked when (i + 1)·p crosses the next half-integer)."""
    if fraction is None or fraction >= 1:
        return list(range(num_blocks))
    return [i for i in range(num_blocks) if math.floor((i + 1) * fraction + 0.5) > math.floor(i * fraction + 0.5)]


def recompute_classes(m) -> list[str] | None:
    """Class names to recompute for the `model` config section, or None when nothing is checkpointed.

    ["LlamaDecoderLayer"] means whole blocks (full granularity)."""
    granularity = m.activations_checkpoint_granularity
    fraction = m.selective_checkpointing
    if granularity is None and fraction is None:
        return None
    if granularity == "selective":
        names = m.activations_checkpoint_recompute
        if names:
            return [str(n) for n in names]
        return ["CoreAttention", "LlamaMLP"] if m.activations_checkpoint_recompute_mlp else ["CoreAttention"]
    return ["LlamaDecoderLayer"]


def checkpoint_plan(blocks: list[tuple[str, nn.Module]], model_cfg,
                    aliases: dict[str, tuple[str, ...]] | None = None) -> tuple[tuple[str, ...], ...]:
    """The module paths the `model` config section asks to recompute, among the decoder `blocks`
    ((path, block) pairs of one model or pipeline stage, each path ending in the block's index in
    the whole model): one group per checkpoint, a single module or a chunk of consecutive blocks.
    `aliases`: NxDT class names -> the model source's classes (its adapter's `recompute_aliases`)."""
    classes = recompute_classes(model_cfg)
    if not classes or not blocks:
        return ()
    aliases = aliases or {}
    # A pipeline stage holds a subset: select by the block's index in the whole model.
    fraction = model_cfg.selective_checkpointing
    total = model_cfg.num_layers or len(blocks)  # hf: null (the count is in config.json)
    chosen = set(selected_blocks(max(total, len(blocks)), fraction))
    present = {type(m).__name__ for _, b in blocks for m in b.modules()}
    aliased = {name for name, alts in aliases.items() if present & set(alts)}
    valid = sorted(present | set(NXDT_CLASSES) | {BLOCK} | set(SHARED_ONCE) | aliased)
    unknown = [c for c in classes if c not in valid]
    if unknown:
        raise ConfigError(f"model.activations_checkpoint_recompute: unknown module class {unknown[0]!r}; "
                          f"valid: {', '.join(valid)}")
    chunk = model_cfg.checkpoint_num_layers
    if chunk > 1:
        # GPT-NeoX: consecutive blocks of this model (or pipeline stage) in chunks of `chunk`; the
        # last chunk is shorter when it does not divide (as NeoX). Validation (nxdt.spec.model) allows
        # it only with full granularity and no fraction, so `classes` is whole blocks here.
        paths = [path for path, _ in blocks]
        return tuple(tuple(paths[start:start + chunk]) for start in range(0, len(paths), chunk))
    wanted = {_class_in(c, present, aliases) for c in classes}
    groups: list[tuple[str, ...]] = []
    for path, block in blocks:
        if int(path.rsplit(".", 1)[1]) not in chosen:
            continue
        if BLOCK in wanted or type(block).__name__ in wanted:
            groups.append((path,))
            continue
        groups += [(f"{path}.{name}" if name else path,) for name, sub in block.named_modules()
                   if type(sub).__name__ in wanted]
    return tuple(groups)


def apply_activation_checkpointing(model: nn.Module, model_cfg=None,
                                   groups: tuple[tuple[str, ...], ...] | None = None) -> nn.Module:
    """Checkpoint the module groups of a plan (`groups`: nxdt.parallel.plan's `StagePlan.checkpoint`),
    or, without one, those the `model` config section asks for in the decoder blocks `model` holds."""
    if groups is None:
        adapter = adapter_of(model)
        layers = adapter.layers_path(model)
        blocks = [(f"{layers}.{name}", b) for name, b in adapter.decoder(model).layers.named_children()]
        groups = checkpoint_plan(blocks, model_cfg, adapter.recompute_aliases)
    for group in groups:
        modules = [model.get_submodule(path) for path in group]
        if len(modules) == 1:
            checkpoint_module(modules[0])
        else:
            checkpoint_chunk(modules)
    return model


def _class_in(name: str, present: set[str], aliases: dict[str, tuple[str, ...]]) -> str:
    """`name`, or the model source's class it stands for in a model without it (its adapter's aliases)."""
    if name in present:
        return name
    return next((alias for alias in aliases.get(name, ()) if alias in present), name)
