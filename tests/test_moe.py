"""Mixture of experts (nxdt.models.moe): parity with transformers' Mixtral, routing and capacity
by hand, the load-balancing loss and its gradient, statistics, config errors. In-process, small.
The MoE layouts that must match one process (data parallel, ZeRO-1, FSDP) are in
tests/test_parallel_layouts.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import REPO
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.models import build_model
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing
from nxdt.models.moe import (LlamaMoE, MoEArgs, capacity, keep_within_capacity, load_balancing_loss,
                             pop_router_stats, route, set_aux_loss_scale, sinkhorn)

E, K = 4, 2
SHAPE = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
             max_position_embeddings=64, layernorm_epsilon=1e-5, rope_theta=10000.0)


def _native(**moe) -> NxdtLlamaForCausalLM:
    torch.manual_seed(0)
    model = NxdtLlamaForCausalLM(LlamaArgs(vocab_size=128, **SHAPE, moe=MoEArgs(num_experts=E, top_k=K, **moe)))
    model.init_weights()
    return model


def _hf_twin(model: NxdtLlamaForCausalLM) -> MixtralForCausalLM:
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, num_local_experts=E, num_experts_per_tok=K, tie_word_embeddings=False)
    hf = MixtralForCausalLM(cfg)
    hf.load_state_dict(model.state_dict(), strict=True)  # same names, same layouts
    return hf


def test_logits_and_aux_loss_match_transformers_mixtral():
    model = _native().eval()
    hf = _hf_twin(model).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids, output_router_logits=True)
    torch.testing.assert_close(ours, theirs.logits, rtol=0, atol=1e-5)
    # the load-balancing loss, pooled over both layers' router logits as transformers pools them
    ref = load_balancing_loss_func(theirs.router_logits, E, K)
    assert float(load_balancing_loss(theirs.router_logits, E, K)) == pytest.approx(float(ref), rel=1e-6)
    assert float(load_balancing_loss(theirs.router_logits[:1], E, K)) == pytest.approx(
        float(load_balancing_loss_func(theirs.router_logits[:1], E, K)), rel=1e-6)


def test_megatron_and_hf_sources_build_the_same_architecture():
    """model_source megatron with Mixtral's shapes and model_source hf with a Mixtral config.json:
    the same parameter names and shapes, and with the same weights the same logits."""
    common = {"moe": {"num_experts": 4, "top_k": 2, "output_router_logits": True}}
    native = build_model(config_from_dict({"model_source": "megatron", "model": {
        "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
        "max_position_embeddings": 1024, "make_vocab_size_divisible_by": 8, **common}}), 8192).eval()
    hf = build_model(config_from_dict({"model_source": "hf", "model": {
        "model_config": "model_configs/tiny_mixtral", **common}})).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert {n: p.shape for n, p in native.named_parameters()} == {n: p.shape for n, p in hf.named_parameters()}
    hf.load_state_dict(native.state_dict())
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(native(ids), hf(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("routing", [{}, {"capacity_factor": 0.5}, {"capacity_factor": 0.0, "dropless": True},
                                     {"routing_algorithm": "sinkhorn", "top_k": 1},
                                     {"router_activation": "sigmoid", "normalize_top_k_affinities": False}])
def test_hf_mixtral_routes_as_model_moe_says(routing):
    """model_source hf with a Mixtral config.json builds nxdt's MoE block (NxDT's HF Mixtral runs NxD's
    MoE layer) under transformers' names: model.moe's routing applies there exactly as in the native
    model (same weights: same logits); with Mixtral's own routing the logits are transformers'."""
    moe = {"num_experts": 4, "top_k": 2, **routing}
    hf = build_model(config_from_dict({"model_source": "hf", "model": {
        "model_config": "model_configs/tiny_mixtral", "moe": moe}})).eval()
    assert type(hf.model.layers[0].mlp) is LlamaMoE and hf.model.layers[0].mlp.args.capacity_factor == moe.get(
        "capacity_factor")
    native = build_model(config_from_dict({"model_source": "megatron", "model": {
        "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
        "max_position_embeddings": 1024, "make_vocab_size_divisible_by": 8, "moe": moe}}), 8192).eval()
    native.load_state_dict(hf.state_dict())
    plain = MixtralForCausalLM(hf.config).eval()  # transformers' own blocks, the same weights
    plain.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = hf(ids).logits, plain(ids).logits
        torch.testing.assert_close(ours, native(ids), rtol=0, atol=1e-5)
    if not routing or routing.get("dropless"):  # Mixtral's routing, every token computed: transformers' logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    else:  # capacity 0.5 drops tokens, sinkhorn and sigmoid route otherwise
        assert (ours - theirs).abs().max() > 1e-3


def test_top_k_routing_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    weights, experts = route(logits, MoEArgs(num_experts=4, top_k=2))
    p = torch.softmax(logits, -1)
    assert experts.tolist() == [[0, 1], [2, 3]]
    top = torch.stack([p[0, [0, 1]], p[1, [2, 3]]])
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    weights, _ = route(logits, MoEArgs(num_experts=4, top_k=2, normalize_top_k_affinities=False,
                                       router_activation="sigmoid"))
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 1.0], [3.0, 1.0]])))


def test_sinkhorn_balances_the_choice():
    """Every token prefers expert 0 (plain top-1 sends all four there); sinkhorn's plan has equal
    token and expert marginals, and its choice sends at most two tokens to expert 0. The
    gradient-carrying weight is the chosen expert's softmax score."""
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0], [4.0, 0.0, 3.0, 0.0], [4.0, 0.0, 0.0, 3.0], [4.0, 2.0, 2.0, 2.0]])
    plan = sinkhorn(logits, iterations=200)
    torch.testing.assert_close(plan.sum(0), torch.full((4,), 0.25), rtol=0, atol=1e-4)  # experts balanced
    torch.testing.assert_close(plan.sum(1), torch.full((4,), 0.25), rtol=0, atol=1e-4)  # tokens too
    weights, experts = route(logits, MoEArgs(num_experts=4, top_k=1, routing_algorithm="sinkhorn",
                                             sinkhorn_iterations=200))
    assert experts.flatten().tolist() == plan.argmax(-1).tolist()
    assert (experts == 0).sum() <= 2 and logits.argmax(-1).tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, experts))


def test_capacity_drops_deterministically_first_choices_first():
    # 4 tokens, top-2 over 2 experts, capacity factor 0.5: ceil(0.5 * 4 * 2 / 2) = 2 per expert
    a = MoEArgs(num_experts=2, top_k=2, capacity_factor=0.5)
    assert capacity(4, a) == 2
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    keep = keep_within_capacity(experts, 2, 2)
    # first choices in token order: e0 ← t0, t1 (full: t3's first choice dropped); e1 ← t2, then
    # second choices: t0 → e1 (its 2nd slot), the rest find their expert full
    assert keep.tolist() == [[True, True], [True, False], [True, False], [False, False]]


def test_experts_run_per_expert_and_match_a_per_token_loop():
    """The block's output equals the obvious per-token computation, also when tokens are dropped."""
    torch.manual_seed(3)
    for moe in (MoEArgs(num_experts=4, top_k=2), MoEArgs(num_experts=4, top_k=2, capacity_factor=0.5),
                MoEArgs(num_experts=4, top_k=1, routing_algorithm="sinkhorn", score_scale=2.0)):
        block = LlamaMoE(16, 24, moe)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.2)
        x = torch.randn(2, 5, 16)
        out = block(x)
        flat = x.reshape(-1, 16)
        weights, experts = route(block.gate(flat), moe)
        keep = (keep_within_capacity(experts, capacity(10, moe), 4) if moe.drops_tokens
                else torch.ones_like(experts, dtype=torch.bool))
        expected = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for slot in range(moe.top_k):
                if keep[t, slot]:
                    e = int(experts[t, slot])
                    gate, up = (block.experts.gate_up_proj[e] @ flat[t]).chunk(2)
                    y = block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)
                    expected[t] += weights[t, slot] * moe.score_scale * y
        torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
        if moe.drops_tokens:
            assert not keep.all()


def test_aux_loss_gradient_is_that_of_the_added_loss():
    """Training: the router receives the gradient of loss + coef x aux, with aux each layer's
    load-balancing loss, exactly as if it had been added to the loss (scale 1)."""
    coef = 0.5
    model = _native(aux_loss_coef=coef).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    set_aux_loss_scale(1.0)
    model(ids).logsumexp(-1).mean().backward()
    got = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]

    # the same with the loss added by hand (router logits captured by hooks), injection off
    model.zero_grad()
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o)) for layer in model.model.layers]
    for layer in model.model.layers:
        layer.mlp.args.aux_loss_coef = 0.0
    loss = model(ids).logsumexp(-1).mean()
    loss = loss + coef * sum(load_balancing_loss((lg,), E, K) for lg in logits)
    loss.backward()
    for h in hooks:
        h.remove()
    for g, layer in zip(got, model.model.layers):
        torch.testing.assert_close(g, layer.mlp.gate.weight.grad, rtol=1e-5, atol=1e-7)
        assert g.abs().sum() > 0


def test_router_statistics_are_recorded_once_per_trained_forward():
    model = _native(capacity_factor=0.5).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
             for layer in model.model.layers]
    for _ in range(2):  # no update between: both forwards route alike
        model(ids).sum().backward()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        model.eval()(ids)  # no statistics from evaluation
    stats = pop_router_stats(model)
    assert set(stats) == {"aux_loss", "dropped_fraction", "expert_share_min", "expert_share_max"}
    # capacity 0.5: ceil(0.5 * 32 tokens * 2 / 4) = 8 of each layer's 64 assignments per expert
    kept = [keep_within_capacity(torch.topk(lg, K).indices, 8, E).sum() for lg in logits[:2]]
    assert stats["dropped_fraction"] == pytest.approx(1 - sum(int(k) for k in kept) / 128)
    assert 0.5 <= stats["dropped_fraction"] < 1.0
    assert 0 <= stats["expert_share_min"] <= 0.25 <= stats["expert_share_max"] <= 1.0
    per_layer = [float(load_balancing_loss((lg,), E, K)) for lg in logits[:2]]
    assert stats["aux_loss"] == pytest.approx(sum(per_layer) / 2, rel=1e-6)  # mean over layers
    assert pop_router_stats(model) == {}  # popped


def _moe_cfg(**moe):
    base = {"model_source": "megatron", "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96,
                                                  "num_attention_heads": 4, "moe": {"num_experts": 4, **moe}}}
    return base


@pytest.mark.parametrize("moe, ds, message", [
    ({"top_k": 5}, {}, r"model.moe.top_k \(5\) must be between 1 and model.moe.num_experts \(4\)"),
    ({"routing_algorithm": "sinkhorn", "top_k": 2}, {}, r"sinkhorn picks one expert per token: model.moe.top_k must be 1"),
    ({"capacity_factor": 0.0}, {}, r"model.moe.capacity_factor: must be > 0"),
    ({"frequency": 0}, {}, r"model.moe.frequency: must be >= 1"),
    ({"capacity_factor": 2.0}, {"context_parallel_size": 2},
     r"'distributed_strategy.context_parallel_size' > 1 with model.moe.capacity_factor .* is not supported yet"),
    ({"num_experts": 3, "top_k": 1}, {"expert_model_parallel_size": 2},
     r"model.moe.num_experts \(3\) is not divisible by distributed_strategy.expert_model_parallel_size \(2\)"),
    ({"num_experts": 0}, {"expert_model_parallel_size": 2},
     r"distributed_strategy.expert_model_parallel_size \(2\) needs an MoE model \(model.moe.num_experts > 0\)"),
    ({"gate_balance_loss_weight": 0.01}, {}, r"model.moe.gate_balance_loss_weight=0.01 weighs LLaMA-MoE's balance "
                                              r"loss: needs model.moe.gate_type"),
])
def test_bad_moe_config_is_one_line(moe, ds, message):
    values = _moe_cfg(**moe)
    values["distributed_strategy"] = ds
    values["trainer"] = {"devices": 2 if ds else 1}
    values["data"] = {"global_batch_size": 8, "micro_batch_size": 1}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(values, check=True)


def test_moe_keys_over_a_dense_hf_config_are_refused():
    """model.moe over a Llama config.json would build a dense model: refused, not trained silently."""
    values = {"model_source": "hf", "trainer": {"devices": 1},
              "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 128},
              "model": {"model_config": "${nxdt_conf:model_configs/tiny_llama/config.json}", "moe": {"num_experts": 4}}}
    with pytest.raises(ConfigError, match=r"model.moe.num_experts \(4\) with model_source hf needs a Mixtral-style "
                                          r"model.model_config .* is model_type 'llama'"):
        config_from_dict(values, check=True)
    # the builder refuses too, for a config it is handed without validation
    with pytest.raises(ValueError, match=r"has no MoE blocks; model.moe needs a Mixtral-style config.json"):
        build_model(config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/tiny_llama",
                                                                      "moe": {"num_experts": 4}}}), device="meta")


def test_hf_mixtral_frequency_is_the_config_jsons():
    values = {"model_source": "hf", "trainer": {"devices": 1},
              "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 128},
              "model": {"model_config": "${nxdt_conf:model_configs/tiny_mixtral/config.json}",
                        "moe": {"num_experts": 4, "frequency": 2}}}
    with pytest.raises(ConfigError, match=r"^model.moe.frequency=2: not supported with model_source hf \(every "
                                          r"layer of transformers' Mixtral is an MoE layer\)"):
        config_from_dict(values, check=True)


def test_capacity_factor_zero_is_fine_when_dropless():
    cfg = config_from_dict({**_moe_cfg(capacity_factor=0.0, dropless=True), "trainer": {"devices": 1},
                            "data": {"global_batch_size": 8, "micro_batch_size": 1}}, check=True)
    assert cfg.model.moe.dropless and math.isclose(cfg.model.moe.capacity_factor, 0.0)


@pytest.mark.parametrize("ds", [{"pipeline_model_parallel_size": 2}, {"expert_model_parallel_size": 2},
                                {"tensor_model_parallel_size": 2, "sequence_parallel": True}])
def test_hf_mixtral_takes_the_native_moe_layouts(ds):
    """nxdt's MoE block in transformers' Mixtral takes pp, ep and tp as the native model's does (their
    parity with one process: tests/test_parallel_layouts.py, hf_moe_*)."""
    values = {"model_source": "hf", "trainer": {"devices": 2}, "distributed_strategy": ds,
              "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 128},
              "model": {"model_config": "${nxdt_conf:model_configs/tiny_mixtral/config.json}", "moe": {"num_experts": 4}}}
    assert config_from_dict(values, check=True).model.moe.num_experts == 4


@pytest.mark.parametrize("extra, message", [
    ({"moe": {"num_experts": 4, "capacity_factor": 2.0}},
     r"^model.moe.capacity_factor=2.0: not supported with model_source hf and model_type 'phimoe' \(its own MoE block"),
    ({"moe": {"num_experts": 4}, "ds": {"pipeline_model_parallel_size": 2}},
     r"^'distributed_strategy.pipeline_model_parallel_size' > 1 with model_source hf and model_type 'phimoe' is not "
     r"supported yet \(got 2\); Mixtral's MoE takes it$"),
])
def test_another_transformers_moe_block_keeps_its_own_routing(tmp_path, extra, message):
    """Only Mixtral's block is nxdt's: another transformers MoE block (PhiMoE's, with num_local_experts)
    routes as transformers does, so model.moe's routing and the pp / ep layouts are refused for it."""
    js = json.loads((REPO / "conf" / "model_configs" / "tiny_mixtral" / "config.json").read_text())
    js["model_type"] = "phimoe"
    (tmp_path / "config.json").write_text(json.dumps(js))
    values = {"model_source": "hf", "trainer": {"devices": 2}, "distributed_strategy": extra.get("ds", {}),
              "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 128},
              "model": {"model_config": str(tmp_path / "config.json"), "moe": extra["moe"]}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(values, check=True)


def test_transformers_moe_block_name_recomputes_nxdts_block():
    """NxDT's selective recompute names transformers' class (MixtralSparseMoeBlock); in an hf Mixtral
    that block is nxdt's LlamaMoE, which is recomputed under that name."""
    cfg = config_from_dict({"model_source": "hf", "data": {"seq_length": 64}, "model": {
        "model_config": "${nxdt_conf:model_configs/tiny_mixtral/config.json}",
        "activations_checkpoint_granularity": "selective", "activations_checkpoint_recompute": ["MixtralSparseMoeBlock"]}},
        check=True)
    model = apply_activation_checkpointing(build_model(cfg, None, device="meta"), cfg.model)
    recomputed = [name for name, m in model.named_modules() if getattr(m, "_nxdt_checkpointed", False)]
    assert recomputed == ["model.layers.0.mlp", "model.layers.1.mlp"]
