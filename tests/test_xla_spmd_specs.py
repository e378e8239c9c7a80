"""nxdt.parallel.xla_spmd's partition specs, read from the parallel plan (no torch-xla needed: the
specs are data; tests/xla/test_xla_spmd.py runs them on four XLA:CPU devices), and the XLA MoE
dispatch (nxdt.models.moe_xla) against the CPU path."""

from __future__ import annotations

import pytest
import torch

from nxdt.models import build_model
from nxdt.models.moe import LlamaMoE, MoEArgs, capacity, keep_within_capacity
from nxdt.models.moe_xla import dispatch_experts
from nxdt.parallel.plan import make_plan
from nxdt.parallel.xla_spmd import mesh_shape, one_write_per_chunk, process_layout, spmd_shardings
from nxdt.spec import build_spec, load_config

TINY = ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "model.max_position_embeddings=64", "model.encoder_seq_length=16",
        "data.seq_length=16", "data.micro_batch_size=1", "data.global_batch_size=8", "trainer.devices=4"]


def _shardings(*overrides: str, zero1: bool = False):
    cfg = load_config(["--config-name", "tiny_llama_cpu", *TINY, *overrides], check_paths=False, quiet=True)
    spec = build_spec(cfg)
    model = build_model(cfg, 256)
    return spec, spmd_shardings(model, make_plan(model, spec), zero1=zero1)


def test_tp_and_fsdp_specs_follow_the_plan():
    spec, s = _shardings("distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true",
                         "distributed_strategy.sharding_strategy=fsdp")
    assert s.mesh_shape == mesh_shape(spec.layout) == (2, 1, 2)
    p = s.params
    assert p["model.layers.0.self_attn.q_proj.weight"] == ("tp", "dp")  # colwise, then FSDP on the other dim
    assert p["model.layers.0.self_attn.o_proj.weight"] == ("dp", "tp")  # rowwise: a Linear's inputs
    assert p["model.layers.0.mlp.down_proj.weight"] == ("dp", "tp")
    assert p["model.embed_tokens.weight"] == ("tp", "dp")  # vocabulary-parallel embedding: rows
    assert p["lm_head.weight"] == ("tp", "dp")  # vocabulary-parallel output layer
    assert p["model.norm.weight"] == ("dp",)
    assert s.optimizer_state == s.params
    assert "model.norm" in s.sequence_parallel and "model.layers.0.input_layernorm" in s.sequence_parallel


def test_zero1_shards_only_the_optimizer_state():
    _, s = _shardings("distributed_strategy.zero1=true", zero1=True)
    assert s.params["model.layers.0.mlp.up_proj.weight"] == (None, None)
    assert s.optimizer_state["model.layers.0.mlp.up_proj.weight"] == ("dp", None)


def test_experts_over_ep():
    _, s = _shardings("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
                      "distributed_strategy.expert_model_parallel_size=2")
    experts = [n for n in s.params if n.endswith("gate_up_proj")]
    assert experts and all(s.params[n][0] == "ep" for n in experts)


@pytest.mark.parametrize("tp", [1, 2])
def test_process_layout_holds_every_dp_share(tp):
    spec, _ = _shardings(f"distributed_strategy.tensor_model_parallel_size={tp}")
    one = process_layout(spec.layout)
    assert one.world_size == 1 and one.local_batch_size == spec.layout.local_batch_size * spec.layout.dp
    assert one.num_microbatches == spec.layout.num_microbatches


@pytest.mark.parametrize("options", [{}, {"capacity_factor": 1.0}, {"capacity_factor": 0.5, "dropless": True},
                                     {"expert_activation": "gelu"}, {"top_k": 3, "score_scale": 1.5}])
def test_xla_dispatch_experts_equal_the_sorted_path(options):
    """nxdt.models.moe_xla (the capacity dispatch, static shapes: the XLA path) gives the CPU path's
    output and gradients (tokens sorted by expert; capacity drops; dropless; two-matrix experts)."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, **{"top_k": 2, **options})
    layer = LlamaMoE(16, 32, args)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 10, 16, requires_grad=True)
    layer(x).sum().backward()
    sorted_grads = [p.grad.clone() for p in (x, *layer.parameters())]
    sorted_out = layer(x).detach().reshape(-1, 16)
    x.grad = None
    layer.zero_grad()
    flat = x.reshape(-1, 16)
    weights, experts, _ = layer.gate.route(flat, args)
    keep = (keep_within_capacity(experts, capacity(20, args), 4) if args.drops_tokens
            else torch.ones_like(experts, dtype=torch.bool))
    cap = capacity(20, args) if args.drops_tokens else 20  # as LlamaMoE on XLA: dropless, every token
    out, counts = dispatch_experts(flat, weights, experts, keep, layer.experts, cap, args.score_scale)
    out.sum().backward()
    assert (out - sorted_out).abs().max() < 1e-5
    assert int(counts.sum()) == int(keep.sum()) and (int(keep.sum()) < 20 * args.top_k) == args.drops_tokens
    for a, p in zip(sorted_grads, (x, *layer.parameters())):
        assert (a - p.grad).abs().max() < 1e-5


def test_one_write_per_chunk_keeps_the_first_replica_of_each_chunk():
    """The SPMD save plan of a dp-sharded, tp-replicated tensor lists each chunk once per replica
    (same fqn and offset, shard index 0 and 1): one of each is kept, the first; other tensors' and
    other offsets' items are untouched (torch-xla 2.9's dedup_tensors dropped them all: docs/xla.md)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    def item(fqn, offset, index):
        return WriteItem(index=MetadataIndex(fqn, torch.Size([offset]), index), type=WriteItemType.SHARD)

    items = [item("norm", 0, 0), item("norm", 0, 1), item("norm", 32, 2), item("norm", 32, 3),
             item("q", 0, 0), item("q", 32, 1)]
    kept = one_write_per_chunk(items)
    assert [(i.index.fqn, i.index.offset[0], i.index.index) for i in kept] == [
        ("norm", 0, 0), ("norm", 32, 2), ("q", 0, 0), ("q", 32, 1)]
