"""Precision across ranks: fp16 loss scaling with pipeline stages, the one overflow verdict for all
ranks, and stochastic rounding of FSDP2's bf16 all-gather (mixed_precisionSR + FSDP).

The 2-rank checks of the pieces run in forked processes (gloo, no re-import: 2-10 s each); the
end-to-end proof that examples/train.py wires fp16 through pipeline stages is the fp16_pp2 layout
of tests/test_parallel_layouts.py. All are multi-process, so marked slow.
"""

from __future__ import annotations

import json
import multiprocessing
import math
import os

import pytest
import torch
import torch.distributed as dist
from test_precision import MODEL, VOCAB, _as_batch, _data, train_curve

from nxdt.spec import build_spec, load_config
from nxdt.models import build_model
from nxdt.parallel.mesh import build_mesh
from nxdt.spec.layout import Layout
from nxdt.precision.precision import Precision
from nxdt.optim.optimizers import build_optimizer
from nxdt.training.step import microbatch_forward_backward, pipeline_forward_backward, train_step

# the presets' tolerance on |loss - reference loss| (test_precision.PRESETS, docs/precision.md)
TOL = 0.05


def _cfg(*overrides: str, world: int = 2):
    return load_config(["--config-name", "tiny_llama_cpu", *MODEL, f"trainer.devices={world}", *overrides],
                       world_size=world, check_paths=False, quiet=True)


def _entry(rank: int, worker, tmp_path, nprocs: int) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=rank, world_size=nprocs)
    try:
        (tmp_path / f"out{rank}.json").write_text(json.dumps(worker(rank, nprocs)))
    finally:
        dist.destroy_process_group()


def _spawn(worker, tmp_path, nprocs: int = 2) -> list:
    """Run `worker(rank, world)` in `nprocs` processes with a gloo group; their JSON results.

    Forked from a forkserver (started once per pytest worker, this module preloaded), not from the
    pytest worker itself: by the time these tests run, earlier tests have left threads in it (gloo,
    TensorBoard writers, pyarrow's pool), and a fork of a multi-threaded process can crash the child
    (seen once in the suite: SIGSEGV in rank 1)."""
    multiprocessing.set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(_entry, args=(worker, tmp_path, nprocs), nprocs=nprocs,
                                          start_method="forkserver", join=True)
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(nprocs)]


# ----------------------------------------------------------------------------- fp16 + pipeline
def _pp_fp16_worker(rank: int, world: int) -> dict:
    from nxdt.spec.layout import compute_layout
    from nxdt.parallel.pipeline import build_pipeline, model_of
    from nxdt.training.loss import masked_token_loss

    cfg = _cfg("model.num_layers=2", "distributed_strategy.pipeline_model_parallel_size=2",
               "data.micro_batch_size=1", "data.global_batch_size=4", "precision.fp16.enabled=true",
               "precision.fp16.initial_scale_power=24", "precision.fp16.hysteresis=1",
               "precision.fp16.max_consecutive_skips=20", "model.optim.lr=1e-2")
    torch.manual_seed(0)
    prec = Precision.from_spec(build_spec(cfg), rank=rank)
    mesh = build_mesh(Layout(pp=2), "cpu")
    pipe = build_pipeline(prec.convert_model(build_model(cfg, VOCAB)), mesh, cfg, compute_layout(cfg, world),
                          torch.device("cpu"), loss_fn=masked_token_loss, loss_scale=lambda: prec.loss_scale)
    model = model_of(pipe)
    prec.attach(model, delegate=True)
    opt = build_optimizer(model, cfg.model.optim)
    records = []
    fwd_bwd = pipeline_forward_backward(pipe, prec)  # the module's pipeline step, without Lightning
    for step, b in enumerate(_data(12)):
        m = train_step(model, opt, None, prec, fwd_bwd, _as_batch(b), step=step, clip=1.0,
                       norm_over_stages=pipe.norm_over_stages)
        records.append([m.applied, prec.loss_scale, float(m.loss)])

    # the verdict is all ranks' together: an overflow seen by rank 1 alone skips the step on both
    agree = Precision.from_spec(build_spec(_cfg("precision.fp16.enabled=true", "precision.fp16.hysteresis=1")), rank=rank)
    own = torch.tensor(math.inf if rank == 1 else 1.0)
    verdicts = [agree.check_step(0, torch.tensor(2.0), own, model),
                agree.check_step(1, torch.tensor(2.0), torch.tensor(1.0), model)]
    return {"records": records, "scaler": prec.state_dict()["scaler"], "verdicts": verdicts,
            "agree_scale": agree.loss_scale, "agree_skipped": agree.skipped_steps}


@pytest.mark.slow
def test_fp16_pipeline_overflow_skips_on_both_stages_together(tmp_path):
    r0, r1 = _spawn(_pp_fp16_worker, tmp_path)
    print("\npp2 fp16 from 2**24, (applied, scale after the step, loss) per step:\n" +
          "\n".join(f"  {step}: {rec}" for step, rec in enumerate(r0["records"])))
    assert r0["records"] == r1["records"]  # same skips, same scale, same reported loss on both stages
    assert r0["scaler"] == r1["scaler"]  # the whole scaler state (what checkpoints carry)
    # 2**24 and 2**23 times a token's loss gradient (1/64 here) overflow fp16 for certain: skipped,
    # the scale halving each time; once it is low enough the steps apply and the scale stays
    assert [rec[:2] for rec in r0["records"][:2]] == [[False, 2.0**23], [False, 2.0**22]]
    skips = [rec for rec in r0["records"] if not rec[0]]
    assert [rec[1] for rec in skips] == [2.0 ** (23 - i) for i in range(len(skips))]
    assert r0["records"][:len(skips)] == skips and len(skips) <= 7  # skips first, then it trains
    assert r0["scaler"]["scale"] == 2.0 ** (24 - len(skips)) and r0["scaler"]["cur_iter"] == 12
    assert all(5.0 < rec[2] < 6.0 for rec in r0["records"])  # the unscaled loss (log 256 = 5.55 at init)
    for r in (r0, r1):
        assert r["verdicts"] == [False, True] and r["agree_scale"] == 2.0**15 and r["agree_skipped"] == 1


# ----------------------------------------------------------------------------- SR under FSDP2
def _sr_unit_worker(rank: int, world: int) -> dict:
    """A Linear sharded by FSDP2 whose fp32 master weights sit between two bf16 values."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nxdt.precision.sr_fsdp import SRState, StochasticRoundingShard, wrap_for_stochastic_rounding

    out = {}
    for sr in (True, False):
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 5, bias=False)  # 5 rows over 2 ranks: uneven shards (3 + 2, padded)
        with torch.no_grad():  # 1/8, 1/2 and 7/8 of a bf16 ulp above 1, 2**-4 and -3
            lin.weight.copy_(torch.tensor([1.0, 2.0**-4, -3.0]).repeat(27)[:80].view(5, 16)
                             * (1 + torch.tensor([1 / 8, 1 / 2, 7 / 8]).repeat_interleave(27)[:80].view(5, 16) / 2**7))
        master = lin.weight.detach().clone()
        state = SRState(seed=7 + rank)
        if sr:
            wrap_for_stochastic_rounding(lin, state)
        mesh = build_mesh(Layout(dp_shard=2), "cpu")["dp_shard"]
        fully_shard(lin, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.float32))
        seen, dtypes = [], set()

        def record(m, args):  # after FSDP2's own pre-forward hook: the gathered compute weight
            dtypes.add(str(m.weight.dtype))
            seen.append(m.weight.detach().float().clone())

        lin.register_forward_pre_hook(record)
        n = 400
        for step in range(n):
            state.step = step
            lin(torch.randn(2, 16)).float().sum().backward()
        w = torch.stack(seen)
        lo = master.to(torch.bfloat16).float()
        ulp = 2.0**-7 * 2.0 ** torch.floor(torch.log2(master.abs()))
        res = {"dtype": sorted(dtypes), "max_err_ulps": float(((w.mean(0) - master) / ulp).abs().max()),
               "neighbours": bool(((w - master).abs() < ulp).all()), "rtn_err_ulps": float(((lo - master) / ulp).abs().max()),
               "grad_dtype": str(lin.weight.grad.dtype)}
        if sr:
            shard = lin.weight.to_local()
            args = (mesh, lin.weight.shape, lin.weight.stride(), lin, None)
            state.step = 5
            a, b = shard.fsdp_pre_all_gather(*args)[0][0], shard.fsdp_pre_all_gather(*args)[0][0]
            state.step = 6
            c = shard.fsdp_pre_all_gather(*args)[0][0]
            res.update(subclass=isinstance(shard, StochasticRoundingShard), same_step_same_bits=bool(torch.equal(a, b)),
                       new_step_new_bits=not torch.equal(a, c), pickled=type(torch.load(_roundtrip(shard))).__name__)
        out["sr" if sr else "rtn"] = res
    return out


def _roundtrip(t: torch.Tensor):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return buf


@pytest.mark.slow
def test_fsdp_all_gather_rounds_stochastically(tmp_path):
    """The bf16 weights FSDP2 gathers for the forward average to the fp32 masters: over 400 steps
    within 1/8 ulp (one draw's std is <= 1/2 ulp, the mean's <= 1/40: 5 sigma). Round-to-nearest,
    FSDP2's own cast, is off by up to 1/2 ulp on the same values, at every step."""
    for res in _spawn(_sr_unit_worker, tmp_path):
        sr, rtn = res["sr"], res["rtn"]
        print(f"\nmean compute weight - fp32 master: stochastic rounding {sr['max_err_ulps']:.3f} ulp, "
              f"round-to-nearest {rtn['max_err_ulps']:.3f} ulp")
        assert sr["dtype"] == rtn["dtype"] == ["torch.bfloat16"] and sr["grad_dtype"] == "torch.float32"
        assert sr["subclass"] and sr["neighbours"] and sr["max_err_ulps"] < 0.125
        assert rtn["max_err_ulps"] > 0.35 and rtn["max_err_ulps"] == pytest.approx(rtn["rtn_err_ulps"])
        # forward and backward (a re-gather) of one step see the same bits; checkpoints see plain tensors
        assert sr["same_step_same_bits"] and sr["new_step_new_bits"] and sr["pickled"] == "Tensor"


def _fsdp_sr_curve_worker(rank: int, world: int) -> dict:
    """test_precision.train_curve's run (same init, data, 100 steps) with each of its two micro-batches
    on its own rank, the model sharded by FSDP2 through nxdt's parallelize_llama."""
    from nxdt.parallel.parallelize import parallelize_llama
    from nxdt.precision.sr_fsdp import StochasticRoundingShard
    from nxdt.training.builder import build_harness

    cfg = _cfg("precision.type=mixed_precisionSR", "distributed_strategy.sharding_strategy=FSDP", "model.optim.lr=3e-3")
    mesh = build_mesh(Layout(dp_shard=2), "cpu")
    h = build_harness(cfg, VOCAB, rank=rank, parallelize=lambda m: parallelize_llama(m, mesh, cfg), max_steps=100)
    model = h.model
    fwd_bwd = microbatch_forward_backward(model, h.precision, 1)

    def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        return reduced / world

    data, losses = _data(), []
    for step in range(100):  # the module's training_step, without Lightning
        b = data[step % len(data)][2 * rank: 2 * rank + 2]
        m = train_step(model, h.optimizer, h.scheduler, h.precision, fwd_bwd, _as_batch(b), step=step, clip=1.0,
                       reduce_loss=mean_over_ranks)
        assert m.applied
        losses.append(float(m.loss))
    with torch.no_grad():
        kinds = {type(p.to_local()).__name__ for p in model.parameters()}
        grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return {"losses": losses, "kinds": sorted(kinds), "grads": sorted(grads),
            "sr": all(isinstance(p.to_local(), StochasticRoundingShard) for p in model.parameters())}


@pytest.mark.slow
def test_fsdp_mixed_precisionSR_tracks_one_rank_and_fp32(tmp_path):
    r0, r1 = _spawn(_fsdp_sr_curve_worker, tmp_path)
    assert r0["losses"] == r1["losses"] and r0["sr"] and r0["grads"] == ["torch.float32"]
    one_rank = train_curve("precision.type=mixed_precisionSR")[0]
    fp32 = train_curve("precision.type=fp32")[0]
    gap_sr = max(abs(a - b) for a, b in zip(r0["losses"], one_rank))
    gap_fp32 = max(abs(a - b) for a, b in zip(r0["losses"], fp32))
    print(f"\nfsdp dp2 mixed_precisionSR over 100 steps: max |loss - 1-rank mixed_precisionSR| = {gap_sr:.4f}, "
          f"max |loss - fp32| = {gap_fp32:.4f} (tolerance {TOL}); final {r0['losses'][-1]:.4f} vs fp32 {fp32[-1]:.4f}")
    assert fp32[-1] < fp32[0] - 1.0
    assert gap_sr < TOL and gap_fp32 < TOL


# ----------------------------------------------------------------------------- DTensor parameters
def _dtensor_swap_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from nxdt.models.llama import LlamaRMSNorm

    prec = Precision.from_spec(build_spec(_cfg("precision.type=mixed_precision")), rank=rank)
    norm = parallelize_module(LlamaRMSNorm(8), init_device_mesh("cpu", (world,)), SequenceParallel(use_local_output=True))
    prec.attach(norm)
    master = norm.weight.to_local()
    prec.begin_step(norm)
    during = [str(norm.weight.dtype), str(norm.weight.to_local().dtype)]
    out = norm(torch.randn(1, 4, 8).to(torch.bfloat16))  # this rank's sequence shard
    out.float().sum().backward()
    prec.finish_grads(norm)
    return {"during": during, "out": str(out.dtype), "after": [str(norm.weight.dtype), str(norm.weight.to_local().dtype)],
            "master_back": norm.weight.to_local().data_ptr() == master.data_ptr(), "grad": str(norm.weight.grad.dtype)}


def test_sequence_parallel_norm_weights_compute_in_bf16_under_master_weights(tmp_path):
    """mixed_precision swaps bf16 copies into the parameters for the step: a sequence-parallel norm's
    weight is a DTensor, whose local shard (what its ops compute with) must be swapped too, and the
    fp32 master put back after the backward (else the norm computes in fp32 while claiming bf16, and
    full activation checkpointing's recompute sees the other dtype: NxDT's DPO config, shrunk)."""
    for res in _spawn(_dtensor_swap_worker, tmp_path):
        assert res == {"during": ["torch.bfloat16"] * 2, "out": "torch.bfloat16",
                       "after": ["torch.float32"] * 2, "master_back": True, "grad": "torch.float32"}, res
