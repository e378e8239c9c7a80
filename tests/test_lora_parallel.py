"""LoRA under tensor, sequence and data parallelism: one torchrun launch of 2 CPU ranks (gloo; this
file is also the worker). For a tiny native Llama with adapters on all seven linears (dropout 0, B
drawn non-zero so A's gradients are too), each layout's forward loss, adapter gradients and loss
after 3 AdamW steps equal one process's with the same weights and batch:

    tp2          adapters distributed like their base (colwise: A whole, B rows; rowwise: A columns, B whole)
    tp2_sp       the same with sequence parallel (o_proj / down_proj reduce-scatter to a sequence shard)
    fsdp         FSDP2 over 2 ranks, frozen base and trained adapters in the same block units
    zero1        replicate over 2 ranks, AdamW state sharded (ZeroRedundancyOptimizer over the adapters)
    tp2_kv1      tp2 with one K/V head: k_proj / v_proj replicated (KVHeadSelect), so are their adapters
    hf_tp2       transformers' LlamaForCausalLM (model_source hf) under tp2
    pp2          two pipeline stages (1F1B, 2 micro-batches): each stage's frozen base and adapters
                 (tp2_sp, fsdp, zero1 and pp2 also train peft's modules_to_save [embed_tokens, lm_head, norm]
                 in full: the vocabulary-parallel embedding and output layer, the replicated norms)
    meta_tp2     a meta-device build with adapters, parallelized and materialised: the weights of the
    meta_fsdp    same build initialised in one process (init_model_weights), adapters drawn as peft does
    tp2_dropout  lora_dropout 0.1 under tp2 (sharded and replicated DTensor inputs) trains: finite losses,
                 adapters updated (one process's dropout masks are not reproduced, nor meant to be)
    moe_ep2      a native Mixtral-style model with adapters on its experts (peft's target_parameters:
    moe_fsdp     gate_up_proj and down_proj, per expert) and on qkv_proj, under ep2 (the expert adapters
    moe_tp2      sharded with their experts), FSDP dp2 and tp2 (each expert's F split: gate_up_proj's B by
                 rows, down_proj's A by columns, the other factors whole, their gradients summed over tp),
                 the routers trained in full (modules_to_save [gate]): the losses of 6 AdamW steps and the
                 first gradients equal one process's

The config-level layouts (10 training steps through the run, pipeline included) are the run's tests.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import exit_worker, run_worker  # noqa: E402

V = 512
TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LAYOUTS = ["tp2", "tp2_sp", "tp2_kv1", "fsdp", "zero1", "hf_tp2", "pp2"]
SAVED = ["embed_tokens", "lm_head", "norm"]  # modules_to_save under SAVED_LAYOUTS
SAVED_LAYOUTS = ("tp2_sp", "fsdp", "zero1", "pp2")
MOE_LAYOUTS = ["moe_ep2", "moe_fsdp", "moe_tp2"]
EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(__file__, 2, tmp_path_factory.mktemp("lora_worker") / "results.json", "NXDT_TEST_OUT")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_layout_matches_one_process(results, layout):
    r = results[layout]
    if layout == "pp2":  # each stage holds one layer
        assert r["adapters"] == 14 and set(r["trainable"]) < set(r["trainable_ref"]), r
    else:
        assert r["trainable"] == r["trainable_ref"] and r["adapters"] == 28, r  # 2 layers x 7 linears x (A, B)
    # embed_tokens, lm_head, 2 x 2 + 1 norms; pp2's rank 0: the first stage's embed_tokens and layer 0's norms
    assert r["saved"] == {"pp2": 3}.get(layout, 7) if layout in SAVED_LAYOUTS else r["saved"] == 0, r
    assert r["loss"] < 1e-5 and r["grads"] < 1e-5 and r["loss_after_3_steps"] < 1e-5, r
    assert r["base_moved"] == 0.0, r  # the frozen base never changes
    assert r["grad_norm_nonzero"], r


@pytest.mark.slow
def test_lora_adapter_placements_follow_the_base(results):
    from torch.distributed.tensor import Replicate, Shard

    colwise, rowwise = [str(Replicate()), str(Shard(0))], [str(Shard(1)), str(Replicate())]  # (A, B)
    assert results["tp2"]["placements"] == {"self_attn.q_proj": colwise, "self_attn.k_proj": colwise,
                                            "self_attn.v_proj": colwise, "self_attn.o_proj": rowwise,
                                            "mlp.gate_proj": colwise, "mlp.up_proj": colwise,
                                            "mlp.down_proj": rowwise}


@pytest.mark.slow
def test_lora_adapters_of_replicated_kv_heads_are_replicated(results):
    from torch.distributed.tensor import Replicate, Shard

    p = results["tp2_kv1"]["placements"]
    assert p["self_attn.k_proj"] == p["self_attn.v_proj"] == [str(Replicate()), str(Replicate())]
    assert p["self_attn.q_proj"] == [str(Replicate()), str(Shard(0))]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "fsdp"])
def test_lora_meta_init_sharded_equals_one_process_init(results, layout):
    m = results[f"meta_{layout}"]
    assert m["max_abs_diff"] == 0.0 and m["b_zero"] and m["a_nonzero"], m


@pytest.mark.slow
def test_lora_dropout_under_tp_trains(results):
    r = results["tp2_dropout"]
    assert r["finite"] and r["adapters_moved"] and not r["base_moved"], r


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_lora_on_experts_layout_matches_one_process(results, layout):
    r = results[layout]
    assert r["trainable"] == r["trainable_ref"] and r["expert_adapters"] == 8, r  # 2 layers x 2 weights x (A, B)
    assert r["routers"] == 2, r  # modules_to_save [gate]: each layer's router weight, trained in full
    assert r["steps"] == 6 and r["losses"] < 1e-5 and r["grads"] < 1e-5, r
    assert r["base_moved"] == 0.0 and r["adapters_moved"], r
    if layout == "moe_ep2":  # each rank holds its 2 experts' adapters; a meta build draws them as one process
        assert r["meta_max_abs_diff"] == 0.0 and r["meta_b_zero"], r
        from torch.distributed.tensor import Shard

        assert r["placements"] == [str(Shard(0))] * 4 and r["local_experts"] == 2, r
    if layout == "moe_tp2":  # lora_A.gate_up_proj, lora_A.down_proj, lora_B.gate_up_proj, lora_B.down_proj
        from torch.distributed.tensor import Replicate, Shard

        assert r["placements"] == [str(p) for p in (Replicate(), Shard(2), Shard(1), Replicate())], r


# ----------------------------------------------------------------------------- the worker
def _cfg(layout: str):
    from nxdt.spec import config_from_dict

    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4,
             "num_kv_heads": 2, "make_vocab_size_divisible_by": 8}
    if layout == "tp2_kv1":
        model["num_kv_heads"] = 1
    if layout == "hf_tp2":
        model = {"model_config": "model_configs/tiny_llama", "num_layers": 2, "hidden_size": 64}
    tp = 2 if "tp2" in layout else 1
    return config_from_dict({
        "model_source": "hf" if layout.startswith("hf") else "megatron", "model": model,
        "distributed_strategy": {"tensor_model_parallel_size": tp, "sequence_parallel": layout == "tp2_sp",
                                 "zero1": layout == "zero1", "sharding_strategy": "FSDP" if layout == "fsdp" else None},
        "precision": {"type": "fp32"},
    })


def _lora_model(cfg, device=None, modules_to_save=()):
    """The model with adapters on every target, B non-zero (seeded: the same on every rank)."""
    from nxdt.models import build_model
    from nxdt.models.lora import inject_lora, lora_modules

    torch.manual_seed(0)
    model = build_model(cfg, V, device=device)
    inject_lora(model, TARGETS, rank=4, alpha=8.0, dropout=0.0, modules_to_save=modules_to_save)
    if device != "meta":
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_backward(model, ids) -> torch.Tensor:
    """Cross entropy of the model on `ids` (vocabulary-parallel logits under loss_parallel, which the
    backward needs too), backpropagated; returns the loss."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    from nxdt.models import logits_of
    from nxdt.parallel.tensor_parallel import is_vocab_parallel
    from nxdt.training.loss import masked_token_loss

    logits = logits_of(model(input_ids=ids))
    with loss_parallel() if is_vocab_parallel(logits) else nullcontext():
        loss = masked_token_loss(logits, ids, torch.ones(ids.shape))  # the run's loss (and the pipeline's)
        loss.backward()
    return loss.detach()


def _layout_case(layout: str, rank: int) -> dict:  # pragma: no cover - under torchrun
    from types import SimpleNamespace

    import torch.distributed as dist

    from nxdt.models.lora import lora_modules, trainable_state_keys
    from nxdt.parallel.data_parallel import zero1_optimizer
    from nxdt.parallel.mesh import build_mesh, submesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama
    from nxdt.parallel.pipeline import build_pipeline, model_of
    from nxdt.training.loss import masked_token_loss
    from nxdt.optim.optimizers import param_groups

    cfg = _cfg(layout)
    shapes = {"fsdp": Layout(dp_shard=2), "zero1": Layout(dp_replicate=2), "pp2": Layout(pp=2)}
    shape = shapes.get(layout, Layout(tp=2))
    mesh = build_mesh(shape, "cpu")
    saved = SAVED if layout in SAVED_LAYOUTS else ()
    ref = _lora_model(cfg, modules_to_save=saved)
    ids = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    dp = shape.dp > 1
    mine = ids[2 * rank:2 * rank + 2] if dp else ids  # data parallel: each rank half the batch
    if layout == "pp2":  # this rank's stage; the schedule's step: forward + backward, the loss on every rank
        pipe = build_pipeline(_lora_model(cfg, modules_to_save=saved), mesh, cfg, Layout(pp=2, num_microbatches=2),
                              torch.device("cpu"), loss_fn=masked_token_loss, parallelize_fn=parallelize_llama)
        model = model_of(pipe)
        run = lambda x: pipe.step(x, x, torch.ones(x.shape))  # noqa: E731
    else:
        model = parallelize_llama(_lora_model(cfg, modules_to_save=saved), mesh, cfg)
        run = lambda x: _loss_backward(model, x)  # noqa: E731
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.0), lr=1e-2)
    if layout == "zero1":
        opt = zero1_optimizer(param_groups(model, 0.0), torch.optim.AdamW, {"lr": 1e-2},
                              submesh(mesh, "dp").get_group())
    else:
        opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-2)
    base_before = {n: _full(p).detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out: dict = {"trainable": trainable_state_keys(model), "trainable_ref": trainable_state_keys(ref),
                 "adapters": sum(".lora_" in n for n in trainable_state_keys(model)),
                 "saved": sum(".lora_" not in n for n in trainable_state_keys(model))}
    for step in range(4):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        ref_loss = _loss_backward(ref, ids).item()
        loss = _full(run(mine)).clone()
        if dp:  # each rank's mean over the same number of tokens: the mean of the means
            dist.all_reduce(loss)
            loss /= 2
        if step == 0:
            out["loss"] = abs(ref_loss - loss.item())
            grads = torch.tensor(max((_full(p.grad) - ref.get_parameter(n).grad).abs().max().item()
                                     for n, p in model.named_parameters() if p.requires_grad))
            dist.all_reduce(grads, op=dist.ReduceOp.MAX)  # pp: each rank checks its own stage
            out["grads"] = grads.item()
            out["grad_norm_nonzero"] = all(float(ref.get_parameter(n).grad.norm()) > 0
                                           for n in out["trainable_ref"])
        if step == 3:
            out["loss_after_3_steps"] = abs(ref_loss - loss.item())
            break
        ref_opt.step()
        opt.step()
    out["base_moved"] = max((_full(model.get_parameter(n)).detach() - b).abs().max().item()
                            for n, b in base_before.items())
    if layout in ("tp2", "tp2_kv1"):
        layer = "model.layers.0."
        out["placements"] = {path[len(layer):]: [str(m.lora_A.weight.placements[0]),
                                                 str(m.lora_B.weight.placements[0])]
                             for path, m in lora_modules(model).items() if path.startswith(layer)}
    return out


def _meta_case(layout: str) -> dict:  # pragma: no cover - under torchrun
    """Meta build + inject + tp2 / FSDP + materialise = meta build + inject + init_model_weights in one process."""
    from nxdt.models import build_model, init_model_weights
    from nxdt.models.lora import inject_lora, lora_modules
    from nxdt.parallel.mesh import build_mesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama

    cfg = _cfg(layout)
    cfg.distributed_strategy.meta_init = True
    shape = Layout(tp=2) if layout == "tp2" else Layout(dp_shard=2)
    torch.manual_seed(3)
    model = build_model(cfg, V, device="meta")
    inject_lora(model, TARGETS, rank=4, alpha=8.0)
    model = parallelize_llama(model, build_mesh(shape, "cpu"), cfg, device="cpu")
    torch.manual_seed(3)
    ref = build_model(cfg, V, device="meta")
    inject_lora(ref, TARGETS, rank=4, alpha=8.0)
    init_model_weights(ref, "cpu")
    mods = lora_modules(model).values()
    return {"max_abs_diff": max((_full(p).detach() - ref.get_parameter(n)).abs().max().item()
                                for n, p in model.named_parameters()),
            "b_zero": all(float(_full(m.lora_B.weight).abs().max()) == 0 for m in mods),
            "a_nonzero": all(float(_full(m.lora_A.weight).abs().min()) > 0 for m in mods)}


def _dropout_case() -> dict:  # pragma: no cover - under torchrun
    from nxdt.models import build_model
    from nxdt.models.lora import inject_lora, lora_modules
    from nxdt.parallel.mesh import build_mesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama

    cfg = _cfg("tp2")
    torch.manual_seed(0)
    model = build_model(cfg, V)
    inject_lora(model, TARGETS, rank=4, alpha=8.0, dropout=0.1)
    model = parallelize_llama(model, build_mesh(Layout(tp=2), "cpu"), cfg).train()
    before = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        losses.append(_loss_backward(model, ids).item())
        opt.step()
    moved = {n: not torch.equal(_full(p).detach(), before[n]) for n, p in model.named_parameters()}
    lora = {n for path in lora_modules(model) for n in (f"{path}.lora_A.weight", f"{path}.lora_B.weight")}
    return {"finite": all(map(math.isfinite, losses)), "adapters_moved": all(moved[n] for n in lora),
            "base_moved": any(m for n, m in moved.items() if n not in lora)}


def _moe_case(layout: str, rank: int) -> dict:  # pragma: no cover - under torchrun
    """LoRA on the experts (and qkv_proj) under ep2 or FSDP dp2 against one process, 6 AdamW steps."""
    import torch.distributed as dist

    from nxdt.models import build_model
    from nxdt.models.lora import inject_lora, trainable_state_keys
    from nxdt.models.lora_experts import lora_experts
    from nxdt.parallel.mesh import build_mesh
    from nxdt.parallel.parallelize import parallelize_llama
    from nxdt.spec import config_from_dict
    from nxdt.spec.layout import Layout

    ep, tp = layout == "moe_ep2", layout == "moe_tp2"
    cfg = config_from_dict({
        "model_source": "megatron", "precision": {"type": "fp32"},
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
                  "num_kv_heads": 2, "make_vocab_size_divisible_by": 8, "moe": {"num_experts": 4, "top_k": 2}},
        "distributed_strategy": {"expert_model_parallel_size": 2 if ep else 1, "tensor_model_parallel_size": 2 if tp else 1,
                                 "sharding_strategy": None if ep or tp else "FSDP"}})

    def lora_model():
        torch.manual_seed(0)
        model = build_model(cfg, V)
        inject_lora(model, ["qkv_proj"], rank=4, alpha=8.0, dropout=0.0, target_parameters=EXPERT_TARGETS,
                    modules_to_save=["gate"])  # the routers trained in full (peft's modules_to_save)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # B non-zero, so that A's gradients are too
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return model

    ref = lora_model()
    mesh = build_mesh(Layout(dp_replicate=2, ep=2) if ep else Layout(tp=2) if tp else Layout(dp_shard=2), "cpu")
    model = parallelize_llama(lora_model(), mesh, cfg)
    ids = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    mine = ids if tp else ids[2 * rank:2 * rank + 2]  # tp: every rank the whole batch
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    out: dict = {"trainable": trainable_state_keys(model), "trainable_ref": trainable_state_keys(ref),
                 "expert_adapters": sum(".experts.lora_" in n for n in trainable_state_keys(model)), "losses": 0.0,
                 "routers": sum(".mlp.gate." in n for n in trainable_state_keys(model))}
    for step in range(6):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        ref_loss = _loss_backward(ref, ids).item()
        loss = _full(_loss_backward(model, mine)).clone()
        dist.all_reduce(loss)
        out["losses"] = max(out["losses"], abs(ref_loss - loss.item() / 2))
        if step == 0:
            out["grads"] = max((_full(p.grad) - ref.get_parameter(n).grad).abs().max().item()
                               for n, p in model.named_parameters() if p.requires_grad)
        ref_opt.step()
        opt.step()
        out["steps"] = step + 1
    moved = {n: not torch.equal(_full(p).detach(), before[n]) for n, p in model.named_parameters()}
    out["base_moved"] = max((_full(p).detach() - before[n]).abs().max().item()
                            for n, p in model.named_parameters() if not p.requires_grad)
    out["adapters_moved"] = all(moved[n] for n in out["trainable"])
    if ep:
        out.update(_meta_moe_case(cfg, mesh))
        experts = next(iter(lora_experts(model).values()))
        out["placements"] = [str(p.placements[0]) for n, p in experts.named_parameters() if ".lora_" in f".{n}"]
        out["local_experts"] = experts.lora_A.gate_up_proj.to_local().shape[0]
    if tp:
        experts = next(iter(lora_experts(model).values()))
        out["placements"] = [str(p.placements[0]) for n, p in experts.named_parameters() if ".lora_" in f".{n}"]
    return out


def _meta_moe_case(cfg, mesh) -> dict:  # pragma: no cover - under torchrun
    """Meta build + expert adapters + ep2 + materialise = the same build initialised in one process."""
    from nxdt.models import build_model, init_model_weights
    from nxdt.models.lora import inject_lora
    from nxdt.parallel.parallelize import parallelize_llama

    cfg.distributed_strategy.meta_init = True
    models = []
    for parallel in (True, False):
        torch.manual_seed(3)
        model = build_model(cfg, V, device="meta")
        inject_lora(model, ["qkv_proj"], rank=4, alpha=8.0, target_parameters=EXPERT_TARGETS)
        models.append(parallelize_llama(model, mesh, cfg, device="cpu") if parallel else init_model_weights(model, "cpu"))
    model, ref = models
    return {"meta_max_abs_diff": max((_full(p).detach() - ref.get_parameter(n)).abs().max().item()
                                     for n, p in model.named_parameters()),
            "meta_b_zero": all(float(_full(p).abs().max()) == 0 for n, p in model.named_parameters()
                               if ".lora_B." in n)}


def _worker() -> None:  # pragma: no cover - runs under torchrun
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {layout: _layout_case(layout, rank) for layout in LAYOUTS}
    results.update({f"meta_{layout}": _meta_case(layout) for layout in ("tp2", "fsdp")})
    results["tp2_dropout"] = _dropout_case()
    results.update({layout: _moe_case(layout, rank) for layout in MOE_LAYOUTS})
    if rank == 0:
        Path(os.environ["NXDT_TEST_OUT"]).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
    exit_worker()
