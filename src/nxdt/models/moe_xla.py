"""The MoE layer's experts with static shapes, for XLA: every expert runs over every token and the
router's weights (zero where a token did not pick the expert, or the expert had no room for it)
combine their outputs. nxdt.models.moe.LlamaMoE takes this path on an XLA device.

Why: the CPU/CUDA path groups the (token, slot) assignments by expert (nonzero, argsort, bincount,
per-expert row counts read on the host, index_add). Its shapes depend on the routing, which XLA
compiles as a new graph per shape or cannot lower at all: with torch-xla 2.9 even a one-device
tiny MoE aborts (`shape.h:848 Check failed: buffer != nullptr`) when nonzero's data-dependent result
feeds index_select / argsort in the same traced graph (each op alone, with a graph cut after
nonzero, runs; bisected on XLA:CPU). Here every shape is fixed by
(tokens, experts, hidden, ffn): three einsums and a one-hot comparison, which XLA compiles once
and which GSPMD partitions over the expert dimension when the experts are sharded over "ep"
(nxdt.parallel.xla_spmd) — the expert-parallel layout is a sharding, not an all-to-all.

The arithmetic is the CPU path's: each token's output is sum over its kept slots of
weight x score_scale x expert(x) (unpicked experts add exact zeros), so the two agree to rounding
(tests/xla/test_xla_moe.py: 1e-5 over training). The cost is E/k times the routed experts'
FLOPs: the price of static shapes; a capacity-based gather (GShard's dispatch tensors) would cut it
for large E.

Only torch and moe_neox's activations: nothing here imports nxdt.models.moe (which imports this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxdt.models.moe_neox import _ACTIVATION


def combine_weights(weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(combine [T, E]: each token's routing weight per expert, 0 where not picked or not kept;
    tokens per expert [E], kept assignments only). No one_hot / bincount: a comparison with
    arange, so no shape or check depends on the values."""
    picked = experts.unsqueeze(-1) == torch.arange(num_experts, device=experts.device)  # [T, k, E]
    picked = picked & keep.unsqueeze(-1)
    combine = (picked.to(weights.dtype) * weights.unsqueeze(-1)).sum(1)
    return combine, picked.sum((0, 1))


def dense_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
                  bank: nn.Module, score_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [T, H], the router's (weights [T, k], experts [T, k]) and which slots are kept
    [T, k] -> (the layer's routed output [T, H] in x's dtype, tokens per expert [E]). `bank`:
    nxdt's SwiGLU experts (MoEExperts: gate_up_proj [E, 2F, H], down_proj [E, H, F], LoRA's update
    included through expert_weights) or the two-matrix experts (MLPExperts: up_proj, down_proj)."""
    combine, counts = combine_weights(weights.float(), experts, keep, bank.num_experts)
    h = x
    if hasattr(bank, "gate_up_proj"):
        w1, w2 = bank.expert_weights()
    else:
        w1, w2 = bank.up_proj, bank.down_proj
    device = x.device.type
    if torch.is_autocast_enabled(device):  # as the CPU path: the matmuls in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        h, w1, w2 = h.to(dtype), w1.to(dtype), w2.to(dtype)
    projected = torch.einsum("th,efh->etf", h, w1)
    if hasattr(bank, "gate_up_proj"):
        gate, up = projected.chunk(2, dim=-1)
        inner = F.silu(gate) * up
    else:
        inner = _ACTIVATION[bank.activation](projected)
    per_expert = torch.einsum("etf,ehf->eth", inner, w2)
    out = torch.einsum("eth,te->th", per_expert, (combine * score_scale).to(per_expert.dtype))
    return out.to(x.dtype), counts
