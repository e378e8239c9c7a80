"""Rotary position embedding (RoPE) of the native model: the inverse frequencies (with Llama 3.1's
scaling), the (cos, sin) table and its application to q and k, in transformers' "rotate half" layout.
Split out of nxdt.models.llama, which re-exports these names."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding for a rotated dimension `dim`.

    With Llama 3.1 scaling, long wavelengths (beyond the original context) are slowed
    down by `factor`, short ones are kept, and the band in between is interpolated
    smoothly. Same formula and fp32 arithmetic as transformers' `_compute_llama3_parameters`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "yarn":
        return yarn_inv_freq(inv_freq, dim, theta, rope_scaling)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3, linear, yarn)")
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 x mscale x ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN (DeepSeek-V3's long context): the frequencies interpolated by `factor` below the
    correction range (beta_fast, beta_slow rotations over original_max_position_embeddings), kept
    above it, ramped linearly between; transformers' `_compute_yarn_parameters` (truncate true)."""
    factor, old = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (attention_factor, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), else mscale(factor)); 1 for every other rope type."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor, mscale, mscale_all = rope_scaling["factor"], rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all))
    return yarn_mscale(factor)


class LlamaRotaryEmbedding(nn.Module):
    """Gives (cos, sin) [B, S, rotary_dim] for the given positions.

    It holds no state: the inverse frequencies are recomputed on each call (rotary_dim/2
    numbers, negligible), so the model is correct straight after a meta-device build and
    `to_empty`, with nothing to re-initialise and nothing in the state dict.
    """

    def __init__(self, args: Any) -> None:
        """`args`: the model's LlamaArgs (rotary_dim, rope_theta, rope_scaling)."""
        super().__init__()
        self.dim = args.rotary_dim
        self.theta = args.rope_theta
        self.rope_scaling = dict(args.rope_scaling) if args.rope_scaling else None

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.dim, self.theta, self.rope_scaling).to(x.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # "rotate half" layout, as in HF Llama
        factor = rope_attention_factor(self.rope_scaling)  # YaRN's; 1 otherwise
        if factor != 1.0:
            return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head of x [B, H, S, D]; pass the rest through."""
    # in x's dtype: under autocast q/k come out of the projections in bf16 while the rotary table
    # follows the fp32 residual stream; keep q, k and v in one dtype for SDPA (XLA needs it)
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # broadcast over heads
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
