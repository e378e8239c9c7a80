"""The output layer and the cross entropy, a chunk of tokens at a time.

With a large vocabulary the logits dominate a step's memory: [batch, seq, vocab] in the compute
dtype, their fp32 copy for the softmax, the softmax itself and, in backward, a gradient as large
(Llama-3's 128,256 entries per token: 1 MiB of fp32 per token, each). Here the output layer runs on
`chunk_size` tokens at a time and each chunk's logits are dropped as soon as its per-token losses
are known; backward recomputes them chunk by chunk (`torch.utils.checkpoint`), so only one chunk's
logits exist at any time. The arithmetic per token is the full path's: the same matmul rows, the
same fp32 cross entropy, so values and gradients agree to rounding (tests/test_chunked_loss.py).
The output layer is called as a module (under the caller's autocast, FSDP's hooks included).

Under tensor parallelism the output layer is vocabulary-parallel (each rank computes vocab / tp of
every chunk's logits, which never leave it; the caller runs this and the backward under torch's
`loss_parallel`, and the losses come back as a replicated DTensor). With sequence parallelism the
hidden states hold 1/k of every sequence ([B, S/k, H] against labels [B, S]) and the output layer
gathers the k slices in order: chunks then run along the sequence, and each chunk's labels are the
same positions of each of the k slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [N] of logits [..., V] against labels [...] (N of them), softmax in fp32:
    the one formula of the chunked path and of the whole-logits loss (nxdt.training.loss)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")


def _chunk_losses(output_layer: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token losses [N] of hidden [N, H] or [B, n, H] (labels [N] or [B, n])."""
    return token_cross_entropy(output_layer(hidden), labels)


def chunked_cross_entropy(hidden: torch.Tensor, output_layer: nn.Module, labels: torch.Tensor,
                          chunk_size: int) -> torch.Tensor:
    """Per-token cross entropy of `output_layer(hidden)` against `labels`, shaped like `labels` (fp32),
    computed `chunk_size` tokens at a time (see the module docstring)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() == 3 and hidden.shape[1] != labels.shape[1]:
        return _sequence_shard_chunks(hidden, output_layer, labels, chunk_size)
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    parts = [checkpoint(_chunk_losses, output_layer, flat_hidden[start:start + chunk_size],
                        flat_labels[start:start + chunk_size], use_reentrant=False)
             for start in range(0, flat_labels.numel(), chunk_size)]
    return torch.cat(parts).view(labels.shape)


def _sequence_shard_chunks(hidden: torch.Tensor, output_layer: nn.Module, labels: torch.Tensor,
                           chunk_size: int) -> torch.Tensor:
    """hidden [B, S/k, H] (one of k sequence slices; the output layer gathers them in order),
    labels [B, S]: chunks of positions along the slice, about `chunk_size` tokens over all k."""
    batch, local, seq = hidden.shape[0], hidden.shape[1], labels.shape[1]
    if seq % local:
        raise ValueError(f"hidden states hold {local} positions of labels' {seq}: not an equal slice")
    k = seq // local
    by_slice = labels.view(batch, k, local)  # [B, k, S/k]: position j of slice r is r * S/k + j
    step = max(1, chunk_size // (batch * k))
    parts = []
    for start in range(0, local, step):
        part_labels = by_slice[:, :, start:start + step]  # the positions this chunk gathers, in order
        width = part_labels.shape[-1]
        # [B, width, H]: 3-D, as the output layer gathers the slices along dim 1
        losses = checkpoint(_chunk_losses, output_layer, hidden[:, start:start + width],
                            part_labels.flatten(1), use_reentrant=False)
        parts.append(losses.view(batch, k, width))
    return torch.cat(parts, dim=-1).view(labels.shape)
