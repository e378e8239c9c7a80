"""The training loss: mean cross entropy over the tokens whose loss_mask is 1; and the token-weighted
sums an evaluation reports (EvalTally).

The Megatron/NxDT convention: per micro-batch the mean over unmasked tokens, then the mean over
the micro-batches of the global batch (nxdt.training.step), so every layout of the same global
batch gives the same loss.

DPO and ORPO (`dpo_loss`, `orpo_loss`, the log-probs they take) follow TRL 1.16 line by line,
so a run compares with TRL's:
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

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nxdt.device import compile_backend
from nxdt.models.chunked_loss import token_cross_entropy
from nxdt.parallel.context_parallel import global_token_count
from nxdt.parallel.mesh import submesh
from nxdt.parallel.tensor_parallel import is_vocab_parallel


@functools.cache
def compiled_token_losses(device_type: str = "cpu"):
    """`token_cross_entropy` through torch.compile (model.fusions.torch_compile): one fused pass for the
    upcast, log-softmax and pick, instead of full-size fp32 tensors for each (on CPU 44 vs 74 ms
    forward + backward for 2,048 tokens x 8,192 in fp32, 34 vs 139 ms from bf16 logits)."""
    return torch.compile(token_cross_entropy, backend=compile_backend(device_type))


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                      cp_group=None, compiled: bool = False) -> torch.Tensor:
    """Mean cross entropy over the tokens whose loss_mask is 1 (fp32 for the softmax).

    `logits` [B, S, V]; or, shaped like `labels`, the per-token losses the model already computed
    (`model.fusions.cross_entropy_chunk_size`: its output layer run a chunk of tokens at a time,
    nxdt.models.chunked_loss).

    Vocabulary-sharded logits (tensor parallel: a Shard(-1) DTensor) need the caller to run this
    and the backward under `loss_parallel()`: the softmax is then computed across the shards.

    With context parallelism (`cp_group`) the tokens are one slice of each sequence: the sum is
    divided by the whole sequence's token count / cp, so the mean over the cp ranks (which the
    dp × cp gradient and metric reductions take) is the whole sequence's mean.

    `compiled`: the cross entropy of plain-tensor logits through `compiled_token_losses`."""
    if logits.dim() == labels.dim():  # per-token losses (the chunked output layer's)
        per_token = logits.flatten()
    elif compiled and not isinstance(logits, DTensor):
        per_token = compiled_token_losses(logits.device.type)(logits, labels)
    else:
        per_token = token_cross_entropy(logits, labels)
    if isinstance(per_token, DTensor):  # tensor parallel: replicated per-token losses, as a plain tensor
        per_token = per_token.full_tensor()
    mask = loss_mask.flatten().to(per_token.dtype)
    count = mask.sum()
    if cp_group is not None:
        count = global_token_count(count, cp_group).clamp(min=1.0) / cp_group.size()
    else:
        count = count.clamp(min=1.0)
    return (per_token * mask).sum() / count


class EvalTally:
    """Token-weighted sums over one validation / test run, for `nxdt evaluate` (nxdt.training.evaluate).

    Training reports a batch's loss as the mean of its micro-batch means; an evaluation reports
    sum(per-token loss) / (loss tokens) over everything it saw, so batches with more loss tokens
    weigh more. Each micro-batch's mean is turned back into its sum with the divisor
    `masked_token_loss` used: max(tokens of the whole micro-batch, 1) / cp (with context parallelism
    each cp rank holds a slice, and its mean was taken over the whole sequence's tokens / cp, so
    the cp ranks' sums add up to the sequence's). `add` keeps tensors (no host sync per batch);
    `totals` reduces once, at the end: sums over dp × cp, token counts over dp (every cp rank
    counted the whole micro-batch).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.batches = 0

    def add(self, losses: list[torch.Tensor], microbatches: list[dict[str, torch.Tensor]], cp: int = 1) -> None:
        for loss, mb in zip(losses, microbatches, strict=True):
            n = mb["loss_mask"].detach().sum(dtype=torch.float64)
            part = loss.detach().double() * n.clamp(min=1.0) / cp
            self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
            self.tokens = n if self.tokens is None else self.tokens + n
        self.batches += 1

    def totals(self, mesh, device: torch.device) -> tuple[float, float, int]:
        """(loss sum, loss tokens, global batches) over every rank: a collective, call it on all ranks."""
        def fresh(value: torch.Tensor | None) -> torch.Tensor:
            # a copy: the sums were made under Lightning's inference mode, which forbids in-place updates
            return torch.zeros((), dtype=torch.float64, device=device) if value is None else value.clone()

        loss_sum, tokens = fresh(self.loss_sum), fresh(self.tokens)
        if dist.is_initialized():
            for value, axis in ((loss_sum, "dp_cp"), (tokens, "dp")):
                group = submesh(mesh, axis)
                if group.size() > 1:
                    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group.get_group())
        return float(loss_sum), float(tokens), self.batches


# --------------------------------------------------------------------------- DPO / ORPO (TRL's formulas)
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
