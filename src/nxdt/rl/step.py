"""GRPO's forward/backward for nxdt.training.step.train_step: gradient accumulation over
micro-batches of completions (a Rollout's rows), the loss of the chosen loss_type per micro-batch.

    fb = GRPOForwardBackward(model, precision, rollout, options, num_microbatches=2)
    m = train_step(model, optimizer, scheduler, precision, fb, batch=None, step=s, clip=1.0)
    fb.sums     # this rank's metric sums (kl, clipped tokens, entropy, tokens), detached

It plays the part of microbatch_forward_backward: the data-parallel gradient sync is switched off
until the last micro-batch, each loss is scaled by the precision's loss scale for the backward.
The old log-probs are the rollout's (num_iterations > 1: computed before the first update) or, on
a fresh rollout with num_iterations = 1, the forward's own, detached (TRL's shortcut): the first
iteration's importance ratio is then exactly 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nxdt.models import logits_of
from nxdt.models.moe import set_aux_loss_scale
from nxdt.parallel.data_parallel import set_gradient_sync
from nxdt.precision.precision import Precision
from nxdt.rl.grpo_loss import grpo_loss
from nxdt.rl.rollout import Rollout, loss_parallel_if, token_entropy, token_logps


@dataclass
class LossOptions:
    loss_type: str
    epsilon: float
    epsilon_high: float | None
    beta: float
    temperature: float
    max_completion_length: int
    tp: int = 1  # tensor-parallel ranks: the log-probs and their backward under loss_parallel


class GRPOForwardBackward:
    """`forward_backward(batch) -> loss` over a Rollout (the batch argument is ignored)."""

    def __init__(self, model: nn.Module, precision: Precision, rollout: Rollout, options: LossOptions, *,
                 num_microbatches: int, backward: Callable[[torch.Tensor], None] | None = None,
                 device_type: str = "cpu"):
        self.model, self.precision, self.rollout, self.options = model, precision, rollout, options
        self.num_microbatches = int(num_microbatches)
        self.run_backward = backward if backward is not None else torch.Tensor.backward
        self.device_type = device_type
        self.sums: dict[str, torch.Tensor] = {}
        self.seconds = 0.0
        self.first_logps: torch.Tensor | None = None  # [L, S] the forward's log-probs (tests compare them)
        self.step = 0  # the optimizer step it serves, and whether its rollout was sampled for it (the log's)
        self.fresh = True

    def _rows(self, i: int, n: int) -> slice:
        size = self.rollout.input_ids.shape[0]
        if size % n:
            raise RuntimeError(f"{size} completions on this rank do not split into {n} micro-batches")
        step = size // n
        return slice(i * step, (i + 1) * step)

    def __call__(self, batch=None) -> torch.Tensor:
        start = time.perf_counter()
        r, o, n = self.rollout, self.options, self.num_microbatches
        total = None
        sums = {k: torch.zeros((), dtype=torch.float64) for k in ("kl", "clipped", "entropy", "tokens")}
        logps_all = []
        for i in range(n):
            rows = self._rows(i, n)
            set_gradient_sync(self.model, i == n - 1)
            set_aux_loss_scale(self.precision.loss_scale / n)
            with self.precision.autocast(self.device_type):
                logits = logits_of(self.model(input_ids=r.input_ids[rows], position_ids=None))
            mask = r.mask[rows]
            with loss_parallel_if(o.tp):  # tensor parallel: the softmax across the vocabulary shards
                logps = token_logps(logits, r.labels[rows], o.temperature)
                logps_all.append(logps.detach())
                old = r.old_logps[rows] if r.old_logps is not None else logps.detach()
                ref = r.ref_logps[rows] if r.ref_logps is not None else None
                parts = grpo_loss(logps, old, r.advantages[rows], mask, loss_type=o.loss_type, epsilon=o.epsilon,
                                  epsilon_high=o.epsilon_high, beta=o.beta, ref_logps=ref, num_microbatches=n,
                                  max_completion_length=o.max_completion_length, tokens_per_rank=r.tokens_per_rank)
                self.run_backward(self.precision.scale_loss(parts.loss))
            total = parts.loss.detach() if total is None else total + parts.loss.detach()
            m = mask.detach().double().cpu()
            if parts.kl is not None:
                sums["kl"] += (parts.kl.double().cpu() * m).sum()
            sums["clipped"] += (parts.clipped.double().cpu() * m).sum()
            sums["entropy"] += (token_entropy(logits, o.temperature).double().cpu() * m).sum()
            sums["tokens"] += m.sum()
        self.first_logps = torch.cat(logps_all)
        self.sums = sums
        self.seconds = time.perf_counter() - start
        return total
