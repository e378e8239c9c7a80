"""Stochastic rounding of the bf16 compute weights under FSDP2 (mixed_precisionSR + FSDP).

FSDP2 owns the parameter storage and makes the bf16 compute copy itself, in its all-gather
(`MixedPrecisionPolicy.param_dtype`), by round-to-nearest. Its supported extension point for
changing that cast is the all-gather hook pair of a tensor subclass (what torchao's float8
weights use): when the *local shard* of a parameter defines `fsdp_pre_all_gather` /
`fsdp_post_all_gather`, FSDP all-gathers whatever the first returns and builds the unsharded
parameter from what the second returns.

`StochasticRoundingShard` is that subclass: an ordinary fp32 tensor (same storage, same
kernels) whose pre-all-gather hook sends `stochastic_round_to_bf16(shard)` instead of a
round-to-nearest cast. Everything else stays as in `mixed_precision`: the fp32 shards are the
master weights the optimizer updates and checkpoints hold; the bf16 gradients are reduced in fp32
(`reduce_dtype`), unsynchronised micro-batch gradients are accumulated in fp32 by FSDP, and the
sharded gradients are fp32.

The random bits are a function of (seed, rank, step, parameter), not of a running generator:
with `reshard_after_forward` the backward all-gathers the weights again, and it must see the
very same bf16 weights as the forward did (as the non-FSDP path, which rounds once per step).
`SRState.step` is advanced by `Precision.begin_step` and saved in its checkpoint state.

Only the sharding code of FSDP (chunk, narrow, new_zeros, view, detach, `.to`) keeps the
subclass; every other op returns plain tensors, so optimizer state, gradients and checkpoints
never see it, and pickling one writes a plain tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from nxdt.precision.stochastic_rounding import stochastic_round_to_bf16


@dataclass
class SRState:
    """Shared by every shard of one model: where the random bits come from."""

    seed: int = 0
    step: int = 0

    def generator(self, index: int, device: torch.device) -> torch.Generator:
        # an odd-multiplier mix of (seed, step, parameter index) into 63 bits
        key = ((self.seed * 1_000_003 + self.step) * 1_000_003 + index) % (2**63 - 1)
        return torch.Generator(device=device).manual_seed(key)


aten = torch.ops.aten
# Ops FSDP2 applies to a parameter while sharding it (fully_shard, reset_sharded_param, meta
# init, CPU offload) and nn.Parameter's detach: their results must stay shards of this class.
# As in torchao's float8 weights.
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default, aten.slice.Tensor,
    aten.split.Tensor, aten.new_zeros.default, aten.empty_like.default, aten.copy_.default,
    aten._to_copy.default, aten._pin_memory.default, aten.clone.default,
}


class StochasticRoundingShard(torch.Tensor):
    """An fp32 (local shard of a) parameter whose FSDP2 all-gather sends a stochastically rounded bf16 copy.

    A wrapper subclass (`_tensor` holds the data): it has to survive ops run at the dispatcher
    level inside DTensor, which a plain Python subclass would not."""

    _tensor: torch.Tensor
    sr_state: SRState
    sr_index: int

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: SRState, index: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, state: SRState, index: int) -> None:
        self._tensor, self.sr_state, self.sr_index = tensor, state, index

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        src = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, StochasticRoundingShard))
        args, kwargs = tree_map_only(StochasticRoundingShard, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, src.sr_state, src.sr_index), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self.sr_state, self.sr_index)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return StochasticRoundingShard(inner["_tensor"], *meta)

    def __repr__(self) -> str:
        return f"StochasticRoundingShard({self._tensor!r})"

    def __reduce_ex__(self, protocol):  # pickle (torch.save, DCP) as the plain fp32 tensor it holds
        return self._tensor.__reduce_ex__(protocol)

    # ---- FSDP2 all-gather extension ------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        gen = self.sr_state.generator(self.sr_index, self._tensor.device)
        rounded = stochastic_round_to_bf16(self._tensor, gen)
        # every rank must send the padded shard size (FSDP pads the last shard(s) on dim 0)
        padded = (math.ceil(outer_size[0] / mesh.size()), *outer_size[1:])
        if tuple(rounded.shape) != padded:
            full = rounded.new_zeros(padded)
            full[: rounded.shape[0]].copy_(rounded)
            rounded = full
        return (rounded,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # later all-gathers refill the same buffer in place
            return None
        return data, (data,)


def wrap_for_stochastic_rounding(model: nn.Module, state: SRState) -> None:
    """Make every floating-point parameter of `model` a StochasticRoundingShard (call before fully_shard)."""
    done: dict[int, nn.Parameter] = {}  # tied parameters (shared embeddings) stay tied
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_floating_point() or isinstance(p, StochasticRoundingShard):
                continue
            if p.dtype != torch.float32:
                raise ValueError(f"stochastic rounding under FSDP expects fp32 master weights, got {p.dtype} for {name}")
            if id(p) not in done:
                done[id(p)] = nn.Parameter(_wrap(p.detach(), state, len(done)), requires_grad=p.requires_grad)
            module.register_parameter(name, done[id(p)])


def _wrap(t: torch.Tensor, state: SRState, index: int) -> torch.Tensor:
    """The subclass goes on the local tensor: a tensor-parallel DTensor keeps its layout around it."""
    if isinstance(t, DTensor):
        return DTensor.from_local(StochasticRoundingShard(t.to_local(), state, index), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
    return StochasticRoundingShard(t, state, index)


def sr_states_of(model: nn.Module) -> list[SRState]:
    """The SRStates of the model's stochastic-rounding shards (one per fully_shard-ed part; [] when none)."""
    states: list[SRState] = []
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if isinstance(local, StochasticRoundingShard) and not any(s is local.sr_state for s in states):
                states.append(local.sr_state)
    return states
