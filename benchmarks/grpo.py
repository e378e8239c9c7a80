#!/usr/bin/env python
"""GRPO step rate and rollout speed: nxdt against TRL's `GRPOTrainer` on the same tiny model.

    .venv/bin/python benchmarks/grpo.py                  # the demo's Llama, 3 interleaved repeats (~3 min on 2 cores)
    .venv/bin/python benchmarks/grpo.py --quick          # smoke run: a 2-layer model, 1 repeat
    .venv/bin/python benchmarks/grpo.py --ways nxdt,nxdt-nocache,trl --repeats 5
    .venv/bin/python benchmarks/grpo.py --peers-json out.json   # issue 40's rows (nxdt, nxdt-compiled, trl), as JSON

It is not a test. Goal (issue 35): nxdt >= 2x TRL's steps/s on this CPU, judged on the median of the
per-repeat ratios and printed PASS / MISS (no exit status: a benchmark, not a check).

What runs (the same for every way). The demo's Llama (`tiny_llama_grpo_cpu`: 4 layers, hidden 256,
8 / 4 heads, ffn 704, vocab 8,192, fp32; --quick: 2 layers, hidden 64), nxdt's bundled tokenizer,
the shipped arithmetic prompts (`nxdt.data.prompts.arithmetic_rows`, plain text), 4 prompts x
num_generations 4 = 16 completions a step of up to --completion-length new tokens (temperature 1,
no top-k / top-p), one reward (`nxdt.rl.rewards.token_fraction`, TRL's calling convention, so the
same function serves both), beta 0 (no reference), loss_type dapo, num_iterations 1, micro-batches
of 4 completions (gradient accumulation 4), AdamW at lr 1e-4, clipping at 1.0, one process.
TRL's model is transformers' `LlamaForCausalLM` with nxdt's initial weights (the native state dict
loaded by name, as benchmarks/generate.py does), generating through `transformers.generate` (no vLLM,
TRL's default).

Ways, each run in its own subprocess (thread pools and allocator state do not leak between runs), in
an order rotated every repeat (`--in-process`: in the driver, one after another; for smoke tests only):
  nxdt          `nxdt.training.trainer.train` on `tiny_llama_grpo_cpu` (Lightning, the logs, everything)
  nxdt-nocache  the same with the generator's KV cache off (every decode step recomputes the sequence):
                what the preallocated cache gives
  nxdt-compiled the same with `model_alignment_strategy.grpo.compile_decode=true`: the rollouts' decode step
                torch.compile'd over a static KV cache; it compiles during the first (warm-up) step, whose
                time is dropped: the compile's seconds are printed apart ("first step s")
  trl           `trl.GRPOTrainer(model, reward_funcs=[token_fraction], args=GRPOConfig(...))`.train()

Measured: a step is the interval between consecutive optimizer-step ends (Lightning's
on_train_batch_end, the Trainer's on_step_end); the first --warmup-steps are dropped. steps/s =
timed steps / their time. Rollout tokens/s = completion tokens generated / the seconds inside the
generation call (nxdt: `nxdt.rl.rollout.rollout`'s sampling; TRL: `_generate_single_turn`, its
`transformers.generate`), over the timed steps. Medians over repeats, with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reason: the sibling module below
from throughput_runs import REPO, in_process, patch, time_nxdt_steps  # noqa: E402

CONF_DIR = str(REPO / "conf")
GOAL_VS_TRL = 2.0
WAYS = ("nxdt", "nxdt-compiled", "nxdt-nocache", "trl")
PEER_WAYS = "nxdt,nxdt-compiled,trl"  # --peers-json's default (--quick: nxdt,trl)
PROMPTS, GENERATIONS, MICRO = 4, 4, 4
QUICK_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
               "model.num_kv_heads=2"]


# ------------------------------------------------------------------------------------ worker
def nxdt_config(args):
    from nxdt.spec import load_config  # after main put src/ on the path

    g = "model_alignment_strategy.grpo"
    seq = 64 if args.completion_length < 48 else 16 + args.completion_length
    argv = ["--config-name", "tiny_llama_grpo_cpu", "trainer.devices=1", f"trainer.max_steps={args.warmup_steps + args.steps}",
            "trainer.enable_progress_bar=false", f"data.global_batch_size={PROMPTS * GENERATIONS}",
            f"data.micro_batch_size={MICRO}", "data.num_workers=0", f"data.seq_length={seq}",
            f"model.encoder_seq_length={seq}", "model.optim.sched.warmup_steps=0",
            f"{g}.reward_funcs=[nxdt.rl.rewards.token_fraction]", f"{g}.reward_weights=null",
            f"{g}.num_generations={GENERATIONS}", f"{g}.max_completion_length={args.completion_length}",
            f"{g}.temperature=1.0", f"{g}.top_k=0", f"{g}.top_p=1.0", f"{g}.beta=0.0", f"{g}.loss_type=dapo",
            f"{g}.num_iterations=1", f"{g}.log_completions_every_n_steps=0", f"exp_manager.exp_dir={args.exp_dir}",
            "precision.type=fp32", *(QUICK_MODEL if args.quick else []),
            *([f"{g}.compile_decode=true"] if args.worker == "nxdt-compiled" else [])]
    return load_config(argv, world_size=1, default_config_dir=CONF_DIR, check_paths=False, quiet=True)


class Timings:
    def __init__(self) -> None:
        self.steps: list[float] = []  # perf_counter at each optimizer-step end
        self.rollouts: list[tuple[int, float, int]] = []  # (steps done before it, seconds, tokens)
        self.start = 0.0  # perf_counter when the first rollout began (the first step's start)

    def timed(self, fn, count_tokens):
        def wrapper(*a, **k):
            start = time.perf_counter()
            self.start = self.start or start
            out = fn(*a, **k)
            self.rollouts.append((len(self.steps), time.perf_counter() - start, count_tokens(out)))
            return out
        return wrapper


def worker_nxdt(args, t: Timings, cache: bool) -> None:
    # each way's libraries load in its own subprocess only (the driver imports neither trainer)
    import functools

    import nxdt.rl.module as rl_module
    import nxdt.rl.rollout as rl_rollout
    import nxdt.training.trainer as run

    cfg = nxdt_config(args)

    time_nxdt_steps(t.steps)
    # the sampling call alone (scoring and the training rows excluded), as TRL's is timed
    patch(rl_rollout, "generate", t.timed(functools.partial(rl_rollout.generate, use_cache=cache),
                                          lambda out: sum(len(c) for c in out)))
    assert rl_module.rollout is rl_rollout.rollout
    run.train(cfg)


def worker_trl(args, t: Timings) -> None:
    # each way's libraries load in its own subprocess only (TRL's import alone takes seconds)
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nxdt.data.prompts import arithmetic_rows
    from nxdt.data.tokenizers import build_tokenizer
    from nxdt.models import build_model
    from nxdt.rl.rewards import token_fraction

    cfg = nxdt_config(args)
    tok = build_tokenizer(None)
    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab_size=len(tok))
    d = {k: v for k, v in native.args.to_hf_config_dict().items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**d, attn_implementation="sdpa"))
    model.load_state_dict(native.state_dict(), strict=True)
    total = args.warmup_steps + args.steps
    data = Dataset.from_list([{"prompt": r["prompt"]} for r in arithmetic_rows()])
    targs = GRPOConfig(
        output_dir=args.exp_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * GENERATIONS // MICRO,
        num_generations=GENERATIONS, max_completion_length=args.completion_length, temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, loss_type="dapo", num_iterations=1, learning_rate=1e-4, max_grad_norm=1.0, max_steps=total,
        lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=cfg.seed,
        dataloader_num_workers=0, disable_tqdm=True, bf16=False)

    class StepTimer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            t.steps.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=[token_fraction], args=targs, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer._generate_single_turn = t.timed(trainer._generate_single_turn, lambda out: sum(len(c) for c in out[0]))
    trainer.train()


def worker(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    t = Timings()
    if args.worker == "trl":
        worker_trl(args, t)
    else:
        worker_nxdt(args, t, cache=args.worker != "nxdt-nocache")
    Path(args.result).write_text(json.dumps({"steps": t.steps, "rollouts": t.rollouts, "start": t.start}))
    return 0


# ------------------------------------------------------------------------------------ driver
def run_here(args, way: str, root: Path, result: Path) -> None:
    """--in-process (smoke tests): the worker in this process, what it changed put back afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    with in_process():
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            worker(argparse.Namespace(**{**vars(args), "worker": way, "result": str(result),
                                         "exp_dir": str(root / way)}))
        except Exception as err:  # as a failed subprocess is reported
            raise SystemExit(f"{way}: {type(err).__name__}: {err}") from err


def run_once(args, way: str, root: Path) -> dict:
    result = root / f"{way}.json"
    if args.in_process:
        run_here(args, way, root, result)
        return timings(args, json.loads(result.read_text()))
    cmd = [sys.executable, __file__, "--worker", way, "--result", str(result), "--exp-dir", str(root / way),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--threads", str(args.threads),
           "--completion-length", str(args.completion_length), *(["--quick"] if args.quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{way}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return timings(args, json.loads(result.read_text()))


def timings(args, raw: dict) -> dict:
    """A run's rates from its worker's stamps."""
    # step k (k >= 1) lasted stamps[k] - stamps[k - 1]; the first has no start stamp; warm-up steps dropped
    stamps, first = raw["steps"], max(args.warmup_steps, 1)
    timed = [stamps[k] - stamps[k - 1] for k in range(first, len(stamps))]
    rolls = [(s, n) for before, s, n in raw["rollouts"] if before >= first]  # sampled for step `before`
    seconds, tokens = sum(s for s, _ in rolls), sum(n for _, n in rolls)
    return {"steps_per_s": len(timed) / sum(timed), "rollout_tok_s": tokens / seconds if seconds else 0.0,
            "first_step_s": stamps[0] - raw["start"] if stamps else 0.0,
            "rollout_share": seconds / sum(timed) * len(timed) / max(len(rolls), 1) if rolls else 0.0,
            "tokens_per_step": tokens / max(len(rolls), 1)}


def _med(values: list[float]) -> str:
    m = statistics.median(values)
    return f"{m:,.2f}" + (f" ({min(values):,.2f}-{max(values):,.2f})" if len(values) > 1 else "")


def report(results: dict[str, list[dict]], repeats: int) -> list[dict]:
    """Print the table and the goal; returns the --peers-json rows."""
    print(f"\n{'way':<14}{'steps/s':>22}  {'rollout tokens/s':>28}{'tokens/step':>13}{'rollout share':>15}"
          f"{'first step s':>14}  runs")
    for way, runs in results.items():
        print(f"{way:<14}{_med([r['steps_per_s'] for r in runs]):>22}  {_med([r['rollout_tok_s'] for r in runs]):>28}"
              f"{statistics.median(r['tokens_per_step'] for r in runs):>13,.0f}"
              f"{statistics.median(r['rollout_share'] for r in runs):>14.0%}"
              f"{statistics.median(r['first_step_s'] for r in runs):>14.1f}  {len(runs)}")
    if "trl" not in results or "nxdt" not in results:
        return []
    rows = []
    for way in [w for w in results if w != "trl"]:
        steps = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results[way], results["trl"])]
        rolls = [a["rollout_tok_s"] / b["rollout_tok_s"] for a, b in zip(results[way], results["trl"])]
        print(f"{way} / trl: steps/s {_med(steps)}x, rollout tokens/s {_med(rolls)}x")
        first = statistics.median(r["first_step_s"] for r in results[way])
        note = (f"median of {len(steps)} interleaved repeats (per-repeat {min(steps):.2f}-{max(steps):.2f}); "
                f"first (warm-up) step {first:.1f} s, not timed"
                + (": it compiles the decode step" if way == "nxdt-compiled" else ""))
        for what, per, key, goal in (("steps/s", steps, "steps_per_s", GOAL_VS_TRL),
                                     ("rollout tokens/s", rolls, "rollout_tok_s", 1.0)):
            ratio = statistics.median(per)
            rows.append({"what": f"{what}, {way}" + ("" if goal == GOAL_VS_TRL else " (no goal of its own: > 1 = faster)"),
                         "nxdt": statistics.median(r[key] for r in results[way]),
                         "peer": statistics.median(r[key] for r in results["trl"]), "ratio": ratio,
                         "goal": f">= {goal:g}", "pass": ratio >= goal, "note": note})
    ratio = statistics.median(a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results["nxdt"], results["trl"]))
    print(f"goal: nxdt >= {GOAL_VS_TRL:g}x TRL's steps/s: {ratio:.2f}x {'PASS' if ratio >= GOAL_VS_TRL else 'MISS'}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", default=None, help=f"comma list from {', '.join(WAYS)} (default nxdt,nxdt-nocache,trl; "
                                                f"with --peers-json {PEER_WAYS}, --quick nxdt,trl)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--completion-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: a 2-layer model, 1 repeat")
    p.add_argument("--peers-json", default=None, metavar="PATH",
                   help="also write the rows (benchmarks/peers.py's schema) to PATH")
    p.add_argument("--in-process", action="store_true", help="smoke tests only: the ways in this process, one after "
                   "another (not a measurement: the measured runs start a fresh process per way)")
    p.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--exp-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.ways is None:
        args.ways = ("nxdt,trl" if args.quick else PEER_WAYS) if args.peers_json else "nxdt,nxdt-nocache,trl"
        if args.peers_json and args.quick:
            args.steps = min(args.steps, 2)
    ways = [w for w in args.ways.split(",") if w]
    if not ways or any(w not in WAYS for w in ways):
        p.exit(2, f"error: --ways: from {', '.join(WAYS)} (got {args.ways})\n")
    if args.repeats < 1 or args.steps < 1 or args.warmup_steps < 0 or args.completion_length < 1:
        p.exit(2, "error: --repeats, --steps and --completion-length must be >= 1, --warmup-steps >= 0\n")
    repeats = 1 if args.quick else args.repeats
    import torch
    import transformers
    import trl

    from nxdt.hardware import machine_line

    torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"python {platform.python_version()}")
    print(f"model: tiny_llama_grpo_cpu{' (quick: 2 layers, hidden 64)' if args.quick else ''}, fp32, 1 process; "
          f"{PROMPTS} prompts x {GENERATIONS} = {PROMPTS * GENERATIONS} completions/step of up to "
          f"{args.completion_length} tokens; micro-batch {MICRO}; {args.steps} timed steps after {args.warmup_steps}; "
          f"{repeats} interleaved repeat(s), medians")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}", flush=True)
    results: dict[str, list[dict]] = {w: [] for w in ways}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nxdt-grpo-bench-") as tmp:
        for rep in range(repeats):
            order = ways[rep % len(ways):] + ways[:rep % len(ways)]
            for way in order:
                r = run_once(args, way, Path(tmp) / f"r{rep}")
                results[way].append(r)
                print(f"repeat {rep + 1}/{repeats} {way}: {r['steps_per_s']:.3f} steps/s, "
                      f"{r['rollout_tok_s']:,.0f} rollout tokens/s", flush=True)
    rows = report(results, repeats)
    print(f"({time.perf_counter() - start:.0f} s in all)")
    if args.peers_json:
        doc = {"job": "grpo", "peer": f"TRL {trl.__version__} GRPOTrainer (generation through transformers.generate, "
                                      "no vLLM)", "machine": machine_line(),
               "shape": f"tiny_llama_grpo_cpu{' (quick)' if args.quick else ''}, {PROMPTS}x{GENERATIONS} completions of "
                        f"up to {args.completion_length} tokens, {args.steps} timed steps", "rows": rows, "skipped": None}
        Path(args.peers_json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
