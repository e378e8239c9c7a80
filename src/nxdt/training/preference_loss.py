"""DPO and ORPO losses in plain torch, written to give TRL 1.16's numbers.

Users compare a DPO/ORPO run with TRL's, so the formulas follow TRL line by line:
- DPO: `trl/trainer/dpo_trainer.py`, `DPOTrainer._compute_loss` (f_divergence reverse_kl,
  label_smoothing 0, no ld_alpha / weighting): sigmoid, hinge and ipo; the rewards TRL logs are
  beta × (policy - reference) summed log-probs, for every loss type.
- ORPO: `trl/experimental/orpo/orpo_trainer.py`, `ORPOTrainer.odds_ratio_loss` and
  `get_batch_loss_metrics`: per-token *average* log-probs of the responses, and the loss
  nll_chosen - mean(beta × logsigmoid(log_odds)), where TRL's NLL is the token-mean cross entropy
  of the chosen sequences over prompt *and* response (`concatenated_forward`: "orpo chosen nll
  loss is computed over the full prompt and response").

Log-probs are fp32 (`-F.cross_entropy(reduction='none')`); tensor-parallel logits (a vocabulary-
sharded DTensor) are handled like nxdt.training.loss.masked_token_loss: the caller runs this and
the backward under `loss_parallel()`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nxdt.parallel.tensor_parallel import is_vocab_parallel

LOSS_TYPES = ("sigmoid", "hinge", "ipo")


# ---- log-probs -------------------------------------------------------------------------------
def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position, fp32, [B, S] (a plain tensor also for vocabulary-sharded logits)."""
    per_token = -F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if is_vocab_parallel(logits):
        per_token = per_token.full_tensor()  # replicated per-token values as a plain tensor
    return per_token.view(labels.shape)


def masked_sums(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the positions whose mask is 1, their count), each [B]."""
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum(-1), mask.sum(-1)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log p(label) over the positions with loss_mask 1, their count), each [B], fp32."""
    return masked_sums(token_logps(logits, labels), loss_mask)


def through_last_response_token(loss_mask: torch.Tensor) -> torch.Tensor:
    """1 on every position up to the last one with loss_mask 1: the prompt's tokens after BOS and the
    response (the positions TRL's ORPO NLL covers), 0 on the padding after them."""
    return loss_mask.flip(-1).cummax(-1).values.flip(-1)


# ---- DPO -------------------------------------------------------------------------------------
def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float, loss_type: str,
             chosen_counts: torch.Tensor | None = None, rejected_counts: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-prompt losses [B], chosen rewards [B], rejected rewards [B]), as TRL's DPOTrainer.

    Arguments are summed response log-probs [B]. `ipo` needs the response token counts: TRL divides
    each log-ratio by its response's length (average per token). Rewards are detached.
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_counts is None or rejected_counts is None:
            raise ValueError("dpo_loss: loss_type 'ipo' needs chosen_counts and rejected_counts")
        chosen_avg = chosen_logratios / chosen_counts.clamp(min=1.0)
        rejected_avg = rejected_logratios / rejected_counts.clamp(min=1.0)
        losses = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r} (one of {list(LOSS_TYPES)})")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


# ---- ORPO ------------------------------------------------------------------------------------
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's orpo_trainer.log1mexp)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPOLoss(NamedTuple):
    """ORPO's total loss and what TRL logs with it (all scalars but the per-prompt rewards)."""

    loss: torch.Tensor  # nll - mean(beta * logsigmoid(log_odds))
    chosen_rewards: torch.Tensor  # [B] beta * average log-prob, detached
    rejected_rewards: torch.Tensor  # [B]
    log_odds_ratio: torch.Tensor  # TRL's `log_odds_ratio`: mean(logsigmoid(log_odds))
    log_odds_chosen: torch.Tensor  # TRL's `log_odds_chosen`: mean(log_odds)
    nll: torch.Tensor  # the chosen sequences' NLL (TRL's `nll_loss`)


def orpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, chosen_nll: torch.Tensor,
              beta: float) -> ORPOLoss:
    """ORPO as TRL's ORPOTrainer: `*_avg_logps` [B] are per-token average response log-probs,
    `chosen_nll` the token-mean NLL of the chosen sequences (prompt and response)."""
    chosen = chosen_avg_logps.float()
    rejected = rejected_avg_logps.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - (beta * ratio).mean()
    return ORPOLoss(loss, beta * chosen.detach(), beta * rejected.detach(), ratio.mean().detach(),
                    log_odds.mean().detach(), chosen_nll.detach())


# ---- metrics ---------------------------------------------------------------------------------
def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's reward scalars: means of the rewards, the accuracy (chosen > rejected) and the margin."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }
