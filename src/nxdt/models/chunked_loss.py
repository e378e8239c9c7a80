"""The output layer and the cross entropy, a chunk of tokens at a time.

With a large vocabulary the logits dominate a step's memory: [batch, seq, vocab] in the compute
dtype, their fp32 copy for the softmax, the softmax itself and, in backward, a gradient as large
(Llama-3's 128,256 entries per token: 1 MiB of fp32 per token, each). Here the output layer runs on
`chunk_size` tokens at a time and each chunk's logits are dropped as soon as its per-token losses
are known; backward recomputes them chunk by chunk (`torch.utils.checkpoint`), so only one chunk's
logits exist at any time. The arithmetic per token is the full path's: the same matmul rows, the
same fp32 cross entropy, so values and gradients agree to rounding (tests/test_chunked_loss.py).
The output layer is called as a module (under the caller's autocast, FSDP's hooks included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_losses(output_layer: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output_layer(hidden).float(), labels, reduction="none")


def chunked_cross_entropy(hidden: torch.Tensor, output_layer: nn.Module, labels: torch.Tensor,
                          chunk_size: int) -> torch.Tensor:
    """Per-token cross entropy of `output_layer(hidden)` against `labels`, shaped like `labels` (fp32),
    computed `chunk_size` tokens at a time (see the module docstring)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    parts = [checkpoint(_chunk_losses, output_layer, flat_hidden[start:start + chunk_size],
                        flat_labels[start:start + chunk_size], use_reentrant=False)
             for start in range(0, flat_labels.numel(), chunk_size)]
    return torch.cat(parts).view(labels.shape)
