"""The training loss: mean cross entropy over the tokens whose loss_mask is 1; and the token-weighted
sums an evaluation reports (EvalTally).

The Megatron/NxDT convention: per micro-batch the mean over unmasked tokens, then the mean over
the micro-batches of the global batch (nxdt.training.step), so every layout of the same global
batch gives the same loss.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nxdt.models.chunked_loss import token_cross_entropy
from nxdt.parallel.context_parallel import global_token_count
from nxdt.parallel.mesh import submesh


@functools.cache
def compiled_token_losses():
    """`token_cross_entropy` through torch.compile (model.fusions.torch_compile): one fused pass for the
    upcast, log-softmax and pick, instead of full-size fp32 tensors for each (on CPU 44 vs 74 ms
    forward + backward for 2,048 tokens x 8,192 in fp32, 34 vs 139 ms from bf16 logits)."""
    return torch.compile(token_cross_entropy)


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
        per_token = compiled_token_losses()(logits, labels)
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
