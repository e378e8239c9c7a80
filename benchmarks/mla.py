#!/usr/bin/env python
"""Tokens/s (forward + backward) of nxdt's multi-head latent attention (nxdt.models.mla.MLAttention,
SDPA core) against transformers' DeepseekV3Attention, eager and sdpa, on the same weights (issue 36,
deliverable 8).

    .venv/bin/python benchmarks/mla.py            # DeepSeek-V3's head shapes scaled down, 7 repeats, medians
    .venv/bin/python benchmarks/mla.py --quick    # smoke run: small shapes, 1 repeat

It is not a test. Goal: nxdt >= transformers' eager attention. Both modules hold the same state dict
(transformers' names); the outputs and q_b_proj's gradients are compared first (max abs diff
printed). A step = forward and backward of a fixed random output gradient, causal, YaRN rope
(factor 40, mscale_all_dim 1: the published config's), fp32, in this one process (same threads), the
ways in an order rotated every repeat; tokens/s is the median over repeats, the ratio the median of
the per-repeat ratios with its min-max.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


def shapes(quick: bool) -> list[dict]:
    if quick:
        return [dict(hidden=128, heads=4, q_lora=48, kv_lora=32, nope=32, rope=16, v=32, batch=1, seq=64)]
    # DeepSeek-V3's per-head dims (128 + 64, v 128), latents 1536 / 512, 8 of its 128 heads
    return [dict(hidden=1024, heads=8, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, batch=1, seq=1024),
            dict(hidden=1024, heads=8, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, batch=2, seq=256)]


def build(s: dict):
    """(nxdt's attention, transformers' eager, transformers' sdpa, its rotary) with one random state dict."""
    import transformers

    from nxdt.models.llama import LlamaArgs
    from nxdt.models.mla import MLAArgs, MLAttention

    config = transformers.DeepseekV3Config(
        hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"], q_lora_rank=s["q_lora"],
        kv_lora_rank=s["kv_lora"], qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"], v_head_dim=s["v"],
        max_position_embeddings=163840, rope_parameters=dict(YARN), num_hidden_layers=1, vocab_size=128)
    theirs = {}
    for impl in ("eager", "sdpa"):
        config._attn_implementation = impl
        theirs[impl] = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    args = LlamaArgs(hidden_size=s["hidden"], num_attention_heads=s["heads"], rope_scaling={k: v for k, v in YARN.items()
                                                                                           if k != "rope_theta"},
                     mla=MLAArgs(kv_lora_rank=s["kv_lora"], q_lora_rank=s["q_lora"], qk_nope_head_dim=s["nope"],
                                 qk_rope_head_dim=s["rope"], v_head_dim=s["v"]))
    ours = MLAttention(args)
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) * (0.02 if v.dim() > 1 else 1.0) for k, v in theirs["eager"].state_dict().items()}
    for m in (ours, *theirs.values()):
        m.load_state_dict(state, strict=True)
    return ours, theirs["eager"], theirs["sdpa"], rotary, args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--target-s", type=float, default=1.0, help="seconds of steps per way per repeat")
    a = p.parse_args(argv)
    from nxdt.models.rope import LlamaRotaryEmbedding

    repeats = a.repeats or (1 if a.quick else 7)
    for s in shapes(a.quick):
        ours, eager, sdpa, rotary, args = build(s)
        b, n = s["batch"], s["seq"]
        x = torch.randn(b, n, s["hidden"])
        pos = torch.arange(n)[None].expand(b, n)
        rope_ours = LlamaRotaryEmbedding(args)(x, pos)
        rope_hf = rotary(x, pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        grad = torch.randn(b, n, s["hidden"])
        ways = {"nxdt": lambda: ours(x, rope_ours, None),
                "hf eager": lambda: eager(x, rope_hf, mask)[0],
                "hf sdpa": lambda: sdpa(x, rope_hf, mask)[0]}
        outs = {}
        for name, fn in ways.items():
            out = fn()
            out.backward(grad)
            module = {"nxdt": ours, "hf eager": eager, "hf sdpa": sdpa}[name]
            outs[name] = (out.detach(), module.q_b_proj.weight.grad.clone())
            module.zero_grad(set_to_none=True)
        print(f"hidden {s['hidden']}, {s['heads']} heads (q/k {s['nope']}+{s['rope']}, v {s['v']}), latents "
              f"{s['q_lora']}/{s['kv_lora']}, batch {b} x seq {n}: max |out diff| vs eager "
              f"{(outs['nxdt'][0] - outs['hf eager'][0]).abs().max():.1e}, q_b_proj grad "
              f"{(outs['nxdt'][1] - outs['hf eager'][1]).abs().max():.1e}")
        rates: dict[str, list[float]] = {k: [] for k in ways}
        order = list(ways)
        for r in range(repeats):
            for name in order[r % len(order):] + order[:r % len(order)]:
                fn, steps, start = ways[name], 0, time.perf_counter()
                while time.perf_counter() - start < a.target_s or steps == 0:
                    fn().backward(grad)
                    steps += 1
                rates[name].append(steps * b * n / (time.perf_counter() - start))
            for m in (ours, eager, sdpa):
                m.zero_grad(set_to_none=True)
        for name, rs in rates.items():
            ratio = [o / t for o, t in zip(rates["nxdt"], rs)]
            print(f"  {name:9s} {statistics.median(rs):10,.0f} tokens/s   nxdt / this {statistics.median(ratio):.2f}x "
                  f"({min(ratio):.2f}-{max(ratio):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
