"""Mixture of experts in plain PyTorch: a router and a bank of SwiGLU experts that replace the MLP.

Read top to bottom: arguments, routing (top-k, sinkhorn, capacity), the load-balancing loss and
how its gradient joins the backward, the experts, the block.

Design points:
- Names and layouts are transformers' Mixtral, so state dicts move with no renaming:
  `mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj` [E, 2F, H] (gate rows, then up rows),
  `mlp.experts.down_proj` [E, H, F].
- The experts run batched per expert: the (token, slot) assignments are sorted by expert and
  each expert does two matmuls over its contiguous block of tokens. The loop is over experts
  (E iterations), never over tokens.
- No distributed code (expert parallelism is applied from outside, like every other plan).
- The auxiliary loss does not travel through the model's outputs: each MoE layer attaches its
  loss's gradient to its own output in the backward (`AuxLossGradient`, Megatron's
  MoEAuxLossAutoScaler), so it works unchanged under pipeline stages and recomputation. The
  training step says how much one micro-batch weighs (`set_aux_loss_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEArgs:
    """One MoE layer's routing and experts. Names follow NxDT's `model.moe` keys."""

    num_experts: int = 8
    top_k: int = 2
    frequency: int = 1
    """Layer i is an MoE layer when i % frequency == 0 (Megatron's moe_layer_freq): 1 = every layer."""
    routing_algorithm: str = "top_k"
    """'top_k' (softmax or sigmoid scores, the k best) or 'sinkhorn' (balanced top-1, Megatron)."""
    router_activation: str = "softmax"
    normalize_top_k_affinities: bool = True
    """Divide the k chosen scores by their sum (Mixtral)."""
    capacity_factor: float | None = None
    """Each expert takes at most ceil(capacity_factor x tokens x k / E) assignments; None = all."""
    dropless: bool = False
    """Compute every routed token whatever capacity_factor says."""
    sinkhorn_iterations: int = 30
    sinkhorn_tol: float | None = None
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the training loss (0: statistics only)."""
    dropout: float = 0.0
    """Dropout on the layer's output."""
    score_scale: float = 1.0
    """Expert outputs x this (LLaMA-MoE's moe_calculator_score_scale_factor)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.routing_algorithm not in ("top_k", "sinkhorn"):
            raise ValueError(f"routing_algorithm must be 'top_k' or 'sinkhorn', got {self.routing_algorithm!r}")
        if self.routing_algorithm == "sinkhorn" and self.top_k != 1:
            raise ValueError(f"sinkhorn routing picks one expert per token; top_k is {self.top_k}")
        if self.router_activation not in ("softmax", "sigmoid"):
            raise ValueError(f"router_activation must be 'softmax' or 'sigmoid', got {self.router_activation!r}")
        if self.drops_tokens and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 when tokens may be dropped, got {self.capacity_factor}")

    @property
    def drops_tokens(self) -> bool:
        return self.capacity_factor is not None and not self.dropless

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx % self.frequency == 0


# --------------------------------------------------------------------------- routing


def sinkhorn(logits: torch.Tensor, iterations: int, tol: float | None = None) -> torch.Tensor:
    """Balance exp(logits) [T, E] towards equal row sums (tokens) and column sums (experts) by
    alternate normalisation (Megatron's sinkhorn); stops after `iterations` or once the column
    factors move less than `tol` on average."""
    cost = torch.exp(logits - logits.max())  # a constant shift: same balanced result, no overflow
    d0 = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    d1 = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    eps = 1e-8
    for _ in range(iterations):
        d0 = 1.0 / (d0.numel() * ((d1 * cost).sum(1) + eps))
        d1_new = 1.0 / (d1.numel() * ((d0[:, None] * cost).sum(0) + eps))
        moved = (d1_new - d1).abs().mean()
        d1 = d1_new
        if tol is not None and moved < tol:
            break
    return d1 * cost * d0[:, None]


def route(logits: torch.Tensor, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] in fp32, expert indices [T, k])."""
    logits = logits.float()
    scores = torch.softmax(logits, -1) if args.router_activation == "softmax" else torch.sigmoid(logits)
    if args.routing_algorithm == "sinkhorn":
        with torch.no_grad():  # sinkhorn picks the expert; the score of the pick carries the gradient
            experts = sinkhorn(logits, args.sinkhorn_iterations, args.sinkhorn_tol).argmax(-1, keepdim=True)
        return scores.gather(-1, experts), experts
    weights, experts = torch.topk(scores, args.top_k, dim=-1)
    if args.normalize_top_k_affinities:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def capacity(num_tokens: int, args: MoEArgs) -> int:
    """Assignments one expert takes when tokens may be dropped: ceil(cf x tokens x k / E)."""
    return math.ceil(args.capacity_factor * num_tokens * args.top_k / args.num_experts)


def keep_within_capacity(experts: torch.Tensor, cap: int, num_experts: int) -> torch.Tensor:
    """Bool [T, k]: which assignments fit. Priority is deterministic: every token's first choice
    before any second choice, and within one slot earlier tokens first (GShard's order)."""
    slot_major = experts.t().reshape(-1)  # [k * T]: slot 0 of all tokens, then slot 1, ...
    one_hot = F.one_hot(slot_major, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # this assignment's place in its expert's queue
    return (position < cap).reshape(experts.shape[1], experts.shape[0]).t()


# --------------------------------------------------------------------------- load balancing


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], num_experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss over the given layers' router logits ([T, E] each):
    E x sum_e f_e x P_e, with f_e the top-k assignments to expert e per token and P_e its mean
    softmax probability, both pooled over the layers given. transformers'
    `load_balancing_loss_func` (no attention mask) computes the same value."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), -1)
        selected = torch.topk(probs, top_k, dim=-1).indices
        counts = counts + torch.bincount(selected.reshape(-1), minlength=num_experts).float()
        prob_sum = prob_sum + probs.sum(0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


_aux_loss_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """How much one forward's auxiliary losses weigh in the backward: the training step sets it
    to loss_scale / micro-batches, as it scales the main loss of each micro-batch."""
    global _aux_loss_scale
    _aux_loss_scale = float(scale)


class AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output; in the backward, `aux_loss` receives the gradient it would
    get had `coef x aux_loss` been added to the (scaled) training loss. The layer's routing
    statistics are recorded here too: the backward runs once per trained micro-batch, also when
    the forward was recomputed for activation checkpointing."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, coef: float, stats: "RouterStats",
                record: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx.coef, ctx.stats, ctx.record = coef, stats, record
        ctx.aux = aux_loss.detach()
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ctx.stats.add(ctx.aux, *ctx.record)
        grad_aux = torch.full((), ctx.coef * _aux_loss_scale, dtype=ctx.aux.dtype, device=ctx.aux.device)
        return grad_output, grad_aux, None, None, None


class RouterStats:
    """Routing statistics of the micro-batches trained since the last `pop()` (not state: no
    parameters, no buffers, nothing checkpointed)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.aux_loss = 0.0
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped = 0
        self.assigned = 0

    def add(self, aux_loss: torch.Tensor, tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> None:
        self.forwards += 1
        self.aux_loss += float(aux_loss)
        counts = tokens_per_expert.detach().float().cpu()
        self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        self.dropped += int(dropped)
        self.assigned += int(tokens_per_expert.sum()) + int(dropped)  # routed: kept + dropped

    def pop(self) -> dict[str, float] | None:
        """{aux_loss (mean per forward), dropped_fraction, expert_share_min/max} and reset; None
        when nothing was trained."""
        if not self.forwards:
            return None
        share = self.tokens_per_expert / self.tokens_per_expert.sum().clamp(min=1.0)
        out = {"aux_loss": self.aux_loss / self.forwards,
               "dropped_fraction": self.dropped / max(1, self.assigned),
               "expert_share_min": float(share.min()), "expert_share_max": float(share.max())}
        self.reset()
        return out


# --------------------------------------------------------------------------- experts


class MoEExperts(nn.Module):
    """E SwiGLU experts as two 3-D weights (transformers' MixtralExperts layout)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x [N, H]: the routed tokens sorted by expert, `tokens_per_expert[e]` rows each → [N, H]."""
        outputs = []
        for e, rows in enumerate(x.split(tokens_per_expert)):
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outputs)


class MoERouter(nn.Module):
    """The gate: one bias-free linear layer, hidden → expert logits (`mlp.gate.weight`)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LlamaMoE(nn.Module):
    """Router + experts in place of the MLP: each token goes to its k experts, their outputs
    weighted by the router's scores and summed (tokens over capacity get nothing from that
    expert; the residual carries them on)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = MoERouter(hidden_size, args.num_experts)
        self.experts = MoEExperts(args.num_experts, hidden_size, ffn_hidden_size)
        self.dropout = nn.Dropout(args.dropout)
        self.stats = RouterStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, experts = route(logits, a)
        if a.drops_tokens:
            keep = keep_within_capacity(experts, capacity(x.shape[0], a), a.num_experts)
        else:
            keep = torch.ones_like(experts, dtype=torch.bool)
        # the kept (token, slot) assignments, grouped by expert (stable: token order within one)
        token_idx = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(experts)[keep]
        expert_idx = experts[keep]
        order = torch.argsort(expert_idx, stable=True)
        token_idx, slot_weight = token_idx[order], weights[keep][order]
        counts = torch.bincount(expert_idx, minlength=a.num_experts)
        routed = self.experts(x[token_idx], counts.tolist())
        routed = routed * (slot_weight[:, None] * a.score_scale).to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token_idx, routed.to(x.dtype))
        out = self.dropout(out).reshape(shape)
        if self.training and torch.is_grad_enabled():
            aux = load_balancing_loss((logits,), a.num_experts, a.top_k)
            dropped = (~keep).sum()
            out = AuxLossGradient.apply(out, aux, a.aux_loss_coef, self.stats, (counts, dropped))
        return out


def pop_router_stats(model: nn.Module) -> dict[str, float]:
    """The routing statistics of every MoE layer of `model` since the last call, averaged over
    the layers (share min/max: the extremes over layers); {} for a dense model or when nothing
    was trained. Resets them."""
    layers = [m.stats for m in model.modules() if isinstance(getattr(m, "stats", None), RouterStats)]
    per_layer = [s for s in (stats.pop() for stats in layers) if s is not None]
    if not per_layer:
        return {}
    out = {k: sum(s[k] for s in per_layer) / len(per_layer) for k in ("aux_loss", "dropped_fraction")}
    out["expert_share_min"] = min(s["expert_share_min"] for s in per_layer)
    out["expert_share_max"] = max(s["expert_share_max"] for s in per_layer)
    return out


def attach_router_aux_loss(block: nn.Module, num_experts: int, top_k: int, coef: float) -> None:
    """The same load-balancing loss and statistics for a transformers MoE block (Mixtral's
    MixtralSparseMoeBlock and its kin: a `gate` whose output, or its first element, is the router
    logits, and `experts`), by forward hooks: the gate's hook keeps the logits, the block's hook
    attaches the loss's gradient to the block's output (AuxLossGradient)."""
    block.stats = RouterStats()
    kept: dict[str, torch.Tensor] = {}

    def keep_logits(_module, _inputs, output):
        kept["logits"] = output[0] if isinstance(output, tuple) else output

    def attach(module, _inputs, output):
        logits = kept.pop("logits", None)
        if logits is None or not (module.training and torch.is_grad_enabled()):
            return output
        logits = logits.reshape(-1, num_experts)
        aux = load_balancing_loss((logits,), num_experts, top_k)
        selected = torch.topk(logits.float(), top_k, dim=-1).indices
        counts = torch.bincount(selected.reshape(-1), minlength=num_experts)
        return AuxLossGradient.apply(output, aux, coef, module.stats, (counts, torch.zeros((), dtype=torch.long)))

    block.gate.register_forward_hook(keep_logits)
    block.register_forward_hook(attach)
