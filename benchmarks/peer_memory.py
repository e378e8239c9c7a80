#!/usr/bin/env python
"""Peak bytes of one training step at Llama-3's vocabulary (128,256) and seq 2,048: nxdt with its fused,
chunked output layer + loss (`model.fusions.cross_entropy_chunk_size`) against `transformers.Trainer`
on `LlamaForCausalLM`, with Liger-Kernel's fused linear cross entropy where it runs, else without.

    .venv/bin/python benchmarks/peer_memory.py                      # the issue-40 shape, ~2 min on 2 cores
    .venv/bin/python benchmarks/peer_memory.py --quick              # smoke run: vocab 32,000, seq 512
    .venv/bin/python benchmarks/peer_memory.py --peers-json OUT.json [--quick]   # for benchmarks/peers.py

Goal (issue 40): nxdt's peak <= 0.6x the Trainer's without Liger.

What runs. Both sides train the same model (hidden 256, 2 layers, 4 / 2 heads, ffn 704, vocab 128,256
padding the bundled tokenizer's 8,192, seq 2,048, micro batch 1, fp32, untied embeddings) from the
same weights on the same batches (nxdt's data module over the bundled corpus), every parameter
trained with AdamW, as its users run it: nxdt through `nxdt.tools.train.train(cfg)` (Lightning, the
shipped tiny_llama_cpu config with the shape's overrides and `cross_entropy_chunk_size=--chunk`);
the Trainer through `Trainer.train()` (its default fused AdamW, clipping at 1.0), `use_liger_kernel=True`
for its Liger way, run by `.venv-peers-liger/bin/python` (`pip install liger-kernel` there).
Each way is a fresh subprocess (`--worker SPEC`), so one way's allocations cannot inflate the other's.

How it is measured. The last step of each run (after --steps steps, so the optimizer state exists and
the allocator is warm) runs under `memory.LiveBytes` (benchmarks/memory.py), a TorchDispatchMode: the
parameters, gradients and optimizer state alive when the step starts count from the start until freed,
then every storage an op creates counts from that op until it is freed (a weakref finalizer on the
storage, each storage once however many views). The peak is the most bytes alive at once: on both
sides the same accounting of tensor bytes, not RSS (glibc keeps freed buffers, so RSS measures the
allocator). The batch and other tensors made before the step are not counted (a few KiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reason: the sibling benchmark modules below
from memory import LiveBytes  # noqa: E402
from throughput_runs import REPO, THREADS, Shape, common_overrides, first_batches  # noqa: E402

LIGER_PYTHON = REPO / ".venv-peers-liger" / "bin" / "python"
DATA_PREFIX = REPO / "data" / "kjv" / "kjv_text_document"
FULL = Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=704, seq=2048, micro_batch=1, vocab=128256,
             about="issue 40's large vocabulary")
QUICK = Shape(hidden=64, layers=1, heads=4, kv_heads=2, ffn=176, seq=512, micro_batch=1, vocab=32000,
              about="smoke run")
GIB = 2**30


# --------------------------------------------------------------------------- one run (the worker side)


@dataclass
class Spec:
    """One way's run: what `--worker` is given (as JSON)."""

    runner: str  # nxdt | hf
    shape: dict
    data_prefix: str
    exp_dir: str
    steps: int  # steps before the measured one (the first `warmup` are not timed)
    warmup: int = 1
    overrides: list[str] = field(default_factory=list)  # nxdt: config overrides
    config_name: str = "tiny_llama_cpu"
    lora: dict | None = None  # {"rank", "alpha", "targets"}: hf side, peft's get_peft_model
    liger: bool = False  # hf side: TrainingArguments(use_liger_kernel=True)


class StepProbe:
    """What both sides' callbacks call: step end times, and on the last step the peak (LiveBytes over
    the parameters, gradients and optimizer state alive at its start), the gradient bytes before the
    optimizer step and the trainable state (trainable parameters + their gradients + optimizer state)."""

    def __init__(self, total: int) -> None:
        self.total, self.begun, self.ends = total, 0, []
        self.mode: LiveBytes | None = None
        self.grad_bytes = self.peak = self.trainable_bytes = self.optimizer_bytes = 0
        self.loss1: float | None = None  # nxdt's step-1 loss (information; the Trainer logs none here)

    @staticmethod
    def _state(optimizer) -> list[torch.Tensor]:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    def begin(self, model, optimizer) -> None:
        self.begun += 1
        if self.begun == self.total:
            params = list(model.parameters())
            held = params + [p.grad for p in params if p.grad is not None] + self._state(optimizer)
            self.mode = LiveBytes(track=held)
            self.mode.__enter__()

    def before_optimizer_step(self, model) -> None:
        if self.mode is not None:
            self.grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)

    def end(self, model, optimizer) -> None:
        self.ends.append(time.perf_counter())
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.peak, self.mode = self.mode.peak, None
            self.optimizer_bytes = sum(t.nbytes for t in self._state(optimizer))
            trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
            self.trainable_bytes = trainable + self.grad_bytes + self.optimizer_bytes

    def result(self, spec: Spec) -> dict:
        shape = Shape(**spec.shape)
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:])][spec.warmup - 1:spec.steps - 1]
        return {"tokens_per_s": shape.micro_batch * shape.seq * len(intervals) / sum(intervals) if intervals
                else float("nan"), "step_times": intervals, "peak_bytes": self.peak, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "trainable_state_bytes": self.trainable_bytes,
                "loss1": self.loss1, "steps": len(self.ends)}


def compose(spec: Spec, extra: list[str] = ()):
    from nxdt.spec import load_config

    argv = common_overrides(Shape(**spec.shape), spec.data_prefix, spec.exp_dir, spec.steps + 1, "cpu", 1, False)
    argv[1] = spec.config_name
    return load_config([*argv, *extra], world_size=1, default_config_dir=REPO / "conf", check_paths=True, quiet=True)


def run_nxdt(spec: Spec) -> dict:
    import lightning.pytorch as pl

    import nxdt.training.trainer as run

    cfg = compose(spec, spec.overrides)
    probe = StepProbe(spec.steps + 1)

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            probe.begin(pl_module, trainer.optimizers[0])

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            probe.before_optimizer_step(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if len(probe.ends) == 0:
                probe.loss1 = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
            probe.end(pl_module, trainer.optimizers[0])

    def with_vocab(spec_, trainer):
        datamodule = build_datamodule(spec_, trainer)
        datamodule.vocab_size = vocab_of(spec, datamodule.vocab_size)
        return datamodule

    build_trainer, build_datamodule = run.build_trainer, run.build_datamodule
    run.build_trainer = lambda cfg, layout, loggers, callbacks: build_trainer(cfg, layout, loggers,
                                                                              [*callbacks, Probe()])
    run.build_datamodule = with_vocab
    try:
        run.train(cfg)
    finally:
        run.build_trainer, run.build_datamodule = build_trainer, build_datamodule
    return probe.result(spec)


def vocab_of(spec: Spec, tokenizer_vocab: int) -> int:
    """The shape's vocabulary where it is larger than the bundled tokenizer's: the model's output layer
    padded to it on both sides. (nxdt's training sizes the model from the data module's tokenizer,
    which `model.vocab_size` does not change; the planner reads model.vocab_size.)"""
    return max(tokenizer_vocab, spec.shape.get("vocab") or 0)


def hf_model(cfg, vocab: int, lora: dict | None):
    """transformers' Llama with the weights nxdt's run starts from (same seed, same builder), wrapped by
    peft's get_peft_model when `lora` is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nxdt.models import build_model

    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab)
    hf_cfg = {k: v for k, v in native.args.to_hf_config_dict().items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, use_cache=False, attn_implementation="sdpa"))
    missing, unexpected = model.load_state_dict(native.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                            target_modules=lora["targets"], bias="none", task_type="CAUSAL_LM"))


def run_hf(spec: Spec) -> dict:
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg = compose(spec)  # the base config: the LoRA keys (if any) do not change the base model's weights
    total = spec.steps + 1
    micro = spec.shape["micro_batch"]
    batches, vocab = first_batches(cfg, total)
    model = hf_model(cfg, vocab_of(spec, vocab), spec.lora)
    samples = [{"input_ids": ids, "labels": ids} for b in batches for ids in b["input_ids"]]
    probe = StepProbe(total)

    class Samples(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return samples[i]

    class InOrder(Trainer):  # the batches in nxdt's order
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            probe.begin(model, optimizer)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            probe.before_optimizer_step(model)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            probe.end(model, optimizer)

    o = cfg.model.optim
    targs = TrainingArguments(
        output_dir=os.path.join(spec.exp_dir, "hf"), per_device_train_batch_size=micro, max_steps=total,
        report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        use_cpu=True, learning_rate=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0],
        adam_beta2=o["betas"][1], seed=cfg.seed, disable_tqdm=True, use_liger_kernel=spec.liger)
    InOrder(model=model, args=targs, train_dataset=Samples(), callbacks=[Probe()]).train()
    return probe.result(spec)


def worker(spec_json: str, out: str) -> int:
    torch.set_num_threads(THREADS)
    spec = Spec(**json.loads(spec_json))
    result = {"nxdt": run_nxdt, "hf": run_hf}[spec.runner](spec)
    Path(out).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the driver side


def run_way(spec: Spec, python: str | Path = sys.executable, in_process: bool = False) -> dict:
    """One way's run in a fresh subprocess (or in this one: the suite's smoke test); its result dict,
    or {"error": last line} when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        spec.exp_dir = spec.exp_dir or tmp
        out = Path(tmp) / "result.json"
        if in_process:
            try:
                worker(json.dumps(asdict(spec)), str(out))
            finally:  # nxdt's run leaves its one-process group up: the next way (a Trainer) would wrap DDP
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
            return json.loads(out.read_text())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(THREADS)}
        proc = subprocess.run([str(python), __file__, "--worker", json.dumps(asdict(spec)), "--out", str(out)],
                              cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
            return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:300]}
        return json.loads(out.read_text())


def row(what: str, nxdt: float, peer: float, goal: str, note: str) -> dict:
    ratio = nxdt / peer
    op, bound = goal.split()
    return {"what": what, "nxdt": nxdt, "peer": peer, "ratio": ratio, "goal": goal,
            "pass": bool(ratio >= float(bound) if op == ">=" else ratio <= float(bound)), "note": note}


def machine() -> str:
    from nxdt.hardware import machine_line

    return machine_line()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: vocab 32,000, seq 512, one layer")
    p.add_argument("--peers-json", help="write the issue-40 protocol's JSON here")
    p.add_argument("--chunk", type=int, default=None, help="nxdt's cross_entropy_chunk_size (default 256)")
    p.add_argument("--steps", type=int, default=3, help="steps before the measured one (the first 2 not timed)")
    p.add_argument("--data-prefix", default=str(DATA_PREFIX))
    p.add_argument("--whole-logits", action="store_true", help="also nxdt without the chunked loss head")
    p.add_argument("--in-process", action="store_true", help="run the ways in this process (the suite's smoke test)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    if not Path(args.data_prefix + ".bin").exists():
        print(f"error: --data-prefix: {args.data_prefix}.bin not found (make data)", file=sys.stderr)
        return 2
    shape = QUICK if args.quick else FULL
    chunk = args.chunk or 256
    print(machine(), flush=True)
    print(f"model: {shape.describe()}; fp32, AdamW on every parameter; peak of step {args.steps + 1} "
          f"(LiveBytes: tensor bytes alive, params + grads + optimizer state + activations)", flush=True)
    # step 2 is nxdt's own memory sample (its MemoryMonitor): not timed
    base = {"shape": asdict(shape), "data_prefix": args.data_prefix, "exp_dir": "", "steps": args.steps,
            "warmup": min(2, args.steps)}
    ways = {f"nxdt (chunks of {chunk})": (Spec("nxdt", **base, overrides=[
        f"model.fusions.cross_entropy_chunk_size={chunk}"]), sys.executable)}
    if args.whole_logits:
        ways["nxdt (whole logits)"] = (Spec("nxdt", **base), sys.executable)
    ways["Trainer"] = (Spec("hf", **base), sys.executable)
    liger_note = "skipped: .venv-peers-liger missing (pip install liger-kernel into it)"
    if LIGER_PYTHON.exists() and not args.in_process:
        ways["Trainer + Liger FLCE"] = (Spec("hf", **base, liger=True), LIGER_PYTHON)
    results = {}
    for name, (spec, python) in ways.items():
        results[name] = run_way(spec, python, args.in_process)
        r = results[name]
        print(f"{name:<24} " + (f"error: {r['error']}" if "error" in r else
                                f"peak {r['peak_bytes'] / GIB:7.3f} GiB   "
                                f"{r['tokens_per_s']:,.0f} tokens/s"), flush=True)
    if "Trainer + Liger FLCE" in results and "error" in results["Trainer + Liger FLCE"]:
        liger_note = f"Liger could not run here: {results['Trainer + Liger FLCE']['error']}"
    elif "Trainer + Liger FLCE" in results:
        liger_note = "ran"
    nx, hf = results[next(iter(ways))], results["Trainer"]
    rows, skipped = [], None
    if "error" in nx or "error" in hf:
        skipped = f"a run failed: nxdt {nx.get('error', 'ok')}; Trainer {hf.get('error', 'ok')}"
    else:
        note = f"{shape.describe()}; fp32; LiveBytes peak of one step; one run each (deterministic)"
        rows.append(row("peak bytes of one step vs Trainer", nx["peak_bytes"], hf["peak_bytes"], "<= 0.6", note))
        lg = results.get("Trainer + Liger FLCE", {})
        if "peak_bytes" in lg:
            rows.append(row("peak bytes of one step vs Trainer + Liger FLCE", nx["peak_bytes"], lg["peak_bytes"],
                            "<= 1.0", "informative (the issue's goal is against the Trainer without it)"))
        for r in rows:
            print(f"{r['what']}: {r['ratio']:.3f} (goal {r['goal']}): {'PASS' if r['pass'] else 'MISS'}")
    print(f"Liger: {liger_note}")
    if args.peers_json:
        Path(args.peers_json).write_text(json.dumps({
            "job": "memory at a large vocabulary", "peer": "transformers.Trainer (LlamaForCausalLM, no Liger); Liger: "
            + liger_note, "machine": machine(), "rows": rows, "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
