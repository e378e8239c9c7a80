"""How long a checkpoint save blocks the training loop: sync vs async, same model, one run.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint.py [--hidden 512 --layers 8 --repeats 3]

A native Llama with AdamW state (one optimizer step taken) is saved through
`nxdt.checkpoint.checkpointer.Checkpointer` — the code path training uses — in one process. "blocked" is
the time `save()` holds the caller: the whole write when synchronous; staging the tensors to
CPU memory and starting the writer thread when asynchronous. "total" for async is until the
checkpoint is complete (marker written, renamed), measured while training steps keep running.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nxdt.checkpoint.checkpointer import Checkpointer  # noqa: E402
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM  # noqa: E402


class _Strategy(SimpleNamespace):
    def barrier(self, *_):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from nxdt.hardware import machine_line

    print(machine_line(), flush=True)

    torch.manual_seed(0)
    model = NxdtLlamaForCausalLM(LlamaArgs(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                                           num_attention_heads=8, ffn_hidden_size=a.hidden * 11 // 4))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, a.vocab, (2, 64))

    def step():
        optimizer.zero_grad()
        model(ids).float().logsumexp(-1).mean().backward()
        optimizer.step()

    step()
    n_params = sum(p.numel() for p in model.parameters())
    state_mb = n_params * 4 * 3 / 2**20
    strategy = _Strategy(global_rank=0, world_size=1, optimizers=[optimizer],
                         lightning_module=SimpleNamespace(model=model, layout=None))
    results: dict[str, list[float]] = {"sync": [], "async": [], "async_total": []}
    steps_during: list[int] = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(a.repeats):
            for mode in ("sync", "async"):
                ckpt = Checkpointer(async_save=(mode == "async"))
                path = Path(root) / f"{mode}-{i}"
                t0 = time.perf_counter()
                ckpt.save(strategy, {"global_step": i}, path)
                results[mode].append(time.perf_counter() - t0)
                if mode == "async":
                    n = 0
                    while ckpt.in_flight:  # training goes on while the writer thread works
                        step()
                        n += 1
                        ckpt.poll()
                    results["async_total"].append(time.perf_counter() - t0)
                    steps_during.append(n)
                assert (path / "COMPLETE").is_file()

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"model: {n_params / 1e6:.1f} M parameters, model + AdamW state {state_mb:.0f} MiB, "
          f"{a.repeats} saves each, medians")
    print(f"  sync  save blocks the loop   {med['sync'] * 1e3:8.1f} ms")
    print(f"  async save blocks the loop   {med['async'] * 1e3:8.1f} ms   "
          f"(complete after {med['async_total'] * 1e3:.1f} ms, {statistics.median(steps_during):.0f} "
          "training steps ran meanwhile)")
    print(f"  blocked time sync / async    {med['sync'] / med['async']:8.1f}x")


if __name__ == "__main__":
    main()
