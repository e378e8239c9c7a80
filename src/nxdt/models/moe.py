"""Mixture of experts in plain PyTorch: a router and a bank of SwiGLU experts that replace the MLP.

Read top to bottom: arguments, routing (top-k, sinkhorn, capacity), the load-balancing loss,
LLaMA-MoE's gates (noisy top-k, switch) and their balance losses, how an auxiliary loss's
gradient joins the backward, the experts, the router, the block.

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

from nxdt.models import moe_calculators as llama_calc
from nxdt.models.llama_moe import noisy_top_k_gate, switch_route
from nxdt.models.moe_balance import LOAD_BALANCING, select_experts, sequence_balance_loss
from nxdt.models.moe_neox import EXPERT_ACTIVATIONS, MLPExperts, neox_sinkhorn_route
from nxdt.models.moe_xla import dispatch_experts


GATE_TYPES = ("mixtral", "top_k_balanced_noisy", "switch_balanced")
ROUTING_ALGORITHMS = ("top_k", "sinkhorn", "neox_sinkhorn")


@dataclass
class MoEArgs:
    """One MoE layer's routing and experts. Names follow NxDT's `model.moe` keys."""

    num_experts: int = 8
    top_k: int = 2
    frequency: int = 1
    """Layer i is an MoE layer when i % frequency == 0 (Megatron's moe_layer_freq): 1 = every layer."""
    routing_algorithm: str = "top_k"
    """'top_k' (softmax or sigmoid scores, the k best), 'sinkhorn' (balanced top-1, Megatron) or
    'neox_sinkhorn' (GPT-NeoX's SinkhornRouter, nxdt.models.moe_neox)."""
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
    gate_type: str = "mixtral"
    """'mixtral' (routing_algorithm / router_activation above, Switch/Mixtral loss), or LLaMA-MoE's
    'top_k_balanced_noisy' (TopKBalancedNoisyGate) or 'switch_balanced' (SwitchBalancedGate), each
    with its own balance loss weighted by aux_loss_coef."""
    gate_add_noise: bool = True
    """LLaMA-MoE gates, training only: learned Gaussian noise (noisy top-k) or Gumbel noise (switch)."""
    gate_noise_epsilon: float = 1e-2
    """Noisy top-k: noise std = softplus(x W_noise^T) + this."""
    num_groups: int | None = None
    """Group-limited top-k (DeepSeek-V3's n_group): experts in this many equal groups, a token picks
    its top_k among the `group_top_k` groups whose two best scores sum highest; None = all experts."""
    group_top_k: int | None = None
    """Groups a token may pick from (DeepSeek-V3's topk_group)."""
    load_balancing: str = "aux_loss"
    """'aux_loss' (the gate's balance loss, weighted by aux_loss_coef), 'loss_free' (DeepSeek-V3: a
    per-expert bias on the selection scores, `mlp.gate.e_score_correction_bias`, moved after each
    optimizer step towards balance; nxdt.models.moe_balance) or 'none'."""
    bias_update_rate: float = 1e-3
    """loss_free: each step every expert's bias moves by this x sign(mean load - its load)."""
    num_shared_experts: int = 0
    """Experts every token goes through (DeepSeek-V3's n_shared_experts): one SwiGLU MLP
    `mlp.shared_experts` of this x the experts' width, added to the routed experts' output."""
    gate_network: str = "linear"
    """The router: 'linear' (one [E, H] weight) or LLaMA-MoE's 'mlp' (Linear -> Tanh -> Linear [E, E])."""
    expert_activation: str = "swiglu"
    """'swiglu' (MoEExperts) or a two-matrix expert's activation (MLPExperts: gelu, gelu_tanh, silu)."""
    llama_moe: llama_calc.LlamaMoEOptions | None = None
    """LLaMA-MoE's calculators, gate switches, unequal experts, residual block (nxdt.models.moe_calculators)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.routing_algorithm not in ROUTING_ALGORITHMS:
            raise ValueError(f"routing_algorithm must be one of {ROUTING_ALGORITHMS}, got {self.routing_algorithm!r}")
        if self.gate_network not in ("linear", "mlp"):
            raise ValueError(f"gate_network must be 'linear' or 'mlp', got {self.gate_network!r}")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert_activation must be one of {EXPERT_ACTIVATIONS}, got {self.expert_activation!r}")
        if self.routing_algorithm == "sinkhorn" and self.top_k != 1:
            raise ValueError(f"sinkhorn routing picks one expert per token; top_k is {self.top_k}")
        if self.router_activation not in ("softmax", "sigmoid"):
            raise ValueError(f"router_activation must be 'softmax' or 'sigmoid', got {self.router_activation!r}")
        if self.drops_tokens and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 when tokens may be dropped, got {self.capacity_factor}")
        if self.gate_type not in GATE_TYPES:
            raise ValueError(f"gate_type must be one of {GATE_TYPES}, got {self.gate_type!r}")
        if self.gate_type == "switch_balanced" and self.top_k != 1:
            raise ValueError(f"the switch gate picks one expert per token; top_k is {self.top_k}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(f"load_balancing must be one of {LOAD_BALANCING}, got {self.load_balancing!r}")
        if self.num_groups is not None and (self.num_experts % self.num_groups
                                            or not 1 <= (self.group_top_k or 0) <= self.num_groups):
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts}) and "
                             f"group_top_k ({self.group_top_k}) be in [1, num_groups]")

    @property
    def noise_weight(self) -> bool:
        """The router has a learned noise weight (LLaMA-MoE's noisy top-k gate with noise)."""
        return self.gate_type == "top_k_balanced_noisy" and self.gate_add_noise

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


def route(logits: torch.Tensor, args: MoEArgs, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] in fp32, expert indices [T, k]). `bias` (loss-free
    balancing's) and group-limited routing change which experts are picked, not their weights."""
    logits = logits.float()
    scores = torch.softmax(logits, -1) if args.router_activation == "softmax" else torch.sigmoid(logits)
    if bias is not None or args.num_groups:
        return select_experts(scores, bias, args)
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
        self.load: torch.Tensor | None = None
        """Tokens per expert since loss-free balancing last took them (`take_load`), apart from pop()'s."""
        self.reset()

    def take_load(self) -> torch.Tensor | None:
        """The tokens per expert routed since the last call (None when nothing was trained); resets them."""
        load, self.load = self.load, None
        return load

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
        self.load = counts.clone() if self.load is None else self.load + counts
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

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [N, H]: the routed tokens sorted by expert, `tokens_per_expert[e]` rows each (a 1-D
        integer tensor) → [N, H], each row times its routing weight (`weights` [N, 1]; None: 1).
        Expert parallelism wraps this call (it exchanges the tokens so that each rank runs its own
        experts over every rank's tokens for them); tensor parallelism returns this rank's partial
        sums (nxdt.parallel.expert_parallel)."""
        out = swiglu_experts(x, tokens_per_expert, *self.expert_weights())
        return out if weights is None else out * weights.to(out.dtype)

    def expert_weights(self, local=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as the experts compute with them, each through `local` (expert
        parallelism: this rank's shard as a plain tensor; None: as they are). LoRA on the experts
        (nxdt.models.lora_experts) adds its adapters' update here."""
        local = local or (lambda w: w)
        return local(self.gate_up_proj), local(self.down_proj)


@torch.compiler.disable  # data-dependent row counts: torch.compile would specialize on them
def swiglu_experts(x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> torch.Tensor:
    """The experts' computation over given weights ([E, 2F, H], [E, H, F]): a function, so that
    expert parallelism runs it over a rank's own experts (local shards) unchanged. Under autocast
    the matmuls run in the autocast dtype, as F.linear's would."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, gate_up_proj, down_proj = x.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
    counts = tokens_per_expert.tolist()  # the one host sync: each expert's block of rows
    if sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} rows, x has {x.shape[0]}")
    if all(type(t) in (torch.Tensor, nn.Parameter) for t in (x, gate_up_proj, down_proj)):
        return _SwiGLUExperts.apply(x, gate_up_proj, down_proj, counts)
    # tensor subclasses (DTensor, ...): the same computation through autograd, per expert
    outputs = [F.linear(F.silu(gate) * up, w2)
               for rows, w1, w2 in zip(x.split(counts), gate_up_proj.unbind(0), down_proj.unbind(0))
               for gate, up in [F.linear(rows, w1).chunk(2, dim=-1)]]
    return torch.cat(outputs)


class _SwiGLUExperts(torch.autograd.Function):
    """Forward and backward of the SwiGLU experts by hand: per expert one matmul per projection
    (and two per projection in the backward), written straight into whole-batch buffers and into
    the [E, ...] weight gradients; the activation and its derivative run once over all rows.
    Through autograd, each expert's weight slice `w[e]` would zero and add a whole [E, ...]
    gradient (E times per weight per backward), and the per-expert outputs would be copied
    once more by a cat: a third of the layer's time on CPU. Saves x and the gate/up projections
    (h = silu(gate) * up is recomputed in the backward), less than autograd would keep."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
        active = [e for e, n in enumerate(counts) if n]
        gate_up = x.new_empty(x.shape[0], gate_up_proj.shape[1])
        for rows, w, o in zip(_blocks(x, counts), _pick(gate_up_proj.transpose(1, 2), active),
                              _blocks(gate_up, counts)):
            torch.mm(rows, w, out=o)
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = x.new_empty(x.shape[0], down_proj.shape[1])
        for rows, w, o in zip(_blocks(h, counts), _pick(down_proj.transpose(1, 2), active), _blocks(out, counts)):
            torch.mm(rows, w, out=o)
        ctx.save_for_backward(x, gate_up, gate_up_proj, down_proj)
        ctx.counts, ctx.active = counts, active
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, gate_up, gate_up_proj, down_proj = ctx.saved_tensors
        counts, active = ctx.counts, ctx.active
        need_x, need_w1, need_w2, _ = ctx.needs_input_grad
        grad_out = _blocks(grad_out.contiguous(), counts)
        gate, up = gate_up.chunk(2, dim=-1)
        silu = F.silu(gate)
        h = silu * up  # recomputed; the buffer then takes d loss / d h
        grad_w2 = _expert_grad(down_proj, active) if need_w2 else None
        if need_w2:
            for g, rows, o in zip(grad_out, _blocks(h, counts), _pick(grad_w2, active)):
                torch.mm(g.t(), rows, out=o)
        grad_h = h
        for g, w, o in zip(grad_out, _pick(down_proj, active), _blocks(grad_h, counts)):
            torch.mm(g, w, out=o)
        grad_gate_up = x.new_empty(gate_up.shape)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad_h, silu, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_h.mul_(up), gate, grad_input=grad_gate)
        grad_gate_up = _blocks(grad_gate_up, counts)
        grad_x = x.new_empty(x.shape) if need_x else None
        grad_w1 = _expert_grad(gate_up_proj, active) if need_w1 else None
        if need_w1:
            for g, rows, o in zip(grad_gate_up, _blocks(x, counts), _pick(grad_w1, active)):
                torch.mm(g.t(), rows, out=o)
        if need_x:
            for g, w, o in zip(grad_gate_up, _pick(gate_up_proj, active), _blocks(grad_x, counts)):
                torch.mm(g, w, out=o)
        return grad_x, grad_w1, grad_w2, None


def _blocks(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """t's rows split into the experts' blocks (views), those of experts without rows left out."""
    return [block for block, n in zip(t.split(counts), counts) if n]


def _pick(weight: torch.Tensor, active: list[int]) -> list[torch.Tensor]:
    """The [E, ...] tensor's slices (views) of the experts in `active`."""
    slices = weight.unbind(0)
    return [slices[e] for e in active]


def _expert_grad(weight: torch.Tensor, active: list[int]) -> torch.Tensor:
    """The [E, ...] gradient buffer: experts with rows are written whole, only the others zeroed."""
    grad = torch.empty_like(weight)
    for e in sorted(set(range(weight.shape[0])) - set(active)):
        grad[e].zero_()
    return grad


class MoERouter(nn.Module):
    """The gate: one bias-free linear layer, hidden → expert logits (`mlp.gate.weight`), and for
    LLaMA-MoE's noisy top-k gate its noise weight (`mlp.gate.weight_noise`, [E, H]: per token and
    expert, noise std = softplus(x W_noise^T) + gate_noise_epsilon). With `mlp` (LLaMA-MoE's
    gate_network "mlp"): logits = tanh(x W^T) W_out^T, `mlp.gate.weight_out` [E, E]."""

    def __init__(self, hidden_size: int, num_experts: int, noise: bool = False, score_bias: bool = False,
                 mlp: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.weight_noise = nn.Parameter(torch.empty(num_experts, hidden_size)) if noise else None
        self.weight_out = nn.Parameter(torch.empty(num_experts, num_experts)) if mlp else None
        # loss-free balancing's per-expert bias on the selection scores (DeepSeek-V3's name): state, no gradient
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts) if score_bias else None)
        self.token_group = None  # context parallel sets it: the balance loss over whole sequences (moe_balance)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Gate ~ N(0, std); noise weight 0 as LLaMA-MoE starts it (std softplus(0) + eps at first)."""
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.weight_out is not None:
            nn.init.normal_(self.weight_out, mean=0.0, std=std)
        if self.weight_noise is not None:
            nn.init.zeros_(self.weight_noise)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return logits if self.weight_out is None else F.linear(torch.tanh(logits), self.weight_out)

    def route(self, x: torch.Tensor, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens [T, H] → (weights [T, k] fp32, experts [T, k], the gate's balance loss,
        unweighted; None from the mixtral gate when no backward will use it). Noise is drawn from
        torch's RNG, in training mode only (activation checkpointing replays the RNG state, so a
        recomputed forward routes alike)."""
        logits = self(x)
        if args.gate_type == "top_k_balanced_noisy":
            std = z = None
            if self.training and self.weight_noise is not None:
                std = F.softplus(F.linear(x, self.weight_noise).float()) + args.gate_noise_epsilon
                z = torch.randn_like(std)
            softmax = args.llama_moe is None or args.llama_moe.gate_use_softmax
            return noisy_top_k_gate(logits, args.top_k, std, z, softmax)
        if args.gate_type == "switch_balanced":
            return switch_route(logits, args, self.training)
        if args.routing_algorithm == "neox_sinkhorn":
            weights, experts = neox_sinkhorn_route(logits, args.top_k, self.training, args.sinkhorn_iterations,
                                                   args.sinkhorn_tol)
        else:
            weights, experts = route(logits, args, self.e_score_correction_bias)
        trained = self.training and torch.is_grad_enabled() and args.load_balancing == "aux_loss"
        aux = None
        if trained:  # under context parallel the statistics of whole sequences (token_group)
            aux = (load_balancing_loss((logits,), args.num_experts, args.top_k) if self.token_group is None
                   else sequence_balance_loss(logits, args.num_experts, args.top_k, self.token_group))
        return weights, experts, aux


class LlamaMoE(nn.Module):
    """Router + experts in place of the MLP: each token goes to its k experts, their outputs
    weighted by the router's scores and summed (tokens over capacity get nothing from that
    expert; the residual carries them on)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, args: MoEArgs,
                 shared_experts: nn.Module | None = None) -> None:
        """`shared_experts`: the MLP every token goes through besides its routed experts (DeepSeek-V3)."""
        super().__init__()
        self.args = args
        self.gate = MoERouter(hidden_size, args.num_experts, noise=args.noise_weight,
                              score_bias=args.load_balancing == "loss_free", mlp=args.gate_network == "mlp")
        if args.expert_activation == "swiglu":
            self.experts = MoEExperts(args.num_experts, hidden_size, ffn_hidden_size)
        else:  # two-matrix experts (GPT-NeoX's)
            self.experts = MLPExperts(args.num_experts, hidden_size, ffn_hidden_size, args.expert_activation)
        if shared_experts is not None:
            self.shared_experts = shared_experts
        self.dropout = nn.Dropout(args.dropout)
        self.stats = RouterStats()
        if args.llama_moe is not None:
            llama_calc.build_parts(self, hidden_size, ffn_hidden_size, args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, lm = self.args, self.args.llama_moe
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, aux = self.gate.route(x, a)
        if a.drops_tokens:
            keep = keep_within_capacity(experts, capacity(x.shape[0], a), a.num_experts)
        elif lm is None or (keep := llama_calc.keep_of(experts, a)) is None:
            keep = torch.ones_like(experts, dtype=torch.bool)
        if x.device.type == "xla" and lm is None:  # static shapes for XLA's compiler: [E, capacity, H] buffers
            cap = capacity(x.shape[0], a) if a.drops_tokens else x.shape[0]
            out, counts = dispatch_experts(x, weights, experts, keep, self.experts, cap, a.score_scale)
        else:
            # the kept (token, slot) assignments, grouped by expert (stable: token order within one)
            # as flat indices token * k + slot (one nonzero; index_select is 2-3x x[idx] on CPU)
            kept = keep.reshape(-1).nonzero().squeeze(1)
            expert_idx = experts.reshape(-1).index_select(0, kept)
            kept = kept.index_select(0, torch.argsort(expert_idx, stable=True))
            token_idx, slot_weight = kept // experts.shape[1], weights.reshape(-1).index_select(0, kept)
            counts = torch.bincount(expert_idx, minlength=a.num_experts)
            scale = slot_weight[:, None] * a.score_scale if lm is None else llama_calc.slot_weights(slot_weight, a)
            routed = self.experts(x.index_select(0, token_idx), counts, scale)
            out = torch.zeros_like(x).index_add_(0, token_idx, routed.to(x.dtype))
            if lm is not None:
                out = llama_calc.finish(self, out, x, weights, keep)
        if a.num_shared_experts:
            out = out + self.shared_experts(x)
        out = self.dropout(out).reshape(shape)
        if self.training and torch.is_grad_enabled():
            dropped = (~keep).sum()
            aux = aux if aux is not None else x.new_zeros((), dtype=torch.float32)  # loss_free / none: stats only
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


def reset_router_stats(model: nn.Module) -> None:
    """Forget the routing statistics and expert loads every MoE layer of `model` recorded (a pass that
    trained nothing, e.g. a pipeline's shape inference)."""
    for m in model.modules():
        if isinstance(getattr(m, "stats", None), RouterStats):
            m.stats.reset()
            m.stats.load = None


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
