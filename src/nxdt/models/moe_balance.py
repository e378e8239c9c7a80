"""Expert selection with a score bias and group limits, and auxiliary-loss-free load balancing
(DeepSeek-V3, Wang et al. 2024 "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts").

Selection (`select_experts`, transformers' DeepseekV3TopkRouter): the choice scores are the router's
scores plus a per-expert bias (`mlp.gate.e_score_correction_bias`); with `num_groups` the experts form
equal groups, each group scored by the sum of its two best choice scores, and a token picks its top_k
experts within its `group_top_k` best groups. The weights that combine the experts' outputs are the
plain scores of the picked experts (renormalised when normalize_top_k_affinities, + 1e-20 as
transformers), never the bias: the bias steers selection only.

Loss-free balancing (`update_expert_bias`): after each optimizer step every MoE layer's bias moves, outside
the gradient, by `bias_update_rate` x sign(mean load - load_e), the loads being the tokens routed to
each expert during that step, summed over the data-parallel ranks (the caller's process group): an
overloaded expert becomes less attractive, an idle one more. The bias is a buffer: checkpointed and
restored with the weights.

Context parallel (`sequence_balance_loss`): a cp rank holds a slice of every sequence, so the Switch/Mixtral
balance loss of its slice is not the micro-batch's. Its statistics (tokens per expert, summed probabilities,
rows) are summed over the cp group, and each rank's loss carries cp x its own probabilities' share, so that
the mean over the group (what the dp x cp gradient reduction takes) has the whole micro-batch's gradient,
and its value is the whole loss. The loss-free loads are summed over dp x cp by the caller.
No distributed code beyond those all_reduces, on the groups handed in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LOAD_BALANCING = ("aux_loss", "loss_free", "none")


def select_experts(scores: torch.Tensor, bias: torch.Tensor | None, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] fp32 (softmax or sigmoid) → (weights [T, k] fp32, experts [T, k]); see the module docstring."""
    choice = scores if bias is None else scores + bias.float()
    if args.num_groups and args.num_groups > 1:
        t, e = choice.shape
        group_scores = choice.view(t, args.num_groups, e // args.num_groups).topk(2, dim=-1)[0].sum(-1)
        groups = torch.topk(group_scores, k=args.group_top_k, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
        keep = group_mask.unsqueeze(-1).expand(-1, -1, e // args.num_groups).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    experts = torch.topk(choice, k=args.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if args.normalize_top_k_affinities:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, experts


def loss_free_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name → MoE block of the layers balanced loss-free (their gate holds the bias)."""
    return {name: m for name, m in model.named_modules()
            if getattr(getattr(m, "args", None), "load_balancing", None) == "loss_free"
            and getattr(getattr(m, "gate", None), "e_score_correction_bias", None) is not None}


def load_figures(load: torch.Tensor) -> dict[str, float]:
    """One layer's expert loads as shares of its routed tokens: min, max and std (population)."""
    share = load / load.sum().clamp(min=1.0)
    return {"load_min": float(share.min()), "load_max": float(share.max()),
            "load_std": float(share.std(unbiased=False))}


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: Any = None) -> dict[str, float]:
    """After an optimizer step: each loss-free layer's bias += rate x sign(mean load - load), the loads
    (tokens per expert since the last update) summed over `group` (a torch.distributed process group;
    None: this process alone). Returns `moe/<layer>/load_min|max|std` per layer ({} when none)."""
    out: dict[str, float] = {}
    for name, block in loss_free_layers(model).items():
        bias = block.gate.e_score_correction_bias
        local = getattr(bias, "to_local", lambda: bias)()  # replicated under tp/fsdp plans: every rank the same
        load = block.stats.take_load()
        load = torch.zeros(local.shape[0]) if load is None else load
        load = load.to(device=local.device, dtype=torch.float32)
        if group is not None and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load, group=group)
        if not bool(load.sum() > 0):
            continue
        local.add_(block.args.bias_update_rate * torch.sign(load.mean() - load).to(local.dtype))
        layer = name.split("layers.")[-1].split(".")[0] if "layers." in name else name
        out.update({f"moe/layer{layer}/{k}": v for k, v in load_figures(load).items()})
    return out


def sequence_balance_loss(logits: torch.Tensor, num_experts: int, top_k: int, group: Any) -> torch.Tensor:
    """nxdt.models.moe.load_balancing_loss of one layer's router logits [T, E] when the micro-batch's sequences
    are split over `group` (context parallel, see the module docstring): the value is the whole micro-batch's
    E x sum_e f_e P_e, the gradient cp x this slice's part of it (the group's mean is the whole gradient)."""
    probs = torch.softmax(logits.float(), -1)
    selected = torch.topk(probs, top_k, dim=-1).indices
    prob_sum = probs.sum(0)
    counts = torch.bincount(selected.reshape(-1), minlength=num_experts).float()
    total = torch.cat([counts, prob_sum.detach(), prob_sum.new_full((1,), float(logits.shape[0]))])
    torch.distributed.all_reduce(total, group=group)
    counts, whole_sum, rows = total[:num_experts], total[num_experts:-1], total[-1]
    f = counts / rows
    whole = num_experts * torch.sum(f * (whole_sum / rows))
    share = num_experts * torch.sum(f * (prob_sum / rows)) * torch.distributed.get_world_size(group)
    return share + (whole - share).detach()
