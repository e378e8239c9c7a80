"""The output layer and the cross entropy, a chunk of tokens at a time.

With a large vocabulary the logits dominate a step's memory: [batch, seq, vocab] in the compute
dtype, their fp32 copy for the softmax, the softmax itself and, in backward, a gradient as large
(Llama-3's 128,256 entries per token: 1 MiB of fp32 per token, each). Here the output layer runs on
`chunk_size` tokens at a time and each chunk's logits are dropped as soon as its per-token losses
are known; a head it cannot fuse (below) has backward recompute them chunk by chunk
(`torch.utils.checkpoint`), so only one chunk's logits exist at any time. The arithmetic per token
is the full path's: the same matmul rows, the same fp32 cross entropy, so values and gradients
agree to rounding (tests/test_chunked_loss.py).
The output layer is called as a module (under the caller's autocast, FSDP's hooks included).

Under tensor parallelism the output layer is vocabulary-parallel (each rank computes vocab / tp of
every chunk's logits, which never leave it; the caller runs this and the backward under torch's
`loss_parallel`, and the losses come back as a replicated DTensor). With sequence parallelism the
hidden states hold 1/k of every sequence ([B, S/k, H] against labels [B, S]) and the output layer
gathers the k slices in order: chunks then run along the sequence, and each chunk's labels are the
same positions of each of the k slices.

Rows whose label is -100 (a prompt, padding, any token the loss mask leaves out) score 0 with no
gradient, so they skip the output layer: only the scored rows are projected (on plain tensors; a
sharded head projects every row), which on fine-tuning data (SFT, DPO: prompts are often half the
tokens) removes that share of the head's matmuls and of the softmax over the vocabulary.

A plain `nn.Linear` head without bias (one process, data parallel, FSDP, context parallel) takes a
faster way, Liger-Kernel's fused linear cross entropy: each chunk's gradients are computed in the
forward, while its logits are at hand (softmax minus the one-hot target, times the head's weight
for the hidden states' rows, times the hidden states for the weight), so nothing is recomputed in
backward, which only scales them. That holds when the loss is a weighted sum of the per-token
losses with the same weight on every token whose label is not -100 (the training loss: a mean
over the unmasked tokens, whose masked labels the step sets to -100); any other weighting recomputes
the chunks in backward with its weights, so the gradients are exact either way. From forward to
backward it holds the weight's gradient (fp32), which the other ways allocate when backward starts,
and no logits: at Llama-3's vocabulary with 4,096 tokens a peak of 2.5 GiB against 5.9 GiB for the
whole logits and 3.0 GiB recomputing, 1.06x the whole logits' speed (benchmarks/memory.py --logits).
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
                          chunk_size: int, fuse: bool = True) -> torch.Tensor:
    """Per-token cross entropy of `output_layer(hidden)` against `labels`, shaped like `labels` (fp32),
    computed `chunk_size` tokens at a time (see the module docstring). `fuse=False`: recompute the
    chunks in backward even where the head could be fused (benchmarks/memory.py compares the two)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() == 3 and hidden.shape[1] != labels.shape[1]:
        return _sequence_shard_chunks(hidden, output_layer, labels, chunk_size)
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    scored = _scored_rows(output_layer, flat_hidden, flat_labels)
    if scored is not None:  # only the rows whose label counts go through the output layer; the others score 0
        part = chunked_cross_entropy(flat_hidden.index_select(0, scored), output_layer,
                                     flat_labels.index_select(0, scored), chunk_size, fuse)
        losses = torch.zeros(flat_labels.numel(), dtype=part.dtype, device=part.device)
        return losses.index_copy(0, scored, part).view(labels.shape)
    if fuse and _fusable(output_layer, flat_hidden):
        if not torch.is_grad_enabled():  # evaluation: the losses alone
            return _chunked_grads(flat_hidden, output_layer.weight, flat_labels, chunk_size, False, False)[0].view(
                labels.shape)
        return _FusedLinearCrossEntropy.apply(flat_hidden, output_layer.weight, flat_labels,
                                              chunk_size).view(labels.shape)
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


IGNORE_INDEX = -100  # F.cross_entropy's: a label that scores nothing


def _scored_rows(output_layer: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """The indices of the rows whose label is not IGNORE_INDEX, when some are (a prompt, padding, a
    masked token) and some are not, and the head and hidden states are plain tensors (a sharded head
    keeps every row); else None. Their losses are 0 and their gradients 0 either way: leaving them out
    of the output layer saves its matmuls and the softmax over the vocabulary on them."""
    if type(hidden) is not torch.Tensor or any(type(p) not in (torch.Tensor, nn.Parameter)
                                               for p in output_layer.parameters()):
        return None
    valid = labels != IGNORE_INDEX
    count = int(valid.sum())
    return valid.nonzero().squeeze(-1) if 0 < count < labels.numel() else None


def _fusable(output_layer: nn.Module, hidden: torch.Tensor) -> bool:
    """A plain bias-free linear head on plain tensors with no hooks of its own (a DTensor weight, a
    LoRA head or a separately sharded head take the module call and recomputation instead)."""
    return (type(output_layer) is nn.Linear and output_layer.bias is None
            and type(output_layer.weight) in (torch.Tensor, nn.Parameter) and type(hidden) is torch.Tensor
            and not output_layer._forward_hooks and not output_layer._forward_pre_hooks)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on (as the module call would run), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _chunk_softmax_grad(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses [n] (fp32) of one chunk and d(loss_i)/d(logits_i) [n, V] (fp32): softmax minus
    the one-hot target. Rows whose label is IGNORE_INDEX score 0 but keep their softmax in the
    gradient: the caller weighs the rows on the (much smaller) matmul operands instead, so no pass
    over the [n, V] block is spent on it. Two passes over the block besides the matmul: the row-wise
    log-softmax (F.cross_entropy's own arithmetic, so the losses match it) and its exponent."""
    valid = labels != IGNORE_INDEX
    target = labels.masked_fill(~valid, 0).unsqueeze(-1)
    log_probs = torch.log_softmax((x @ weight.t()).float(), dim=-1)
    losses = -log_probs.gather(-1, target).squeeze(-1) * valid
    grad = log_probs.exp_()
    grad.scatter_add_(-1, target, torch.full_like(target, -1.0, dtype=grad.dtype))
    return losses, grad


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy [N] of hidden [N, H] @ weight[V, H]^T against labels [N], `chunk`
    tokens at a time, the gradients computed in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        losses, grad_x, grad_w = _chunked_grads(hidden, weight, labels, chunk, *ctx.needs_input_grad[:2])
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, labels)
        # kept on ctx, not saved: backward scales them in place and hands them on (no second
        # weight-sized tensor); a second backward (retain_graph) finds them gone and recomputes
        ctx.grads = grad_x, grad_w
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        valid = labels != IGNORE_INDEX
        # the weight of the first scored token (the loss's mean: every scored token's); one host sync
        # to check that it is every scored token's (the rows of the others carry no gradient)
        scale = grad_losses[valid.int().argmax()]
        if grads is None or not bool(((grad_losses - scale) * valid).eq(0).all()):
            need_x, need_w = ctx.needs_input_grad[:2]
            _, grad_x, grad_w = _chunked_grads(hidden, weight, labels, ctx.chunk, need_x, need_w, grad_losses)
        else:
            grad_x, grad_w = grads
            grad_x = grad_x.mul_(scale.to(grad_x.dtype)) if grad_x is not None else None
            grad_w = grad_w.mul_(scale) if grad_w is not None else None
        return grad_x, grad_w.to(weight.dtype) if grad_w is not None else None, None, None


def _chunked_grads(hidden, weight, labels, chunk, need_x: bool, need_w: bool, token_weights=None):
    """Losses [N] and, as asked, the gradients of sum(token_weights * losses) for hidden and weight
    (grad_w in fp32; token_weights None: 1 on every token), `chunk` tokens at a time."""
    dtype = _compute_dtype(weight)
    w = weight.to(dtype)
    losses = torch.empty(labels.numel(), dtype=torch.float32, device=hidden.device)
    grad_x = torch.empty_like(hidden) if need_x else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, labels.numel(), chunk):
            end = min(start + chunk, labels.numel())
            x, rows = hidden[start:end].to(dtype), labels[start:end]
            losses[start:end], grad = _chunk_softmax_grad(x, w, rows)
            row_weights = (rows != IGNORE_INDEX).to(torch.float32)  # ignored rows: no gradient
            if token_weights is not None:
                row_weights = row_weights * token_weights[start:end]
            grad, row_weights = grad.to(dtype), row_weights.to(dtype).unsqueeze(-1)
            if need_x:
                grad_x[start:end] = (grad @ w) * row_weights
            if need_w:
                if dtype == torch.float32:
                    grad_w.addmm_(grad.t(), x * row_weights)
                else:
                    grad_w += (grad.t() @ (x * row_weights)).float()
    return losses, grad_x, grad_w
