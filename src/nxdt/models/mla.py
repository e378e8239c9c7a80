"""Multi-head latent attention (MLA, DeepSeek-V2/V3) for the native model, with transformers'
DeepseekV3Attention's parameter names and arithmetic.

    queries   q_proj (q_lora_rank null, V2-Lite) or q_b_proj(q_a_layernorm(q_a_proj(x)))
              [B, S, heads x (qk_nope_head_dim + qk_rope_head_dim)]
    latent    kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_rot (qk_rope_head_dim, one head, shared)]
    keys      [kv_b_proj(kv_a_layernorm(c_kv)) nope part | k_rot], values the kv_b_proj's v part
    out       o_proj over heads x v_head_dim

The rotary part of q and k is stored interleaved (pairs (x0, x1), (x2, x3), ... rotated together)
when `rope_interleave` (DeepSeek's checkpoints); it is de-interleaved and rotated "rotate half",
which transformers shows is the same rotation. The softmax scale is qk_head_dim^-0.5, times
YaRN's mscale(factor, mscale_all_dim)^2 when the rope scaling has mscale_all_dim; the attention
core (nxdt.models.llama.CoreAttention: SDPA, whose scale is 1/sqrt(q's last dim)) gets it by a
factor on q. The latent norms have eps 1e-6 (transformers' DeepseekV3RMSNorm default), whatever
rms_norm_eps says. Under tensor parallelism q_proj / q_b_proj / kv_b_proj are split by heads
(column-wise), o_proj row-wise, the latent projections and norms replicated: the reference
implementations' plan (nxdt.parallel.tensor_parallel). Decoding caches the latent (nxdt.models.kv_cache
holds [B, 1, L, kv_lora_rank] and the rotated [B, 1, L, qk_rope_head_dim] per layer), not the heads'
keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxdt.models.llama import CoreAttention, LlamaRMSNorm
from nxdt.models.rope import apply_rotary, rope_attention_factor, yarn_mscale  # noqa: F401 - rope_attention_factor re-exported

LATENT_NORM_EPS = 1e-6


@dataclass
class MLAArgs:
    """MLA's dimensions. Names are transformers' (Megatron's in brackets in the config schema)."""

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    """None: queries by one projection, q_proj (DeepSeek-V2-Lite)."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"MLA {key} must be >= 1, got {getattr(self, key)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLA q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention(self, args: Any, layer_idx: int) -> nn.Module:
        """The attention module of one decoder layer (nxdt.models.llama builds it through here)."""
        return MLAttention(args, layer_idx)


def softmax_scale_factor(mla: MLAArgs, rope_scaling: dict[str, Any] | None) -> float:
    """transformers' MLA scale over SDPA's 1/sqrt(qk_head_dim): mscale(factor, mscale_all_dim)^2 under a
    scaled rope with mscale_all_dim, else 1."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
        return 1.0
    mscale_all = rope_scaling.get("mscale_all_dim", 0)
    if not mscale_all:
        return 1.0
    m = yarn_mscale(rope_scaling["factor"], mscale_all)
    return m * m


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0 x1 x2 x3 ...)] → [..., (x0 x2 ... | x1 x3 ...)]: interleaved pairs as rotate-half halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class SharedRopeKey(nn.Module):
    """The rotary key part (one head, [B, 1, S, qk_rope_head_dim]) handed to every head this module's
    caller holds: a module of its own so tensor parallelism can sum its gradient over the ranks' heads
    (nxdt.parallel.tensor_parallel: each rank's heads use it, the latent projection is replicated)."""

    def forward(self, k_rot: torch.Tensor, heads: int) -> torch.Tensor:
        return k_rot.expand(-1, heads, -1, -1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention (see the module docstring)."""

    def __init__(self, args: Any, layer_idx: int = 0) -> None:
        super().__init__()
        m: MLAArgs = args.mla
        self.layer_idx, self.mla = layer_idx, m
        self.num_heads = args.num_attention_heads
        self.head_dim = m.qk_head_dim  # of queries and keys (values: v_head_dim)
        hidden, heads, bias = args.hidden_size, args.num_attention_heads, args.has_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = LlamaRMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = LlamaRMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=bias)
        self.q_scale = softmax_scale_factor(m, args.rope_scaling)
        self.rope_key = SharedRopeKey()
        self.core_attention = CoreAttention(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, kv_cache: Any = None) -> torch.Tensor:
        m = self.mla
        b, s, _ = x.shape
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # -1 heads: a tensor-parallel shard holds fewer heads and runs this unchanged
        q = q.view(b, s, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_layernorm(latent), k_rot.view(b, 1, s, m.qk_rope_head_dim)
        if m.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cos, sin = rope
        q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        if kv_cache is not None:
            # decoding: the cache holds the normed latent and the rotated shared key, kv_lora_rank +
            # qk_rope_head_dim numbers per token and layer (DeepSeek's latent cache; full keys and values
            # would be heads x (qk_head_dim + v_head_dim)); the heads' keys and values are recomputed
            # from it (kv_b_proj over the cached tokens) at each step
            cached, k_rot = kv_cache.update(self.layer_idx, latent.unsqueeze(1), k_rot)
            latent = cached.squeeze(1)
        kv = self.kv_b_proj(latent).view(b, latent.shape[1], -1, m.qk_nope_head_dim + m.v_head_dim)
        k_pass, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_pass, self.rope_key(k_rot, k_pass.shape[1])), dim=-1)
        out = self.core_attention(q, k, v, mask)  # [B, H, S, v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
