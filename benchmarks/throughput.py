#!/usr/bin/env python
"""Training throughput and MFU: nxdt vs a hand-written PyTorch loop vs Hugging Face's `Trainer`.

    .venv/bin/python benchmarks/throughput.py                    # the reference shape: fp32 + bf16, goals judged
    .venv/bin/python benchmarks/throughput.py --shape large      # hidden 1024, 8 layers, seq 1024, vocab 32,000
    .venv/bin/python benchmarks/throughput.py --quick            # a smoke run (short, 1 repeat)
    .venv/bin/python benchmarks/throughput.py --ways nxdt,nxdt-compile,hf,hf-compile
    .venv/bin/python benchmarks/throughput.py --device cuda --shape llama-3.2-1b          # on a GPU machine
    .venv/bin/python benchmarks/throughput.py --device cuda --shape llama-3.1-8b --ranks 8  # FSDP over 8 GPUs

It is not a test. Every way trains the same Llama on the same batches (the bundled corpus,
tokenized with the bundled tokenizer into a temporary directory, read through nxdt's
MegatronDataModule; a larger `model.vocab_size` pads the output layer) from the same initial
weights, with AdamW, gradient clipping at 1.0 and the same learning rate.

Ways (each run in its own subprocess, so thread pools, compiled graphs and allocator state don't
leak between them; the ways are interleaved and rotated in every repeat; medians are reported;
`--in-process` runs them in the driver instead, for the suite's smoke test only):
  nxdt[-compile]          the product: `load_config(["--config-name", "tiny_llama_cpu", ...])` and
                          `nxdt.training.trainer.train(cfg)` (Lightning, exp_manager, TensorBoard, logging,
                          clipping, LR schedule), fp32; -compile adds model.fusions.torch_compile=true
  nxdt-autocast[-compile] precision.type=autocast (bf16 autocast over fp32 weights)
  nxdt-mixed[-compile]    precision.type=mixed_precision (bf16 copies of the fp32 weights, made once a step)
  nxdt-bf16sr[-compile]   precision.type=bf16SR (bf16 weights, fp32 update, stochastic rounding)
  plain[-compile]         the textbook loop on nxdt's model: forward, F.cross_entropy, backward,
                          clip_grad_norm_, torch's default AdamW, zero_grad (fp32)
  hf[-compile]            `transformers.Trainer` on `LlamaForCausalLM` with the same weights, SDPA
                          attention and the Trainer's defaults, as a user gets it; -compile sets
                          TrainingArguments(torch_compile=True)
  hf-bf16[-compile]       the same with TrainingArguments(bf16=True) (its bf16 autocast)

Step time is the wall-clock interval between consecutive optimizer-step ends (everything a step
costs: data loading, loop overhead, logging); the first --warmup-steps intervals (compilation,
allocator warm-up) are dropped. tokens/s = tokens per step x timed steps / their time; MFU = model
FLOPs per token (nxdt.models.flops, the formula of the run's `mfu`) x tokens/s / the peak: on CPU
the best fp32 or bf16 matmul rate measured by this script before and after the runs (never the
cached figure), on a GPU the published dense peak of the device.

Goals (issue 19), judged on the CPU's table and printed as PASS / MISS:
  fp32: the faster nxdt fp32 way >= 1.1x each Trainer fp32 way, and >= 85% of the fp32 peak;
  bf16: where bf16 matmuls run faster than fp32 here (AMX, AVX512-BF16), the fastest nxdt bf16 way
        >= 1.5x each Trainer bf16 way and >= 50% of the bf16 peak; elsewhere the bf16 ways are
        not run (they would take ~70x as long) and the measured slowdown is printed instead;
  overhead: nxdt >= 0.97x the plain loop.
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
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput_runs import (  # noqa: E402
    DEFAULT_CPU_WAYS, DEFAULT_CUDA_WAYS, SHAPES, THREADS, WAYS, compose, in_process, worker)

GOAL_FP32_VS_TRAINER = 1.1
GOAL_FP32_MFU = 0.85
GOAL_BF16_VS_TRAINER = 1.5
GOAL_BF16_MFU = 0.50
GOAL_VS_PLAIN = 0.97
GOAL_GPU_MFU = 0.45


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


def model_flops_per_token(args) -> float:
    """The run's model FLOPs per token (nxdt plan's figure: the model built on the meta device)."""
    from nxdt.planner.estimate import plan
    from nxdt.spec import build_spec

    return float(plan(build_spec(compose(args)))["flops_per_token"])


def measure_cpu_peaks(budget_s: float = 1.0) -> dict[str, float]:
    """fp32 and bf16 matmul TFLOP/s with THREADS threads, measured now (not the cached figure)."""
    import torch

    from nxdt.hardware import probe_matmul_tflops

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return {dtype: probe_matmul_tflops(dtype, budget_s=budget_s) for dtype in ("fp32", "bf16")}
    finally:
        torch.set_num_threads(threads)


def worker_command(way: str, args, out: Path, exp_dir: Path) -> list[str]:
    """The command line of one way's run: this script's worker mode, under torchrun for --ranks > 1."""
    launcher = [sys.executable]
    if args.ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]
    cmd = [*launcher, __file__, "--worker", way, "--out", str(out), "--data-prefix", args.data_prefix,
           "--exp-dir", str(exp_dir), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
           "--shape", args.shape, "--device", args.device, "--ranks", str(args.ranks)]
    return cmd + (["--fsdp"] if args.fsdp else [])


def run_here(way: str, args, out: Path, exp_dir: Path, log: Path) -> int:
    """--in-process (smoke tests): the worker in this process; its exit status, a failure's traceback in `log`."""
    with in_process():
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            return worker(argparse.Namespace(**{**vars(args), "worker": way, "out": str(out),
                                                "exp_dir": str(exp_dir)}))
        except Exception:  # the way failed: reported as a subprocess's failure is
            log.write_text(traceback.format_exc())
            return 1


def run_way(way: str, args, work: Path, tag: str) -> dict | None:
    out, log, exp_dir = work / f"{tag}-{way}.json", work / f"{tag}-{way}.log", work / f"exp-{tag}-{way}"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    start = time.perf_counter()
    if args.in_process:
        rc = run_here(way, args, out, exp_dir, log)
    else:
        with open(log, "w") as f:
            rc = subprocess.call(worker_command(way, args, out, exp_dir), stdout=f, stderr=subprocess.STDOUT, env=env,
                                 cwd=str(work))
    wall = time.perf_counter() - start
    if rc != 0 or not out.exists():
        tail = log.read_text().splitlines()[-25:]
        print(f"  {way:22s} FAILED (exit {rc}); log {log}:\n    " + "\n    ".join(tail), flush=True)
        return None
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    times = res["step_times"]
    print(f"  {way:22s} {res['tokens_per_s']:9,.0f} tok/s   step {statistics.median(times):.3f}s median "
          f"({min(times):.3f}-{max(times):.3f})   loss {res['final_loss']:.3f}   process {wall:5.1f}s", flush=True)
    return res


@dataclass
class Report:
    """What the table needs: tokens/s per way per repeat, the peaks and the model FLOPs."""

    by_repeat: dict[str, dict[int, float]]
    peaks: dict[str, float]  # TFLOP/s per dtype (one device)
    flops_per_token: float
    nproc: int = 1
    bf16_native: bool = True
    device: str = "cpu"

    def median(self, way: str) -> float | None:
        vals = list(self.by_repeat.get(way, {}).values())
        return statistics.median(vals) if vals else None

    def mfu(self, way: str) -> float | None:
        med, peak = self.median(way), self.peaks.get("bf16" if WAYS[way].bf16 else "fp32")
        return None if med is None or not peak else self.flops_per_token * med / self.nproc / (peak * 1e12)


def table(rep: Report, judge: bool = True) -> str:
    per_gpu = " per device" if rep.nproc > 1 else ""
    lines = [f"{'way':24s} {'tokens/s' + per_gpu:>18s} {'min-max':>19s} {'spread':>7s} {'MFU':>6s} {'runs':>5s}"]
    for way, per in rep.by_repeat.items():
        vals = list(per.values())
        if not vals:
            lines.append(f"{way:24s} {'failed or not run':>18s}")
            continue
        med = rep.median(way)
        mfu = rep.mfu(way)
        lines.append(f"{way:24s} {med / rep.nproc:18,.0f} {min(vals):9,.0f}-{max(vals):<9,.0f} "
                     f"{(max(vals) - min(vals)) / med:6.0%} {'' if mfu is None else f'{mfu:6.1%}':>6s} {len(vals):5d}")
    lines.append("")

    def best(names) -> str | None:
        present = [w for w in names if rep.median(w)]
        return max(present, key=rep.median) if present else None

    def ratio(a: str | None, b: str, goal: float | None) -> None:
        if a is None or not rep.median(a) or not rep.median(b):
            return
        r = rep.median(a) / rep.median(b)
        pairs = [rep.by_repeat[a][k] / rep.by_repeat[b][k] for k in rep.by_repeat[a] if k in rep.by_repeat[b]]
        spread = f"(per repeat {min(pairs):.3f}-{max(pairs):.3f})" if pairs else ""
        verdict = "" if goal is None or not judge else f"  goal ≥ {goal:.2f}×  " + ("PASS" if r >= goal else "MISS")
        lines.append(f"{a + ' / ' + b:40s} {r:5.3f}×  {spread}{verdict}")

    def mfu_goal(way: str | None, goal: float, dtype: str) -> None:
        if way is None or rep.mfu(way) is None or not judge:
            return
        m = rep.mfu(way)
        lines.append(f"{way + ' MFU':40s} {m:5.1%}   of the {dtype} peak {rep.peaks[dtype] * 1e3:,.1f} GFLOP/s"
                     f"  goal ≥ {goal:.0%}  " + ("PASS" if m >= goal else "MISS"))

    nxdt_fp32 = best([w for w, v in WAYS.items() if v.runner == "nxdt" and not v.bf16])
    nxdt_bf16 = best([w for w, v in WAYS.items() if v.runner == "nxdt" and v.bf16])
    if rep.device == "cuda":
        mfu_goal(nxdt_bf16, GOAL_GPU_MFU, "bf16")
        return "\n".join(lines)
    ratio("nxdt", "plain", GOAL_VS_PLAIN)
    for trainer_way in ("hf", "hf-compile"):
        ratio(nxdt_fp32, trainer_way, GOAL_FP32_VS_TRAINER)
    mfu_goal(nxdt_fp32, GOAL_FP32_MFU, "fp32")
    if rep.bf16_native:
        for trainer_way in ("hf-bf16", "hf-bf16-compile"):
            ratio(nxdt_bf16, trainer_way, GOAL_BF16_VS_TRAINER)
        mfu_goal(nxdt_bf16, GOAL_BF16_MFU, "bf16")
    elif rep.peaks.get("bf16"):
        lines.append(f"bf16 not judged: bf16 matmuls run {rep.peaks['fp32'] / rep.peaks['bf16']:.1f}x slower than "
                     f"fp32 on this CPU ({rep.peaks['bf16'] * 1e3:,.1f} vs {rep.peaks['fp32'] * 1e3:,.1f} GFLOP/s)")
    ratio("nxdt-compile", "plain-compile", None)
    ratio("plain", "hf", None)
    return "\n".join(lines)


def cuda_peaks() -> dict[str, float]:
    from nxdt.hardware import device_peak

    peak = device_peak("cuda", "bf16")
    return {"bf16": peak.tflops} if peak else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES), help="the model (see SHAPES)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--ranks", type=int, default=1, help="ranks per way (torchrun; cuda: one per GPU)")
    p.add_argument("--fsdp", action="store_true", help="FSDP over the ranks (default with --ranks > 1)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per run (after warm-up)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps run but not timed (compile, allocator)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    p.add_argument("--ways", default=None, help=f"comma list from {','.join(WAYS)}")
    p.add_argument("--quick", action="store_true", help="a short smoke run: few steps, 1 repeat")
    p.add_argument("--data-dir", default=None, help="reuse tokenized data here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (worker logs)")
    p.add_argument("--no-judge", action="store_true", help="print the table without PASS / MISS")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="CPU: seconds per dtype of the matmul peak probe")
    p.add_argument("--data-prefix", help="train on this Megatron .bin/.idx prefix (default: the bundled corpus)")
    p.add_argument("--in-process", action="store_true",
                   help="smoke tests only: run the ways in this process, one after another (not a measurement: "
                        "the measured runs start a fresh process per way); one rank")
    # worker mode (internal)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--exp-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.fsdp = args.fsdp or args.ranks > 1
    if args.worker:
        return worker(args)
    if args.ranks < 1 or args.probe_seconds <= 0 or args.repeats < 1:
        p.error("--ranks and --repeats must be >= 1, --probe-seconds > 0")
    if args.in_process and args.ranks > 1:
        p.error("--in-process runs one rank (--ranks 1)")
    big = SHAPES[args.shape].hidden >= 1024
    if args.steps is None:
        args.steps = 4 if args.quick else (6 if big else 20)
    if args.warmup_steps is None:
        args.warmup_steps = 2 if args.quick or big else 5
    if args.quick:
        args.repeats = 1
    return drive(args, p)


def drive(args, parser) -> int:
    import torch

    from nxdt.hardware import machine_line

    if args.device == "cpu":
        torch.set_num_threads(THREADS)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible here", file=sys.stderr)
        return 2
    ways = [w.strip() for w in (args.ways or (DEFAULT_CUDA_WAYS if args.device == "cuda" else DEFAULT_CPU_WAYS))
            .split(",") if w.strip()]
    bad = [w for w in ways if w not in WAYS]
    if bad:
        parser.error(f"unknown way(s) {bad}; choose from {','.join(WAYS)}")
    if args.ranks > 1 and any(WAYS[w].runner != "nxdt" for w in ways):
        parser.error("--ranks > 1 runs the nxdt ways only (FSDP over the ranks)")
    if args.device == "cuda":
        peaks, bf16_native = cuda_peaks(), True
        print(f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} visible, using {args.ranks}; "
              f"bf16 peak {peaks.get('bf16', float('nan')):,.0f} TFLOP/s (published, dense)", flush=True)
    else:
        peaks = measure_cpu_peaks(args.probe_seconds)
        bf16_native = peaks["bf16"] > peaks["fp32"]
        print(machine_line(peaks=peaks) + f" (measured now, {args.probe_seconds:g} s each)", flush=True)
        if not bf16_native and args.ways is None:
            ways = [w for w in ways if not WAYS[w].bf16]
            print(f"bf16 ways not run: bf16 matmuls are {peaks['fp32'] / peaks['bf16']:.1f}x slower than fp32 here "
                  f"(--ways runs them anyway)", flush=True)

    work = Path(tempfile.mkdtemp(prefix="nxdt-bench-"))
    if not args.data_prefix:  # else: Megatron .bin/.idx data given as is
        data_dir = Path(args.data_dir) if args.data_dir else work / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        args.data_prefix = prepare_data(data_dir)
    args.data_prefix = os.path.abspath(args.data_prefix)  # the workers run in their own directory
    args.exp_dir = str(work / "plan")
    from nxdt.config import ConfigError

    try:  # composes the config every way trains with: a bad --data-prefix is one line here
        flops = model_flops_per_token(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        return 2
    shape = SHAPES[args.shape]
    print(f"model ({args.shape}, {shape.about}): {shape.describe()}; {flops / 1e6:,.1f} MFLOP/token; "
          f"{args.steps} timed steps after {args.warmup_steps} warm-up, {args.repeats} repeat(s), {args.ranks} rank(s)"
          f"{' FSDP' if args.fsdp else ''}; torch {torch.__version__}", flush=True)
    results: dict[str, dict[int, float]] = {w: {} for w in ways}
    checksums: set[int] = set()
    try:
        for r in range(args.repeats):
            order = ways[r % len(ways):] + ways[: r % len(ways)]  # rotate so no way always runs first
            print(f"repeat {r + 1}/{args.repeats}: {' → '.join(order)}", flush=True)
            for way in order:
                res = run_way(way, args, work, f"r{r}")
                if res is not None:
                    results[way][r] = res["tokens_per_s"]
                    checksums.add(res["batch_checksum"])
    except KeyboardInterrupt:
        print("\ninterrupted: the table below covers the runs that finished", flush=True)
        args.keep = True
    if args.device == "cpu":  # the peak is the best rate seen: a probe slowed by other load counts less
        after = measure_cpu_peaks(args.probe_seconds)
        peaks = {k: max(peaks[k], after[k]) for k in peaks}
    print()
    if len(checksums) == 1:
        print(f"all ways trained on the same batches (token checksum {checksums.pop()})")
    elif len(checksums) > 1:
        print("WARNING: the ways did not train on the same batches")
    rep = Report(results, peaks, flops, nproc=args.ranks, bf16_native=bf16_native, device=args.device)
    print(table(rep, judge=not args.no_judge and args.shape != "tiny"))
    failed = [w for w, per in results.items() if len(per) < args.repeats]
    if failed:
        args.keep = True
        print(f"\nruns failed: {', '.join(failed)}", flush=True)
    if args.keep:
        print(f"\nworker logs: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
