#!/usr/bin/env python
"""SFT with packing and DPO: nxdt against TRL's `SFTTrainer` and `DPOTrainer` on the same tiny Llama (issue 40).

    .venv/bin/python benchmarks/peer_trl.py --job sft                 # 3 interleaved repeats (~70 s on 2 cores)
    .venv/bin/python benchmarks/peer_trl.py --job dpo                 # 3 interleaved repeats (~100 s on 2 cores)
    .venv/bin/python benchmarks/peer_trl.py --job dpo --quick --peers-json out.json   # smoke run, one repeat

It is not a test: the ratios are printed with PASS / MISS against the goals of issue 40, and
`--peers-json` writes them in the shared format of benchmarks/peers.py (no exit status from a MISS).

The same on both sides. The demo's Llama (`tiny_llama_cpu`: 4 layers, hidden 256, 8 / 4 heads, ffn
704, nxdt's bundled tokenizer, vocab 8,192; --quick: 2 layers, hidden 64), fp32, one process, 2
threads. TRL trains transformers' `LlamaForCausalLM` holding nxdt's initial weights (the native state
dict saved as a Hugging Face folder, which TRL loads by path as its users do: for DPO the reference
model is a second load of that folder). AdamW (betas 0.9 / 0.95, eps 1e-8, no weight decay), clipping
at 1.0, a constant lr of 1e-4 (nxdt: `model.optim.sched=null`), the rows in file order (TRL:
`train_sampling_strategy="sequential"`). TRL's own defaults that this fp32 comparison does not use
are switched off on its side: gradient checkpointing (on by default in TRL: it would slow TRL down)
and bf16. nxdt runs with its fused output layer + loss (`model.fusions.cross_entropy_chunk_size`
1024), as TRL runs with its own (`add_fused_lm_head`, always on in both trainers); nxdt's projects only
the tokens the loss scores, TRL's on CPU every position (it compacts only on CUDA / XPU with Triton).
Rows are made here, deterministically, from the bundled King James Bible. nxdt's sequences are
BOS + prompt + response + EOS; TRL's tokenizer call adds no BOS, so TRL's prompts start with the BOS
text and both sides see the same token ids.

  sft   rows {input: 4-24 words, output: 4-48 words}. nxdt: `model_alignment_strategy.sft.packing`
        (first fit in order into rows of seq 256, the tail padded; position ids restart per
        example). TRL: `SFTConfig(packing=True, padding_free=True)` (best-fit decreasing; each
        micro-batch is one flat sequence without padding, position ids restart per example),
        completion-only loss on both. 4 rows a micro-batch, 2 micro-batches a step. tokens/s counts
        the real tokens of the timed steps (each example's BOS + prompt + output + EOS; no padding),
        the same count on both sides. Goal: nxdt >= 1.2x TRL.
  dpo   rows from `nxdt preference-data`'s generator (prompt 24 words, chosen / rejected 16 words),
        beta 0.1, loss sigmoid, 16 pairs a step in micro-batches of 4, one epoch (the data is the
        steps' pairs exactly), nxdt's seq_length the longest pair's (nothing is cut). nxdt:
        `model_alignment_strategy.dpo` with precompute_ref_log_probs (its only mode without LoRA:
        the reference is scored once, before the first step). TRL: `DPOTrainer` as it comes (a
        reference model forwarded every step), and with `precompute_ref_log_probs=True`.
        Rows: training pairs/s (the timed steps; goals nxdt >= 1.5x TRL's default, >= 1.0x its
        precomputed mode), the reference pass's pairs/s against TRL's precompute (the same work on
        both sides), the loss of step 1 (ln 2 on both sides whatever the weights: the policy is its
        reference) and, the stronger check, the loss of step 2 (after one AdamW step from the same
        weights and pairs), each equal within 1e-5. The printed table also has one epoch's pairs/s,
        1 / (seconds per training pair + seconds per reference-pass pair).

Each side runs in a subprocess of its own (`--in-process`: in the driver, one after another; for smoke
tests only, not a measurement), in an order rotated every repeat; steps are timed from
one optimizer-step end to the next (Lightning's on_train_batch_end, the Trainer's on_step_end), the
first --warmup-steps dropped. Medians over repeats (the ratio: the median of the per-repeat ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reason: the sibling module below
from throughput_runs import REPO, in_process, patch, time_nxdt_steps  # noqa: E402

CONF_DIR = str(REPO / "conf")
JOBS = {"sft": ("nxdt", "trl"), "dpo": ("nxdt", "trl", "trl-precompute")}
GOALS = {"sft": 1.2, "dpo-default": 1.5, "dpo-precompute": 1.0, "loss": 1e-5}
THREADS = 2
CHUNK = 1024  # nxdt's fused output layer + loss (model.fusions.cross_entropy_chunk_size), tokens per chunk
LR, BETAS, CLIP, DPO_BETA = 1e-4, (0.9, 0.95), 1.0, 0.1
SFT = {"seq": 256, "micro": 4, "global": 8, "rows": 1024}
DPO = {"micro": 4, "global": 16, "prompt_words": 24, "response_words": 16}
QUICK_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
               "model.num_kv_heads=2"]


# ------------------------------------------------------------------------------------ rows (driver)
def sft_rows(n: int, seed: int = 1234) -> list[dict[str, str]]:
    """`n` {input, output} rows of varied length, deterministic: consecutive words of a chapter."""
    from nxdt.data.assets import bundled_corpus_path
    from nxdt.tools.preference_data import read_chapters

    chapters = [words for _, words in read_chapters(bundled_corpus_path()) if len(words) >= 80]
    rng, out = random.Random(seed), []
    while len(out) < n:
        words = rng.choice(chapters)
        k_in, k_out = rng.randint(4, 24), rng.randint(4, 48)
        at = rng.randrange(len(words) - k_in - k_out)
        out.append({"input": " ".join(words[at:at + k_in]), "output": " " + " ".join(words[at + k_in:at + k_in + k_out])})
    return out


def dpo_rows(n: int) -> list[dict[str, str]]:
    from nxdt.data.assets import bundled_corpus_path
    from nxdt.tools.preference_data import make_preference_rows, read_chapters

    return make_preference_rows(read_chapters(bundled_corpus_path()), n, DPO["prompt_words"], DPO["response_words"])


def write_rows(job: str, steps: int, root: Path) -> tuple[Path, int]:
    """The job's rows as jsonl under `root`, and the sequence length nxdt runs at."""
    from nxdt.data.tokenizers import build_tokenizer

    path = root / f"{job}.jsonl"
    if job == "sft":
        rows, seq = sft_rows(SFT["rows"]), SFT["seq"]
    else:  # one epoch: the steps' pairs exactly, so the reference pass scores what training uses
        rows = dpo_rows(steps * DPO["global"])
        tok = build_tokenizer(None)
        # the longest BOS + prompt + response + EOS, less one (position t predicts t+1): nothing is cut
        seq = max(len(tok(r["prompt"] + r[k], add_special_tokens=False)["input_ids"]) + 1
                  for r in rows for k in ("chosen", "rejected"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, seq


# ------------------------------------------------------------------------------------ worker: shared
def nxdt_config(args):
    from nxdt.spec import load_config  # after main put src/ on the path

    micro, glob = (SFT["micro"], SFT["global"]) if args.job == "sft" else (DPO["micro"], DPO["global"])
    common = ["trainer.devices=1", f"trainer.max_steps={args.warmup_steps + args.steps}", "trainer.limit_val_batches=0",
              "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", f"trainer.gradient_clip_val={CLIP}",
              f"data.micro_batch_size={micro}", f"data.global_batch_size={glob}", "data.num_workers=0",
              "data.data_prefix=null", f"data.train_dir={args.rows}", "data.val_dir=null", "data.dev_choose_samples=null",
              f"data.seq_length={args.seq}", f"model.encoder_seq_length={args.seq}", f"model.optim.lr={LR}",
              f"model.optim.betas=[{BETAS[0]},{BETAS[1]}]", "model.optim.weight_decay=0.0",
              "model.optim.sched=null", f"model.fusions.cross_entropy_chunk_size={CHUNK}",
              f"exp_manager.exp_dir={args.exp_dir}", "exp_manager.create_tensorboard_logger=false",
              "precision.type=fp32", *(QUICK_MODEL if args.quick else []), *args.nxdt_overrides.split()]
    if args.job == "sft":
        argv = ["--config-name", "tiny_llama_cpu", *common, "+model_alignment_strategy.sft.packing=true"]
    else:
        d = "model_alignment_strategy.dpo"
        argv = ["--config-name", "tiny_llama_dpo_cpu", *common, f"{d}.kl_beta={DPO_BETA}", f"{d}.loss_type=sigmoid",
                f"{d}.max_dpo_prompt_length=null", f"{d}.precompute_ref_log_probs=true"]
    return load_config(argv, world_size=1, default_config_dir=CONF_DIR, check_paths=False, quiet=True)


class Record:
    """What a worker measures: optimizer-step end stamps, per-step real tokens (SFT), per-step losses,
    the reference pass's seconds (DPO with precompute)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []  # SFT: real tokens per consumed item (nxdt) or per micro-batch (TRL)
        self.losses: list[float] = []  # per micro-batch, in order
        self.reference_s = 0.0

    def timed_reference(self, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            self.reference_s += time.perf_counter() - start
            return out
        return wrapper


def hf_model_folder(cfg, path: Path):
    """nxdt's initial weights (seeded as nxdt's run seeds them) as a transformers Llama folder; the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nxdt.data.tokenizers import build_tokenizer
    from nxdt.models import build_model

    tok = build_tokenizer(None)
    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab_size=len(tok))
    d = {k: v for k, v in native.args.to_hf_config_dict().items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**d, attn_implementation="sdpa", bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.load_state_dict(native.state_dict(), strict=True)
    model.save_pretrained(path)
    return tok


def trl_common(args, micro: int, glob: int) -> dict:
    return dict(output_dir=str(Path(args.exp_dir) / "trl"), per_device_train_batch_size=micro,
                gradient_accumulation_steps=glob // micro, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=CLIP, max_steps=args.warmup_steps + args.steps,
                lr_scheduler_type="constant", warmup_steps=0, train_sampling_strategy="sequential", logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=True, seed=1234, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
                gradient_checkpointing=False, model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"})


def step_callback(rec: Record):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            rec.stamps.append(time.perf_counter())

    return StepTimer()


def run_nxdt(cfg, rec: Record) -> None:
    import nxdt.training.trainer as run

    time_nxdt_steps(rec.stamps)
    run.train(cfg)


# ------------------------------------------------------------------------------------ worker: SFT
def worker_nxdt_sft(args, rec: Record) -> None:
    import nxdt.data.sft as sft
    import nxdt.training.step as step

    get = sft.SFTRows.__getitem__

    def counted(self, idx):  # the real tokens of the row's examples (each whole: BOS + prompt + output + EOS)
        rec.tokens.append(sum(min(len(self.examples[e][0]), self.seq_length + 1) for e in self.rows[int(idx)]))
        return get(self, idx)

    patch(sft.SFTRows, "__getitem__", counted)
    micro_loss = step.microbatch_loss

    def recorded(*a, **k):
        loss = micro_loss(*a, **k)
        rec.losses.append(float(loss.detach()))
        return loss

    patch(step, "microbatch_loss", recorded)
    run_nxdt(nxdt_config(args), rec)


def worker_trl_sft(args, rec: Record) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = nxdt_config(args)
    folder = Path(args.exp_dir) / "hf"
    tok = hf_model_folder(cfg, folder)
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": tok.bos_token + r["input"], "completion": r["output"]} for r in rows])
    targs = SFTConfig(**trl_common(args, SFT["micro"], SFT["global"]), max_length=args.seq, packing=True,
                      padding_free=True, completion_only_loss=True)
    trainer = SFTTrainer(model=str(folder), args=targs, train_dataset=data, processing_class=tok,
                         callbacks=[step_callback(rec)])
    compute_loss = trainer.compute_loss

    def counted(model, inputs, *a, **k):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        rec.tokens.append(int(mask.sum()) if mask is not None else ids.numel())  # padding-free: no padding at all
        out = compute_loss(model, inputs, *a, **k)
        rec.losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
        return out

    trainer.compute_loss = counted
    trainer.train()


# ------------------------------------------------------------------------------------ worker: DPO
def worker_nxdt_dpo(args, rec: Record) -> None:
    import nxdt.training.preference as pref

    patch(pref, "compute_reference_logps", rec.timed_reference(pref.compute_reference_logps))
    micro_loss = pref.preference_microbatch_loss

    def recorded(*a, **k):
        loss, metrics = micro_loss(*a, **k)
        rec.losses.append(float(loss.detach()))
        return loss, metrics

    patch(pref, "preference_microbatch_loss", recorded)
    run_nxdt(nxdt_config(args), rec)


def worker_trl_dpo(args, rec: Record, precompute: bool) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    cfg = nxdt_config(args)
    folder = Path(args.exp_dir) / "hf"
    tok = hf_model_folder(cfg, folder)
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines()]
    data = Dataset.from_list([{**r, "prompt": tok.bos_token + r["prompt"]} for r in rows])
    # nxdt's seq_length counts positions (BOS + prompt + response + EOS, less one); TRL's max_length counts tokens
    targs = DPOConfig(**trl_common(args, DPO["micro"], DPO["global"]), beta=DPO_BETA, loss_type=["sigmoid"],
                      max_length=args.seq + 1, precompute_ref_log_probs=precompute)
    patch(DPOTrainer, "_precompute_ref_logps", rec.timed_reference(DPOTrainer._precompute_ref_logps))
    trainer = DPOTrainer(model=str(folder), args=targs, train_dataset=data, processing_class=tok,
                         callbacks=[step_callback(rec)])
    compute = trainer._compute_loss

    def recorded(model, inputs, return_outputs):
        out = compute(model, inputs, return_outputs)
        rec.losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
        return out

    trainer._compute_loss = recorded
    trainer.train()


def worker(args) -> int:
    import torch

    torch.set_num_threads(THREADS)
    rec = Record()
    if args.profile:  # the op table of the whole run (startup included) for `--profile DIR`
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_worker(args, rec)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        Path(args.profile, f"{args.job}-{args.worker}.txt").write_text(table)
    else:
        run_worker(args, rec)
    Path(args.result).write_text(json.dumps(vars(rec)))
    return 0


def run_worker(args, rec: Record) -> None:
    if args.job == "sft":
        (worker_nxdt_sft if args.worker == "nxdt" else worker_trl_sft)(args, rec)
    elif args.worker == "nxdt":
        worker_nxdt_dpo(args, rec)
    else:
        worker_trl_dpo(args, rec, precompute=args.worker == "trl-precompute")


# ------------------------------------------------------------------------------------ driver
class PeerFailed(RuntimeError):
    """A TRL way exited with an error (its last line in the message)."""


def run_here(args, way: str, root: Path, rows: Path, seq: int, result: Path) -> None:
    """--in-process (smoke tests): the worker in this process, what it changed put back afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    with in_process():
        os.environ.update(TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
        try:
            worker(argparse.Namespace(**{**vars(args), "worker": way, "result": str(result), "rows": str(rows),
                                         "seq": seq, "exp_dir": str(root / way)}))
        except Exception as err:  # as a failed subprocess is reported
            if way == "nxdt":
                raise
            raise PeerFailed(f"TRL ({way}) failed here: {type(err).__name__}: {err}") from err


def run_once(args, way: str, root: Path, rows: Path, seq: int) -> dict:
    result = root / f"{way}.json"
    if args.in_process:
        run_here(args, way, root, rows, seq, result)
        return summarize(args, json.loads(result.read_text()), way)
    cmd = [sys.executable, __file__, "--job", args.job, "--worker", way, "--result", str(result), "--rows", str(rows),
           "--seq", str(seq), "--exp-dir", str(root / way), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--nxdt-overrides", args.nxdt_overrides,
           *(["--profile", args.profile] if args.profile else []),
           *(["--quick"] if args.quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        if way == "nxdt":
            raise RuntimeError(f"{way}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerFailed(f"TRL ({way}) failed here: exit {proc.returncode}: {last}")
    return summarize(args, json.loads(result.read_text()), way)


def summarize(args, raw: dict, way: str) -> dict:
    """Rates of one run: the timed steps are those after the warm-up ones (step k lasts stamps[k] - stamps[k-1])."""
    stamps, first = raw["stamps"], max(args.warmup_steps, 1)
    seconds = stamps[-1] - stamps[first - 1]
    timed = len(stamps) - first
    ga = (SFT["global"] // SFT["micro"]) if args.job == "sft" else DPO["global"] // DPO["micro"]
    losses = raw["losses"]
    # TRL's SFT divides each micro-batch's token sum by the step's token count: its step loss is their sum
    reduce = sum if (args.job, way) == ("sft", "trl") else statistics.fmean
    step_loss = [reduce(losses[k * ga:(k + 1) * ga]) for k in range(min(2, len(losses) // ga))]
    out = {"seconds": seconds, "steps": len(stamps), "loss1": step_loss[0] if step_loss else math.nan,
           "loss2": step_loss[1] if len(step_loss) > 1 else math.nan}
    if args.job == "sft":
        per_step = (SFT["global"] if way == "nxdt" else ga)  # nxdt: items (rows) per step; TRL: micro-batches
        tokens = raw["tokens"][first * per_step:len(stamps) * per_step]
        out["tok_s"] = sum(tokens) / seconds
        return out
    pairs = timed * DPO["global"]
    out["train_pairs_s"] = pairs / seconds
    out["reference_s"] = raw["reference_s"]
    ref_rate = len(stamps) * DPO["global"] / raw["reference_s"] if raw["reference_s"] else math.inf
    out["ref_pairs_s"] = ref_rate
    out["pairs_s"] = 1.0 / (1.0 / out["train_pairs_s"] + 1.0 / ref_rate)
    return out


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _span(values: list[float]) -> str:
    m = _med(values)
    return f"{m:,.1f}" + (f" ({min(values):,.1f}-{max(values):,.1f})" if len(values) > 1 else "")


def _row(what: str, nxdt: float, peer: float, ratio: float, goal: str, note: str) -> dict:
    op, bound = goal.split()
    ok = math.isfinite(ratio) and (ratio >= float(bound) if op == ">=" else ratio <= float(bound))
    return {"what": what, "nxdt": nxdt, "peer": peer, "ratio": ratio, "goal": goal, "pass": bool(ok), "note": note}


def rows_of(job: str, results: dict[str, list[dict]], repeats: int) -> list[dict]:
    """The JSON rows of the ways that ran (a row needs nxdt and its TRL way)."""
    note = f"median of {repeats} interleaved repeat(s)"
    ratios = lambda key, way: [a[key] / b[key] for a, b in zip(results["nxdt"], results[way])]  # noqa: E731
    med = lambda key, way: _med([r[key] for r in results[way]])  # noqa: E731
    if "nxdt" not in results:
        return []
    if job == "sft":
        return [_row("tokens/s (packed, real tokens)", med("tok_s", "nxdt"), med("tok_s", "trl"),
                     _med(ratios("tok_s", "trl")), f">= {GOALS['sft']}", note + "; TRL packing=True (bfd, padding-free)")
                ] if "trl" in results else []
    out = []
    for way, goal, label in (("trl", GOALS["dpo-default"], "default (reference model forwarded every step)"),
                             ("trl-precompute", GOALS["dpo-precompute"], "precompute_ref_log_probs=True")):
        if way in results:
            out.append(_row(f"training pairs/s vs TRL {label}", med("train_pairs_s", "nxdt"),
                            med("train_pairs_s", way), _med(ratios("train_pairs_s", way)), f">= {goal}",
                            note + "; timed steps (the one-time reference pass apart)"))
    if "trl-precompute" in results:
        out.append(_row("reference pass pairs/s vs TRL precompute_ref_log_probs=True", med("ref_pairs_s", "nxdt"),
                        med("ref_pairs_s", "trl-precompute"), _med(ratios("ref_pairs_s", "trl-precompute")),
                        f">= {GOALS['dpo-precompute']}", note + "; once per run, before the first step, the epoch's pairs"))
    peer = "trl" if "trl" in results else "trl-precompute" if "trl-precompute" in results else None
    for key, what in (("loss1", "loss step 1 |diff|"), ("loss2", "loss step 2 |diff|")) if peer else ():
        n, t = results["nxdt"][0][key], results[peer][0][key]
        out.append(_row(what, n, t, abs(n - t), f"<= {GOALS['loss']:g}", f"first repeat; vs TRL's {peer}"
                        + ("; after one AdamW step from the same weights and pairs" if key == "loss2" else "")))
    return out


def report(job: str, results: dict[str, list[dict]], rows: list[dict]) -> None:
    if job == "sft":
        print(f"\n{'way':<16}{'tokens/s':>26}{'step-1 loss':>14}  runs")
        for way, runs in results.items():
            print(f"{way:<16}{_span([r['tok_s'] for r in runs]):>26}{runs[0]['loss1']:>14.6f}  {len(runs)}")
    else:
        print(f"\n{'way':<16}{'pairs/s (epoch)':>24}{'train pairs/s':>24}{'reference pairs/s':>20}"
              f"{'loss 1':>11}{'loss 2':>11}  runs")
        for way, runs in results.items():
            ref = _med([r["ref_pairs_s"] for r in runs])
            print(f"{way:<16}{_span([r['pairs_s'] for r in runs]):>24}{_span([r['train_pairs_s'] for r in runs]):>24}"
                  f"{('-' if math.isinf(ref) else f'{ref:,.1f}'):>20}{runs[0]['loss1']:>11.6f}{runs[0]['loss2']:>11.6f}"
                  f"  {len(runs)}")
    for r in rows:
        print(f"{r['what']}: nxdt {r['nxdt']:.6g}, TRL {r['peer']:.6g}: {r['ratio']:.4g} (goal {r['goal']}) "
              f"{'PASS' if r['pass'] else 'MISS'}")


def peer_name(job: str) -> str:
    import trl

    if job == "sft":
        return f"TRL SFTTrainer {trl.__version__} (packing=True, bfd, padding-free)"
    return f"TRL DPOTrainer {trl.__version__} (default, and precompute_ref_log_probs=True)"


def write_json(path: str | None, job: str, rows: list[dict], skipped: str | None) -> None:
    if path:
        body = {"job": "sft-packing" if job == "sft" else "dpo", "peer": peer_name(job) if not skipped else "TRL",
                "rows": rows, "skipped": skipped}
        Path(path).write_text(json.dumps(body, indent=1))


def measure(args, ways: list[str], repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix=f"nxdt-peer-trl-{args.job}-") as tmp:
        rows, seq = write_rows(args.job, args.warmup_steps + args.steps, Path(tmp))
        for rep in range(repeats):
            for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                r = run_once(args, way, Path(tmp) / f"r{rep}", rows, seq)
                results[way].append(r)
                rate = f"{r['tok_s']:,.0f} tokens/s" if args.job == "sft" else f"{r['pairs_s']:,.1f} pairs/s"
                print(f"repeat {rep + 1}/{repeats} {way}: {rate}, step-1 loss {r['loss1']:.6f}", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default sft 6, dpo 5; --quick 1)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps (default 2; --quick 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: a 2-layer model, 1 timed step, 1 repeat")
    p.add_argument("--peers-json", help="write the rows here (benchmarks/peers.py's format)")
    p.add_argument("--ways", help=f"a subset, comma-separated (sft: {','.join(JOBS['sft'])}; dpo: {','.join(JOBS['dpo'])})")
    p.add_argument("--profile", help="write each run's torch.profiler op table (whole run) into this folder")
    p.add_argument("--nxdt-overrides", default="", help="extra nxdt config overrides, space-separated (experiments)")
    p.add_argument("--in-process", action="store_true", help="smoke tests only: the ways in this process, one after "
                   "another (not a measurement: the measured runs start a fresh process per way)")
    for hidden in ("--worker", "--result", "--rows", "--seq", "--exp-dir"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.quick else 6 if args.job == "sft" else 5
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.quick else 2
    if args.worker:
        args.seq = int(args.seq)
        return worker(args)
    if args.repeats < 1 or args.steps < 1 or args.warmup_steps < 0:
        p.exit(2, "error: --repeats and --steps must be >= 1, --warmup-steps >= 0\n")
    ways = args.ways.split(",") if args.ways else list(JOBS[args.job])
    if "nxdt" not in ways or any(w not in JOBS[args.job] for w in ways):
        p.exit(2, f"error: --ways: nxdt and some of {', '.join(JOBS[args.job][1:])} for --job {args.job} "
                  f"(got {args.ways})\n")
    try:
        import torch
        import transformers
        import trl
    except ImportError as err:  # the peer is not installed: the runner shows the reason
        print(f"skipped: {err}")
        write_json(args.peers_json, args.job, [], f"TRL is not installed here: {err}")
        return 0
    from nxdt.hardware import machine_line

    torch.set_num_threads(THREADS)
    repeats = 1 if args.quick else args.repeats
    print(machine_line(), flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"python {platform.python_version()}")
    print(f"job {args.job}: model tiny_llama_cpu{' (quick: 2 layers, hidden 64)' if args.quick else ''}, fp32, "
          f"1 process, {THREADS} threads; {args.steps} timed steps after {args.warmup_steps}; {repeats} interleaved "
          f"repeat(s), medians")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}", flush=True)
    start = time.perf_counter()
    try:
        results = measure(args, ways, repeats)
    except PeerFailed as err:  # TRL could not run here: the shared format's "skipped", exit 0
        print(f"skipped: {err}")
        write_json(args.peers_json, args.job, [], str(err))
        return 0
    rows = rows_of(args.job, results, repeats)
    report(args.job, results, rows)
    write_json(args.peers_json, args.job, rows, None)
    print(f"({time.perf_counter() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
