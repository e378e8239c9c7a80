"""Context parallel pieces against one process, on a real 4-rank gloo group (torchrun).

End-to-end cp layouts are in tests/test_parallel_layouts.py (cp2 only: two ranks per group).
Here cp = 4 exercises every branch of the head-tail ring (rank r sees blocks of earlier,
later and its own chunks), with GQA shapes, a loss mask that differs between slices, and
gradients of q, k, v.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import exit_worker, run_worker


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from nxdt.parallel.context_parallel import RingSDPA, shard_sequence
    from nxdt.training.loss import masked_token_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    b, h, kv, s, d, vocab = 2, 4, 2, 32, 8, 11
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, kv, s, d, requires_grad=True)
    v = torch.randn(b, kv, s, d, requires_grad=True)
    grad_out = torch.randn(b, h, s, d)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                         is_causal=True)
    ref.backward(grad_out)

    # Cut [B, H, S, D] tensors along S exactly as shard_sequence cuts [B, S] batches: via
    # position ids, which record each local token's global index.
    positions = shard_sequence({"input_ids": torch.zeros(b, s, dtype=torch.long)}, mesh)["position_ids"][0]

    def local(t):
        return t.detach()[:, :, positions].clone().requires_grad_(t.requires_grad)

    ql, kl, vl = local(q), local(k), local(v)
    out = RingSDPA(mesh.get_group())(ql, kl.repeat_interleave(h // kv, 1), vl.repeat_interleave(h // kv, 1),
                                     is_causal=True)
    out.backward(grad_out[:, :, positions])
    gaps = {
        "out": (out - ref.detach()[:, :, positions]).abs().max().item(),
        "dq": (ql.grad - q.grad[:, :, positions]).abs().max().item(),
        "dk": (kl.grad - k.grad[:, :, positions]).abs().max().item(),
        "dv": (vl.grad - v.grad[:, :, positions]).abs().max().item(),
    }

    # Loss: slices hold different numbers of unmasked tokens; the mean over the cp ranks of
    # each rank's loss must be the whole sequence's masked mean.
    logits = torch.randn(b, s, vocab)
    labels = torch.randint(0, vocab, (b, s))
    loss_mask = (torch.rand(b, s) < 0.3).float()
    loss_mask[:, : s // 2] = 1.0  # early chunks dense, late ones sparse
    whole = masked_token_loss(logits, labels, loss_mask)
    batch = shard_sequence({"input_ids": labels, "labels": labels, "loss_mask": loss_mask,
                            "logits_index": torch.arange(s).expand(b, s)}, mesh)
    idx = batch["logits_index"][0]
    part = masked_token_loss(logits[:, idx], batch["labels"], batch["loss_mask"], mesh.get_group())
    mean = part.detach().clone()
    dist.all_reduce(mean)
    result = {"gaps": gaps, "positions": positions.tolist(), "loss_gap": abs(mean.item() / world - whole.item())}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(__file__, 4, tmp_path_factory.mktemp("cp") / "results.json", "NXDT_CP_TEST_OUT")


@pytest.mark.slow
def test_ring_attention_cp4_matches_full_attention(results):
    for rank, r in enumerate(results):
        assert max(r["gaps"].values()) < 1e-5, (rank, r["gaps"])


@pytest.mark.slow
def test_head_tail_slices_cover_the_sequence_once(results):
    # 32 tokens in 8 chunks of 4: rank r holds chunks r and 7 - r
    assert results[1]["positions"] == [4, 5, 6, 7, 24, 25, 26, 27]
    assert sorted(p for r in results for p in r["positions"]) == list(range(32))


@pytest.mark.slow
def test_cp_loss_is_the_whole_sequence_mean_with_uneven_masks(results):
    for r in results:
        assert r["loss_gap"] < 1e-6, r


if __name__ == "__main__":
    _worker(os.environ["NXDT_CP_TEST_OUT"])
    exit_worker()
