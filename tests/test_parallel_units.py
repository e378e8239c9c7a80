"""Parallel engine pieces: activation checkpointing (in process), config errors, and one torchrun
launch checking ZeRO-1 optimizer bytes and meta-device initialisation (this file is also the worker)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from nxdt.spec import config_from_dict
from nxdt.spec import build_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import exit_worker, run_worker  # noqa: E402
from test_config import error, load  # noqa: E402
from test_pipeline import BLOCKS  # noqa: E402


def _dp_sections(cfg):
    """data_parallel_config takes the run spec's sharding and precision settings."""
    spec = build_spec(cfg)
    return spec.sharding, spec.precision


def tiny_cfg(**model):
    return config_from_dict({
        "model_source": "megatron",
        "model": {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4,
                  "num_kv_heads": 2, "make_vocab_size_divisible_by": 8, "activations_checkpoint_granularity": None,
                  "activations_checkpoint_recompute": None, "activations_checkpoint_recompute_mlp": False,
                  "selective_checkpointing": None, **model},
        "distributed_strategy": {"tensor_model_parallel_size": 1, "sequence_parallel": False, "zero1": False,
                                 "sharding_strategy": None, "fsdp": False, "cpu_offload": False,
                                 "low_cpu_fsdp": False, "meta_init": False},
        "precision": {"type": "fp32"},
    })


# ----------------------------------------------------------------------------- activation checkpointing
def _loss_and_grads(cfg, checkpointed: bool):
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules

    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=512)
    names = checkpointed_modules(apply_activation_checkpointing(model, cfg.model)) if checkpointed else []
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, names


@pytest.mark.parametrize("model_keys, expected", [
    ({"activations_checkpoint_granularity": "full"}, [f"model.layers.{i}" for i in range(4)]),
    ({"activations_checkpoint_granularity": "selective"},
     [f"model.layers.{i}.self_attn.core_attention" for i in range(4)]),
    ({"activations_checkpoint_granularity": "selective", "activations_checkpoint_recompute_mlp": True},
     [m for i in range(4) for m in (f"model.layers.{i}.self_attn.core_attention", f"model.layers.{i}.mlp")]),
    ({"activations_checkpoint_granularity": "selective", "activations_checkpoint_recompute": ["LlamaRMSNorm"]},
     [m for i in range(4) for m in (f"model.layers.{i}.input_layernorm", f"model.layers.{i}.post_attention_layernorm")]),
    ({"selective_checkpointing": 0.5}, ["model.layers.0", "model.layers.2"]),  # fms-fsdp: half, evenly spaced
])
def test_activation_checkpointing_same_loss_and_grads(model_keys, expected):
    cfg = tiny_cfg(**model_keys)
    loss0, grads0, _ = _loss_and_grads(cfg, checkpointed=False)
    loss1, grads1, names = _loss_and_grads(cfg, checkpointed=True)
    assert sorted(names) == sorted(expected)
    assert loss1 == loss0
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=0, atol=0, msg=n)


def test_checkpointed_block_recomputes_in_backward():
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing

    cfg = tiny_cfg(activations_checkpoint_granularity="full")
    model = apply_activation_checkpointing(build_model(cfg, vocab_size=512), cfg.model)
    calls = []
    model.model.layers[1].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    model(torch.randint(0, 512, (1, 8))).sum().backward()
    assert len(calls) == 2  # forward + recomputation


# The block types besides pre_ln, with position embeddings and norms as test_pipeline.BLOCKS says
BLOCK_TYPES = {name: keys for name, keys in BLOCKS.items() if name != "pre_ln"}


@pytest.mark.parametrize("block", list(BLOCK_TYPES))
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_checkpointing_every_block_type(block, granularity):
    """Full: every block, whatever its norms; selective: attention core and MLP (normformer's MLP
    holds its ffn_layernorm). Same loss, bitwise the same gradients."""
    keys = {**BLOCK_TYPES[block], "activations_checkpoint_granularity": granularity,
            "activations_checkpoint_recompute_mlp": granularity == "selective"}
    loss0, grads0, _ = _loss_and_grads(tiny_cfg(**keys), checkpointed=False)
    loss1, grads1, names = _loss_and_grads(tiny_cfg(**keys), checkpointed=True)
    per_block = [""] if granularity == "full" else [".self_attn.core_attention", ".mlp"]
    assert sorted(names) == sorted(f"model.layers.{i}{m}" for i in range(4) for m in per_block)
    assert loss1 == loss0
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=0, atol=0, msg=n)


def hf_neox_cfg(config_json: Path, **model):
    """model_source hf with a transformers GPTNeoX config.json written to `config_json` (Pythia's
    shape in small: parallel residual, rotary_pct 0.25, untied embeddings)."""
    config_json.write_text(json.dumps({
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256, "rotary_pct": 0.25,
        "max_position_embeddings": 64, "use_parallel_residual": True, "tie_word_embeddings": False}))
    cfg = tiny_cfg(**model)
    cfg.model_source, cfg.model.model_config = "hf", str(config_json)
    cfg.model.num_layers = cfg.model.hidden_size = None  # the config.json's
    return cfg


@pytest.mark.parametrize("granularity, expected", [
    ("full", ["gpt_neox.layers.0", "gpt_neox.layers.1"]),
    ("selective", [f"gpt_neox.layers.{i}.{m}" for i in range(2) for m in ("attention", "mlp")]),
])
def test_hf_gpt_neox_activation_checkpointing(tmp_path, granularity, expected):
    """transformers' GPTNeoXForCausalLM (blocks at gpt_neox.layers, found through base_model): full
    granularity checkpoints its GPTNeoXLayer blocks, selective its attention (CoreAttention's
    counterpart) and MLP; the gradients are bitwise those without checkpointing."""
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules

    grads, names = [], []
    for keys in ({}, {"activations_checkpoint_granularity": granularity,
                      "activations_checkpoint_recompute_mlp": granularity == "selective"}):
        cfg = hf_neox_cfg(tmp_path / "config.json", **keys)
        torch.manual_seed(0)
        model = apply_activation_checkpointing(build_model(cfg), cfg.model)
        names.append(checkpointed_modules(model))
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        torch.nn.functional.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), ids.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert names == [[], expected]
    assert len(grads[0]) == 2 * 12 + 4  # 12 tensors per block; embed_in, final norm (2), lm_head
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


# GPT-NeoX checkpoint_num_layers: chunks of consecutive blocks under one checkpoint
@pytest.mark.parametrize("n, chunks", [
    (2, [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"]]),
    (3, [["model.layers.0", "model.layers.1", "model.layers.2"]]),  # + layer 3 alone (NeoX: shorter last chunk)
    (4, [[f"model.layers.{i}" for i in range(4)]]),
])
def test_checkpoint_chunks_same_loss_and_grads_and_names(n, chunks):
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_chunks

    cfg = tiny_cfg(activations_checkpoint_granularity="full", checkpoint_num_layers=n)
    loss0, grads0, _ = _loss_and_grads(tiny_cfg(), checkpointed=False)
    loss1, grads1, singles = _loss_and_grads(cfg, checkpointed=True)
    assert singles == (["model.layers.3"] if n == 3 else [])
    assert loss1 == loss0
    for name, g in grads0.items():  # same parameter names (checkpoints stay compatible), same gradients
        torch.testing.assert_close(grads1[name], g, rtol=0, atol=0, msg=name)
    model = apply_activation_checkpointing(build_model(cfg, vocab_size=512), cfg.model)
    assert checkpointed_chunks(model) == chunks
    assert list(model.state_dict()) == list(build_model(cfg, vocab_size=512).state_dict())


def test_hf_checkpoint_chunks_same_grads():
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing

    grads = []
    for keys in ({}, {"activations_checkpoint_granularity": "full", "checkpoint_num_layers": 2}):
        cfg = tiny_cfg(**keys)
        cfg.model_source, cfg.model.model_config, cfg.model.num_layers = "hf", "model_configs/tiny_llama", 2
        torch.manual_seed(0)
        model = apply_activation_checkpointing(build_model(cfg), cfg.model)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an op creates, weakly: after the forward, the live ones are what autograd
    (and checkpoints) keep for the backward, whoever holds them."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.created.append((StorageWeakRef(st), st.data_ptr(), st.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum({ptr: n for ref, ptr, n in self.created if not ref.expired()}.values())


def test_checkpoint_chunks_keep_fewer_activations():
    """Bytes alive between forward and backward: per-block checkpoints keep each block's input,
    chunks of 2 only every other one; the backward still recomputes every block."""
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing

    def held(**keys):
        cfg = tiny_cfg(**keys)
        model = apply_activation_checkpointing(build_model(cfg, vocab_size=512), cfg.model)
        calls = []
        model.model.layers[2].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
        with _LiveStorages() as mode:
            loss = model(ids).logsumexp(-1).mean()
        live = mode.live_bytes()
        loss.backward()
        return live, len(calls)

    none, per_block, chunk2 = held(), held(activations_checkpoint_granularity="full"), held(
        activations_checkpoint_granularity="full", checkpoint_num_layers=2)
    hidden = 2 * 64 * 64 * 4  # one block input, [B, S, H] fp32
    assert per_block[1] == chunk2[1] == 2 and none[1] == 1  # forward + recomputation
    assert chunk2[0] < per_block[0] < none[0] / 2, (none, per_block, chunk2)
    assert per_block[0] - chunk2[0] == 2 * hidden  # inputs of layers 1 and 3 no longer kept


def test_selected_blocks_evenly_spaced():
    from nxdt.parallel.activation_checkpointing import selected_blocks

    assert selected_blocks(8, None) == list(range(8))
    assert selected_blocks(8, 0.25) == [1, 5]
    assert len(selected_blocks(32, 1 / 3)) == round(32 / 3)


def test_hf_selective_maps_core_attention_to_llama_attention():
    from nxdt.models import build_model
    from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules

    cfg = tiny_cfg(activations_checkpoint_granularity="selective")
    cfg.model_source = "hf"
    cfg.model.model_config = "model_configs/tiny_llama"
    cfg.model.num_layers = 2
    names = checkpointed_modules(apply_activation_checkpointing(build_model(cfg), cfg.model))
    assert names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


# ----------------------------------------------------------------------------- bad input
def test_unknown_recompute_class_is_one_line_listing_valid_ones():
    msg = error("model.activations_checkpoint_granularity=selective",
                "model.activations_checkpoint_recompute=[CoreAtention]")
    assert "unknown module class 'CoreAtention'" in msg and "did you mean 'CoreAttention'" in msg
    assert "valid: CoreAttention, LlamaAttention" in msg


def test_bad_parallel_sizes_are_one_line_errors():
    assert "num_attention_heads (8) is not divisible by" in error(
        "distributed_strategy.tensor_model_parallel_size=16", "trainer.devices=16", world_size=16)
    assert "hsdp_replicate_size (3) does not divide the data-parallel size 2" in error(
        "distributed_strategy.sharding_strategy=HSDP", "distributed_strategy.hsdp_replicate_size=3")
    assert "context_parallel_size (3) = 3 does not divide the world size 2" in error(
        "distributed_strategy.context_parallel_size=3")
    assert "data.seq_length (128) must be divisible by 2 x distributed_strategy.context_parallel_size (256)" in error(
        "distributed_strategy.context_parallel_size=128", "trainer.devices=128", "data.global_batch_size=4",
        world_size=128)


def test_checkpoint_num_layers_bad_values_are_one_line_errors():
    assert "model.checkpoint_num_layers: must be >= 1, got 0" in error("model.checkpoint_num_layers=0")
    for keys in (["model.checkpoint_num_layers=2"],
                 ["model.checkpoint_num_layers=2", "model.activations_checkpoint_granularity=selective"],
                 ["model.checkpoint_num_layers=2", "model.activations_checkpoint_granularity=full",
                  "model.selective_checkpointing=0.5"]):
        assert error(*keys) == ("model.checkpoint_num_layers (2) needs model.activations_checkpoint_granularity="
                                "full and no model.selective_checkpointing"), keys


def test_parallel_keys_are_accepted():
    load("distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true",
         "trainer.devices=4", "distributed_strategy.zero1=true", world_size=4)
    for strategy in ("FSDP", "HSDP", "grad-shard", "no-shard"):
        offload = [] if strategy == "no-shard" else ["distributed_strategy.cpu_offload=true"]  # FSDP2 offloads shards
        load(f"distributed_strategy.sharding_strategy={strategy}", *offload,
             "distributed_strategy.meta_init=true", "model.activations_checkpoint_granularity=full",
             "model.selective_checkpointing=0.5")
    load("model.activations_checkpoint_granularity=full", "model.checkpoint_num_layers=3")  # 3 does not divide 4: as NeoX


def test_mesh_shape_for_hsdp_and_data_parallel_config():
    from nxdt.spec.layout import compute_layout
    from nxdt.parallel.data_parallel import data_parallel_config

    cfg = load("distributed_strategy.sharding_strategy=HSDP", "trainer.devices=4", world_size=4)
    shape = compute_layout(cfg, 4).with_sharding("HSDP", num_nodes=2)
    assert (shape.dp_replicate, shape.dp_shard) == (2, 2)
    assert data_parallel_config(*_dp_sections(cfg)).mode == "shard"
    grad = data_parallel_config(*_dp_sections(load("distributed_strategy.sharding_strategy=grad-shard")))
    assert grad.mode == "shard" and not grad.reshard_after_forward
    assert data_parallel_config(*_dp_sections(load("distributed_strategy.fsdp=true"))).mode == "shard"
    assert data_parallel_config(*_dp_sections(load())).mode == "replicate"


# ----------------------------------------------------------------------------- torchrun: ZeRO-1 bytes, meta init
@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    return run_worker(__file__, 2, tmp_path_factory.mktemp("worker") / "results.json", "NXDT_TEST_OUT")


@pytest.mark.slow
def test_zero1_optimizer_bytes_are_one_over_dp(worker_results):
    z = worker_results["zero1"]
    assert sum(z["per_rank"]) == z["unsharded"]  # every state tensor lives on exactly one rank
    for b in z["per_rank"]:
        assert abs(b / (z["unsharded"] / 2) - 1) <= 0.02, z
    assert z["params_equal_across_ranks"]
    assert z["params_max_diff_to_plain_adamw"] < 1e-4, z  # one AdamW step (lr 1e-2) as plain AdamW on one rank


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_meta_init_allocates_shards_and_matches_unsharded_init(worker_results, layout):
    m = worker_results[f"meta_{layout}"]
    assert m["max_abs_diff"] == 0.0
    assert m["local_bytes"] < 0.6 * m["full_bytes"], m  # each rank holds about half


@pytest.mark.slow
@pytest.mark.parametrize("layout, kinds", [("fsdp", ["DTensor"]), ("tp", ["DTensor", "Tensor"])])
def test_grad_norm_of_sharded_grads_is_the_float64_norm(worker_results, layout, kinds):
    """total_norm accumulates in float64 (per shard, then across ranks): the split over ranks no
    longer shows (it did at ~1e-7..1e-5 relative in fp32)."""
    n = worker_results[f"norm_{layout}"]
    assert n["kinds"] == kinds and n["dtype"] == "torch.float64"
    assert n["rel"] < 1e-12, n


@pytest.mark.slow
def test_checkpoint_chunks_under_fsdp_recompute_with_same_grads(worker_results):
    r = worker_results["fsdp_chunk2"]
    assert r == {"layer0_mlp_calls": 2, "max_grad_diff": 0.0}  # forward + recomputation; bitwise equal


# tp2 vs one process, max |gap| / max |value|: measured <= 1.3e-6 (row-parallel sums in another order)
TP_RTOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{block}_sp" for block in BLOCK_TYPES] + ["normformer_no_sp"])
def test_tensor_parallel_every_block_type_matches_one_process(worker_results, case):
    """tp2 (+ sequence parallel) on every block type: the logits, the loss and every parameter's
    gradient (gathered) equal the unsharded model's on both tp ranks. normformer's ffn_layernorm
    sees the whole intermediate row and keeps plain, whole weights on every tp rank."""
    r = worker_results[f"tp_{case}"]
    assert r["logits"] < TP_RTOL and r["loss"] < TP_RTOL, r
    assert r["grads"] < TP_RTOL and r["num_grads"] == r["num_params"], r
    assert r["ffn_norm_weight"] == ("Tensor" if case.startswith("normformer") else None), r  # plain, whole
    if r["sp"]:  # every norm of the block (named by block type) runs on a sequence shard
        assert r["norm_weights"] == ["DTensor"] * r["num_norms"] and r["num_norms"] >= 1, r


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate_zero1", "fsdp"])
def test_hf_gpt_neox_data_parallel_matches_one_process(worker_results, mode):
    """transformers' GPTNeoXForCausalLM (model_source hf) under dp2: each decoder block is its own
    unit (found at gpt_neox.layers), the gradients of two half batches equal one process's on the
    whole batch, and a ZeRO-1 AdamW step gives the plain AdamW parameters."""
    r = worker_results[f"hf_neox_{mode}"]
    assert r["block_units"] == 2 and r["root_unit"] and r["grads"] < 1e-5, r
    if mode == "replicate_zero1":
        assert r["params_after_step"] < 1e-4 and r["params_moved"] > 5e-3, r  # AdamW's first step: ~lr


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_block_case(keys: dict, sp: bool, V: int) -> dict:  # pragma: no cover - under torchrun
    """tp2 (+ sp) vs the unsharded model: relative max gaps (logits, loss, gradients), max over tp ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from nxdt.models import build_model
    from nxdt.parallel.mesh import build_mesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama
    from nxdt.parallel.tensor_parallel import block_norms

    cfg = tiny_cfg(**{**keys, "num_layers": 2})
    cfg.distributed_strategy.tensor_model_parallel_size = 2
    cfg.distributed_strategy.sequence_parallel = sp
    torch.manual_seed(3)
    ref = build_model(cfg, V)
    torch.manual_seed(3)
    model = parallelize_llama(build_model(cfg, V), build_mesh(Layout(tp=2), "cpu"), cfg)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))  # same batch on both ranks
    ref_logits = ref(ids)
    (ref_loss := torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), ids.flatten())).backward()
    logits = model(ids)
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()

    def rel(a, b):
        return ((_full(a) - b).abs().max() / b.abs().max()).item()

    def kind(t):
        return "DTensor" if isinstance(t, DTensor) else "Tensor"

    grads = [rel(p.grad, ref.get_parameter(n).grad) for n, p in model.named_parameters() if p.grad is not None]
    gaps = torch.tensor([rel(logits, ref_logits), rel(loss, ref_loss), max(grads)], dtype=torch.float64)
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    block = model.model.layers[0]
    ffn_norm = getattr(block.mlp, "ffn_layernorm", None)
    return {"sp": sp, "logits": gaps[0].item(), "loss": gaps[1].item(), "grads": gaps[2].item(),
            "num_grads": len(grads), "num_params": len(list(ref.parameters())), "num_norms": len(block_norms(block)),
            "norm_weights": [kind(getattr(block, n).weight) for n in block_norms(block)],
            "ffn_norm_weight": kind(ffn_norm.weight) if ffn_norm is not None else None}


def _hf_neox_dp_case(mode: str, rank: int, config_json: Path) -> dict:  # pragma: no cover - under torchrun
    """transformers GPT-NeoX under dp2 (replicate + ZeRO-1 AdamW, or FSDP) against one process."""
    from torch.distributed.fsdp import FSDPModule

    from nxdt.models import build_model
    from nxdt.parallel.data_parallel import zero1_optimizer
    from nxdt.parallel.mesh import build_mesh, submesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama

    cfg = hf_neox_cfg(config_json)
    if mode == "fsdp":
        cfg.distributed_strategy.sharding_strategy = "FSDP"
    mesh = build_mesh(Layout(dp_shard=2) if mode == "fsdp" else Layout(dp_replicate=2), "cpu")
    torch.manual_seed(5)
    ref = build_model(cfg)
    model = build_model(cfg)
    model.load_state_dict(ref.state_dict())
    model = parallelize_llama(model, mesh, cfg)
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(2))

    def loss_of(m, x):
        return torch.nn.functional.cross_entropy(m(input_ids=x).logits.flatten(0, 1), x.flatten())

    loss_of(ref, ids).backward()
    loss_of(model, ids[2 * rank:2 * rank + 2]).backward()
    out = {"grads": max((_full(p.grad) - ref.get_parameter(n).grad).abs().max().item()
                        for n, p in model.named_parameters()),
           "block_units": sum(isinstance(b, FSDPModule) for b in model.gpt_neox.layers),
           "root_unit": isinstance(model, FSDPModule)}
    if mode != "fsdp":
        before = [p.detach().clone() for p in ref.parameters()]
        opt = zero1_optimizer([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-2},
                              submesh(mesh, "dp").get_group())
        opt.step()
        torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
        out["params_after_step"] = max((_full(p).detach() - ref.get_parameter(n)).abs().max().item()
                                       for n, p in model.named_parameters())
        out["params_moved"] = max((p.detach() - b).abs().max().item() for p, b in zip(ref.parameters(), before))
    return out


def _worker() -> None:  # pragma: no cover - runs under torchrun
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nxdt.models import build_model, init_model_weights
    from nxdt.parallel.data_parallel import apply_data_parallel, zero1_optimizer
    from nxdt.parallel.mesh import build_mesh, submesh
    from nxdt.spec.layout import Layout
    from nxdt.parallel.parallelize import parallelize_llama

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    V = 512

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    # ZeRO-1: replicate over dp=2, AdamW state sharded
    cfg = tiny_cfg()
    mesh = build_mesh(Layout(dp_replicate=2), "cpu")
    torch.manual_seed(0)
    model = build_model(cfg, V)
    plain = build_model(cfg, V)
    plain.load_state_dict(model.state_dict())
    apply_data_parallel(model, mesh)
    opt = zero1_optimizer([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-2},
                          submesh(mesh, "dp").get_group())
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ids = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    for m, o, x in ((model, opt, ids[2 * rank:2 * rank + 2]), (plain, ref_opt, ids)):
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        o.step()

    def state_bytes(optim):
        return sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                   if torch.is_tensor(t))

    per_rank = [None, None]
    dist.all_gather_object(per_rank, state_bytes(opt.optim))
    mine = torch.cat([full(p).detach().flatten() for p in model.parameters()])
    other = mine.clone()
    dist.broadcast(other, src=0)
    ref = torch.cat([p.detach().flatten() for p in plain.parameters()])
    results["zero1"] = {"per_rank": per_rank, "unsharded": state_bytes(ref_opt),
                        "params_equal_across_ranks": bool(torch.equal(mine, other)),
                        "params_max_diff_to_plain_adamw": (mine - ref).abs().max().item()}

    # meta-device init: sharded (FSDP dp=2 / TP=2) equals an unsharded meta init with the same seed
    for layout, shape, keys in (("fsdp", Layout(dp_shard=2), {"sharding_strategy": "FSDP"}),
                                ("tp", Layout(tp=2), {"tensor_model_parallel_size": 2})):
        cfg = tiny_cfg()
        cfg.distributed_strategy.meta_init = True
        for key, value in keys.items():  # a typed config: set attributes
            setattr(cfg.distributed_strategy, key, value)
        mesh = build_mesh(shape, "cpu")
        torch.manual_seed(3)
        model = parallelize_llama(build_model(cfg, V, device="meta"), mesh, cfg)
        torch.manual_seed(3)
        ref = init_model_weights(build_model(cfg, V, device="meta"), "cpu")
        diff = max((full(p).detach() - ref.get_parameter(n)).abs().max().item()
                   for n, p in model.named_parameters())
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters())
        results[f"meta_{layout}"] = {"max_abs_diff": diff, "local_bytes": local,
                                     "full_bytes": sum(p.numel() * 4 for p in ref.parameters())}
    # gradient norm of sharded gradients (FSDP: Shard(0) DTensors; tp: DTensors on the tp mesh mixed
    # with plain norm weights) = the float64 norm of the same gradients gathered in one place
    from torch.distributed.tensor.parallel import loss_parallel

    from nxdt.parallel.tensor_parallel import total_norm

    for layout, shape, keys in (("fsdp", Layout(dp_shard=2), {"sharding_strategy": "FSDP"}),
                                ("tp", Layout(tp=2), {"tensor_model_parallel_size": 2})):
        cfg = tiny_cfg()
        for key, value in keys.items():  # a typed config: set attributes
            setattr(cfg.distributed_strategy, key, value)
        torch.manual_seed(3)
        model = parallelize_llama(build_model(cfg, V), build_mesh(shape, "cpu"), cfg)
        ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))  # same batch on each rank
        logits = model(ids)
        with loss_parallel():
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        grads = [p.grad for p in model.parameters()]
        exact = torch.cat([full(g).double().flatten() for g in grads]).norm()
        norm = total_norm(grads)
        results[f"norm_{layout}"] = {"dtype": str(norm.dtype), "rel": abs(norm.item() / exact.item() - 1),
                                     "kinds": sorted({type(g).__name__ for g in grads})}
    # checkpoint_num_layers=2 under FSDP2: both blocks of a chunk run again in the backward, and
    # the sharded gradients are those of the same FSDP model without checkpointing
    chunk_grads, calls = [], []
    for keys in ({}, {"activations_checkpoint_granularity": "full", "checkpoint_num_layers": 2}):
        cfg = tiny_cfg(**keys)
        cfg.distributed_strategy.sharding_strategy = "FSDP"
        torch.manual_seed(3)
        model = parallelize_llama(build_model(cfg, V), build_mesh(Layout(dp_shard=2), "cpu"), cfg)
        calls.clear()
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(rank))
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        chunk_grads.append([p.grad.to_local() for p in model.parameters()])
    results["fsdp_chunk2"] = {"layer0_mlp_calls": len(calls), "max_grad_diff": max(
        (a - b).abs().max().item() for a, b in zip(*chunk_grads))}
    # every block type under tp2 + sequence parallel (normformer also without it)
    for block, keys in BLOCK_TYPES.items():
        results[f"tp_{block}_sp"] = _tp_block_case(keys, True, V)
    results["tp_normformer_no_sp"] = _tp_block_case(BLOCK_TYPES["normformer"], False, V)
    # transformers' GPT-NeoX under data parallel
    config_json = Path(os.environ["NXDT_TEST_OUT"]).with_name(f"neox_config{rank}.json")
    for mode in ("replicate_zero1", "fsdp"):
        results[f"hf_neox_{mode}"] = _hf_neox_dp_case(mode, rank, config_json)
    if rank == 0:
        Path(os.environ["NXDT_TEST_OUT"]).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
    exit_worker()


def test_use_torch_compile_compiles_each_block_and_only_blocks():
    """model.use_torch_compile: every decoder block gets torch.compile'd (not run here: cold compile is slow)."""
    from nxdt.models import build_model
    from nxdt.parallel.parallelize import apply_compile

    cfg = config_from_dict({"model_source": "megatron", "model": {
        "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4}})
    model = build_model(cfg, 64)
    apply_compile(model)
    assert all(block._compiled_call_impl is not None for block in model.model.layers)
    assert model._compiled_call_impl is None and model.lm_head._compiled_call_impl is None


def test_compile_keys_backend_check_and_xla(tmp_path, monkeypatch, kjv_prefix):
    """model.fusions.torch_compile and fms-fsdp's model.use_torch_compile are one switch; inert (said once)
    on XLA; asked for where torch cannot compile for the device (no C++ compiler for the CPU), the run
    stops before anything starts with one line naming the key (exit 2). Compiled runs against eager:
    tests/test_parallel_layouts.py (one process, tp2, fsdp2)."""
    import shutil

    from conftest import TINY_OVERRIDES, train_in_process

    from nxdt.spec.model import wants_compile
    from nxdt.config.inert import inert_keys

    for key in ("fusions.torch_compile", "use_torch_compile"):
        cfg = tiny_cfg(**({"fusions": {"torch_compile": True}} if key.startswith("fusions") else {key: True}))
        assert wants_compile(cfg)
        assert [k for k, _, _ in inert_keys(cfg, backend="xla") if "compile" in k] == [f"model.{key}"]
        assert not [k for k, _, _ in inert_keys(cfg, backend="cpu") if "compile" in k]
    assert not wants_compile(tiny_cfg())

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    result = train_in_process(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                               f"data.data_prefix=[1.0,{kjv_prefix}]", f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
                               "model.fusions.torch_compile=true"])
    assert result.rc == 2
    assert [line for line in result.err.splitlines() if line.startswith("error:")] == [
        "error: model.fusions.torch_compile: torch's inductor needs a C++ compiler to compile for the CPU (g++, "
        "clang++ or $CXX); none found; install it, or set model.fusions.torch_compile=false (and "
        "model.use_torch_compile=false)"]
    assert not (tmp_path / "run").exists()
    assert error("model.fusions.torch_compile=true", "distributed_strategy.tensor_model_parallel_size=2",
                 "trainer.devices=2", "model.activations_checkpoint_granularity=selective").startswith(
        "model.fusions.torch_compile with distributed_strategy.tensor_model_parallel_size > 1 and "
        "model.activations_checkpoint_granularity=selective is not supported yet")
