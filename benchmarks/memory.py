"""Peak memory per rank for ddp / zero1 / fsdp, with and without full activation checkpointing.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/memory.py [--layers 4 --hidden 256]

One model, one launch: each layout is built, trained for 2 steps and measured in turn. Memory
is counted in tensor bytes, not RSS (glibc keeps freed buffers, see engineering notes):
parameters / gradients / optimizer state are the local tensors each rank holds after a step;
the activation peak is the most bytes saved for backward at once during a forward (a
saved-tensor hook, so recomputed activations of checkpointed blocks count only while alive).

    python benchmarks/memory.py --logits [--vocab 128256 --hidden 2048 --tokens 1024 --chunk 256]

The output layer + cross entropy alone, one process, at Llama-3's vocabulary: the bytes saved for
backward and the largest tensor alive, with the whole logits (`F.cross_entropy` on them) and with
`model.fusions.cross_entropy_chunk_size` (nxdt.models.chunked_loss), and the time of forward + backward.
"""

from __future__ import annotations

import argparse
import os
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from nxdt.spec import config_from_dict


def cfg_for(args, sharding: str | None, zero1: bool, ac: bool):
    return config_from_dict({
        "model_source": "megatron",
        "model": {"num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.hidden * 11 // 4,
                  "num_attention_heads": 8, "num_kv_heads": 4, "make_vocab_size_divisible_by": 8,
                  "activations_checkpoint_granularity": "full" if ac else None,
                  "activations_checkpoint_recompute": None, "activations_checkpoint_recompute_mlp": False,
                  "selective_checkpointing": None},
        "distributed_strategy": {"tensor_model_parallel_size": 1, "sequence_parallel": False, "zero1": zero1,
                                 "sharding_strategy": sharding, "fsdp": False, "cpu_offload": False,
                                 "low_cpu_fsdp": False, "meta_init": False},
        "precision": {"type": "fp32"},
    })


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


class SavedBytes:
    """Bytes of tensors saved for backward, current and peak (storage de-duplicated)."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.peak = 0

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        self.live[key] = local.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(self.live.values()))
        return (key, t)

    def unpack(self, packed):
        key, t = packed
        self.live.pop(key, None)
        return t


def _count_inputs(tracker: SavedBytes, inputs) -> None:
    for t in inputs:
        if torch.is_tensor(t):
            tracker.pack(t)


def measure(args, mesh, name, sharding, zero1, ac):
    from nxdt.models import build_model
    from nxdt.parallel.data_parallel import zero1_optimizer
    from nxdt.parallel.mesh import submesh
    from nxdt.parallel.parallelize import parallelize_llama

    cfg = cfg_for(args, sharding, zero1, ac)
    torch.manual_seed(0)
    model = parallelize_llama(build_model(cfg, args.vocab), mesh, cfg)
    if zero1:
        opt = zero1_optimizer([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-3},
                              submesh(mesh, "dp").get_group())
        state = lambda: opt.optim.state  # noqa: E731
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = lambda: opt.state  # noqa: E731
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tracker = SavedBytes()
    # A checkpointed block keeps its inputs (outside the saved-tensor hooks): count them as saved.
    for m in model.modules():
        if getattr(m, "_nxdt_checkpointed", False):
            m.register_forward_pre_hook(lambda mod, inputs: _count_inputs(tracker, inputs))
    for _ in range(2):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        tracker.live.clear()
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    params = local_bytes(model.parameters())
    grads = local_bytes(p.grad for p in model.parameters())
    optim = local_bytes(t for s in state().values() for t in s.values() if torch.is_tensor(t))
    return {"layout": name, "params": params, "grads": grads, "optimizer": optim, "activations": tracker.peak}


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes alive in tensor storages while the mode is on: each storage an op creates
    counts from that op until it is freed (a weakref finalizer on the storage), once however many views
    it has. `existing` storages (views of them are not new bytes) are not counted unless `track` is
    given them: then they count as alive from the start until they are freed (parameters, gradients,
    optimizer state held before a training step, so the peak is the step's whole footprint).
    benchmarks/peer_memory.py and benchmarks/lora.py measure a training step's peak with it."""

    def __init__(self, existing=(), track=()):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = {id(t.untyped_storage()) for t in existing}
        for t in track:
            self._add(t.untyped_storage())

    def _add(self, storage) -> None:
        if id(storage) in self.seen or not storage.nbytes():
            return
        self.seen.add(id(storage))
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out


def logits_memory(args) -> None:
    """--logits: the loss head's memory, full logits vs chunked (see the module docstring)."""
    import time

    import torch.nn.functional as F

    from nxdt.hardware import machine_line
    from nxdt.models.chunked_loss import chunked_cross_entropy

    class LogitsAndPeak(LiveBytes):
        """LiveBytes, plus the largest logits-shaped tensor ([..., vocab]: logits, their softmax, their
        gradient) any op returns (the weight and its gradient, [vocab, hidden], are the same either way
        and not counted)."""

        def __init__(self, existing: list[torch.Tensor]):
            super().__init__(existing)
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == args_vocab
                        and t.numel() != args_vocab * args_hidden):  # not the weight (or its transpose)
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return out

    args_vocab, args_hidden = args.vocab, args.hidden

    print(machine_line(), flush=True)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.tokens,))
    ways = {"full logits": lambda: F.cross_entropy(head(hidden).float(), labels, reduction="none"),
            f"chunks of {args.chunk}, fused": lambda: chunked_cross_entropy(hidden, head, labels, args.chunk),
            f"chunks of {args.chunk}, recomputed": lambda: chunked_cross_entropy(hidden, head, labels, args.chunk,
                                                                                  fuse=False)}
    print(f"output layer {args.hidden} -> {args.vocab:,}, {args.tokens:,} tokens, fp32; whole logits "
          f"= tokens x vocab x 4 B = {args.tokens * args.vocab * 4 / 2**20:,.0f} MiB; the weight "
          f"{args.vocab * args.hidden * 4 / 2**20:,.0f} MiB")
    print("peak: the most bytes alive at once in the tensors forward and backward create (every way's includes "
          "the weight's gradient)")
    print(f"{'way':<28} {'largest logits':>15} {'peak':>13} {'fwd+bwd':>9}")
    rows = {}
    for name, loss in ways.items():
        hidden.grad = head.weight.grad = None
        mode = LogitsAndPeak([hidden, head.weight, labels])
        start = time.perf_counter()
        with mode:
            loss().sum().backward()
        rows[name] = (mode.peak, time.perf_counter() - start)
        print(f"{name:<28} {mode.largest / 2**20:>11,.1f} MiB {mode.peak / 2**20:>9,.0f} MiB {rows[name][1]:>8.2f}s",
              flush=True)
    (full, full_s), (fused, fused_s), (recomputed, recomputed_s) = rows.values()
    print(f"fused: peak {(fused - full) / 2**20:+,.0f} MiB against the whole logits, {full_s / fused_s:.2f}x their speed; "
          f"recomputed: {(recomputed - full) / 2**20:+,.0f} MiB, {full_s / recomputed_s:.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logits", action="store_true", help="the output layer + loss alone: full logits vs chunked")
    ap.add_argument("--tokens", type=int, default=1024, help="--logits: tokens in the batch")
    ap.add_argument("--chunk", type=int, default=256, help="--logits: tokens per chunk")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    if args.logits:
        if args.vocab == 8192 and args.hidden == 256:  # the defaults of the layouts table: Llama-3's head instead
            args.vocab, args.hidden = 128256, 2048
        return logits_memory(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    from nxdt.parallel.mesh import build_mesh
    from nxdt.spec.layout import Layout

    world = dist.get_world_size()
    if dist.get_rank() == 0:
        from nxdt.hardware import machine_line

        print(machine_line(), flush=True)
    meshes = {"replicate": build_mesh(Layout(dp_replicate=world), "cpu"),
              "shard": build_mesh(Layout(dp_shard=world), "cpu")}
    rows = []
    for name, sharding, zero1 in (("ddp", None, False), ("zero1", None, True), ("fsdp", "FSDP", False)):
        for ac in (False, True):
            mesh = meshes["shard" if sharding else "replicate"]
            rows.append(measure(args, mesh, name + (" +AC" if ac else ""), sharding, zero1, ac))
    if dist.get_rank() == 0:
        mib = 1 / 2**20
        print(f"per-rank tensor bytes (MiB), dp={world}, {args.layers} layers, hidden {args.hidden}, "
              f"vocab {args.vocab}, batch {args.batch} x seq {args.seq}, fp32, AdamW")
        print(f"{'layout':<12}{'params':>10}{'grads':>10}{'optimizer':>11}{'activ.':>10}{'total':>10}")
        for r in rows:
            total = r["params"] + r["grads"] + r["optimizer"] + r["activations"]
            print(f"{r['layout']:<12}{r['params'] * mib:>10.2f}{r['grads'] * mib:>10.2f}{r['optimizer'] * mib:>11.2f}"
                  f"{r['activations'] * mib:>10.2f}{total * mib:>10.2f}")
        by = {r["layout"]: r for r in rows}
        ratio = by["zero1"]["optimizer"] / by["ddp"]["optimizer"]
        cut = 1 - by["ddp +AC"]["activations"] / by["ddp"]["activations"]
        print(f"ZeRO-1 optimizer bytes / DDP = {ratio:.4f} (goal 1/{world} = {1 / world:.4f} ± 2%): "
              f"{'ok' if abs(ratio * world - 1) <= 0.02 else 'MISSED'}")
        print(f"full activation checkpointing cuts the activation peak by {cut:.1%} (goal >= 60%): "
              f"{'ok' if cut >= 0.6 else 'MISSED'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
