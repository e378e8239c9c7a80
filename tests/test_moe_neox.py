"""GPT-NeoX's dropless MoE in nxdt: `nxdt import-config neox` on NeoX's own 125M-dmoe.yml builds the
parameters NeoX builds, and nxdt's two-matrix experts and NeoX-sinkhorn router compute what NeoX's
code computes. The reference below is written from EleutherAI/gpt-neox at ea7aefd8:
megatron/model/moe.py (ParallelDroplessMoE, ParallelDroplessMLP), moe_mlp.py (ParallelGroupedMLP),
router.py (TopKTokenChoiceRouter, SinkhornRouter), with megablocks' grouped GEMMs and
gather/scatter written as per-expert loops. In-process, tiny."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from test_import_config import TINY, _write

from nxdt.cli import main as cli
from nxdt.config.errors import ConfigError
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.models.moe import LlamaMoE, MoEArgs
from nxdt.models.moe_neox import MLPExperts
from nxdt.spec import config_from_dict, load_config
from nxdt.tools.plan import main as plan_main

NEOX_CONFIGS = REPO / "tests" / "neox_configs"


# --------------------------------------------------------------------------- NeoX's code, as a reference
def neox_sinkhorn(cost, tol=0.0001, max_iter=3):
    """router.py SinkhornRouter.sinkhorn, verbatim."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 0.00000001
    error = 1e9
    d1_old = d1
    for iteration in range(max_iter):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if error < tol:
            break
    return d1 * cost * d0.unsqueeze(1)


def neox_router(x, layer_weight, router_type, top_k, training):
    """TopKTokenChoiceRouter.forward (no jitter) / SinkhornRouter.sinkhorn_load_balancing."""
    logits = F.linear(x.view(-1, x.shape[-1]), layer_weight)
    if router_type == "topk":
        scores = logits.softmax(dim=-1)
        return scores.max(dim=-1, keepdim=True) if top_k == 1 else torch.topk(scores, top_k, dim=-1)
    act = (lambda t: torch.sigmoid(t)) if top_k == 1 else (
        lambda t: torch.softmax(t, dim=-1, dtype=torch.float32).type_as(t))
    if training:
        with torch.no_grad():
            _, indices = torch.topk(neox_sinkhorn(logits.to(dtype=torch.float32)), k=top_k, dim=1)
        return torch.gather(act(logits), 1, indices), indices
    return torch.topk(act(logits), k=top_k, dim=1)


def neox_dropless_moe(x, layer_weight, w1, w2, num_experts, top_k, activation_func, router_type, training):
    """ParallelDroplessMoE.forward at model-parallel size 1: route, sort the (token, slot) pairs by
    expert (megablocks.ops.sort / gather), ParallelGroupedMLP.forward per expert
    (gmm(x, w1, trans_b=True), activation, gmm(x, w2)), scatter weighted by the expert weights."""
    in_shape = x.size()
    expert_weights, expert_indices = neox_router(x, layer_weight, router_type, top_k, training)
    expert_weights, expert_indices = expert_weights.flatten(), expert_indices.flatten()
    tokens = x.view(-1, x.shape[-1])
    order = torch.argsort(expert_indices, stable=True)
    routed = tokens[order // top_k]
    counts = torch.bincount(expert_indices, minlength=num_experts).tolist()
    hidden = tokens.shape[-1]
    w1v, w2v = w1.view(num_experts, -1, hidden), w2.view(num_experts, -1, hidden)
    outs = [activation_func(rows @ w1v[e].t()) @ w2v[e] for e, rows in enumerate(routed.split(counts))]
    y = torch.cat(outs) * expert_weights[order, None]
    out = torch.zeros_like(tokens).index_add_(0, order // top_k, y)
    return out.view(in_shape)


def _twin(num_experts, hidden, ffn, top_k, router_type, activation):
    """NeoX's weights (layer.weight [E, H], w1 and w2 [E x F, H], drawn as NeoX's init would: normal)
    and nxdt's LlamaMoE holding the same numbers."""
    torch.manual_seed(0)
    gate = torch.randn(num_experts, hidden) * 0.5
    w1 = torch.randn(num_experts * ffn, hidden) * 0.2
    w2 = torch.randn(num_experts * ffn, hidden) * 0.2
    routing = ({"routing_algorithm": "top_k", "router_activation": "softmax", "normalize_top_k_affinities": False}
               if router_type == "topk" else {"routing_algorithm": "neox_sinkhorn", "sinkhorn_iterations": 3,
                                              "sinkhorn_tol": 1e-4})
    ours = LlamaMoE(hidden, ffn, MoEArgs(num_experts=num_experts, top_k=top_k, dropless=True,
                                         expert_activation=activation, **routing))
    with torch.no_grad():
        ours.gate.weight.copy_(gate)
        ours.experts.up_proj.copy_(w1.view(num_experts, ffn, hidden))
        ours.experts.down_proj.copy_(w2.view(num_experts, ffn, hidden).transpose(1, 2))
    return ours, gate, w1, w2


@pytest.mark.parametrize("router_type, top_k, activation, neox_act", [
    ("sinkhorn", 1, "gelu", F.gelu),  # 125M-dmoe: NeoX's default router and activation
    ("sinkhorn", 2, "gelu", F.gelu),
    ("topk", 2, "gelu", F.gelu),
    ("topk", 1, "silu", lambda t: t * torch.sigmoid(t)),  # activation swiglu: NeoX's experts apply swish
])
def test_two_matrix_experts_match_neoxs_dropless_moe(router_type, top_k, activation, neox_act):
    E, H, FF = 4, 16, 24
    ours, gate, w1, w2 = _twin(E, H, FF, top_k, router_type, activation)
    assert isinstance(ours.experts, MLPExperts)
    x = torch.randn(3, 10, H)
    for training in (True, False):
        ours.train(training)
        want = neox_dropless_moe(x, gate, w1, w2, E, top_k, neox_act, router_type, training)
        got = ours(x)
        assert (got - want).abs().max().item() < 1e-5, (training, (got - want).abs().max().item())
    # gradients of the experts' weights: the reference's autograd through the same numbers
    ours.train(True)
    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    neox_dropless_moe(x, gate, w1r, w2r, E, top_k, neox_act, router_type, True).square().sum().backward()
    ours(x).square().sum().backward()
    assert torch.allclose(ours.experts.up_proj.grad, w1r.grad.view(E, FF, H), atol=1e-5)
    assert torch.allclose(ours.experts.down_proj.grad, w2r.grad.view(E, FF, H).transpose(1, 2), atol=1e-5)


def test_neox_sinkhorn_differs_from_megatrons():
    """NeoX's sinkhorn is its own (column factors first, 3 iterations): on these logits it picks other
    experts than nxdt's Megatron sinkhorn run for 3 iterations, so the importer must not map one to the other."""
    torch.manual_seed(1)
    ours_neox, gate, w1, w2 = _twin(8, 16, 8, 1, "sinkhorn", "gelu")
    megatron = LlamaMoE(16, 8, MoEArgs(num_experts=8, top_k=1, routing_algorithm="sinkhorn", sinkhorn_iterations=3,
                                       router_activation="sigmoid", expert_activation="gelu"))
    megatron.load_state_dict(ours_neox.state_dict())
    x = torch.randn(64, 16) * 3
    assert not torch.equal(ours_neox.gate.route(x, ours_neox.args)[1], megatron.gate.route(x, megatron.args)[1])


# --------------------------------------------------------------------------- the import
def _neox_count(vocab, h, layers, experts, ffn):
    """The parameters NeoX builds for a pre-LN, biased, untied GPT with a dropless MoE in every layer
    (shapes from megatron/model: ParallelSelfAttention query_key_value [3h, h] + bias, dense [h, h] +
    bias; two LayerNorms; router layer [E, h]; ParallelGroupedMLP w1 and w2 [E x F, h]; final norm;
    embedding and output layer [vocab, h])."""
    attention = 3 * h * h + 3 * h + h * h + h
    moe = experts * h + 2 * experts * ffn * h
    return 2 * vocab * h + layers * (attention + 2 * 2 * h + moe) + 2 * h


def test_neox_125m_dmoe_imports_with_neoxs_exact_count(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(NEOX_CONFIGS)
    out = tmp_path / "dmoe.yaml"
    rc = cli(["import-config", "neox", "125M-dmoe.yml", "local_setup.yml", "--output", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    cfg = load_config(["--config-path", str(tmp_path), "--config-name", "dmoe"], check_paths=False, quiet=True)
    moe = cfg.model.moe
    assert (moe.num_experts, moe.top_k, moe.frequency, moe.routing_algorithm, moe.expert_activation,
            moe.ffn_hidden_size, moe.dropless, moe.capacity_factor, moe.output_router_logits) == \
        (8, 1, 1, "neox_sinkhorn", "gelu", 3072, True, None, False)
    assert (cfg.model.activation, cfg.model.has_bias, moe.sinkhorn_iterations, moe.sinkhorn_tol) == ("gelu", True, 3, 1e-4)
    vocab = 128 * -(-50257 // 128)  # GPT-2's 50257 padded to make-vocab-size-divisible-by 128
    want = _neox_count(vocab, 768, 12, 8, 256 * -(-4 * 768 // 256))
    assert want == 558_712_320  # the number NeoX prints for 125M-dmoe.yml + local_setup.yml
    assert plan_main(["--config-path", str(tmp_path), "--config-name", "dmoe"]) == 0
    assert f"parameters   {want:,} total" in capsys.readouterr().out


def _neox_tiny(tmp_path, capsys, extra):
    src = _write(tmp_path / "m.yml", {**TINY, "data-path": "d/corpus", "moe-num-experts": 4, **extra})
    out = tmp_path / "m.yaml"
    rc = cli(["import-config", "neox", str(src), "--output", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, out


def test_neox_moe_keys_topk_swiglu_interval(tmp_path, capsys):
    rc, stdout, err, out = _neox_tiny(tmp_path, capsys, {
        "moe-router-type": "topk", "moe-top-k": 2, "moe-expert-interval": 2, "activation": "swiglu",
        "intermediate-size": 96, "moe-jitter-eps": 0.01, "moe-lbl-in-fp32": True})
    assert rc == 0, err
    cfg = load_config(["--config-path", str(tmp_path), "--config-name", "m"], check_paths=False, quiet=True)
    moe = cfg.model.moe
    assert (moe.routing_algorithm, moe.router_activation, moe.normalize_top_k_affinities, moe.top_k, moe.frequency,
            moe.expert_activation, moe.ffn_hidden_size) == ("top_k", "softmax", False, 2, 2, "silu", 96)
    assert "not mapped   moe-jitter-eps" in stdout and "inert        moe-lbl-in-fp32" in stdout
    # layer 0 is MoE (0 % 2 == 0), layer 1 dense (NeoX's gated MLP: 2/3 of 96 = 64 -> gate+up 64, down 32)
    h, E = 64, 4
    attention = 4 * h * h + 4 * h
    moe_layer = attention + 4 * h + E * h + 2 * E * 96 * h
    dense_layer = attention + 4 * h + (2 * 32 * h + 2 * 32) + (32 * h + h)
    assert plan_main(["--config-path", str(tmp_path), "--config-name", "m"]) == 0
    vocab = 128 * -(-50257 // 128)
    assert f"parameters   {2 * vocab * h + moe_layer + dense_layer + 2 * h:,} total" in capsys.readouterr().out


def test_neox_moe_with_fused_bias_gelu_is_refused(tmp_path, capsys):
    """NeoX's experts call bias_gelu_impl(x) with no bias: NeoX itself cannot run it."""
    rc, _, err, out = _neox_tiny(tmp_path, capsys, {"bias-gelu-fusion": True})
    assert rc == 2 and not out.exists(), err
    assert f"neox key 'bias-gelu-fusion' (in {tmp_path / 'm.yml'}) = True: with moe-num-experts, NeoX's experts call its fused " \
           "bias-GELU without a bias" in err


# --------------------------------------------------------------------------- nxdt side
def test_two_matrix_experts_train_in_a_biased_gelu_model():
    """model.has_bias with an MoE: attention keeps its biases, experts have none; init and a backward work."""
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                     max_position_embeddings=32, activation="gelu", has_bias=True, normalization="layernorm",
                     moe=MoEArgs(num_experts=4, top_k=2, expert_activation="gelu", frequency=2))
    model = NxdtLlamaForCausalLM(args)
    model.init_weights()
    names = [n for n, _ in model.named_parameters() if ".mlp." in n]
    assert "model.layers.0.mlp.experts.up_proj" in names and not any("experts" in n and "bias" in n for n in names)
    assert "model.layers.1.mlp.down_proj.bias" in names  # the dense layer keeps has_bias
    up = model.model.layers[0].mlp.experts.up_proj
    assert abs(up.std().item() - 0.02) < 2e-3
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert up.grad is not None and up.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"MixtralConfig cannot express: .*moe.expert_activation=gelu"):
        hf_config_dict(args)  # nxdt-to-hf: transformers has no two-matrix experts


@pytest.mark.parametrize("moe, ds, source, message", [
    ({"expert_activation": "gelu"}, {"expert_model_parallel_size": 2}, "megatron",
     r"'distributed_strategy.expert_model_parallel_size' > 1 with two-matrix experts \(model.moe.expert_activation "
     r"gelu\) is not supported yet"),
    ({"expert_activation": "gelu"}, {}, "hf", r"model.moe.expert_activation=gelu: two-matrix experts are built for "
                                              r"model_source megatron only"),
])
def test_two_matrix_experts_refusals(moe, ds, source, message):
    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
             "moe": {"num_experts": 4, **moe}}
    if source == "hf":
        model = {"model_config": "${nxdt_conf:model_configs/tiny_mixtral/config.json}", "moe": {"num_experts": 4, **moe}}
    values = {"model_source": source, "model": model, "distributed_strategy": ds,
              "trainer": {"devices": 2 if ds else 1},
              "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 128}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(values, check=True)
