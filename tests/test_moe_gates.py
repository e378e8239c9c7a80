"""LLaMA-MoE's gates (nxdt.models.moe): the noisy top-k gate and the switch gate, their balance
losses against values computed by hand on 3 tokens x 4 experts, noise in training only, the
loss's gradient, a tiny model that trains, and the config lines. In-process, small."""

from __future__ import annotations

import math

import pytest
import torch

from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.models import build_model
from nxdt.models.builder import moe_args_from_cfg
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.models.llama_moe import cv_squared, noisy_top_k_gate, switch_gate
from nxdt.models.moe import LlamaMoE, MoEArgs, pop_router_stats, set_aux_loss_scale


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def phi(v: float) -> float:
    """Standard normal CDF."""
    return 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))


def cv2_by_hand(xs: list[float]) -> float:
    """var (n - 1) / mean^2, the eps of 1e-10 being far below these tests' tolerance."""
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / mean ** 2


def test_cv_squared_is_unbiased_variance_over_squared_mean():
    # [3, 1, 0, 0]: mean 1, unbiased variance (4 + 0 + 1 + 1) / 3 = 2 (the biased one would be 1.5)
    assert float(cv_squared(torch.tensor([3.0, 1.0, 0.0, 0.0]))) == pytest.approx(2.0, rel=1e-6)
    assert float(cv_squared(torch.tensor([2.0, 2.0, 2.0, 2.0]))) == 0.0
    assert float(cv_squared(torch.tensor([5.0]))) == 0.0  # one expert: LLaMA-MoE's guard
    assert float(cv_squared(torch.zeros(4))) == 0.0  # eps keeps 0 / 0 away


# 3 tokens x 4 experts, k = 2, no noise
CLEAN = torch.tensor([[2.0, 1.0, 0.0, -1.0],    # experts 0, 1: softmax([2, 1]) = sigmoid(1), sigmoid(-1)
                      [0.0, 1.0, 3.0, 0.0],     # experts 2, 1: sigmoid(2), sigmoid(-2)
                      [1.0, 0.0, -1.0, 2.0]])   # experts 3, 0: sigmoid(1), sigmoid(-1)


def test_noisy_gate_without_noise_by_hand():
    weights, experts, loss = noisy_top_k_gate(CLEAN, 2)
    assert experts.tolist() == [[0, 1], [2, 1], [3, 0]]
    expected_w = [[sigmoid(1), sigmoid(-1)], [sigmoid(2), sigmoid(-2)], [sigmoid(1), sigmoid(-1)]]
    torch.testing.assert_close(weights, torch.tensor(expected_w), rtol=0, atol=1e-6)  # softmax over the k only
    # importance = summed weights: [1, sigmoid(-1) + sigmoid(-2), sigmoid(2), sigmoid(1)]
    #            = [1, 0.3881443, 0.8807971, 0.7310586]; CV^2 = 0.0703021 / 0.75^2 = 0.1249815
    importance = [1.0, sigmoid(-1) + sigmoid(-2), sigmoid(2), sigmoid(1)]
    assert cv2_by_hand(importance) == pytest.approx(0.1249815, rel=1e-5)
    # load = tokens per expert [2, 2, 1, 1]: variance (4 x 0.25) / 3 = 1/3, CV^2 = (1/3) / 1.5^2 = 0.1481481
    assert float(loss) == pytest.approx(0.1249815 + 0.1481481, rel=1e-5)


def test_noisy_gate_load_is_the_normal_cdf_of_staying_in_the_top_k():
    clean = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    std = torch.tensor([[1.0] * 4, [2.0] * 4, [0.5] * 4])
    z = torch.tensor([[0.0, 0.5, -0.5, 0.0], [0.0, 0.0, 0.25, -0.5], [3.0, 0.0, 0.0, -1.0]])
    # noisy = clean + z x std: [1, .5, -.5, 0], [0, 2, .5, -1], [1.5, 0, 1, .5]
    weights, experts, loss = noisy_top_k_gate(clean, 2, std, z)
    assert experts.tolist() == [[0, 1], [1, 2], [0, 2]]
    expected_w = [[sigmoid(0.5), sigmoid(-0.5)], [sigmoid(1.5), sigmoid(-1.5)], [sigmoid(0.5), sigmoid(-0.5)]]
    torch.testing.assert_close(weights, torch.tensor(expected_w), rtol=0, atol=1e-6)
    # per token: thresholds (3rd, 2nd noisy logit) = (0, .5), (0, .5), (.5, 1); an expert in the
    # top 2 must stay above the 3rd, one outside must pass the 2nd: Phi((clean - threshold) / std)
    prob = [[phi(1 / 1), phi(0 / 1), phi(-0.5 / 1), phi(-0.5 / 1)],
            [phi(-0.5 / 2), phi(2 / 2), phi(0 / 2), phi(-0.5 / 2)],
            [phi(-0.5 / 0.5), phi(-1 / 0.5), phi(0.5 / 0.5), phi(0 / 0.5)]]
    load = [sum(col) for col in zip(*prob)]  # [1.4012937, 1.3640948, 1.6498822, 1.2098312]
    assert load == pytest.approx([1.4012937, 1.3640948, 1.6498822, 1.2098312], abs=1e-6)
    importance = [2 * sigmoid(0.5), sigmoid(-0.5) + sigmoid(1.5), sigmoid(-1.5) + sigmoid(-0.5), 0.0]
    assert float(loss) == pytest.approx(cv2_by_hand(importance) + cv2_by_hand(load), rel=1e-5)
    # expert 0 of token 2 is in the top 2 by its noise alone (noisy 1.5, clean 0): it counts
    # Phi(-1) = 0.1587 (staying above 0.5), not Phi(-2) (passing 1)
    assert prob[2][0] == pytest.approx(0.1586553, abs=1e-6)


def test_switch_gate_by_hand():
    # probabilities [4, 2, 1, 1] / 8, [1, 1, 2, 4] / 8, [2, 4, 1, 1] / 8: experts 0, 3, 1
    logits = torch.tensor([[4.0, 2.0, 1.0, 1.0], [1.0, 1.0, 2.0, 4.0], [2.0, 4.0, 1.0, 1.0]]).log()
    weights, experts, loss = switch_gate(logits)
    assert experts.tolist() == [[0], [3], [1]]
    torch.testing.assert_close(weights, torch.full((3, 1), 0.5), rtol=0, atol=1e-6)
    # mean probabilities [.875, .875, .5, .75] / 3, token shares [1, 1, 0, 1] / 3:
    # 4 x (.875 + .875 + .75) / 9 = 10 / 9
    assert float(loss) == pytest.approx(10 / 9, rel=1e-6)
    # Gumbel noise moves token 0 to expert 2 (probability 1/8): shares [0, 1, 1, 1] / 3
    gumbel = torch.tensor([[0.0, 0.0, 10.0, 0.0], [0.0] * 4, [0.0] * 4])
    weights, experts, loss = switch_gate(logits, gumbel)
    assert experts.tolist() == [[2], [3], [1]]
    assert float(weights[0, 0]) == pytest.approx(0.125, rel=1e-6)
    assert float(loss) == pytest.approx(4 * (0.875 + 0.5 + 0.75) / 9, rel=1e-6)  # 0.9444


def _layer(gate_type: str = "top_k_balanced_noisy", top_k: int = 2, coef: float = 0.01) -> LlamaMoE:
    torch.manual_seed(0)
    layer = LlamaMoE(8, 12, MoEArgs(num_experts=4, top_k=top_k, gate_type=gate_type, aux_loss_coef=coef))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_noise_in_training_only_and_deterministic_given_the_rng():
    layer = _layer()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    layer.eval()
    state = torch.get_rng_state()
    with torch.no_grad():
        a, b = layer(x), layer(x)
    assert torch.equal(torch.get_rng_state(), state)  # evaluation draws nothing
    assert torch.equal(a, b)
    weights, experts, _ = layer.gate.route(x.reshape(-1, 8), layer.args)
    clean_w, clean_e, _ = noisy_top_k_gate(layer.gate(x.reshape(-1, 8)), 2)
    assert torch.equal(experts, clean_e) and torch.equal(weights, clean_w)

    layer.train()
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(layer.gate.route(x.reshape(-1, 8), layer.args)[1])
    assert torch.equal(outs[0], outs[1])  # same RNG state, same noise, same routing
    assert not torch.equal(outs[0], outs[2])  # noise changes the choice of some tokens
    assert not torch.equal(outs[0], clean_e)


def test_balance_loss_reaches_the_noise_weight_and_is_logged():
    layer = _layer(coef=0.5).train()
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    set_aux_loss_scale(1.0)
    torch.manual_seed(7)
    (layer(x) * 0.0).sum().backward()  # only the balance loss sends gradient back
    assert layer.gate.weight_noise.grad.abs().sum() > 0
    assert layer.gate.weight.grad.abs().sum() > 0
    grads = (layer.gate.weight.grad.clone(), layer.gate.weight_noise.grad.clone())

    # the same loss by hand from the same noise: 0.5 x its gradient, and logged unweighted
    layer.zero_grad()
    torch.manual_seed(7)
    std = torch.nn.functional.softplus(x @ layer.gate.weight_noise.t()) + 0.01
    _, _, loss = noisy_top_k_gate(x @ layer.gate.weight.t(), 2, std, torch.randn_like(std))
    (0.5 * loss).backward()
    torch.testing.assert_close(grads[0], layer.gate.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], layer.gate.weight_noise.grad, rtol=1e-5, atol=1e-7)
    assert pop_router_stats(layer)["aux_loss"] == pytest.approx(float(loss.detach()), rel=1e-6)


def _tiny(gate_type: str, top_k: int) -> NxdtLlamaForCausalLM:
    torch.manual_seed(0)
    moe = MoEArgs(num_experts=4, top_k=top_k, gate_type=gate_type, aux_loss_coef=0.01, score_scale=4 / top_k)
    model = NxdtLlamaForCausalLM(LlamaArgs(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                           num_kv_heads=2, ffn_hidden_size=24, max_position_embeddings=32,
                                           layernorm_epsilon=1e-5, rope_theta=10000.0, moe=moe))
    model.init_weights()
    return model


@pytest.mark.parametrize("gate_type, top_k", [("top_k_balanced_noisy", 2), ("switch_balanced", 1)])
def test_a_tiny_model_with_the_gate_trains(gate_type, top_k):
    model = _tiny(gate_type, top_k).train()
    if gate_type == "top_k_balanced_noisy":  # init: noise weight 0 (LLaMA-MoE), std softplus(0) + eps
        assert all(not layer.mlp.gate.weight_noise.detach().any() for layer in model.model.layers)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    set_aux_loss_scale(1.0)
    losses = []
    for _ in range(6):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.3, losses
    stats = pop_router_stats(model)
    assert stats["aux_loss"] > 0 and stats["dropped_fraction"] == 0.0


def test_switch_weights_carry_the_router_gradient():
    layer = _layer("switch_balanced", top_k=1, coef=0.0).train()
    layer(torch.randn(6, 8, generator=torch.Generator().manual_seed(4))).sum().backward()
    assert layer.gate.weight.grad.abs().sum() > 0  # through the chosen probability, with no loss
    assert layer.gate.weight_noise is None


# --------------------------------------------------------------------------- config


def _values(model_source: str = "megatron", **moe) -> dict:
    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
             "moe": {"num_experts": 4, **moe}}
    if model_source == "hf":
        model = {"model_config": "${nxdt_conf:model_configs/tiny_mixtral/config.json}", "moe": moe}
    return {"model_source": model_source, "model": model, "trainer": {"devices": 1},
            "data": {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": 64}}


def test_llama_moe_names_are_accepted_and_built():
    cfg = config_from_dict(_values(gate_type="TopKBalancedNoisyGate", num_selects=2, gate_balance_loss_weight=0.01,
                                   moe_calculator_score_scale_factor=2.0), check=True)
    moe = cfg.model.moe
    assert (moe.gate_type, moe.top_k) == ("top_k_balanced_noisy", 2)
    args = moe_args_from_cfg(moe)
    assert (args.gate_type, args.top_k, args.aux_loss_coef, args.score_scale) == ("top_k_balanced_noisy", 2, 0.01, 2.0)
    assert args.noise_weight and args.gate_noise_epsilon == 0.01
    model = build_model(cfg, 128, device="meta")
    assert tuple(model.model.layers[0].mlp.gate.weight_noise.shape) == (4, 64)
    switch = moe_args_from_cfg(config_from_dict(_values(gate_type="SwitchBalancedGate", num_selects=1),
                                                check=True).model.moe)
    assert (switch.gate_type, switch.noise_weight, switch.aux_loss_coef) == ("switch_balanced", False, 0.0)


@pytest.mark.parametrize("source, moe, message", [
    ("megatron", {"gate_type": "switch_balanced", "top_k": 2},
     r"^model.moe.gate_type switch_balanced picks one expert per token: model.moe.top_k \(num_selects\) must be 1, "
     r"got 2$"),
    ("megatron", {"gate_type": "SwitchBalancedGate", "num_selects": 4},
     r"^model.moe.gate_type switch_balanced picks one expert per token: .* got 4$"),
    ("hf", {"gate_type": "top_k_balanced_noisy"},
     r"^model.moe.gate_type top_k_balanced_noisy: LLaMA-MoE's gates are built for model_source megatron only "
     r"\(got hf\)$"),
    ("megatron", {"gate_balance_loss_weight": 0.01},
     r"^model.moe.gate_balance_loss_weight=0.01 weighs LLaMA-MoE's balance loss: needs model.moe.gate_type "
     r"top_k_balanced_noisy or switch_balanced \(the mixtral gate's loss is model.moe.router_aux_loss_coef\)$"),
    ("megatron", {"gate_type": "top_k_balanced_noisy", "router_activation": "sigmoid"},
     r"^model.moe.router_activation=sigmoid: the mixtral gate's setting; with model.moe.gate_type "
     r"top_k_balanced_noisy routing and its loss are the gate's own"),
    ("megatron", {"gate_type": "top_k_balanced_noisy", "output_router_logits": True},
     r"^model.moe.output_router_logits=True: the mixtral gate's setting"),
    ("megatron", {"gate_type": "top_k_balanced_noisy", "gate_noise_epsilon": -0.1},
     r"^model.moe.gate_noise_epsilon: must be >= 0, got -0.1$"),
    ("megatron", {"gate_type": "noisy"}, r"model.moe.gate_type"),
])
def test_bad_gate_config_is_one_line(source, moe, message):
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(_values(source, **moe), check=True)
    assert "\n" not in str(err.value)


def test_hf_export_refuses_llama_moe_gates():
    args = LlamaArgs(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=24,
                     moe=MoEArgs(num_experts=4, top_k=2, gate_type="top_k_balanced_noisy"))
    with pytest.raises(ValueError, match=r"moe.gate_type=top_k_balanced_noisy"):
        args.to_hf_config_dict()
