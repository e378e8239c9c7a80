#!/usr/bin/env python
"""Training throughput: nxdt vs a hand-written PyTorch loop vs `transformers.Trainer`.

    .venv/bin/python benchmarks/throughput.py                 # 3 interleaved repeats, medians
    .venv/bin/python benchmarks/throughput.py --quick         # a short smoke run (1 repeat)
    .venv/bin/python benchmarks/throughput.py --ways nxdt,plain,hf,nxdt-bf16,hf-bf16,nxdt-compile

It is not a test. Every way trains the same Llama (the engineering-notes reference model: vocab
8192, hidden 256, 6 layers, 8 heads / 4 kv heads, ffn 704, seq 256, micro batch 8, fp32, 2
threads) on the same batches: the bundled corpus tokenized with the bundled tokenizer into a
temporary directory, read through nxdt's MegatronDataModule with the composed config.

Ways (each in its own subprocess, so process groups, thread pools and allocator state don't
leak between them; the ways are interleaved and rotated in every repeat):
  nxdt          the product path: `load_config(["--config-name", "tiny_llama_cpu", ...overrides])`
                + `nxdt.training.run.train(cfg)` on 1 device (Lightning, exp_manager, TensorBoard,
                progress bar, logging every log_every_n_steps, gradient clipping, LR schedule).
  plain         the textbook loop on the same `nxdt.models.build_model` model: forward,
                cross entropy, backward, clip_grad_norm_(1.0), AdamW step, zero_grad.
  hf            `transformers.Trainer` on `LlamaForCausalLM` with the same config and the same
                initial weights (copied from the native model: same parameter names), SDPA
                attention, the Trainer's defaults (fused AdamW, max_grad_norm 1.0).
  (nxdt builds fused AdamW by default for plain tensors, as the HF Trainer does; the plain loop
  uses torch's default AdamW, the textbook choice.)
  nxdt-bf16     nxdt with `precision.type=autocast` (bf16 autocast, fp32 master weights).
  nxdt-compile  nxdt with `model.use_torch_compile=true` (each decoder block torch.compile'd).
  nxdt-bf16-compile  both of the above.
  hf-bf16       hf with `TrainingArguments(bf16=True)` (the Trainer's bf16 autocast).
  plain-compile the plain loop with the same per-block compile.

Step time is the wall-clock interval between consecutive optimizer-step ends, so it contains
everything a step costs (data loading, loop overhead, logging); the first --warmup-steps
intervals are dropped. tokens/s = micro_batch_size × seq_length × steps / their total time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

THREADS = 2
MICRO_BATCH = 8
SEQ = 256
TOKENS_PER_STEP = MICRO_BATCH * SEQ
GOAL_VS_PLAIN = 0.97
GOAL_VS_HF = 1.25
# nxdt variants: extra config overrides (real config keys) on top of the equal-footing run.
NXDT_VARIANTS = {
    "nxdt": [],
    "nxdt-bf16": ["precision.type=autocast"],
    "nxdt-compile": ["model.use_torch_compile=true"],
    "nxdt-bf16-compile": ["precision.type=autocast", "model.use_torch_compile=true"],
}
WAYS = (*NXDT_VARIANTS, "plain", "hf", "hf-bf16", "plain-compile")
DEFAULT_WAYS = "nxdt,plain,hf"


def overrides(data_prefix: str, exp_dir: str, max_steps: int, extra: list[str] | None = None) -> list[str]:
    """The reference model as overrides of the shipped `tiny_llama_cpu` config."""
    return [
        "--config-name", "tiny_llama_cpu",
        "trainer.devices=1",
        f"trainer.max_steps={max_steps}",
        "trainer.limit_val_batches=0",          # no validation inside the timed window
        f"model.optim.sched.warmup_steps={max(1, max_steps // 4)}",  # the shipped 30 needs max_steps > 30
        "model.num_layers=6",
        "model.hidden_size=256",
        "model.ffn_hidden_size=704",
        "model.num_attention_heads=8",
        "model.num_kv_heads=4",
        f"model.encoder_seq_length={SEQ}",
        f"data.micro_batch_size={MICRO_BATCH}",
        f"data.global_batch_size={MICRO_BATCH}",
        "data.num_workers=0",                   # all three load batches in the main process
        f"data.data_prefix=[1.0,{data_prefix}]",
        f"exp_manager.exp_dir={exp_dir}",
        "precision.type=fp32",
        *(extra or []),
    ]


# ------------------------------------------------------------------------------------ worker


def _compose(args, extra=None):
    from nxdt.config.load import load_config

    total = args.warmup_steps + args.steps
    return load_config(
        overrides(args.data_prefix, args.exp_dir, total, extra),
        world_size=1, default_config_dir=CONF_DIR, check_paths=True, quiet=True,
    )


def _batches(cfg, n: int):
    """The first n training batches exactly as nxdt's data module yields them (dp rank 0 of 1)."""
    from nxdt.data.megatron_module import MegatronDataModule

    dm = MegatronDataModule(cfg, None)
    dm.setup("fit")
    out = []
    for batch in dm.train_dataloader():
        out.append(batch)
        if len(out) == n:
            break
    assert len(out) == n, f"only {len(out)} batches"
    return out, dm.vocab_size


def _compile_blocks(model):
    from nxdt.parallel.parallelize import transformer_blocks

    for block in transformer_blocks(model):
        block.compile()
    return model


class _Stamps:
    """perf_counter() at the end of every optimizer step."""

    def __init__(self, label: str, total: int) -> None:
        self.t: list[float] = []
        self.label, self.total = label, total
        self.cpu: list[float] = []
        self.checksum = 0  # of the token ids trained on, in order: proves "same batches"

    def saw(self, input_ids) -> None:
        self.checksum += (len(self.t) + 1) * int(input_ids.long().sum())

    def mark(self) -> None:
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())  # all threads of this process: less hurt by other load
        k = len(self.t)
        if k == 1 or k % 5 == 0 or k == self.total:
            dt = self.t[-1] - self.t[-2] if k > 1 else float("nan")
            print(f"[{self.label}] step {k}/{self.total}  last {dt:.3f}s", file=sys.stderr, flush=True)


def worker_nxdt(args, stamps: _Stamps, extra: list[str]) -> dict:
    import lightning.pytorch as pl

    import nxdt.training.run as run

    cfg = _compose(args, extra)

    class StepTimer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.saw(batch["input_ids"])
            stamps.mark()

    build_trainer = run.build_trainer
    run.build_trainer = lambda cfg, layout, mesh, loggers, callbacks: build_trainer(
        cfg, layout, mesh, loggers, [*callbacks, StepTimer()]
    )
    trainer, module = run.train(cfg)
    loss = trainer.callback_metrics.get("reduced_train_loss")
    return {"final_loss": float(loss) if loss is not None else None}


def worker_plain(args, stamps: _Stamps, compile_blocks: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from nxdt.models import build_model

    cfg = _compose(args)
    batches, vocab = _batches(cfg, args.warmup_steps + args.steps)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, vocab)
    if compile_blocks:
        _compile_blocks(model)
    o = cfg.model.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"])
    model.train()
    losses = []
    for batch in batches:
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # what a textbook loop prints; a no-op sync on CPU
        stamps.saw(batch["input_ids"])
        stamps.mark()
    return {"final_loss": sum(losses) / len(losses)}


def worker_hf(args, stamps: _Stamps, bf16: bool) -> dict:
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from nxdt.models import build_model

    cfg = _compose(args)
    total = args.warmup_steps + args.steps
    batches, vocab = _batches(cfg, total)
    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab)
    hf_cfg = native.args.to_hf_config_dict()
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, use_cache=False, attn_implementation="sdpa"))
    missing, unexpected = model.load_state_dict(native.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    del native

    # HF causal-LM convention: labels = input_ids, the model shifts them (it scores S-1 of the
    # S positions; the compute is the same). Samples in the same order as the other ways.
    samples = [{"input_ids": ids, "labels": ids} for b in batches for ids in b["input_ids"]]
    fetched: list[int] = []  # sample indices in the order the Trainer's loader asked for them

    class Samples(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            fetched.append(i)
            return samples[i]

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class StepTimer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            k = len(stamps.t)
            stamps.saw(torch.stack([samples[i]["input_ids"] for i in fetched[k * MICRO_BATCH:(k + 1) * MICRO_BATCH]]))
            stamps.mark()

    o = cfg.model.optim
    targs = TrainingArguments(
        output_dir=os.path.join(args.exp_dir, "hf"),
        per_device_train_batch_size=MICRO_BATCH, max_steps=total, report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, use_cpu=True, bf16=bf16,
        learning_rate=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1],
        seed=cfg.seed, disable_tqdm=True,
    )
    trainer = InOrder(model=model, args=targs, train_dataset=Samples(), callbacks=[StepTimer()])
    out = trainer.train()
    return {"final_loss": float(out.training_loss)}


def worker(args) -> int:
    import torch

    torch.set_num_threads(THREADS)
    stamps = _Stamps(args.worker, args.warmup_steps + args.steps)
    way = args.worker
    if way in NXDT_VARIANTS:
        info = worker_nxdt(args, stamps, NXDT_VARIANTS[way])
    elif way in ("plain", "plain-compile"):
        info = worker_plain(args, stamps, way == "plain-compile")
    elif way in ("hf", "hf-bf16"):
        info = worker_hf(args, stamps, way == "hf-bf16")
    else:
        raise SystemExit(f"unknown way {way}")
    intervals = [b - a for a, b in zip(stamps.t, stamps.t[1:])]
    # stamps.t[0] ends step 1; interval i ends step i+2. Keep those after the warm-up steps.
    steady = intervals[max(args.warmup_steps - 1, 0):]
    cpu = [b - a for a, b in zip(stamps.cpu, stamps.cpu[1:])][max(args.warmup_steps - 1, 0):]
    result = {
        "way": way, "steps": len(steady), "step_times": steady, "threads": torch.get_num_threads(),
        "tokens_per_s": TOKENS_PER_STEP * len(steady) / sum(steady), "batch_checksum": stamps.checksum,
        "tokens_per_cpu_s": TOKENS_PER_STEP * len(cpu) / sum(cpu), **info,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------ driver


def prepare_data(data_dir: Path) -> str:
    from nxdt.data.assets import bundled_corpus_path, bundled_tokenizer_dir
    from nxdt.tools.preprocess import main as preprocess

    prefix = data_dir / "kjv_text_document"
    if not Path(f"{prefix}.idx").exists():
        print(f"tokenizing the bundled corpus into {data_dir} ...", flush=True)
        preprocess([
            "--input", str(bundled_corpus_path()), "--tokenizer", str(bundled_tokenizer_dir()),
            "--output-prefix", str(prefix), "--quiet",
        ])
    return str(prefix)


def run_way(way: str, args, data_prefix: str, work: Path, tag: str) -> dict | None:
    out = work / f"{tag}-{way}.json"
    log = work / f"{tag}-{way}.log"
    exp_dir = work / f"exp-{tag}-{way}"
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, "--worker", way, "--out", str(out), "--data-prefix", data_prefix,
           "--exp-dir", str(exp_dir), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(work))
    wall = time.perf_counter() - start
    if rc != 0 or not out.exists():
        tail = log.read_text().splitlines()[-25:]
        print(f"  {way:14s} FAILED (exit {rc}); log {log}:\n    " + "\n    ".join(tail), flush=True)
        return None
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    times = res["step_times"]
    print(f"  {way:14s} {res['tokens_per_s']:8,.0f} tok/s  {res['tokens_per_cpu_s']:6,.0f} tok/cpu-s   step {statistics.median(times):.3f}s median "
          f"({min(times):.3f}-{max(times):.3f})   loss {res['final_loss']:.3f}   process {wall:5.1f}s",
          flush=True)
    return res


def table(by_repeat: dict[str, dict[int, float]]) -> str:
    """Medians per way and the ratios; per-repeat ratios pair runs of the same repeat."""
    results = {w: list(v.values()) for w, v in by_repeat.items()}
    lines = [f"{'way':15s} {'tokens/s (median)':>18s} {'min-max':>17s} {'spread':>7s} {'runs':>5s}"]
    med = {}
    for way, vals in results.items():
        if not vals:
            lines.append(f"{way:15s} {'failed':>18s}")
            continue
        med[way] = statistics.median(vals)
        spread = (max(vals) - min(vals)) / med[way]
        lines.append(f"{way:15s} {med[way]:18,.0f} {min(vals):8,.0f}-{max(vals):<8,.0f} {spread:6.0%} {len(vals):5d}")
    lines.append("")

    def ratio(a: str, b: str, goal: float | None) -> None:
        if a not in med or b not in med:
            return
        r = med[a] / med[b]
        # per-repeat ratios (same repeat = closest in time) show how much of the gap is noise
        pairs = [by_repeat[a][k] / by_repeat[b][k] for k in by_repeat[a] if k in by_repeat[b]] or [float("nan")]
        verdict = "" if goal is None else (f"  goal ≥ {goal:.2f}×  " + ("PASS" if r >= goal else "MISS"))
        lines.append(f"{a + ' / ' + b:28s} {r:5.3f}×  (per repeat {min(pairs):.3f}-{max(pairs):.3f}){verdict}")

    ratio("nxdt", "plain", GOAL_VS_PLAIN)
    ratio("nxdt", "hf", GOAL_VS_HF)
    ratio("plain", "hf", None)
    for opt in ("nxdt-bf16", "nxdt-compile", "nxdt-bf16-compile"):
        ratio(opt, "plain", None)
        ratio(opt, "hf", GOAL_VS_HF)
    ratio("nxdt-bf16", "hf-bf16", None)
    ratio("nxdt-compile", "plain-compile", None)
    return "\n".join(lines)


def summarize(work: Path) -> int:
    """The table from the r<k>-<way>.json files of a kept (possibly interrupted) run."""
    results: dict[str, dict[int, float]] = {}
    per_cpu: dict[str, dict[int, float]] = {}
    checksums = set()
    for f in sorted(work.glob("r*-*.json"), key=lambda f: int(f.name.split("-")[0][1:])):
        res, rep = json.loads(f.read_text()), int(f.name.split("-")[0][1:])
        results.setdefault(res["way"], {})[rep] = res["tokens_per_s"]
        if "tokens_per_cpu_s" in res:
            per_cpu.setdefault(res["way"], {})[rep] = res["tokens_per_cpu_s"]
        checksums.add(res.get("batch_checksum"))
    if len(checksums) == 1 and None not in checksums:
        print(f"all ways trained on the same batches (token checksum {checksums.pop()})")
    print(table(results))
    if per_cpu:
        print("\nsame, in tokens per CPU-second of the process (wall time hides other load; this less so):")
        print(table(per_cpu))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run (after warm-up)")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps run but not timed (compile, allocator)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    p.add_argument("--ways", default=DEFAULT_WAYS, help=f"comma list from {','.join(WAYS)}")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 warm-up, 1 repeat (a smoke run)")
    p.add_argument("--data-dir", default=None, help="reuse tokenized data here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (worker logs)")
    p.add_argument("--from-dir", help="only re-tabulate the worker results kept (--keep) in this work dir")
    # worker mode (internal)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data-prefix", help=argparse.SUPPRESS)
    p.add_argument("--exp-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.from_dir:
        return summarize(Path(args.from_dir))
    if args.quick:
        args.steps, args.warmup_steps, args.repeats = 6, 2, 1
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in WAYS]
    if bad:
        p.error(f"unknown way(s) {bad}; choose from {WAYS}")

    work = Path(tempfile.mkdtemp(prefix="nxdt-bench-"))
    data_dir = Path(args.data_dir) if args.data_dir else work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    data_prefix = prepare_data(data_dir)
    import torch

    from nxdt.hardware import machine_line

    print(machine_line(), flush=True)
    print(f"model: vocab 8192, hidden 256, 6 layers, 8/4 heads, ffn 704, seq {SEQ}, micro batch {MICRO_BATCH}, "
          f"{THREADS} threads; {args.steps} timed steps after {args.warmup_steps} warm-up, "
          f"{args.repeats} repeat(s), ways {','.join(ways)}; torch {torch.__version__}, {os.cpu_count()} cpus",
          flush=True)
    results: dict[str, dict[int, float]] = {w: {} for w in ways}
    per_cpu: dict[str, dict[int, float]] = {w: {} for w in ways}
    checksums: set[int] = set()
    try:
        for r in range(args.repeats):
            order = ways[r % len(ways):] + ways[: r % len(ways)]  # rotate so no way always runs first
            print(f"repeat {r + 1}/{args.repeats}: {' → '.join(order)}", flush=True)
            for way in order:
                res = run_way(way, args, data_prefix, work, f"r{r}")
                if res is not None:
                    results[way][r] = res["tokens_per_s"]
                    per_cpu[way][r] = res["tokens_per_cpu_s"]
                    checksums.add(res["batch_checksum"])
                    if len(checksums) > 1:
                        print("  WARNING: the ways did not train on the same batches", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the table below covers the runs that finished", flush=True)
        args.keep = True
    print()
    if len(checksums) == 1:
        print(f"all ways trained on the same batches (token checksum {checksums.pop()})")
    print(table(results))
    print("\nsame, in tokens per CPU-second of the process (wall time hides other load; this less so):")
    print(table(per_cpu))
    if args.keep:
        print(f"\nworker logs: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
