#!/usr/bin/env python
"""LoRA vs full fine-tuning on the same model: step time, trainable / total parameters, and the
bytes of gradients and optimizer state; peft's LoRA on transformers' Llama as the reference.

    .venv/bin/python benchmarks/lora.py              # 5 interleaved repeats, medians (~1 min on 2 quiet cores)
    .venv/bin/python benchmarks/lora.py --quick      # smoke run: a small model, 1 repeat, ~10 s
    .venv/bin/python benchmarks/lora.py --rank 64 --repeats 7 --target-s 5

    .venv/bin/python benchmarks/lora.py --peers-json OUT.json [--quick]   # issue 40: vs peft + Trainer

It is not a test. Goal (the LoRA issue): LoRA's optimizer state must fall by the adapter ratio,
i.e. optimizer-state bytes (LoRA) / optimizer-state bytes (full) = trainable parameters (LoRA) /
trainable parameters (full) within 1% (AdamW keeps two fp32 moments per trainable parameter, plus
one `step` scalar per parameter tensor, counted exactly). Full fine-tuning trains every base
parameter, so the denominator is the base model's size; LoRA's own trainable / total (also printed)
is smaller by the factor 1 + adapters / base, because its total includes the adapters (3.7% at
the default shape, 12% at --quick's). The script prints PASS / FAIL and exits 1 on FAIL.

What runs. One native nxdt Llama (`nxdt.config.load.config_from_dict` + `nxdt.models.build_model`:
hidden 512, 8 layers, ffn 1408, 8 heads / 4 kv heads, vocab 8192, seq 256, micro batch 4, fp32,
no dropout, untied embeddings) trained three ways, each one AdamW step = forward, cross entropy,
backward, `optimizer.step()`, `zero_grad(set_to_none=True)`:
  full        every parameter trainable; `nxdt.optim.optimizers.build_optimizer(model,
              {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01, ...})` (torch's fused AdamW, as
              nxdt builds it for plain tensors).
  nxdt-lora   a copy of the same model (same initial weights) with
              `nxdt.models.lora.inject_lora(model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
              rank=16, alpha=32, dropout=0.0)` (adapters on all seven linears of every block), then
              the same build_optimizer, which holds only the trainable parameters (the adapters).
  peft-lora   transformers' `LlamaForCausalLM` (SDPA attention) with the same config and weights
              (the native state dict loads into it by name), `peft.get_peft_model` with
              `LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=<the seven>)`, and
              `torch.optim.AdamW(<its trainable parameters>, fused=True)` (the transformers Trainer's
              default optimizer) with the same lr / betas / weight decay: the ecosystem reference.
              peft is optional: without it the row is printed as skipped.
All three see the same batch of random token ids (labels = the ids shifted by one) and compute the
loss the same way from the logits.

Checks first (step 0, before any update): B = 0 makes LoRA the same function as the base, so the
LoRA models' logits and loss must equal the full model's; the max abs differences are printed
(nxdt-lora: exactly 0 expected; peft-lora runs transformers' Llama code, so up to rounding).

Memory is counted in tensor bytes, not RSS (glibc keeps freed buffers): parameters (each once),
gradients (the `p.grad` tensors after the first backward), optimizer state (every tensor in
`optimizer.state` after the first step: exp_avg + exp_avg_sq + step), and the activations saved
for backward in that forward (a saved-tensor hook; storages counted once, parameters excluded).

Timing. All ways live in this one process (same allocator, same threads: --threads, default 2).
A repeat runs, for each way, one untimed warm-up step, then as many steps as fill about
--target-s seconds (counted once per way from its first warm-up, then fixed); the ways run in an
order rotated every repeat. Step time is the median over --repeats (default 5) of each repeat's
mean; tokens/s = micro batch x seq / step time. "speed vs full" is the median of the per-repeat
ratios full step time / this step time (the ways of one repeat ran closest in time) with their
min-max, the better guide on a shared machine. The CPU columns are the same from
`time.process_time()` (all threads of this process): less distorted than wall time when other
jobs share the cores, though OpenMP spin-waiting still moves them.

--peers-json (issue 40, the LoRA row of benchmarks/peers.py): nxdt against peft + `transformers.Trainer`
as their users run them, each way a fresh subprocess per repeat (benchmarks/peer_memory.py's runner):
nxdt through `nxdt.tools.train.train(cfg)` on the shipped `tiny_llama_lora_cpu` config (Lightning,
the bundled corpus, lr 3e-3, clipping 1.0) with this script's shape, rank, alpha and the four NxDT
targets and its fused output layer + loss (`model.fusions.cross_entropy_chunk_size=--chunk`, 512; 0 for
the whole logits); the peer builds transformers' Llama with the same initial base weights, `get_peft_model` with
the same rank / alpha / seven linears, and runs `Trainer.train()` (its fused AdamW, same lr / betas /
weight decay) on the same batches in the same order. The shape is hidden 512, 8 layers, seq 256,
micro batch 4, vocab 8,192 (the bundled tokenizer's). Rows: tokens/s (median over --repeats
interleaved repeats, the first 3 steps of each run not timed; goal >= 1.3x), trainable-state bytes
(trainable parameters + their gradients + optimizer state, after the last step; goal <= 1.0x) and the
peak bytes of one step (the last step of a run under benchmarks/memory.py's `LiveBytes`: the frozen
base, the adapters, their gradients and optimizer state alive at the step's start plus every tensor
the step creates, until freed; the same accounting on both sides; goal <= 1.0x).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

NXDT_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the same seven
TOLERANCE = 0.01  # optimizer-state ratio vs trainable ratio, relative
OPTIM = {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}
MIB = 2**20
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # --peers-json imports peer_memory.py and throughput_runs.py


@dataclass
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, ffn {self.ffn}, {self.heads}/{self.kv_heads} heads, "
                f"vocab {self.vocab}, seq {self.seq} x micro batch {self.batch} = {self.tokens} tokens/step, fp32")


FULL = Shape(hidden=512, layers=8, ffn=1408, heads=8, kv_heads=4, vocab=8192, seq=256, batch=4)
QUICK = Shape(hidden=128, layers=2, ffn=352, heads=4, kv_heads=2, vocab=1024, seq=64, batch=2)


# --------------------------------------------------------------------------- building the ways


def native_model(s: Shape) -> nn.Module:
    from nxdt.spec import config_from_dict
    from nxdt.models import build_model

    cfg = config_from_dict({
        "model_source": "megatron",
        "model": {"num_layers": s.layers, "hidden_size": s.hidden, "ffn_hidden_size": s.ffn,
                  "num_attention_heads": s.heads, "num_kv_heads": s.kv_heads, "encoder_seq_length": s.seq,
                  "max_position_embeddings": s.seq, "make_vocab_size_divisible_by": 128,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0},
        "distributed_strategy": {"tensor_model_parallel_size": 1},
        "precision": {"type": "fp32"},
    })
    torch.manual_seed(0)
    return build_model(cfg, vocab_size=s.vocab).train()


def peft_model(native: nn.Module, rank: int, alpha: float) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d = native.args.to_hf_config_dict()
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
    hf = LlamaForCausalLM(LlamaConfig(**d, use_cache=False, attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(native.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    torch.manual_seed(1)
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=PEFT_TARGETS,
                                          bias="none"))
    return model.train()


@dataclass
class Way:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # filled by first_step
    loss0: float = float("nan")
    logits0: torch.Tensor | None = None
    grad_bytes: int = 0
    saved_bytes: int = 0
    times: list[float] = field(default_factory=list)  # wall seconds per step, one per repeat
    cpu: list[float] = field(default_factory=list)  # CPU seconds (all threads of the process) per step

    def loss(self, batch) -> torch.Tensor:
        ids, labels = batch
        out = self.model(input_ids=ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def step(self, batch) -> None:
        self.loss(batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- counts
    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())  # de-duplicated

    def trainable(self) -> int:
        return sum(p.numel() for p in self.params() if p.requires_grad)

    def total(self) -> int:
        return sum(p.numel() for p in self.params())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params())

    def optimizer_bytes(self) -> tuple[int, int]:
        """(all tensor bytes in optimizer.state, of which the `step` scalars)."""
        total = steps = 0
        for state in self.optimizer.state.values():
            for key, t in state.items():
                if torch.is_tensor(t):
                    n = t.numel() * t.element_size()
                    total += n
                    steps += n if key == "step" else 0
        return total, steps


class SavedBytes:
    """Bytes of the tensors autograd saves for backward during one forward (storages counted once,
    the parameters' own storages excluded: they exist anyway)."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def first_step(way: Way, batch) -> None:
    """Step 0: the logits and loss before any update, then the gradient, optimizer-state and
    saved-activation bytes of one full step."""
    with torch.no_grad():
        out = way.model(input_ids=batch[0])
        way.logits0 = (out if isinstance(out, torch.Tensor) else out.logits).detach().clone()
    saved = SavedBytes(way.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = way.loss(batch)
    way.loss0, way.saved_bytes = loss.detach().item(), saved.total
    loss.backward()
    way.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in way.params() if p.grad is not None)
    way.optimizer.step()
    way.optimizer.zero_grad(set_to_none=True)


def build_ways(s: Shape, rank: int, alpha: float) -> tuple[list[Way], list[str]]:
    from nxdt.models.lora import inject_lora
    from nxdt.optim.optimizers import build_optimizer

    full = native_model(s)
    lora = copy.deepcopy(full)  # same initial weights, before the full model's first update
    wrapped = inject_lora(lora, NXDT_TARGETS, rank=rank, alpha=alpha, dropout=0.0)
    assert len(wrapped) == len(PEFT_TARGETS) * s.layers, wrapped
    notes = []
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours to fix
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing")
            hf = peft_model(full, rank, alpha)
    except ImportError as e:
        hf = None
        notes.append(f"peft-lora: skipped, {type(e).__name__}: {e} (pip install peft)")
    ways = [Way("full", full, build_optimizer(full, OPTIM)), Way("nxdt-lora", lora, build_optimizer(lora, OPTIM))]
    if hf is not None:
        o = {k: tuple(v) if isinstance(v, list) else v for k, v in OPTIM.items() if k != "name"}
        ways.append(Way("peft-lora", hf, torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad],
                                                             fused=True, **o)))
    return ways, notes


def make_batch(s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# --------------------------------------------------------------------------- timing


def measure(ways: list[Way], batch, target_s: float, repeats: int) -> None:
    """Seconds per step of each way per repeat, the ways interleaved (order rotated every repeat)."""
    steps: dict[str, int] = {}
    for r in range(repeats):
        order = ways[r % len(ways):] + ways[:r % len(ways)]
        for w in order:
            t0 = time.perf_counter()
            w.step(batch)  # warm-up: allocator, thread pool, caches after the other ways ran
            steps.setdefault(w.name, max(1, min(50, round(target_s / (time.perf_counter() - t0)))))
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps[w.name]):
                w.step(batch)
            w.times.append((time.perf_counter() - t0) / steps[w.name])
            w.cpu.append((time.process_time() - c0) / steps[w.name])
        print(f"  repeat {r + 1}/{repeats} ({' -> '.join(w.name for w in order)}): "
              + ", ".join(f"{w.name} {w.times[-1]:.3f}s x{steps[w.name]}" for w in ways), flush=True)


# --------------------------------------------------------------------------- report


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f}"


def report(s: Shape, ways: list[Way], notes: list[str], skipped_rows: list[str]) -> bool:
    full = ways[0]
    print("\nstep 0 (B = 0, before any update): the LoRA models compute the full model's function")
    for w in ways[1:]:
        logit_d = float((w.logits0 - full.logits0).abs().max())
        print(f"  {w.name:<10} loss {w.loss0:.6f} vs full {full.loss0:.6f}: "
              f"|loss diff| {abs(w.loss0 - full.loss0):.1e}, max |logit diff| {logit_d:.1e}")

    # ---- time
    print(f"\n{'way':<11}{'step s (median)':>16}{'  min-max':<16}{'tokens/s':>10}{'speed vs full':>15}"
          f"{'  (min-max)':<15}{'CPU s/step':>11}{'speed vs full by CPU s':>24}")
    for w in ways:
        med, cpu = statistics.median(w.times), statistics.median(w.cpu)
        per = [a / b for a, b in zip(full.times, w.times)]
        per_cpu = [a / b for a, b in zip(full.cpu, w.cpu)]
        rng = f"  {min(w.times):.3f}-{max(w.times):.3f}"
        ratio = "1" if w is full else f"{statistics.median(per):.2f}x"
        per_rng = "" if w is full else f"  ({min(per):.2f}-{max(per):.2f})"
        ratio_cpu = "1" if w is full else (f"{statistics.median(per_cpu):.2f}x ({min(per_cpu):.2f}-"
                                           f"{max(per_cpu):.2f})")
        print(f"{w.name:<11}{med:>16.3f}{rng:<16}{s.tokens / med:>10,.0f}{ratio:>15}{per_rng:<15}{cpu:>11.3f}"
              f"{ratio_cpu:>24}")
    for row in skipped_rows:
        print(f"{row:<11}{'skipped':>16}")

    # ---- memory
    full_opt, _ = full.optimizer_bytes()
    print(f"\n{'way':<11}{'trainable':>12}{'total':>12}{'trainable %':>13}{'params MiB':>12}{'grads MiB':>11}"
          f"{'optim MiB':>11}{'optim / full':>14}{'trainable / full':>18}{'saved act. MiB':>16}")
    ok = True
    checks = []
    for w in ways:
        opt, step_bytes = w.optimizer_bytes()
        frac = w.trainable() / w.total()
        adapter_ratio = w.trainable() / full.trainable()  # what the optimizer state must fall by
        opt_ratio = opt / full_opt
        print(f"{w.name:<11}{w.trainable():>12,}{w.total():>12,}{100 * frac:>12.3f}%{_mib(w.param_bytes()):>12}"
              f"{_mib(w.grad_bytes):>11}{_mib(opt):>11}{opt_ratio:>14.5f}{adapter_ratio:>18.5f}"
              f"{_mib(w.saved_bytes):>16}")
        moments = opt - step_bytes
        moments_ok, grads_ok = moments == 2 * 4 * w.trainable(), w.grad_bytes == 4 * w.trainable()
        ok &= moments_ok and grads_ok
        checks.append(f"  {w.name:<10} exp_avg + exp_avg_sq = {moments:,} B = 8 B x {w.trainable():,} trainable: "
                      f"{'yes' if moments_ok else 'NO'}; + step scalars {step_bytes:,} B ({len(w.optimizer.state)} "
                      f"tensors); grads = 4 B x trainable: {'yes' if grads_ok else 'NO'}")
        if w is not full:
            rel = abs(opt_ratio / adapter_ratio - 1)
            passed = rel <= TOLERANCE
            ok &= passed
            checks.append(f"  {w.name:<10} optimizer state / full's = {opt_ratio:.5f} vs trainable / full's trainable "
                          f"= {adapter_ratio:.5f}: relative difference {rel:.4%} (goal <= {TOLERANCE:.0%}): "
                          f"{'PASS' if passed else 'FAIL'}  (its trainable / total: {frac:.5f})")
    for row in skipped_rows:
        print(f"{row:<11}{'skipped':>12}")
    print("\nchecks:")
    print("\n".join(checks))
    for line in notes:
        print(f"  {line}")
    print(f"\noptimizer state: {'PASS' if ok else 'FAIL'}")
    return ok


# --------------------------------------------------------------------------- --peers-json (issue 40)


def peers(args) -> int:
    """nxdt's LoRA through its training entry vs peft + transformers.Trainer: the protocol's rows."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    import peer_memory as pm  # reason: a sibling script, and only this mode needs it
    from throughput_runs import Shape as RunShape  # reason: as above

    s = QUICK if args.quick else FULL
    shape = RunShape(hidden=s.hidden, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn, seq=s.seq,
                     micro_batch=s.batch)
    if not Path(args.data_prefix + ".bin").exists():
        print(f"error: --data-prefix: {args.data_prefix}.bin not found (make data)", file=sys.stderr)
        return 2
    warmup, timed = (2, 1) if args.quick else (3, args.steps)  # step 2: nxdt samples its own memory
    base = {"shape": asdict(shape), "data_prefix": args.data_prefix, "exp_dir": "", "steps": warmup + timed,
            "warmup": warmup, "config_name": "tiny_llama_lora_cpu"}
    peft_key = "model_alignment_strategy.peft"
    nxdt = pm.Spec("nxdt", **base, overrides=[
        f"{peft_key}.lora_rank={args.rank}", f"{peft_key}.lora_alpha={args.alpha:g}", f"{peft_key}.lora_dropout=0.0",
        f"{peft_key}.target_modules=[{','.join(NXDT_TARGETS)}]", f"{peft_key}.merge_lora=false",
        f"{peft_key}.lora_verbose=false", "exp_manager.resume_if_exists=false",
        "exp_manager.create_checkpoint_callback=false", *([f"model.fusions.cross_entropy_chunk_size={args.chunk}"]
                                                          if args.chunk else [])])
    peer = pm.Spec("hf", **base, lora={"rank": args.rank, "alpha": args.alpha, "targets": PEFT_TARGETS})
    print(pm.machine(), flush=True)
    print(f"model: {shape.describe()}, fp32; LoRA rank {args.rank}, alpha {args.alpha:g} on q/k/v/o/gate/up/down; "
          f"nxdt's loss head {f'fused, chunks of {args.chunk}' if args.chunk else 'whole logits'}; "
          f"{timed} timed steps x {args.repeats} interleaved repeats, fresh processes", flush=True)
    runs: dict[str, list[dict]] = {"nxdt": [], "peft": []}
    for r in range(args.repeats):
        for name, spec in (("nxdt", nxdt), ("peft", peer))[::1 if r % 2 == 0 else -1]:
            runs[name].append(pm.run_way(pm.Spec(**asdict(spec)), in_process=args.in_process))
            got = runs[name][-1]
            print(f"  repeat {r + 1}/{args.repeats} {name:<5} " + (f"error: {got['error']}" if "error" in got else
                  f"{got['tokens_per_s']:,.0f} tokens/s, peak {got['peak_bytes'] / MIB:,.1f} MiB, trainable state "
                  f"{got['trainable_state_bytes'] / MIB:,.2f} MiB"), flush=True)
    errors = [f"{name}: {got['error']}" for name, rs in runs.items() for got in rs if "error" in got]
    rows = [] if errors else peer_rows(runs)
    for row in rows:
        print(f"{row['what']}: nxdt {row['nxdt']:,.0f} / peft+Trainer {row['peer']:,.0f} = {row['ratio']:.3f} "
              f"(goal {row['goal']}): {'PASS' if row['pass'] else 'MISS'}")
    if args.peers_json:
        import peft
        import transformers

        Path(args.peers_json).write_text(json.dumps({
            "job": "LoRA SFT", "peer": f"peft {peft.__version__} + transformers.Trainer {transformers.__version__}",
            "machine": pm.machine(), "rows": rows, "skipped": "; ".join(errors)[:500] if errors else None}, indent=1))
    return 0


def peer_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """The protocol's rows from the runs of both ways (tokens/s: medians, the per-repeat ratios' range)."""
    import peer_memory as pm  # reason: a sibling script, and only this mode needs it

    nx, hf = runs["nxdt"], runs["peft"]
    per = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(nx, hf)]
    med = {k: {name: statistics.median(g[k] for g in rs) for name, rs in runs.items()}
           for k in ("tokens_per_s", "trainable_state_bytes", "peak_bytes")}
    n = len(nx)
    return [
        pm.row("tokens/s", med["tokens_per_s"]["nxdt"], med["tokens_per_s"]["peft"], ">= 1.3",
               f"median of {n} interleaved repeats (fresh processes); per-repeat ratios {min(per):.2f}-{max(per):.2f}"),
        pm.row("trainable-state bytes (adapters + grads + optimizer state)", med["trainable_state_bytes"]["nxdt"],
               med["trainable_state_bytes"]["peft"], "<= 1.0", "tensor bytes after the last step"),
        pm.row("peak bytes of one step", med["peak_bytes"]["nxdt"], med["peak_bytes"]["peft"], "<= 1.0",
               "LiveBytes (benchmarks/memory.py): frozen base + adapters + grads + optimizer state + every tensor "
               "the step creates, until freed; same accounting both sides"),
    ]


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model, 1 repeat (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5; quick 1)")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed steps per way per repeat (default 2; quick 0.2)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers-json", help="issue 40: nxdt's training entry vs peft + transformers.Trainer, JSON here")
    p.add_argument("--steps", type=int, default=10, help="--peers-json: timed steps per run")
    p.add_argument("--chunk", type=int, default=512,
                   help="--peers-json: nxdt's model.fusions.cross_entropy_chunk_size (the fused loss head; 0: off)")
    p.add_argument("--data-prefix", default=str(REPO / "data" / "kjv" / "kjv_text_document"),
                   help="--peers-json: the corpus both sides train on")
    p.add_argument("--in-process", action="store_true", help="--peers-json: the runs in this process (smoke test)")
    args = p.parse_args(argv)
    if args.peers_json:
        args.repeats = args.repeats or (1 if args.quick else 3)
        return peers(args)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.target_s = args.target_s or (0.2 if args.quick else 2.0)
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    import transformers

    try:
        import peft
        peft_version = f"peft {peft.__version__}"
    except ImportError:
        peft_version = "peft not installed"
    from nxdt.hardware import machine_line

    print(machine_line())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {peft_version}")
    print(f"model: {s.describe()}; LoRA rank {args.rank}, alpha {args.alpha:g}, "
          f"on q/k/v/o/gate/up/down of every block")
    print(f"AdamW lr {OPTIM['lr']:g}; ~{args.target_s:g} s of steps x {args.repeats} interleaved repeats per way, "
          f"medians")

    ways, notes = build_ways(s, args.rank, args.alpha)
    skipped_rows = [] if any(w.name == "peft-lora" for w in ways) else ["peft-lora"]
    batch = make_batch(s)
    for w in ways:
        first_step(w, batch)
    measure(ways, batch, args.target_s, args.repeats)
    return 0 if report(s, ways, notes, skipped_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
