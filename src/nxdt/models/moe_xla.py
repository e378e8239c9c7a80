"""The MoE layer's experts with static shapes, for XLA: a capacity-based dispatch. Each (token, slot)
assignment is scattered into its expert's buffer [E, capacity, H] at its place in that expert's queue,
the experts run as two batched einsums over the buffers, and each token gathers its rows back,
weighted by the router. nxdt.models.moe.LlamaMoE takes this path on an XLA device.

Why: the CPU/CUDA path groups the (token, slot) assignments by expert (nonzero, argsort, bincount,
per-expert row counts read on the host, index_add). Its shapes depend on the routing, which XLA
compiles as a new graph per shape or cannot lower at all: with torch-xla 2.9 even a one-device
tiny MoE aborts (`shape.h:848 Check failed: buffer != nullptr`) when nonzero's data-dependent result
feeds index_select / argsort in the same traced graph (each op alone, with a graph cut after
nonzero, runs; bisected on XLA:CPU). Here every shape is fixed by (tokens, k, experts, capacity,
hidden, ffn) (GShard's dispatch, written as a scatter and a gather instead of [T, E, C] one-hot
tensors), so XLA compiles it once, and GSPMD partitions the einsums over the expert dimension when
the experts are sharded over "ep" (nxdt.parallel.xla_spmd): expert parallel is a sharding, not an
all-to-all.

The capacity is the config's (moe.capacity: ceil(capacity_factor x T x k / E) when tokens may be
dropped); dropless or without a capacity factor it is T (a token's k experts are distinct, so no
expert gets more than T assignments). The experts compute E x capacity rows: capacity_factor x the
routed rows when tokens may be dropped, E/k x them when dropless (as the dense every-expert-over-
every-token layer this replaced). The arithmetic is the CPU path's: each token's output is the sum
over its kept slots of weight x score_scale x expert(x), with the same drops (keep_within_capacity's
queue order), so the two agree to rounding (tests/test_xla_spmd_specs.py; tests/xla: 1e-5 over training).

Only torch and moe_neox's activations: nothing here imports nxdt.models.moe (which imports this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdt.models.moe_neox import _ACTIVATION


def dispatch_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
                     bank: nn.Module, capacity: int, score_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [T, H], the router's (weights [T, k], experts [T, k]), which slots are kept [T, k] and
    each expert's `capacity` (rows of its buffer) -> (the layer's routed output [T, H] in x's dtype,
    tokens per expert [E]). `bank`: nxdt's SwiGLU experts (MoEExperts: gate_up_proj [E, 2F, H],
    down_proj [E, H, F], LoRA's update included through expert_weights) or the two-matrix experts
    (MLPExperts: up_proj, down_proj).

    The (token, slot) assignments are taken slot-major (every token's first choice, then every
    second choice: keep_within_capacity's queue order); an assignment's row in its expert's buffer is
    its place in that expert's queue, so the kept ones fill rows 0..capacity-1 and a dropped one goes
    to a spare row `capacity`, never computed. Capacity above T is cut to T: a token's k experts are
    distinct, so no expert gets more than T assignments (dropless: capacity T)."""
    tokens, k = experts.shape
    cap = min(capacity, tokens)
    slot_major = experts.t().reshape(-1)  # [k T]: assignment s * T + t is token t's slot s
    picked = slot_major.unsqueeze(-1) == torch.arange(bank.num_experts, device=x.device)  # [k T, E]
    position = (picked.cumsum(0) * picked).sum(-1) - 1  # the assignment's place in its expert's queue
    kept = keep.t().reshape(-1) & (position < cap)
    row = torch.where(kept, position, torch.full_like(position, cap))
    if hasattr(bank, "gate_up_proj"):
        w1, w2 = bank.expert_weights()
    else:
        w1, w2 = bank.up_proj, bank.down_proj
    h = x.repeat(k, 1)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # as the CPU path: the matmuls in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        h, w1, w2 = h.to(dtype), w1.to(dtype), w2.to(dtype)
    buffers = h.new_zeros(bank.num_experts, cap + 1, h.shape[-1]).index_put((slot_major, row), h, accumulate=True)
    projected = torch.einsum("ech,efh->ecf", buffers[:, :cap], w1)
    if hasattr(bank, "gate_up_proj"):
        gate, up = projected.chunk(2, dim=-1)
        inner = F.silu(gate) * up
    else:
        inner = _ACTIVATION[bank.activation](projected)
    done = torch.einsum("ecf,ehf->ech", inner, w2)
    done = torch.cat([done, done.new_zeros(done.shape[0], 1, done.shape[-1])], 1)  # the spare row: zeros
    scale = weights.float().t().reshape(-1) * kept * score_scale
    out = (done[slot_major, row] * scale.unsqueeze(-1).to(done.dtype)).reshape(k, tokens, -1).sum(0)
    return out.to(x.dtype), (picked & kept.unsqueeze(-1)).sum(0)
