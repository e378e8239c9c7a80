#!/usr/bin/env python
"""Tokens/s and peak memory per precision preset, one model, one run; ratios against fp32.

    .venv/bin/python benchmarks/precision.py                  # reference model, 3 interleaved repeats
    .venv/bin/python benchmarks/precision.py --quick          # small model, 1 repeat (smoke)
    .venv/bin/python benchmarks/precision.py --presets fp32,autocast,bf16SR

It is not a test. Each preset trains the same Llama (the engineering-notes reference model:
vocab 8192, hidden 256, 6 layers, 8/4 heads, ffn 704, seq 256, micro batch 8, 2 threads; two
micro-batches per step so gradient accumulation is exercised) on the same random batches
through `nxdt.training.step.train_step` — the step NxdtLightningModule runs, without
Lightning — in its own subprocess (clean allocator and thread pool), presets interleaved and
rotated per repeat; the medians are printed.

Peak memory is the peak RSS of the subprocess (ru_maxrss) minus its RSS after imports and
model build, i.e. what training itself added; with glibc's allocator caching, read it as an
upper bound. (On CUDA, torch.cuda.max_memory_allocated is reported instead.)

Expectations on this CPU (engineering notes): fp32 runs near the fp32 matmul peak; bf16 has
AMX headroom, but bf16 elementwise work and the casts of master mode cost time, so bf16 presets
need not be faster on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PRESETS = {
    "fp32": ["precision.type=fp32"],
    "autocast": ["precision.type=autocast"],
    "mixed_precision": ["precision.type=mixed_precision"],
    "mixed_precisionSR": ["precision.type=mixed_precisionSR"],
    "bf16SR": ["precision.type=bf16SR"],
    "fp16": ["precision.type=fp32", "precision.fp16.enabled=true"],
}
REFERENCE = ["model.num_layers=6", "model.hidden_size=256", "model.ffn_hidden_size=704",
             "model.num_attention_heads=8", "model.num_kv_heads=4", "model.max_position_embeddings=256",
             "model.encoder_seq_length=256", "data.seq_length=256", "data.micro_batch_size=8"]
QUICK = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=352",
         "model.num_attention_heads=4", "model.num_kv_heads=2", "model.max_position_embeddings=128",
         "model.encoder_seq_length=128", "data.seq_length=128", "data.micro_batch_size=4"]
VOCAB = 8192


def worker(preset: str, model_args: list[str], steps: int, warmup: int) -> None:
    import resource

    import torch

    from nxdt.spec import load_config
    from nxdt.training.builder import build_harness
    from nxdt.training.step import microbatch_forward_backward, train_step

    cfg = load_config(["--config-name", "tiny_llama_cpu", *model_args, "trainer.devices=1", *PRESETS[preset]],
                      world_size=1, check_paths=False, quiet=True)
    mbs, seq = cfg.data.micro_batch_size, cfg.data.seq_length
    h = build_harness(cfg, VOCAB)
    fwd_bwd = microbatch_forward_backward(h.model, h.precision, 2)  # two micro-batches: accumulation
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2 * mbs, seq + 1), generator=g) for _ in range(4)]
    loss_mask = torch.ones(2 * mbs, seq)

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for step in range(warmup + steps):
        b = batches[step % len(batches)]
        t0 = time.perf_counter()
        m = train_step(h.model, h.optimizer, None, h.precision, fwd_bwd,
                       {"input_ids": b[:, :-1], "labels": b[:, 1:], "loss_mask": loss_mask}, step=step, clip=1.0)
        losses.append(float(m.loss))
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokens = 2 * mbs * seq * len(times)
    print("RESULT " + json.dumps({"preset": preset, "tok_s": tokens / sum(times), "peak_mib": peak / 1024,
                                  "train_mib": (peak - base_rss) / 1024, "final_loss": losses[-1]}), flush=True)


def run_one(preset: str, model_args: list[str], steps: int, warmup: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, __file__, "--worker", preset, "--steps", str(steps), "--warmup", str(warmup),
           "--model-json", json.dumps(model_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{preset} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 1 repeat")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.model_json), args.steps, args.warmup)
        return
    from nxdt.hardware import machine_line

    print(machine_line(), flush=True)
    model_args = QUICK if args.quick else REFERENCE
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (6 if args.quick else 8)
    presets = args.presets.split(",")
    results: dict[str, list[dict]] = {p: [] for p in presets}
    for r in range(repeats):
        order = presets[r % len(presets):] + presets[:r % len(presets)]  # rotate: no preset always first
        for preset in order:
            results[preset].append(run_one(preset, model_args, steps, args.warmup, args.threads))
    med = {p: {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "peak_mib", "train_mib", "final_loss")}
           for p, rs in results.items()}
    base = med.get("fp32")
    print(f"model: {' '.join(model_args)}; vocab {VOCAB}; {steps} timed steps x {repeats} repeats; "
          f"{args.threads} threads; medians")
    print(f"{'preset':<20}{'tokens/s':>10}{'vs fp32':>9}{'peak MiB':>10}{'train MiB':>11}{'vs fp32':>9}{'loss':>8}")
    for p, m in med.items():
        rt = f"{m['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        rm = f"{m['train_mib'] / base['train_mib']:.2f}x" if base and base["train_mib"] > 0 else "-"
        print(f"{p:<20}{m['tok_s']:>10.0f}{rt:>9}{m['peak_mib']:>10.0f}{m['train_mib']:>11.0f}{rm:>9}"
              f"{m['final_loss']:>8.3f}")


if __name__ == "__main__":
    main()
