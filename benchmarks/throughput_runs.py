"""The model shapes, the ways and the worker side of benchmarks/throughput.py: each way's training
loop (nxdt, the plain PyTorch loop, Hugging Face's Trainer) run in a subprocess of its own (or, for
the suite's smoke tests, in the caller: in_process), timing every optimizer step and writing its result
as JSON for the driver (see throughput.py)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
THREADS = 2  # CPU runs: threads per process (the machines this is judged on have 2 cores)


@dataclass(frozen=True)
class Shape:
    """A Llama shape, as overrides of the shipped tiny_llama_cpu config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    micro_batch: int
    vocab: int | None = None  # None: the bundled tokenizer's 8,192 (padded)
    tied: bool = False
    rope_theta: float | None = None
    activation_checkpointing: bool = False
    about: str = ""

    def overrides(self) -> list[str]:
        out = [
            f"model.num_layers={self.layers}", f"model.hidden_size={self.hidden}",
            f"model.ffn_hidden_size={self.ffn}", f"model.num_attention_heads={self.heads}",
            f"model.num_kv_heads={self.kv_heads}", f"model.encoder_seq_length={self.seq}",
            f"model.max_position_embeddings={max(self.seq, 1024)}",
            f"model.share_embeddings_and_output_weights={self.tied}",
        ]
        if self.vocab:
            out.append(f"model.vocab_size={self.vocab}")
        if self.rope_theta:
            out.append(f"model.rope_theta={self.rope_theta}")
        if self.activation_checkpointing:
            out.append("model.activations_checkpoint_granularity=full")
        return out

    def describe(self) -> str:
        vocab = f"{self.vocab:,}" if self.vocab else "8,192"
        return (f"vocab {vocab}, hidden {self.hidden}, {self.layers} layers, {self.heads}/{self.kv_heads} heads, "
                f"ffn {self.ffn}, seq {self.seq}, micro batch {self.micro_batch}"
                + (", tied embeddings" if self.tied else "") + (", full AC" if self.activation_checkpointing else ""))


SHAPES = {
    # the engineering notes' reference model (8.5M parameters)
    "small": Shape(hidden=256, layers=6, heads=8, kv_heads=4, ffn=704, seq=256, micro_batch=8,
                   about="the reference shape"),
    # matmul-heavier (130M parameters): the shape issue 19 names
    "large": Shape(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=2816, seq=1024, micro_batch=1, vocab=32000,
                   about="matmul-heavier"),
    # a smoke shape: the suite runs the whole script with it (tests/test_benchmark_scripts.py)
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq=64, micro_batch=2, about="smoke test"),
    # GPU shapes (--device cuda): Llama-3.2-1B and Llama-3.1-8B, torchtitan's sequence for the 8B
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, seq=2048, micro_batch=4,
                          vocab=128256, tied=True, rope_theta=500000.0, about="Llama-3.2-1B"),
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, seq=8192, micro_batch=1,
                          vocab=128256, rope_theta=500000.0, activation_checkpointing=True, about="Llama-3.1-8B"),
    # its first 8 layers: what one 80 GB card holds with fp32 weights and AdamW (benchmarks/gpu.sh)
    "llama-3.1-8b-8l": Shape(hidden=4096, layers=8, heads=32, kv_heads=8, ffn=14336, seq=8192, micro_batch=1,
                             vocab=128256, rope_theta=500000.0, activation_checkpointing=True,
                             about="Llama-3.1-8B, first 8 layers"),
}


@dataclass(frozen=True)
class Way:
    runner: str  # nxdt | plain | hf
    bf16: bool = False
    compiled: bool = False
    overrides: tuple[str, ...] = ()  # nxdt: config overrides on top of the common ones


COMPILE = "model.fusions.torch_compile=true"
CE_CHUNKS = "model.fusions.cross_entropy_chunk_size=512"  # the fused output layer + loss, 512 tokens at a time
WAYS = {
    "nxdt": Way("nxdt"),
    "nxdt-compile": Way("nxdt", compiled=True, overrides=(COMPILE,)),
    "nxdt-chunks": Way("nxdt", overrides=(CE_CHUNKS,)),
    "nxdt-chunks-compile": Way("nxdt", compiled=True, overrides=(CE_CHUNKS, COMPILE)),
    "nxdt-autocast": Way("nxdt", bf16=True, overrides=("precision.type=autocast",)),
    "nxdt-autocast-compile": Way("nxdt", bf16=True, compiled=True, overrides=("precision.type=autocast", COMPILE)),
    "nxdt-mixed": Way("nxdt", bf16=True, overrides=("precision.type=mixed_precision",)),
    "nxdt-mixed-compile": Way("nxdt", bf16=True, compiled=True, overrides=("precision.type=mixed_precision", COMPILE)),
    "nxdt-mixed-chunks-compile": Way("nxdt", bf16=True, compiled=True,
                                     overrides=("precision.type=mixed_precision", CE_CHUNKS, COMPILE)),
    "nxdt-bf16sr": Way("nxdt", bf16=True, overrides=("precision.type=bf16SR",)),
    "nxdt-bf16sr-compile": Way("nxdt", bf16=True, compiled=True, overrides=("precision.type=bf16SR", COMPILE)),
    "plain": Way("plain"),
    "plain-compile": Way("plain", compiled=True),
    "hf": Way("hf"),
    "hf-compile": Way("hf", compiled=True),
    "hf-bf16": Way("hf", bf16=True),
    "hf-bf16-compile": Way("hf", bf16=True, compiled=True),
}
DEFAULT_CPU_WAYS = ("nxdt,nxdt-compile,plain,hf,hf-compile,"
                    "nxdt-mixed,nxdt-mixed-compile,nxdt-mixed-chunks-compile,hf-bf16,hf-bf16-compile")
DEFAULT_CUDA_WAYS = "nxdt-mixed,nxdt-mixed-compile"


def common_overrides(shape: Shape, data_prefix: str, exp_dir: str, max_steps: int, device: str, nproc: int,
                     fsdp: bool) -> list[str]:
    """Every nxdt way's config (and the source of the model and batches of the other ways)."""
    out = [
        "--config-name", "tiny_llama_cpu",
        f"trainer.devices={nproc}",
        f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
        f"trainer.max_steps={max_steps}",
        "trainer.limit_val_batches=0",          # no validation inside the timed window
        f"model.optim.sched.warmup_steps={max(1, max_steps // 4)}",  # the shipped 30 needs max_steps > 30
        *shape.overrides(),
        f"data.micro_batch_size={shape.micro_batch}",
        f"data.global_batch_size={shape.micro_batch * nproc}",
        "data.num_workers=0",                   # every way loads its batches in the main process
        f"data.data_prefix=[1.0,{data_prefix}]",
        f"exp_manager.exp_dir={exp_dir}",
        "precision.type=fp32",
    ]
    if fsdp:
        out.append("distributed_strategy.fsdp=true")
    return out


# ------------------------------------------------------------------------------------ worker

_PATCHES: list[tuple[object, str, object]] = []  # (owner, name, what it held) for in_process to put back
_ABSENT = object()


def patch(owner, name: str, value) -> None:
    """`owner.name = value` for a worker's timing hooks; undone when an in_process() run ends."""
    _PATCHES.append((owner, name, vars(owner).get(name, _ABSENT)))
    setattr(owner, name, value)


def time_nxdt_steps(stamps: list[float]) -> None:
    """Append a `time.perf_counter()` to `stamps` at each optimizer step's end of the next nxdt run
    (`nxdt.training.trainer.train`): a Lightning callback added where the run builds its Trainer."""
    import lightning.pytorch as pl

    import nxdt.training.trainer as run

    class StepTimer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.append(time.perf_counter())

    build_trainer = run.build_trainer
    patch(run, "build_trainer", lambda cfg, layout, loggers, callbacks: build_trainer(cfg, layout, loggers,
                                                                                     [*callbacks, StepTimer()]))


@contextlib.contextmanager
def in_process():
    """A way run in the calling process (the scripts' `--in-process`, for the suite's smoke tests only: the
    measured runs start a fresh process per way). Afterwards what a run leaves behind is put back: the hooks
    patch() set, the process group nxdt's run leaves up (the next way, a Trainer, would wrap DDP), the
    environment (Lightning's and exp_manager's variables) and the torch thread count."""
    import torch

    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        while _PATCHES:
            owner, name, old = _PATCHES.pop()
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)


def compose(args, extra=()):
    from nxdt.spec import load_config

    total = args.warmup_steps + args.steps
    argv = common_overrides(SHAPES[args.shape], args.data_prefix, args.exp_dir, total, args.device, args.ranks,
                            args.fsdp)
    return load_config([*argv, *extra], world_size=args.ranks, default_config_dir=CONF_DIR, check_paths=True,
                       quiet=True)


def first_batches(cfg, n: int):
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


class Stamps:
    """perf_counter() at the end of every optimizer step, and a checksum of the tokens trained on."""

    def __init__(self, label: str, total: int) -> None:
        self.t: list[float] = []
        self.label, self.total = label, total
        self.checksum = 0  # of the token ids trained on, in order: proves "same batches"

    def saw(self, input_ids) -> None:
        self.checksum += (len(self.t) + 1) * int(input_ids.long().sum())

    def mark(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        k = len(self.t)
        if k == 1 or k % 5 == 0 or k == self.total:
            dt = self.t[-1] - self.t[-2] if k > 1 else float("nan")
            print(f"[{self.label}] step {k}/{self.total}  last {dt:.3f}s", file=sys.stderr, flush=True)


def worker_nxdt(args, stamps: Stamps, way: Way) -> dict:
    import lightning.pytorch as pl

    import nxdt.training.trainer as run

    cfg = compose(args, way.overrides)
    losses = []

    class StepTimer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.saw(batch["input_ids"])
            stamps.mark()
            losses.append(outputs["loss"] if isinstance(outputs, dict) else outputs)  # a tensor: no sync here

    build_trainer = run.build_trainer
    patch(run, "build_trainer", lambda cfg, layout, loggers, callbacks: build_trainer(
        cfg, layout, loggers, [*callbacks, StepTimer()]))
    run.train(cfg)
    # the mean training loss over the run, as the plain loop and the Trainer (training_loss) report it
    return {"final_loss": sum(float(x) for x in losses) / len(losses)}


def compile_blocks(model):
    from nxdt.parallel.parallelize import transformer_blocks

    for block in transformer_blocks(model):
        block.compile()
    return model


def worker_plain(args, stamps: Stamps, way: Way) -> dict:
    import torch
    import torch.nn.functional as F

    from nxdt.models import build_model

    cfg = compose(args)
    batches, vocab = first_batches(cfg, args.warmup_steps + args.steps)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, vocab)
    if way.compiled:
        compile_blocks(model)
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


def worker_hf(args, stamps: Stamps, way: Way) -> dict:
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from nxdt.models import build_model

    cfg = compose(args)
    total = args.warmup_steps + args.steps
    micro = SHAPES[args.shape].micro_batch
    batches, vocab = first_batches(cfg, total)
    torch.manual_seed(cfg.seed)
    native = build_model(cfg, vocab)
    hf_cfg = native.args.to_hf_config_dict()
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, use_cache=False, attn_implementation="sdpa"))
    missing, unexpected = model.load_state_dict(native.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k or "lm_head" in k for k in missing), (missing, unexpected)
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
            stamps.saw(torch.stack([samples[i]["input_ids"] for i in fetched[k * micro:(k + 1) * micro]]))
            stamps.mark()

    o = cfg.model.optim
    targs = TrainingArguments(
        output_dir=os.path.join(args.exp_dir, "hf"),
        per_device_train_batch_size=micro, max_steps=total, report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, use_cpu=args.device == "cpu", bf16=way.bf16,
        torch_compile=way.compiled,
        learning_rate=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1],
        seed=cfg.seed, disable_tqdm=True,
    )
    trainer = InOrder(model=model, args=targs, train_dataset=Samples(), callbacks=[StepTimer()])
    out = trainer.train()
    return {"final_loss": float(out.training_loss)}


def worker(args) -> int:
    import torch

    if args.device == "cpu":
        torch.set_num_threads(THREADS)
    rank = int(os.environ.get("RANK", "0"))
    stamps = Stamps(args.worker, args.warmup_steps + args.steps)
    way = WAYS[args.worker]
    info = {"nxdt": worker_nxdt, "plain": worker_plain, "hf": worker_hf}[way.runner](args, stamps, way)
    if rank != 0:
        return 0
    intervals = [b - a for a, b in zip(stamps.t, stamps.t[1:])]
    # stamps.t[0] ends step 1; interval i ends step i+2. Keep those after the warm-up steps.
    steady = intervals[max(args.warmup_steps - 1, 0):]
    shape = SHAPES[args.shape]
    tokens_per_step = shape.micro_batch * shape.seq * args.ranks
    result = {
        "way": args.worker, "steps": len(steady), "step_times": steady,
        "threads": torch.get_num_threads(), "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
        "batch_checksum": stamps.checksum, **info,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0
