"""fp32 → bf16 with stochastic rounding (unbiased), and round-to-nearest as its twin.

bf16 is the top 16 bits of an fp32. Rounding toward zero drops the low 16 bits; adding a
uniform random 16-bit integer to the int32 view first makes the carry into bit 16 happen with
probability (low bits / 2**16), i.e. the value rounds up (in magnitude) with probability equal
to its distance from the lower neighbour. So E[round(x)] = x, and a value that is already a bf16
(low 16 bits zero) never changes. The int32 add works for negative values too: fp32 is
sign-magnitude, and the add only touches the magnitude bits (a carry out of the exponent gives
±inf, the correct overflow). NaNs are passed through unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_LOW16 = 1 << 16


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` rounded to bfloat16 with stochastic rounding (a new bf16 tensor; `x` is untouched).

    A non-fp32 input is upcast first (exact for bf16/fp16). `generator` makes it reproducible.
    DTensors are rounded shard by shard (each rank draws its own bits).
    """
    to_local = getattr(x, "to_local", None)
    if to_local is not None:  # DTensor: round the local shard, keep the layout
        local = stochastic_round_to_bf16(to_local(), generator)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    x32 = x.detach().to(torch.float32).contiguous()
    noise = torch.randint(0, _LOW16, x32.shape, dtype=torch.int32, device=x32.device, generator=generator)
    bits = (x32.view(torch.int32) + noise).bitwise_and_(-_LOW16)  # -2**16 == 0xFFFF0000
    out = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    nan = torch.isnan(x32)
    if nan.any():
        out = torch.where(nan, x32.to(torch.bfloat16), out)
    return out


def round_to(x: torch.Tensor, dtype: torch.dtype, stochastic: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` in `dtype`: stochastic rounding for fp32 → bf16 when asked, else torch's round-to-nearest-even."""
    if stochastic and dtype == torch.bfloat16 and x.dtype == torch.float32:
        return stochastic_round_to_bf16(x, generator)
    return x.detach().to(dtype)
