"""Context parallelism (cp): each rank of a cp group holds a slice of every sequence.

Everything outside attention is per token, so it runs on the local slice unchanged. Attention
needs all keys and values: it runs as **ring attention**, torch's own implementation
(`torch.distributed.tensor.experimental._context_parallel`: `_templated_ring_attention` and its
backward, which rotate K/V around the cp group with functional collectives and merge the
partial results by their log-sum-exp). We call it directly with the device's SDPA kernel
instead of going through torch's DTensor dispatcher, because torch 2.13 registers that
dispatcher only for the CUDA kernels (flash / efficient / cuDNN): on CPU it fails with
"aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered". The kernels are chosen per device in `_KERNELS`.

Causal attention costs less on early tokens, so sequences are cut into 2 × cp chunks and rank r
keeps chunks r and 2·cp−1−r (torch's head-tail load balancer; the ring code assumes exactly this
order when `_cp_options.enable_load_balance` is on). Inputs, labels, loss masks and position ids
are all cut the same way by `shard_sequence`, so rotary embeddings see true positions.

Gradients: every cp rank computes its slice's share of the loss (`masked_token_loss` with
`cp_group`), and the parameter gradients are reduced over dp × cp together (see
`nxdt.parallel.data_parallel`): to the optimizer a cp rank is one more data-parallel rank.

MoE layers: routing is per token, but the Switch/Mixtral balance loss is a statistic of the micro-batch,
so every router gets the cp group (`token_group`) and sums its statistics over it
(nxdt.models.moe_balance.sequence_balance_loss); loss-free balancing's expert loads are summed over
dp × cp after the step. Routings whose result depends on the other tokens (capacity drops, sinkhorn,
LLaMA-MoE's gates) are refused by the config validation. MLA's values, narrower than its queries and
keys, are padded to their head size for the kernel.

The model's adapter (nxdt.models.adapter `set_attention`) routes its attention through the ring:
the native Llama through `CoreAttention.sdpa`, transformers' Llama through its attention-function
registry (`AttentionInterface`, name "nxdt_ring").

Limits (refused by the config validation): causal self-attention only — no document masks
(`reset_position_ids` / `reset_attention_mask`, SFT packing), no attention dropout or sliding window.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from nxdt.config.errors import ConfigError
from nxdt.models.adapter import adapter_of
from nxdt.models.moe import MoERouter

aten = torch.ops.aten


def _cp_api():
    # Private torch module: import it in one place so a torch without it fails with one line.
    try:
        from torch.distributed.tensor.experimental import _context_parallel as cp  # private: one place, one line if absent
    except ImportError as err:  # pragma: no cover - depends on the installed torch
        raise RuntimeError(f"context_parallel_size > 1 needs torch's context-parallel module: {err}") from err
    return cp


# device type -> (forward kernel, backward kernel, backward's name for the output gradient)
_KERNELS = {
    "cpu": (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out"),
}


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over `group` for local q, k, v of shape [B, H, S_local, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp = _cp_api()
        fwd, bwd, grad_name = _KERNELS[q.device.type]  # apply_context_parallel checked the device
        cp._cp_options.enable_load_balance = True  # inputs are cut head-tail by shard_sequence
        out, lse, *_ = cp._attention._templated_ring_attention(
            group, 2, fwd, q, k, v, is_causal=True, dropout_p=0.0, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.bwd, ctx.grad_name = group, scale, bwd, grad_name
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cp = _cp_api()
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, *_ = cp._attention._templated_ring_attention_backward(
            ctx.group, 2, ctx.bwd, grad_out=grad_out.contiguous(), grad_out_name=ctx.grad_name,
            query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0, scale=ctx.scale)
        return dq, dk, dv, None, None


class RingSDPA:
    """A drop-in for `F.scaled_dot_product_attention` (causal, no mask, no dropout) on a cp group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None):
        if attn_mask is not None or not is_causal or dropout_p:
            raise RuntimeError("context parallel attention supports causal attention without a mask or dropout only")
        if torch.is_autocast_enabled(q.device.type):
            # as autocast casts F.scaled_dot_product_attention's inputs: the kernels the ring calls are
            # not autocast ops, and transformers' rotary leaves q, k in fp32 (its cos/sin follow the
            # fp32 hidden states) beside a low-precision v
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        dv, dqk = v.shape[-1], q.shape[-1]
        if dv == dqk:
            return _RingAttention.apply(q, k, v, self.group, scale)
        # MLA: values narrower than queries and keys (or wider); the CPU kernel takes one head size, so the
        # narrower side is padded with zeros (dot products and the values' columns unchanged), as transformers
        # pads MLA's values for flash attention
        scale = dqk ** -0.5 if scale is None else scale
        if dv < dqk:
            return _RingAttention.apply(q, k, F.pad(v, (0, dqk - dv)), self.group, scale)[..., :dv]
        q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
        return _RingAttention.apply(q, k, v, self.group, scale)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route every block's core attention through ring attention on `cp_mesh` (no-op for cp 1)."""
    if cp_mesh.size() == 1:
        return
    if cp_mesh.device_type not in _KERNELS:
        # Not wired yet: the CUDA flash / efficient kernels take extra outputs (philox state,
        # padded log-sum-exp) that need a test on a multi-GPU machine before we claim them.
        raise ConfigError(f"distributed_strategy.context_parallel_size > 1 on device '{cp_mesh.device_type}' is "
                          f"not supported yet (ring-attention kernels are wired for: {', '.join(_KERNELS)})")
    if not adapter_of(model).set_attention(model, RingSDPA(cp_mesh.get_group())):
        raise RuntimeError(f"context parallel: no Llama attention found in {type(model).__name__}")
    for router in (m for m in model.modules() if isinstance(m, MoERouter)):
        router.token_group = cp_mesh.get_group()  # its balance loss over whole sequences (nxdt.models.moe_balance)


def shard_sequence(batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """This cp rank's slice (head-tail order) of every [B, S] tensor of a micro-batch.

    Position ids are made explicit first (0..S-1 when the batch has none), so the slice keeps
    the true positions of its tokens."""
    if cp_mesh.size() == 1:
        return batch
    cp = _cp_api()
    ids = batch["input_ids"]
    batch = dict(batch)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    balancer = cp._HeadTailLoadBalancer(ids.shape[1], cp_mesh.size(), ids.device)
    shards = cp._context_parallel_shard(cp_mesh, [batch[k] for k in keys], [1] * len(keys), balancer)
    return {**batch, **dict(zip(keys, shards))}


def global_token_count(local_count: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """The number of loss tokens over the whole sequence (all cp slices)."""
    total = local_count.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=cp_group)
    return total
