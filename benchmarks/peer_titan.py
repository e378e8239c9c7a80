#!/usr/bin/env python
"""Pre-training, nxdt against torchtitan 0.3.0 (issue 40): tokens/s in fp32 and bf16 autocast, and
the loss of the first 10 steps from the same weights on the same batches.

    .venv/bin/python benchmarks/peer_titan.py                  # both shapes, 3 interleaved repeats
    .venv/bin/python benchmarks/peer_titan.py --quick          # the smoke shape, 1 repeat
    .venv/bin/python benchmarks/peer_titan.py --peers-json OUT # the table for benchmarks/peers.py

torchtitan runs in its own venv, `.venv-peers-titan` (`make bench-peers`: torch 2.13.0, torchtitan
0.3.0 with --no-deps, and what its model imports). Its packaged trainer (`torchtitan.train`) does not
import there (it needs torchdata, HF datasets and a tokenizer asset the wheel does not ship), so the
torchtitan side is its model + optimizer loop, as its Trainer.train_step runs it on one device:
its `llama3` model (`Llama3Model` built from `_build_llama3_layers`, fused QKV, ComplexRoPE), its
SDPA inner attention (0.3.0's `get_attention_config` refuses "sdpa" for language models, so the
`ScaledDotProductAttention` module is set in the layer configs, as its graph_trainer tests do), its
`ChunkedLossWrapper(CrossEntropyLoss)` with the lm_head skipped in the model (the debugmodel's loss),
`default_adamw` (one catch-all AdamW group), its LR-scheduler container (constant lr here), its
`clip_grad_norm_` (foreach, max norm 1.0), zero_grad, and `loss.item()` each step (log_freq 1).
bf16 autocast: 0.3.0 documents torch.autocast for single-device mixed precision but applies none;
here its forward and loss run under torch.autocast(cpu, bf16), nxdt's under precision.type=autocast.

nxdt's side is the product: `nxdt.training.trainer.train(cfg)` (Lightning, exp_manager, clipping,
logging) on the shipped tiny_llama_cpu config with the shape's overrides. Both sides: nxdt's initial
weights (seed 1234; torchtitan loads them through its own Llama3StateDictAdapter.from_hf), nxdt's
first batches (the bundled corpus through MegatronDataModule), AdamW lr 8e-4 betas (0.9, 0.95) eps 1e-8
weight decay 0.1 on every parameter (torchtitan's default_adamw; nxdt: do_layer_norm_weight_decay),
constant lr, clipping at 1.0. Shapes: torchtitan's `debugmodel` (dim 256, 6 layers, 16 heads, ffn 768,
rope theta 500,000 with Llama-3 scaling; its seq_len 2,048 at batch 1; the bundled tokenizer's 8,192
vocab instead of its 2,048-token test tokenizer) and the reference shape of benchmarks/throughput.py.
Each run is its own subprocess with 2 threads; nxdt and torchtitan alternate, the order rotating per
repeat; medians. Goals: nxdt >= 1.0x torchtitan's tokens/s, losses equal within 1e-5 in fp32.
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
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# torchtitan's venv (make bench-peers); NXDT_TITAN_VENV points elsewhere
TITAN_PYTHON = Path(os.environ.get("NXDT_TITAN_VENV", REPO / ".venv-peers-titan")) / "bin" / "python"
THREADS = 2
LOSS_STEPS = 10
GOAL_SPEED = 1.0
GOAL_LOSS = 1e-5
OPTIM = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # torchtitan's debugmodel
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def shapes():
    """name -> (throughput_runs.Shape, Llama-3 rope scaling?)."""
    sys.path.insert(0, str(HERE))
    from throughput_runs import SHAPES

    debug = SHAPES["small"].__class__(hidden=256, layers=6, heads=16, kv_heads=16, ffn=768, seq=2048, micro_batch=1,
                                      rope_theta=500000.0, about="torchtitan's llama3 debugmodel")
    return {"debugmodel": (debug, True), "reference": (SHAPES["small"], False),
            "tiny": (replace(SHAPES["tiny"], seq=128), False)}


def nxdt_argv(shape, scaled: bool, data_prefix: str, exp_dir: str, steps: int, bf16: bool) -> list[str]:
    from throughput_runs import common_overrides

    argv = common_overrides(shape, data_prefix, exp_dir, steps, "cpu", 1, False)
    argv += [f"model.optim.lr={OPTIM['lr']}", f"model.optim.betas=[{OPTIM['betas'][0]},{OPTIM['betas'][1]}]",
             f"model.optim.eps={OPTIM['eps']}", f"model.optim.weight_decay={OPTIM['weight_decay']}",
             "~model.optim.sched", "model.do_layer_norm_weight_decay=true"]
    if scaled:
        argv.append("model.rope_scaling={" + ",".join(f"{k}:{v}" for k, v in LLAMA3_SCALING.items()) + "}")
    if bf16:
        argv.append("precision.type=autocast")
    return argv


# ------------------------------------------------------------------------------------ workers


def worker_nxdt(spec: dict) -> dict:
    """nxdt's trainer on the spec's config; the end time and the loss of every optimizer step."""
    import lightning.pytorch as pl

    import nxdt.training.trainer as run
    from nxdt.spec import load_config

    cfg = load_config(spec["argv"], world_size=1, default_config_dir=REPO / "conf", check_paths=True, quiet=True)
    stamps, losses = [], []

    class StepTimer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.append(time.perf_counter())
            losses.append(outputs["loss"] if isinstance(outputs, dict) else outputs)

    build_trainer = run.build_trainer
    run.build_trainer = lambda cfg, layout, loggers, callbacks: build_trainer(cfg, layout, loggers,
                                                                             [*callbacks, StepTimer()])
    run.train(cfg)
    return {"stamps": stamps, "losses": [float(x) for x in losses]}


def titan_model(spec: dict):
    """torchtitan's Llama3Model for the spec's shape, SDPA inner attention, on the CPU, nxdt's weights."""
    import torch
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    s, dim, vocab, eps = spec["shape"], spec["shape"]["hidden"], spec["vocab"], spec["eps"]
    rope = ComplexRoPE.Config(dim=dim // s["heads"], max_seq_len=131072, theta=spec["rope_theta"],
                              scaling="llama" if spec["scaled"] else "none")
    layers = L._build_llama3_layers(n_layers=s["layers"], dim=dim, n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                                    hidden_dim=s["ffn"], rope=rope, attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
    cfg = L.Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)))
    if spec["name"] == "debugmodel":  # the shape is torchtitan's own, vocab aside
        ref = L.llama3_configs["debugmodel"](attn_backend="flex")
        ra, ca = ref.layers[0].attention, cfg.layers[0].attention
        assert (ref.dim, len(ref.layers), ra.n_heads, ra.rope, ref.layers[0].feed_forward.w1.out_features) == \
               (cfg.dim, len(cfg.layers), ca.n_heads, ca.rope, cfg.layers[0].feed_forward.w1.out_features), ref
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf = torch.load(spec["weights"])
    model.load_state_dict(L.Llama3StateDictAdapter(cfg, None).from_hf(hf), strict=True)
    return cfg, model


def worker_titan(spec: dict) -> dict:
    """torchtitan's model + optimizer loop (Trainer.train_step on one device, see the module doc)."""
    import contextlib

    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import utils as dist_utils

    cfg, model = titan_model(spec)
    batches = torch.load(spec["batches"])
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec["vocab"])).build(
        compile_config=CompileConfig())
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(**OPTIM).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(
        optimizers=optimizers, training_steps=len(batches))
    params = list(model.parameters())
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if spec["bf16"] else contextlib.nullcontext

    def clip():
        if not spec.get("clip64"):
            return dist_utils.clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=None, ep_enabled=False)
        # --titan-fp64-clip-norm: nxdt's clipping (nxdt.parallel.tensor_parallel: the norm in float64)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
        if 1.0 / (float(norm) + 1e-6) < 1.0:
            torch._foreach_mul_(grads, 1.0 / (float(norm) + 1e-6))
    model.train()
    stamps, losses = [], []
    for ids, labels in batches:
        optimizers.zero_grad(set_to_none=True)
        valid = (labels != -100).sum()
        with amp():
            pred = model(ids)
            loss, _ = loss_fn(pred, labels, valid)
        del pred
        loss.backward()
        clip()
        optimizers.step()
        schedulers.step()
        losses.append(float(loss.detach().item()))
        stamps.append(time.perf_counter())
    return {"stamps": stamps, "losses": losses}


def worker(args) -> int:
    import torch

    torch.set_num_threads(THREADS)
    spec = json.loads(Path(args.spec).read_text())
    res = (worker_titan if args.worker == "titan" else worker_nxdt)(spec)
    intervals = [b - a for a, b in zip(res["stamps"], res["stamps"][1:])]
    steady = intervals[max(spec["warmup"] - 1, 0):]
    res["tokens_per_s"] = spec["tokens_per_step"] * len(steady) / sum(steady)
    res["threads"] = torch.get_num_threads()
    Path(args.out).write_text(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------------ driver


def prepare(name: str, args, work: Path) -> dict:
    """The shape's spec for both workers: nxdt's config (argv), its first batches and initial weights
    saved for torchtitan (HF names, as torchtitan's state-dict adapter reads them)."""
    import torch

    from nxdt.models import build_model
    from nxdt.spec import load_config
    from throughput_runs import first_batches

    shape, scaled = shapes()[name]
    total = args.warmup + args.steps
    argv = nxdt_argv(shape, scaled, args.data_prefix, str(work / f"exp-{name}"), total, False)
    cfg = load_config(argv, world_size=1, default_config_dir=REPO / "conf", check_paths=True, quiet=True)
    batches, vocab = first_batches(cfg, total)
    saved = []
    for b in batches:
        labels = b["labels"].clone()
        if "loss_mask" in b:
            labels[b["loss_mask"] == 0] = -100
        saved.append((b["input_ids"].clone(), labels))
    torch.save(saved, work / f"{name}-batches.pt")
    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab)
    state = {k: v.detach().clone() for k, v in native.state_dict().items() if "rotary" not in k}
    torch.save(state, work / f"{name}-weights.pt")
    fields = ("hidden", "layers", "heads", "kv_heads", "ffn", "seq", "micro_batch")
    return {"name": name, "argv": argv, "shape": {f: getattr(shape, f) for f in fields}, "scaled": scaled,
            "vocab": int(native.args.vocab_size), "eps": float(cfg.model.layernorm_epsilon),
            "rope_theta": float(native.args.rope_theta), "warmup": args.warmup, "bf16": False,
            "tokens_per_step": shape.micro_batch * shape.seq,
            "batches": str(work / f"{name}-batches.pt"), "weights": str(work / f"{name}-weights.pt")}


def run_side(side: str, spec: dict, bf16: bool, work: Path, tag: str) -> dict | None:
    """One run of one side in its own process; None (with the log's tail printed) when it fails."""
    spec = dict(spec, bf16=bf16)
    if side == "nxdt":
        spec["argv"] = [*spec["argv"], "precision.type=autocast"] if bf16 else spec["argv"]
    label = f"{spec['name']}-{side}-{'bf16' if bf16 else 'fp32'}-{tag}"
    spec_path, out, log = work / f"{label}.spec.json", work / f"{label}.json", work / f"{label}.log"
    spec_path.write_text(json.dumps(spec))
    python = str(TITAN_PYTHON) if side == "titan" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    if side == "titan":  # the peer venv knows nothing of nxdt: its worker reads the spec only
        env.pop("PYTHONPATH", None)
    cmd = [python, __file__, "--worker", side, "--spec", str(spec_path), "--out", str(out)]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(work))
    if rc != 0 or not out.exists():
        tail = log.read_text().splitlines()[-15:]
        print(f"  {label:32s} FAILED (exit {rc}):\n    " + "\n    ".join(tail), flush=True)
        return None
    res = json.loads(out.read_text())
    print(f"  {label:32s} {res['tokens_per_s']:9,.0f} tok/s  loss {res['losses'][0]:.6f} -> {res['losses'][-1]:.6f}",
          flush=True)
    return res


def measure(spec: dict, args, work: Path, bf16: bool) -> dict[str, list[dict]]:
    """Interleaved repeats of both sides; results per side."""
    out: dict[str, list[dict]] = {"nxdt": [], "titan": []}
    order = ["nxdt", "titan"]
    for r in range(args.repeats):
        for side in order[r % 2:] + order[:r % 2]:
            res = run_side(side, spec, bf16, work, f"r{r}")
            if res is not None:
                out[side].append(res)
    return out


def rows_for(name: str, runs: dict[str, list[dict]], dtype: str) -> list[dict]:
    rows = []
    med = {side: statistics.median(r["tokens_per_s"] for r in res) if res else None for side, res in runs.items()}
    n = min(len(runs["nxdt"]), len(runs["titan"]))
    if med["nxdt"] and med["titan"]:
        ratio = med["nxdt"] / med["titan"]
        rows.append({"what": f"{name}: tokens/s {dtype}", "nxdt": med["nxdt"], "peer": med["titan"], "ratio": ratio,
                     "goal": f">= {GOAL_SPEED}", "pass": ratio >= GOAL_SPEED,
                     "note": f"median of {n} interleaved repeat(s)"})
    else:
        failed = [side for side, v in med.items() if not v]
        rows.append({"what": f"{name}: tokens/s {dtype}", "nxdt": med["nxdt"], "peer": med["titan"], "ratio": None,
                     "goal": f">= {GOAL_SPEED}", "pass": False, "note": f"failed: {', '.join(failed)}"})
    if dtype == "fp32" and n:
        a, b = runs["nxdt"][0]["losses"][:LOSS_STEPS], runs["titan"][0]["losses"][:LOSS_STEPS]
        diffs = [abs(x - y) for x, y in zip(a, b)]
        rows.append({"what": f"{name}: loss step 1 |diff| fp32", "nxdt": a[0], "peer": b[0], "ratio": diffs[0],
                     "goal": f"<= {GOAL_LOSS:g}", "pass": diffs[0] <= GOAL_LOSS, "note": "same weights, same batch"})
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        rows.append({"what": f"{name}: loss steps 1-{len(a)} max |diff| fp32", "nxdt": a[worst], "peer": b[worst],
                     "ratio": diffs[worst], "goal": f"<= {GOAL_LOSS:g}",
                     "pass": diffs[worst] <= GOAL_LOSS and len(a) == len(b) == LOSS_STEPS,
                     "note": f"at step {worst + 1}; signed diffs " + " ".join(f"{x - y:+.0e}" for x, y in zip(a, b))})
    return rows


def clip_norm_row(name: str, nxdt: dict, titan: dict | None) -> list[dict]:
    """The loss row of --titan-fp64-clip-norm: nxdt's losses against torchtitan's with its clipping norm
    in float64 (nxdt's); what remains is the rest of the two steps' rounding."""
    if titan is None:
        return []
    a, b = nxdt["losses"][:LOSS_STEPS], titan["losses"][:LOSS_STEPS]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return [{"what": f"{name}: loss 1-{len(a)} |diff|, titan fp64 norm", "nxdt": a[worst], "peer": b[worst],
             "ratio": diffs[worst], "goal": f"<= {GOAL_LOSS:g}", "pass": diffs[worst] <= GOAL_LOSS,
             "note": f"at step {worst + 1}; diagnostic; signed diffs " + " ".join(f"{x - y:+.0e}" for x, y in zip(a, b))}]


def titan_own_figure(args) -> int:
    """torchtitan's own figure for benchmarks/gpu.sh: its llama3 flavor (--titan-flavor, its first
    --titan-layers layers), SDPA, bf16 autocast, its per-block torch.compile and compiled chunked loss
    (apply_compile, CompileConfig(enable=True)), default_adamw, random tokens; prints one line with
    tokens/s, its MFU (its FLOPs/token and its get_peak_flops) and the peak allocated memory."""
    import types

    import torch
    import torchtitan.models.llama3 as L
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.tools.utils import get_peak_flops

    device = torch.device(args.device)
    cfg = L.llama3_configs[args.titan_flavor](attn_backend="flex")
    if args.titan_layers:
        cfg.layers = cfg.layers[:args.titan_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    compile_cfg = CompileConfig(enable=args.titan_compile)
    if args.titan_compile:
        apply_compile(model, compile_config=compile_cfg, parallel_dims=types.SimpleNamespace(tp_enabled=False))
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)).build(
        compile_config=compile_cfg)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(**OPTIM).build(model_parts=[model])
    params, stamps = list(model.parameters()), []
    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(cfg.vocab_size, (args.titan_batch, args.titan_seq + 1), generator=gen).to(device)
        optimizers.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], torch.tensor(tokens[:, 1:].numel(), device=device))
        loss.backward()
        dist_utils.clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        loss.item()
        stamps.append(time.perf_counter())
    steady = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup - 1:]
    tps = args.titan_batch * args.titan_seq * len(steady) / sum(steady)
    _, flops = cfg.get_nparams_and_flops(model, args.titan_seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"torchtitan {args.titan_flavor} ({len(cfg.layers)} layers, seq {args.titan_seq}, batch {args.titan_batch}, "
          f"bf16 autocast{', compiled' if args.titan_compile else ''}): {tps:,.0f} tokens/s, "
          f"MFU {flops * tps / get_peak_flops(name):.1%} (its figure), peak memory {peak:.1f} GiB", flush=True)
    return 0


def titan_missing() -> str | None:
    """Why the torchtitan side cannot run here (one line), or None."""
    venv = TITAN_PYTHON.parent.parent
    shown = venv.name if venv.parent == REPO else str(venv)
    if not TITAN_PYTHON.exists():
        return f"torchtitan's venv {shown} is missing: run make bench-peers"
    probe = subprocess.run([str(TITAN_PYTHON), "-c", "import torchtitan.models.llama3, torchtitan.components.loss"],
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                if k != "PYTHONPATH"})
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchtitan does not import in {shown}: {last}"
    return None


def table(rows: list[dict]) -> str:
    lines = [f"{'what':44s} {'nxdt':>12s} {'torchtitan':>12s} {'ratio':>9s} {'goal':>8s}"]
    for r in rows:
        def num(x):
            return "-" if x is None else (f"{x:12,.1f}" if abs(x) >= 100 else f"{x:12.6f}")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:9.3g}"
        verdict = "skipped" if r["pass"] is None else ("PASS" if r["pass"] else "MISS")
        lines.append(f"{r['what']:44s} {num(r['nxdt']):>12s} {num(r['peer']):>12s} {ratio:>9s} {r['goal']:>8s}  "
                     f"{verdict}  {r.get('note', '')}")
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="comma list from debugmodel,reference,tiny "
                                                  "(default: debugmodel,reference; --quick: tiny)")
    p.add_argument("--quick", action="store_true", help="the smoke shape, 1 repeat, few steps")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run (>= {LOSS_STEPS} with the warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="steps run but not timed")
    p.add_argument("--peers-json", help="write the rows for benchmarks/peers.py here")
    p.add_argument("--data-prefix", help="Megatron .bin/.idx prefix (default: the bundled corpus, tokenized)")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds per dtype of the matmul peak probe")
    p.add_argument("--no-bf16", action="store_true", help="fp32 only")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    p.add_argument("--titan-fp64-clip-norm", action="store_true",
                   help="a diagnostic of the loss rows: one more fp32 torchtitan run per shape with its clipping "
                        "norm in float64, as nxdt computes it, and its losses against nxdt's")
    g = p.add_argument_group("torchtitan's own figure (benchmarks/gpu.sh; torchtitan's python, no nxdt)")
    g.add_argument("--titan-flavor", help="run only torchtitan's llama3 flavor (1B, 8B, debugmodel) on --device")
    g.add_argument("--titan-layers", type=int, default=0, help="its first N layers (0: all)")
    g.add_argument("--titan-seq", type=int, default=2048)
    g.add_argument("--titan-batch", type=int, default=1)
    g.add_argument("--titan-compile", action="store_true", help="its per-block torch.compile + compiled loss")
    g.add_argument("--device", default="cuda", help="--titan-flavor's device")
    p.add_argument("--worker", choices=("nxdt", "titan"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.titan_flavor:
        args.steps = args.steps or 10
        return p, args
    names = (args.shapes or ("tiny" if args.quick else "debugmodel,reference")).split(",")
    bad = [n for n in names if n not in ("debugmodel", "reference", "tiny")]
    if bad:
        p.error(f"--shapes: from debugmodel, reference, tiny (got {args.shapes})")
    args.shapes = names
    if args.quick:
        args.repeats = 1
    if args.steps is None:
        args.steps = LOSS_STEPS - args.warmup  # the loss check needs 10 steps; no more
    if args.repeats < 1 or args.warmup < 1 or args.steps < 1 or args.probe_seconds <= 0:
        p.error("--repeats, --warmup and --steps must be >= 1, --probe-seconds > 0")
    return p, args


def main(argv=None) -> int:
    parser, args = parse(argv)
    if args.worker:
        return worker(args)
    if args.titan_flavor:
        return titan_own_figure(args)
    result = {"job": "pre-training", "peer": "torchtitan 0.3.0 llama3 (SDPA, AdamW)",
              "rows": [], "skipped": titan_missing()}
    if result["skipped"] is None:
        result = drive(args, result)
    if result["skipped"]:
        print(f"pre-training vs torchtitan skipped: {result['skipped']}", flush=True)
    if args.peers_json:
        Path(args.peers_json).write_text(json.dumps(result, indent=1))
    return 1 if any(r["pass"] is False and r["ratio"] is None for r in result["rows"]) else 0


def drive(args, result: dict) -> dict:
    import shutil

    import torch

    sys.path.insert(0, str(HERE))
    from throughput import measure_cpu_peaks, prepare_data

    torch.set_num_threads(THREADS)
    from nxdt.hardware import machine_line

    peaks = measure_cpu_peaks(args.probe_seconds)
    print(machine_line(peaks=peaks) + f" (measured now, {args.probe_seconds:g} s each)", flush=True)
    bf16 = not args.no_bf16 and peaks["bf16"] > peaks["fp32"]
    work = Path(tempfile.mkdtemp(prefix="nxdt-peer-titan-"))
    args.data_prefix = os.path.abspath(args.data_prefix or prepare_data(work / "data"))
    for name in args.shapes:
        spec = prepare(name, args, work)
        print(f"{name}: {spec['shape']}, vocab {spec['vocab']}, {args.warmup} warm-up + {args.steps} timed steps, "
              f"{args.repeats} repeat(s)", flush=True)
        runs = measure(spec, args, work, False)
        result["rows"] += rows_for(name, runs, "fp32")
        if args.titan_fp64_clip_norm and runs["nxdt"]:
            result["rows"] += clip_norm_row(name, runs["nxdt"][0], run_side("titan", dict(spec, clip64=True), False,
                                                                            work, "clip64"))
        if bf16:
            result["rows"] += rows_for(name, measure(spec, args, work, True), "bf16 autocast")
        else:
            why = ("--no-bf16" if args.no_bf16 else f"bf16 matmuls are {peaks['fp32'] / peaks['bf16']:.1f}x slower "
                   "than fp32 on this CPU (no native bf16)")
            result["rows"].append({"what": f"{name}: tokens/s bf16 autocast", "nxdt": None, "peer": None,
                                   "ratio": None, "goal": f">= {GOAL_SPEED}", "pass": None, "note": f"skipped: {why}"})
    print(table(result["rows"]), flush=True)
    if args.keep:
        print(f"logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
