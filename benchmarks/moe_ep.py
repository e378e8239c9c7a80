#!/usr/bin/env python
"""Expert parallelism: one MoE layer at ep2 vs ep1 on 2 ranks: tokens/s (forward + backward +
gradient sync) and bytes per rank (issue 13, deliverable 8).

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/moe_ep.py            # 7 interleaved repeats
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/moe_ep.py --quick    # smoke run, a few seconds

It is not a test. Both ways hold the same weights and train on the same tokens (each rank its own
batch, as data parallel would give it):
- ep1: every rank holds all 8 experts and routes its tokens through them; the step ends with the
  all-reduce (mean) of the expert gradients that data parallel does;
- ep2: each rank holds 4 experts (nxdt.parallel.expert_parallel): the routed rows go to the
  expert's rank and back by all-to-all, and no expert gradient is reduced (their replicas: none).
First the outputs and the (reduced) expert gradients of both are compared (max abs diff
printed), then steps of each way are timed in interleaved repeats (medians). Bytes per rank are
counted from the tensors (expert weights, their gradients, AdamW's two states), not from RSS,
which hides what sharding saves.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

NUM_EXPERTS, TOP_K = 8, 2


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--target-s", type=float, default=None, help="seconds of steps per way per repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.tokens = 128, 352, 256
    repeats = args.repeats or (1 if args.quick else 7)
    target = args.target_s or (0.05 if args.quick else 0.5)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: .venv/bin/torchrun --nproc_per_node 2 benchmarks/moe_ep.py")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        from nxdt.hardware import machine_line

        print(machine_line(), flush=True)
    from torch.distributed.device_mesh import init_device_mesh

    from nxdt.models.moe import LlamaMoE, MoEArgs
    from nxdt.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)
    ep1 = LlamaMoE(args.hidden, args.ffn, MoEArgs(num_experts=NUM_EXPERTS, top_k=TOP_K)).train()
    for param in ep1.parameters():
        torch.nn.init.normal_(param, std=0.02)
    ep2 = copy.deepcopy(ep1)
    apply_expert_parallel(ep2, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    torch.manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(args.tokens, args.hidden)
    grad_out = torch.randn(args.tokens, args.hidden)

    def step_ep1():
        ep1(x).backward(grad_out)
        for param in ep1.experts.parameters():  # what data parallel does for replicated experts
            dist.all_reduce(param.grad)
            param.grad /= world

    def step_ep2():
        ep2(x).backward(grad_out)

    # the same numbers first
    step_ep1()
    step_ep2()
    with torch.no_grad():
        out_gap = (ep1(x) - ep2(x)).abs().max()
        grad_gap = max((a.grad - b.grad.full_tensor()).abs().max() for a, b in
                       zip(ep1.experts.parameters(), ep2.experts.parameters()))
    gaps = torch.stack([out_gap, grad_gap])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)

    times = {"ep1": [], "ep2": []}
    ways = {"ep1": step_ep1, "ep2": step_ep2}
    for r in range(repeats):
        for name in (("ep1", "ep2") if r % 2 == 0 else ("ep2", "ep1")):
            for module in (ep1, ep2):
                module.zero_grad(set_to_none=True)
            dist.barrier()
            n, t0 = 0, time.perf_counter()
            while True:
                ways[name]()
                n += 1
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ranks agree on when to stop
                if elapsed >= target:
                    break
            times[name].append(world * args.tokens * n / float(elapsed))
    if rank != 0:
        dist.destroy_process_group()
        return
    tps = {k: statistics.median(v) for k, v in times.items()}
    ratios = sorted(b / a for a, b in zip(times["ep1"], times["ep2"]))

    def expert_bytes(module):
        params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.experts.parameters())
        return params * 4, params * 4, params * 8  # fp32 weights, gradients, AdamW exp_avg + exp_avg_sq

    print(f"MoE layer: hidden {args.hidden}, ffn {args.ffn}, {NUM_EXPERTS} experts top-{TOP_K}, "
          f"{args.tokens} tokens per rank, {world} ranks (gloo, 1 thread each), fp32; {repeats} repeats, medians")
    print(f"same numbers: max |output gap| {float(gaps[0]):.1e}, max |expert gradient gap| {float(gaps[1]):.1e}")
    print(f"{'':8}{'tokens/s':>12}{'weights/rank':>16}{'grads/rank':>14}{'AdamW/rank':>14}")
    for name, module in (("ep1", ep1), ("ep2", ep2)):
        w, g, o = expert_bytes(module)
        print(f"{name:8}{tps[name]:>12,.0f}{w / 2**20:>13.1f}MiB{g / 2**20:>11.1f}MiB{o / 2**20:>11.1f}MiB")
    print(f"ep2 / ep1 tokens/s: {statistics.median(ratios):.2f}x (min {ratios[0]:.2f}, max {ratios[-1]:.2f}); "
          f"expert bytes per rank: 1/{world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
