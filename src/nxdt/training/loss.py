"""The training loss: mean cross entropy over the tokens whose loss_mask is 1.

The Megatron/NxDT convention: per micro-batch the mean over unmasked tokens, then the mean over
the micro-batches of the global batch (nxdt.training.step), so every layout of the same global
batch gives the same loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nxdt.parallel.context_parallel import global_token_count
from nxdt.parallel.tensor_parallel import is_vocab_parallel


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                      cp_group=None) -> torch.Tensor:
    """Mean cross entropy over the tokens whose loss_mask is 1 (fp32 for the softmax).

    Vocabulary-sharded logits (tensor parallel: a Shard(-1) DTensor) need the caller to run this
    and the backward under `loss_parallel()`: the softmax is then computed across the shards.

    With context parallelism (`cp_group`) the tokens are one slice of each sequence: the sum is
    divided by the whole sequence's token count / cp, so the mean over the cp ranks (which the
    dp × cp gradient and metric reductions take) is the whole sequence's mean."""
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if is_vocab_parallel(logits):
        per_token = per_token.full_tensor()  # replicated per-token losses as a plain tensor
    mask = loss_mask.flatten().to(per_token.dtype)
    count = mask.sum()
    if cp_group is not None:
        count = global_token_count(count, cp_group).clamp(min=1.0) / cp_group.size()
    else:
        count = count.clamp(min=1.0)
    return (per_token * mask).sum() / count
