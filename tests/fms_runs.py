"""The runs of tests/test_data_arrow.py's 2-rank launch (conftest.run_pool's `entry`): training
command lines go to nxdt's training entry; `reduce-check` checks precision.grad_reduce_dtype on
FSDP2 itself (fms-fsdp's bfSixteen reduces gradients in bf16, nxdt's default in fp32)."""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nxdt.parallel.data_parallel import data_parallel_config
from nxdt.spec.precision import precision_settings
from nxdt.tools.train import main as train_main


def _grads(reduce: str, mesh) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the FSDP-reduced gradients, gathered full; every rank's local bf16 gradients, stacked)."""
    pcfg = types.SimpleNamespace(type="mixed_precision", fp16=types.SimpleNamespace(enabled=False),
                                 grad_reduce_dtype=reduce)
    sharding = types.SimpleNamespace(shard=True, reshard_after_forward=True)
    policy = data_parallel_config(sharding, precision_settings(pcfg)).mp_policy
    assert policy.param_dtype == torch.bfloat16
    assert policy.reduce_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce], policy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))
    reference = copy.deepcopy(model).to(torch.bfloat16)  # what each rank computes before the reduction
    fully_shard(model, mesh=mesh, mp_policy=policy)
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(16, 64)
    model(x).float().pow(2).sum().backward()
    reference(x.to(torch.bfloat16)).float().pow(2).sum().backward()
    reduced = [p.grad.full_tensor() for p in model.parameters()]
    local = []
    for p in reference.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, p.grad)
        local.append(torch.stack(parts))
    return reduced, local


def reduce_check() -> int:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    got32, local = _grads("fp32", mesh)
    got16, local16 = _grads("bf16", mesh)
    differ = 0
    for g32, g16, lo, lo16 in zip(got32, got16, local, local16):
        assert torch.equal(lo, lo16)
        want32 = lo.float().sum(0) / lo.shape[0]  # fp32 sum of the bf16 gradients
        want16 = (lo.sum(0, dtype=torch.bfloat16) / lo.shape[0]).float()  # the sum rounded to bf16
        assert g32.dtype == g16.dtype == torch.float32  # FSDP hands fp32 gradients to the fp32 master
        assert torch.equal(g32, want32), (g32 - want32).abs().max()
        assert torch.equal(g16, want16), (g16 - want16).abs().max()
        assert ((g16 - g32).abs() <= g32.abs() * 2**-8 + 1e-30).all()  # one bf16 rounding apart
        differ += int((g16 != g32).sum())
    assert differ > 0, "bf16 reduction gave the fp32 result everywhere"
    print(f"reduce-check: bf16 = bf16 reference, fp32 = fp32 reference; {differ} gradient entries differ "
          f"by bf16 rounding")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["reduce-check"]:
        return reduce_check()
    return train_main(argv)
