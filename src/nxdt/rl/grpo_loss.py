"""GRPO's numbers in plain torch, as TRL's GRPOTrainer computes them (trl 1.16,
`_generate_and_score_completions` and `_compute_loss`):

    rewards      [N, F] per completion and function (NaN: the function had no opinion);
                 total = nansum(rewards * weights), NaN where every function abstained
    advantages   total - mean of its group (G consecutive completions of one prompt), divided by
                 (std + 1e-4) with std over the group (scale_rewards='group'), over the whole batch
                 ('batch') or not at all ('none'); Bessel-corrected, NaN-aware; an unscorable
                 completion's advantage is 0
    per token    ratio = exp(logp - old_logp); loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
                 + beta * (exp(ref - logp) - (ref - logp) - 1)
    aggregation  (mask [B, T]: the completion tokens counted)
        grpo     mean over sequences of each sequence's token mean
        bnpo     token mean over the micro-batch
        dr_grpo  token sum / (sequences × max_completion_length)
        dapo     token sum / (completion tokens of the global batch / data-parallel ranks)
    each (but dapo) divided by the micro-batches of the step (gradient accumulation), so the
    step's loss is their sum and the data-parallel gradient mean gives TRL's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The Bessel-corrected std ignoring NaNs (NaN with fewer than 2 values), as TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=var.dtype))
    std = torch.sqrt(var * correction)
    return std if keepdim or dim is None else std.squeeze(dim)


def total_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N]: the weighted sum over functions of [N, F] (NaNs left out), NaN where all are NaN."""
    total = (per_func * weights.to(per_func)[None]).nansum(dim=1)
    return torch.where(torch.isnan(per_func).all(dim=1), torch.full_like(total, float("nan")), total)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """[N] advantages of total rewards [N] in groups of `num_generations` consecutive completions."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = (nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not one of group, batch, none")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@dataclass
class LossParts:
    loss: torch.Tensor
    """The micro-batch's loss, normalised for its loss_type (a scalar with grad)."""
    kl: torch.Tensor | None
    """Per-token KL [B, T] (detached), None with beta = 0."""
    clipped: torch.Tensor
    """Per-token bool [B, T]: the ratio was clipped (low or high) where that changed the objective."""


def per_token_objective(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *,
                        epsilon: float, epsilon_high: float | None, beta: float,
                        ref_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(per-token loss [B, T], per-token KL or None, clipped [B, T]) before aggregation."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    clipped = ((coef_1 < 1 - epsilon) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    return per_token, kl, clipped


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, num_microbatches: int = 1,
              max_completion_length: int | None = None, tokens_per_rank: float | None = None) -> torch.Tensor:
    """The micro-batch loss of `loss_type` (see the module docstring). `tokens_per_rank` (dapo): the
    global batch's completion tokens / data-parallel ranks."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        loss = masked.sum() / (per_token.size(0) * max_completion_length)
    elif loss_type == "dapo":
        if tokens_per_rank is None:
            raise ValueError("dapo needs the global batch's completion tokens per rank")
        return masked.sum() / max(float(tokens_per_rank), 1.0)
    else:
        raise ValueError(f"loss_type: {loss_type!r} is not one of {list(LOSS_TYPES)}")
    return loss / num_microbatches


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              loss_type: str, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logps: torch.Tensor | None = None, num_microbatches: int = 1,
              max_completion_length: int | None = None, tokens_per_rank: float | None = None) -> LossParts:
    """One micro-batch's GRPO loss from per-token log-probs [B, T] (policy with grad, old, reference),
    advantages [B] and the completion mask [B, T]."""
    per_token, kl, clipped = per_token_objective(logps, old_logps, advantages, epsilon=epsilon,
                                                 epsilon_high=epsilon_high, beta=beta, ref_logps=ref_logps)
    loss = aggregate(per_token, mask, loss_type, num_microbatches=num_microbatches,
                     max_completion_length=max_completion_length, tokens_per_rank=tokens_per_rank)
    return LossParts(loss, None if kl is None else kl.detach(), clipped)
