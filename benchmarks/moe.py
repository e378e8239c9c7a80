#!/usr/bin/env python
"""Tokens/s (forward + backward) of nxdt's MoE layer and of a small Mixtral-shaped model against
transformers' Mixtral with each of its experts implementations (issue 13, deliverable 8).

    .venv/bin/python benchmarks/moe.py              # layer and model, 7 interleaved repeats, medians
    .venv/bin/python benchmarks/moe.py --quick      # smoke run: small shapes, 1 repeat, a few seconds
    .venv/bin/python benchmarks/moe.py --sections layer --repeats 9
    .venv/bin/python benchmarks/moe.py --sections families   # DeepSeek-V3's and Qwen3-MoE's MoE layers

It is not a test. Goal: nxdt ≥ the fastest of transformers' implementations and ≥ 1.5× `eager`
at 8 experts, top-2, fp32.

What runs. nxdt's `LlamaMoE` (and `NxdtLlamaForCausalLM` with it) and transformers'
`MixtralSparseMoeBlock` (and `MixtralForCausalLM`) hold the same weights (the same state dict
loads in both, as in tests/test_moe.py), one copy per experts implementation (`eager`,
`batched_mm`, `grouped_mm`: `MixtralConfig(experts_implementation=...)`, which the experts
module reads at every forward). Both are in training mode; nxdt's layer then also computes its
load-balancing loss and routing statistics (coefficient 0), transformers' model is run with
`output_router_logits=False`. One step = forward, backward of a fixed loss (the layer: a fixed
random output gradient; the model: cross entropy on random tokens), gradients dropped. The
outputs and the expert-weight gradients are compared first (max abs diff printed).

Measurement. All ways run in this one process (same allocator, same 2 threads); a repeat
times about `--target-s` seconds of steps of each way after one warm-up step, the ways in an
order rotated every repeat. tokens/s is the median over repeats; the ratio columns are medians of the per-repeat
ratios (the ways of one repeat ran closest in time) with their min–max, the better guide on a
shared machine. `batched_mm` gathers one copy of the expert weights per (token, slot) (it is
meant for decoding): where that would exceed `--max-gib` it is skipped and the reason printed,
which is why each section also has a small-batch row where every implementation runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
NUM_EXPERTS, TOP_K = 8, 2


@dataclass
class Shape:
    label: str
    hidden: int
    ffn: int
    batch: int
    seq: int
    layers: int = 0  # 0: the MoE layer alone
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 8192

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        model = f"{self.layers} layers, {self.heads}/{self.kv_heads} heads, vocab {self.vocab}, " if self.layers else ""
        return (f"{model}hidden {self.hidden}, ffn {self.ffn}, {NUM_EXPERTS} experts top-{TOP_K}, "
                f"batch {self.batch} x seq {self.seq} = {self.tokens} tokens")


FULL = {
    "layer": [Shape("layer", hidden=512, ffn=1408, batch=2, seq=512),
              Shape("layer, small batch", hidden=512, ffn=1408, batch=1, seq=64)],
    # Mixtral-8x7B's proportions scaled down: ffn 3.5 x hidden, 4 query heads per kv head,
    # vocab 8 x hidden (14336 / 4096, 32 / 8, 32000 / 4096)
    "model": [Shape("model", hidden=256, ffn=896, batch=2, seq=512, layers=4, heads=8, kv_heads=2, vocab=2048),
              Shape("model, small batch", hidden=256, ffn=896, batch=1, seq=64, layers=4, heads=8, kv_heads=2,
                    vocab=2048)],
}
QUICK = {
    "layer": [Shape("layer", hidden=128, ffn=352, batch=2, seq=128),
              Shape("layer, small batch", hidden=128, ffn=352, batch=1, seq=32)],
    "model": [Shape("model", hidden=128, ffn=352, batch=2, seq=128, layers=2, heads=4, kv_heads=2, vocab=1024),
              Shape("model, small batch", hidden=128, ffn=352, batch=1, seq=32, layers=2, heads=4, kv_heads=2,
                    vocab=1024)],
}


# DeepSeek-V3's and Qwen3-MoE's MoE layers (issue 36): nxdt's layer as its native model builds it from the
# transformers config, against transformers' DeepseekV3MoE / Qwen3MoeSparseMoeBlock with the same weights.
# Proportions of the published models scaled down: many narrow experts (expert width 0.29 x hidden in
# DeepSeek-V3, 0.375 x in Qwen3-30B-A3B), 16 experts top-4; DeepSeek-V3 also: sigmoid scores in 4 groups,
# a token's experts within its 2 best groups, a score bias (loss-free balancing's, random), x 2.5, one shared expert.
FAMILY_EXPERTS, FAMILY_TOP_K = 16, 4


@dataclass
class FamilyShape(Shape):
    family: str = "deepseek_v3"

    def describe(self) -> str:
        extra = ", 4 groups top-2, 1 shared expert, sigmoid x 2.5" if self.family == "deepseek_v3" else ", softmax"
        return (f"{self.family} layer: hidden {self.hidden}, expert ffn {self.ffn}, {FAMILY_EXPERTS} experts "
                f"top-{FAMILY_TOP_K}{extra}, batch {self.batch} x seq {self.seq} = {self.tokens} tokens")


FAMILIES = {
    "full": [FamilyShape("DeepSeek-V3 layer", hidden=512, ffn=160, batch=2, seq=512, family="deepseek_v3"),
             FamilyShape("DeepSeek-V3 layer, small batch", hidden=512, ffn=160, batch=1, seq=64, family="deepseek_v3"),
             FamilyShape("Qwen3-MoE layer", hidden=512, ffn=192, batch=2, seq=512, family="qwen3_moe"),
             FamilyShape("Qwen3-MoE layer, small batch", hidden=512, ffn=192, batch=1, seq=64, family="qwen3_moe")],
    "quick": [FamilyShape("DeepSeek-V3 layer", hidden=128, ffn=48, batch=2, seq=128, family="deepseek_v3"),
              FamilyShape("Qwen3-MoE layer", hidden=128, ffn=48, batch=2, seq=128, family="qwen3_moe")],
}


def _family_config(s: FamilyShape, impl: str):
    import transformers

    common = dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=4 * s.hidden, moe_intermediate_size=s.ffn,
                  num_attention_heads=s.heads, num_key_value_heads=s.heads, num_experts_per_tok=FAMILY_TOP_K,
                  norm_topk_prob=True, max_position_embeddings=max(s.seq, 64), experts_implementation=impl)
    if s.family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=FAMILY_EXPERTS, n_group=4,
            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_scaling=None)
    return transformers.Qwen3MoeConfig(**common, num_hidden_layers=1, num_experts=FAMILY_EXPERTS, head_dim=64,
                                       decoder_sparse_step=1, mlp_only_layers=[])


def _family_layers(s: FamilyShape, impls: list[str]) -> list["Way"]:
    """nxdt's MoE layer (its native model's, built from the transformers config) and transformers' block
    per experts implementation, the same state dict in each."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from nxdt.models import build_model
    from nxdt.models.deepseek_v3 import deepseek_v3_model_keys
    from nxdt.models.qwen3 import qwen3_model_keys
    from nxdt.spec import config_from_dict

    torch.manual_seed(0)
    hf_dict = _family_config(s, "eager").to_dict()
    keys = deepseek_v3_model_keys(hf_dict) if s.family == "deepseek_v3" else qwen3_model_keys(hf_dict)
    model = build_model(config_from_dict({"model_source": "megatron", "model": keys}), s.vocab)
    layer = model.model.layers[len(model.model.layers) - 1].mlp.train()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            torch.nn.init.normal_(p, std=0.02)
        bias = getattr(layer.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(std=0.01, generator=torch.Generator().manual_seed(3))
    ways = [Way("nxdt", layer)]
    cls = DeepseekV3MoE if s.family == "deepseek_v3" else Qwen3MoeSparseMoeBlock
    for impl in impls:
        block = cls(_family_config(s, impl)).train()
        block.load_state_dict(layer.state_dict(), strict=True)
        ways.append(Way(f"hf-{impl}", block))
    return ways


def run_family(s: FamilyShape, args) -> dict:
    impls = args.impls.split(",")
    big = "batched_mm" in impls and _batched_mm_gib(s) > args.max_gib
    skipped = [f"hf-batched_mm: skipped, it would hold ~{_batched_mm_gib(s):.1f} GiB of per-(token, slot) weight "
               f"copies (> --max-gib {args.max_gib:g})"] if big else []
    ways = _family_layers(s, [i for i in impls if i != "batched_mm" or not big])
    batch = make_batch(s)
    diffs = agreement(ways, batch)
    tok_s = measure(ways, batch, s.tokens, args.target_s, args.repeats)
    return report(s, tok_s, diffs, skipped, goal_eager=1.0)


# --------------------------------------------------------------------------- building the ways


def _mixtral_config(s: Shape, impl: str):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                         num_hidden_layers=max(1, s.layers), num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=max(s.seq, 64), rms_norm_eps=1e-5, rope_theta=10000.0,
                         num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False,
                         experts_implementation=impl)


def _nxdt_module(s: Shape) -> torch.nn.Module:
    from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
    from nxdt.models.moe import LlamaMoE, MoEArgs

    torch.manual_seed(0)
    moe = MoEArgs(num_experts=NUM_EXPERTS, top_k=TOP_K)
    if not s.layers:
        layer = LlamaMoE(s.hidden, s.ffn, moe)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return layer
    model = NxdtLlamaForCausalLM(LlamaArgs(
        vocab_size=s.vocab, hidden_size=s.hidden, num_layers=s.layers, num_attention_heads=s.heads,
        num_kv_heads=s.kv_heads, ffn_hidden_size=s.ffn, max_position_embeddings=max(s.seq, 64),
        layernorm_epsilon=1e-5, rope_theta=10000.0, moe=moe))
    model.init_weights()
    return model


def _hf_module(s: Shape, impl: str, state: dict) -> torch.nn.Module:
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _mixtral_config(s, impl)
    module = MixtralSparseMoeBlock(cfg) if not s.layers else MixtralForCausalLM(cfg)
    module.load_state_dict(state, strict=True)  # same names, same layouts
    if s.layers:
        got = module.config._experts_implementation
        if got != impl:
            raise RuntimeError(f"transformers chose experts_implementation={got!r} for {impl!r}")
    return module


def _batched_mm_gib(s: Shape) -> float:
    """What batched_mm holds at its peak: per MoE layer, the gathered gate_up and down weights of
    every (token, slot), kept for the backward, and once more their gradients."""
    per_layer = s.tokens * TOP_K * 3 * s.ffn * s.hidden * 4
    return per_layer * (max(1, s.layers) + 1) / 2**30


@dataclass
class Way:
    name: str
    module: torch.nn.Module

    def loss(self, batch) -> torch.Tensor:
        x, target = batch
        if isinstance(x, torch.Tensor) and x.dtype == torch.long:  # a model: cross entropy
            logits = self.module(x)
            logits = logits if isinstance(logits, torch.Tensor) else logits.logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
        return (self.module(x) * target).sum()  # a layer: d loss / d output = target

    def step(self, batch) -> None:
        for p in self.module.parameters():
            p.grad = None
        x, _ = batch
        if x.dtype != torch.long:
            x.grad = None
        self.loss(batch).backward()


def build_ways(s: Shape, impls: list[str], max_gib: float) -> tuple[list[Way], list[str]]:
    nxdt = _nxdt_module(s).train()
    ways, skipped = [Way("nxdt", nxdt)], []
    state = nxdt.state_dict()
    for impl in impls:
        if impl == "batched_mm" and _batched_mm_gib(s) > max_gib:
            skipped.append(f"hf-{impl}: skipped, it would hold ~{_batched_mm_gib(s):.1f} GiB of per-(token, slot) "
                           f"weight copies (> --max-gib {max_gib:g})")
            continue
        try:  # transformers checks the name when the model is built, the experts module at its forward
            way = Way(f"hf-{impl}", _hf_module(s, impl, state).train())
            way.step(make_batch(s))
            ways.append(way)
        except Exception as e:  # transformers refuses this implementation here
            skipped.append(f"hf-{impl}: skipped, transformers refused it: {type(e).__name__}: {e}")
    return ways, skipped


def make_batch(s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if s.layers:
        ids = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    x = torch.randn(s.batch, s.seq, s.hidden, generator=g).requires_grad_(True)
    return x, torch.randn(s.batch, s.seq, s.hidden, generator=g)


# --------------------------------------------------------------------------- agreement and timing


def _experts_grad(module: torch.nn.Module) -> torch.Tensor:
    return next(p.grad for n, p in module.named_parameters() if n.endswith("experts.gate_up_proj"))


def agreement(ways: list[Way], batch) -> dict[str, tuple[float, float]]:
    """Max abs difference to nxdt of each way's output and first experts.gate_up_proj gradient."""
    outs, grads = {}, {}
    for w in ways:
        w.step(batch)  # forward + backward once (also a warm-up)
        with torch.no_grad():
            out = w.module(batch[0])
        outs[w.name] = out if isinstance(out, torch.Tensor) else out.logits
        grads[w.name] = _experts_grad(w.module).clone()
    ref_out, ref_grad = outs["nxdt"], grads["nxdt"]
    return {n: (float((o - ref_out).abs().max()), float((grads[n] - ref_grad).abs().max()))
            for n, o in outs.items() if n != "nxdt"}


def measure(ways: list[Way], batch, tokens: int, target_s: float, repeats: int) -> dict[str, list[float]]:
    """tokens/s of each way per repeat, the ways interleaved (order rotated every repeat). One
    measurement = one untimed warm-up step, then as many steps as fill about `target_s` (counted
    once per way from its first warm-up step, then fixed)."""
    tok_s: dict[str, list[float]] = {w.name: [] for w in ways}
    steps: dict[str, int] = {}
    for r in range(repeats):
        for w in ways[r % len(ways):] + ways[:r % len(ways)]:
            t0 = time.perf_counter()
            w.step(batch)  # warm-up: allocator, thread pool
            steps.setdefault(w.name, max(1, min(50, round(target_s / (time.perf_counter() - t0)))))
            t0 = time.perf_counter()
            for _ in range(steps[w.name]):
                w.step(batch)
            tok_s[w.name].append(tokens * steps[w.name] / (time.perf_counter() - t0))
    return tok_s


def report(s: Shape, tok_s: dict[str, list[float]], diffs: dict, skipped: list[str], goal_eager: float) -> dict:
    hf = [n for n in tok_s if n != "nxdt"]
    med = {n: statistics.median(v) for n, v in tok_s.items()}
    fastest = max(hf, key=med.get) if hf else None
    print(f"\n== {s.label}: {s.describe()}")
    for line in skipped:
        print(f"   {line}")
    print(f"   {'way':<16}{'tokens/s':>10}{'nxdt / this':>14}{'  (min-max per repeat)':<24}"
          f"{'max|out diff|':>15}{'max|grad diff|':>16}")
    for n in tok_s:
        if n == "nxdt":
            print(f"   {n:<16}{med[n]:>10.0f}{'1':>14}{'':<24}{'-':>15}{'-':>16}")
            continue
        per = [a / b for a, b in zip(tok_s["nxdt"], tok_s[n])]
        out_d, grad_d = diffs.get(n, (float("nan"),) * 2)
        print(f"   {n:<16}{med[n]:>10.0f}{statistics.median(per):>13.2f}x  ({min(per):.2f}-{max(per):.2f})"
              f"{'':<{24 - len(f'  ({min(per):.2f}-{max(per):.2f})')}}{out_d:>15.1e}{grad_d:>16.1e}")
    verdict = {}
    if fastest:
        per = [a / b for a, b in zip(tok_s["nxdt"], tok_s[fastest])]
        verdict["vs_fastest"] = r_fast = statistics.median(per)
        line = f"   nxdt / fastest ({fastest}): {r_fast:.2f}x (goal ≥ 1: {_verdict(per, 1.0)})"
        if "hf-eager" in tok_s:
            per = [a / b for a, b in zip(tok_s["nxdt"], tok_s["hf-eager"])]
            verdict["vs_eager"] = r_eager = statistics.median(per)
            line += f"; nxdt / eager: {r_eager:.2f}x (goal ≥ {goal_eager:g}: {_verdict(per, goal_eager)})"
        print(line)
    return verdict


def _verdict(ratios: list[float], goal: float) -> str:
    """'met' / 'missed' by the median ratio; 'within noise' when it misses but the per-repeat
    ratios straddle the goal and the median is within 3% of it."""
    median = statistics.median(ratios)
    if median >= goal:
        return "met"
    if min(ratios) <= goal <= max(ratios) and median >= 0.97 * goal:
        return "missed by the median, within noise"
    return "missed"


def run_shape(s: Shape, args) -> dict:
    ways, skipped = build_ways(s, args.impls.split(","), args.max_gib)
    batch = make_batch(s)
    diffs = agreement(ways, batch)
    tok_s = measure(ways, batch, s.tokens, args.target_s, args.repeats)
    return report(s, tok_s, diffs, skipped, goal_eager=1.5)


# --------------------------------------------------------------------------- expert parallelism


def expert_parallel(args) -> None:
    """Expert parallelism needs ranks: it has its own script, benchmarks/moe_ep.py."""
    print("\n== expert parallel (ep2 vs ep1): .venv/bin/torchrun --nproc_per_node 2 benchmarks/moe_ep.py")


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 1 repeat (a smoke run)")
    p.add_argument("--sections", default="layer,model,families",
                   help="comma list from layer, model, families (DeepSeek-V3's and Qwen3-MoE's layers), ep")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="transformers' experts implementations")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed steps per way per repeat (default 0.5; quick 0.05)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7; quick 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-gib", type=float, default=4.0, help="skip batched_mm where it would hold more than this")
    args = p.parse_args(argv)
    args.target_s = args.target_s or (0.05 if args.quick else 0.5)
    args.repeats = args.repeats or (1 if args.quick else 7)
    torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else FULL
    import transformers

    from nxdt.hardware import machine_line

    print(machine_line())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, fp32; "
          f"~{args.target_s:g} s of steps x {args.repeats} interleaved repeats per way, medians")
    for section in args.sections.split(","):
        if section == "ep":
            expert_parallel(args)
            continue
        if section == "families":
            for s in FAMILIES["quick" if args.quick else "full"]:
                run_family(s, args)
            continue
        for s in shapes[section]:
            run_shape(s, args)


if __name__ == "__main__":
    main()
