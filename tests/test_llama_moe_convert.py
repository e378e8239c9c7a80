"""`nxdt convert hf-to-nxdt` of LLaMA-MoE folders (config.json model_type llama_moe): the converted
native model's logits equal those of the same weights in a reference written from LLaMA-MoE's code
(pjlab-sys4nlp/llama-moe at b17aff43: smoe/modules/moe/moe_gates.py get_gate_network and
TopKBalancedNoisyGate.forward, moe_calculators.py UniversalCalculator.forward, moe_experts.py
LinearGLUExperts, models/llama_moe/modeling_llama_moe.py: transformers' Llama with that MoE layer as
each layer's mlp), within 1e-5; what nxdt does not build is refused at convert time. In-process, tiny."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TOKENIZER_DIR
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.cli import main
from nxdt.config.errors import ConfigError
from nxdt.models import build_model, logits_of
from nxdt.models.builder import moe_args_from_cfg
from nxdt.models.llama_moe import llama_moe_model_keys, llama_moe_to_native
from nxdt.models.moe import LlamaMoE, set_aux_loss_scale
from nxdt.models.moe_calculators import moe_for_layer
from nxdt.spec import config_from_dict
from nxdt.tools.convert import nxdt_to_hf


def get_gate_network(network, hidden, experts):
    if network == "linear":
        return nn.Linear(hidden, experts, bias=False)
    return nn.Sequential(nn.Linear(hidden, experts, bias=False), nn.Tanh(), nn.Linear(experts, experts, bias=False))


class RefGate(nn.Module):
    """TopKBalancedNoisyGate.forward (use_balance, training noise, the load by noise or by count)."""

    def __init__(self, hidden, experts, k, network, add_noise, use_softmax=True, use_balance=True, weight=1e-2, eps=1e-2):
        super().__init__()
        self.num_experts, self.num_selects, self.add_noise, self.noise_epsilon = experts, k, add_noise, eps
        self.use_softmax, self.use_balance, self.balance_loss_weight = use_softmax, use_balance, weight
        self.gate_network = get_gate_network(network, hidden, experts)
        if add_noise:
            self.weight_noise = nn.Linear(hidden, experts, bias=False)

    @staticmethod
    def cv_squared(x, eps=1e-10):
        if x.shape[0] == 1:
            return torch.tensor(0.0)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def forward(self, x):
        logits_gate = self.gate_network(x)
        if self.training and self.add_noise:
            noise_control = F.softplus(self.weight_noise(x)) + self.noise_epsilon
            logits_noise = torch.randn_like(logits_gate) * noise_control
            logits = logits_gate + logits_noise
        else:
            logits = logits_gate
        top_logits, top_indices = logits.topk(min(self.num_selects + 1, self.num_experts), dim=1)
        top_k_logits, top_k_indices = top_logits[:, :self.num_selects], top_indices[:, :self.num_selects]
        top_k_scores = torch.softmax(top_k_logits.to(torch.float32), 1) if self.use_softmax else top_k_logits
        top_k_scores = top_k_scores.to(logits.dtype)
        zeros = torch.zeros_like(logits, requires_grad=True)
        scores_filtered = zeros.scatter(dim=1, index=top_k_indices, src=top_k_scores)
        importance = scores_filtered.sum(0)
        load = (scores_filtered > 0).sum(0)  # (the noisy load is not compared here: see test_moe_gates)
        balance_loss = torch.tensor(-100.0)
        if self.use_balance:
            balance_loss = (self.cv_squared(importance) + self.cv_squared(load)) * self.balance_loss_weight
        return {"topK_indices": top_k_indices, "topK_scores": top_k_scores, "balance_loss": balance_loss}


class RefSwitchGate(nn.Module):
    """SwitchBalancedGate.forward; gumbel_rsample = deepspeed's (torch's Gumbel(0, 1).rsample)."""

    def __init__(self, hidden, experts, network, add_noise, use_softmax=True, weight=1e-2):
        super().__init__()
        self.num_experts, self.add_noise, self.use_softmax, self.balance_loss_weight = experts, add_noise, use_softmax, weight
        self.gate_network = get_gate_network(network, hidden, experts)

    def forward(self, x):
        batch_size = x.shape[0]
        logits = self.gate_network(x)
        scores = torch.softmax(logits, 1) if self.use_softmax else logits
        if self.add_noise:
            gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample
            logits_w_noise = logits + gumbel(logits.shape).to(logits)
        else:
            logits_w_noise = logits
        top1_scores, top1_indices = torch.max(logits_w_noise, dim=1)
        load = top1_indices.bincount(minlength=self.num_experts)
        balance_loss = self.num_experts * torch.sum(scores.mean(0) * (load / batch_size)) * self.balance_loss_weight
        return {"topK_indices": top1_indices, "topK_scores": top1_scores, "balance_loss": balance_loss}


class RefExperts(nn.Module):
    """LinearGLUExperts(bias=False): per expert weight_gate / weight_up [size, H], weight_down [H, size]."""

    def __init__(self, hidden, sizes):
        super().__init__()
        self.num_experts, self.out_features = len(sizes), hidden
        self.weight_gate = nn.ParameterList([nn.Parameter(torch.randn(s, hidden) * 0.1) for s in sizes])
        self.weight_up = nn.ParameterList([nn.Parameter(torch.randn(s, hidden) * 0.1) for s in sizes])
        self.weight_down = nn.ParameterList([nn.Parameter(torch.randn(hidden, s) * 0.1) for s in sizes])

    def forward(self, x, i):
        return F.linear(F.silu(F.linear(x, self.weight_gate[i])) * F.linear(x, self.weight_up[i]), self.weight_down[i])


class WeightNorm(nn.Module):
    """smoe/modules/norm.py WeightNorm (weight started at scale)."""

    def __init__(self, size, scale):
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), float(scale)))

    def forward(self, hidden):
        return hidden * self.weight


class RefCalculator(nn.Module):
    """UniversalCalculator.forward (multiply_gate_scores, add_weight_norm)."""

    def __init__(self, experts, score_scale, multiply=True, add_weight_norm=False):
        super().__init__()
        self.experts, self.score_scale_factor, self.multiply_gate_scores = experts, score_scale, multiply
        self.num_experts = experts.num_experts
        self.mlp_norm = WeightNorm(1, score_scale) if multiply and add_weight_norm else None

    def forward(self, x, topK_indices, topK_scores, **kwargs):
        batch_size, num_selects = topK_indices.shape
        topK_indices, topK_scores = topK_indices.flatten(), topK_scores.flatten()
        batch_indices = torch.arange(batch_size).repeat_interleave(num_selects)
        _, index_sorted = topK_indices.sort(0)
        sorted_scores = topK_scores.index_select(0, index_sorted)
        sorted_batch = batch_indices.index_select(0, index_sorted)
        sizes = topK_indices.bincount(minlength=self.num_experts).tolist()
        split_x = torch.split(x.index_select(0, sorted_batch), sizes, dim=0)
        outs = torch.cat([self.experts(split_x[i], i) for i in range(len(sizes)) if split_x[i].shape[0] > 0], 0)
        if self.multiply_gate_scores:
            if self.mlp_norm is None:
                outs = torch.mul(outs, sorted_scores.reshape(-1, 1) * self.score_scale_factor)
            else:
                outs = self.mlp_norm(torch.mul(outs, sorted_scores.reshape(-1, 1)))
        return torch.zeros((batch_size, outs.size(1)), dtype=outs.dtype).index_add(0, sorted_batch, outs)


class RefSwitchCalculator(nn.Module):
    """SwitchDropTokenCalculator.forward."""

    def __init__(self, experts, score_scale, multiply=True, add_weight_norm=False, drop_tokens=True,
                 dropped_padding="zero", capacity_factor=1.25):
        super().__init__()
        self.experts, self.score_scale_factor, self.multiply_gate_scores = experts, score_scale, multiply
        self.num_experts, self.out_features = experts.num_experts, experts.out_features
        self.mlp_norm = WeightNorm(experts.out_features, score_scale) if multiply and add_weight_norm else None
        self.drop_tokens, self.dropped_padding, self.capacity_factor = drop_tokens, dropped_padding, capacity_factor

    def forward(self, x, topK_indices, topK_scores, **kwargs):
        batch_size = topK_indices.size(0)
        capacity = int(self.capacity_factor * batch_size / self.num_experts)
        dropped_indices = []
        y = torch.zeros((batch_size, self.out_features), dtype=x.dtype)
        for i in range(self.num_experts):
            token_indices = (topK_indices == i).nonzero(as_tuple=True)[0]
            num_assigned_tokens = token_indices.numel()
            if self.drop_tokens and num_assigned_tokens > capacity:
                token_indices = token_indices[torch.randperm(num_assigned_tokens)]
                dropped_indices.append(token_indices[capacity:])
                token_indices = token_indices[:capacity]
            if num_assigned_tokens > 0:
                y[token_indices, :] = self.experts(x[token_indices, :], i)
        if self.dropped_padding == "input" and len(dropped_indices) > 0:
            dropped_indices = torch.cat(dropped_indices, dim=0)
            y[dropped_indices, :] = x[dropped_indices, :]
        if self.multiply_gate_scores:
            y = torch.mul(y, topK_scores.reshape(-1, 1) * self.score_scale_factor)
            if self.mlp_norm is not None:
                y = self.mlp_norm(y)
        return y


class RefMoE(nn.Module):
    """LinearGLUMoELayer (BaseMoELayer._create_gate / _create_calculator / forward) from a config.json."""

    def __init__(self, hf, sizes):
        super().__init__()
        h, n = hf["hidden_size"], hf["num_experts"]
        common = dict(network=hf["gate_network"], add_noise=hf["gate_add_noise"], use_softmax=hf["gate_use_softmax"])
        if hf["gate_type"] == "SwitchBalancedGate":
            self.gate = RefSwitchGate(h, n, weight=hf["gate_balance_loss_weight"], **common)
        else:
            self.gate = RefGate(h, n, hf["num_selects"], use_balance=hf["gate_use_balance"],
                                weight=hf["gate_balance_loss_weight"], **common)
        experts = RefExperts(h, sizes)
        calc = dict(multiply=hf["multiply_gate_scores"], add_weight_norm=hf["add_weight_norm"])
        if hf["calculator_type"] == "SwitchDropTokenCalculator":
            self.calculator = RefSwitchCalculator(experts, hf["score_scale_factor"], drop_tokens=hf["drop_tokens"],
                                                  dropped_padding=hf["dropped_padding"],
                                                  capacity_factor=hf["capacity_factor"], **calc)
        else:
            self.calculator = RefCalculator(experts, hf["score_scale_factor"], **calc)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gate_outputs = self.gate(x)
        self.balance_loss = gate_outputs["balance_loss"]
        return self.calculator(x, **gate_outputs).reshape(shape)


class RefUniformGate(nn.Module):
    """UniformLearnableGate (gate_network linear): every expert, scores softmax(logits) or the logits."""

    def __init__(self, hidden, experts, use_softmax):
        super().__init__()
        self.gate_network, self.use_softmax = nn.Linear(hidden, experts, bias=False), use_softmax

    def forward(self, x):
        logits = self.gate_network(x)
        return torch.softmax(logits, 1) if self.use_softmax else logits


class RefResidualBlock(nn.Module):
    """The residual block: UniformLearnableGate + UniformCalculator over LinearGLUExperts."""

    def __init__(self, hidden, sizes, use_softmax, multiply, scale):
        super().__init__()
        self.gate = RefUniformGate(hidden, len(sizes), use_softmax)
        self.calculator = nn.Module()  # UniformCalculator: its parameters are calculator.experts.*
        self.calculator.experts = RefExperts(hidden, sizes)
        self.multiply, self.scale = multiply, scale

    def forward(self, x):
        scores = self.gate(x)
        experts = self.calculator.experts
        outs = torch.stack([experts(x, i) for i in range(experts.num_experts)], 0)
        if self.multiply:
            outs = outs * (scores.transpose(0, 1).unsqueeze(2).expand(outs.shape) * self.scale)
        return torch.sum(outs, dim=0)


class RefResidualMoE(nn.Module):
    """LinearGLUMoEResidualLayer (use_weighting false): moe_layer(x) + residual_block(x)."""

    def __init__(self, hf, sizes):
        super().__init__()
        self.moe_layer = RefMoE(hf, sizes)
        n = hf["num_experts_residual"]
        self.residual_block = RefResidualBlock(hf["hidden_size"], [hf["intermediate_size_moe"] // hf["num_experts"]] * n,
                                               hf["gate_use_softmax_residual"], hf["multiply_gate_scores_residual"],
                                               hf["score_scale_factor_residual"])

    def forward(self, x):
        shape = x.shape
        out = self.moe_layer(x)
        self.balance_loss = self.moe_layer.balance_loss
        return out + self.residual_block(x.reshape(-1, shape[-1])).reshape(shape)


LLAMA_MOE = {"model_type": "llama_moe", "architectures": ["LlamaMoEForCausalLM"], "vocab_size": 1000,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "num_experts": 4, "num_selects": 2,
             "size_experts": None, "gate_type": "TopKBalancedNoisyGate", "gate_network": "mlp",
             "gate_use_softmax": True, "gate_use_balance": True, "gate_balance_loss_weight": 1e-2,
             "gate_add_noise": True, "gate_noise_epsilon": 1e-2, "calculator_type": "UniversalCalculator",
             "multiply_gate_scores": True, "score_scale_factor": 2.0, "add_weight_norm": False,
             "drop_tokens": True, "dropped_padding": "zero", "capacity_factor": 1.25}
RESIDUAL = {"model_type": "llama_moe_residual", "intermediate_size": 192, "intermediate_size_moe": 128,
            "intermediate_size_residual": 64, "num_experts_residual": 2, "size_experts_residual": None,
            "gate_use_softmax_residual": True, "multiply_gate_scores_residual": True,
            "score_scale_factor_residual": 0.5, "use_weighting": False}
SWITCH = {"gate_type": "SwitchBalancedGate", "num_selects": 1, "calculator_type": "SwitchDropTokenCalculator"}
UNEQUAL = [[16, 48, 40, 24], [24, 40, 32, 32]]
CASES = {  # each LLaMA-MoE layer option at least once
    "mlp": {}, "linear": {"gate_network": "linear"},
    "unequal+weight_norm+raw_logits": {"size_experts": UNEQUAL, "add_weight_norm": True, "gate_use_softmax": False},
    "unweighted+no_balance": {"multiply_gate_scores": False, "gate_use_balance": False},
    "switch_drops_input_padding": {**SWITCH, "capacity_factor": 0.5, "dropped_padding": "input", "add_weight_norm": True},
    "switch_no_drops_no_noise": {**SWITCH, "drop_tokens": False, "gate_add_noise": False, "gate_use_softmax": False},
    "residual": RESIDUAL,
    "residual_unweighted": {**RESIDUAL, "gate_use_softmax_residual": False, "multiply_gate_scores_residual": False,
                            "size_experts": UNEQUAL},
}


def _ref_layer(hf, layer):
    """The reference MoE layer of `layer` (LlamaMoEDecoderLayer / LlamaMoEResidualDecoderLayer's mlp)."""
    width = hf.get("intermediate_size_moe", hf["intermediate_size"])
    sizes = hf["size_experts"][layer] if hf["size_experts"] else [width // hf["num_experts"]] * hf["num_experts"]
    mlp = RefResidualMoE(hf, sizes) if hf["model_type"] == "llama_moe_residual" else RefMoE(hf, sizes)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if p.dim() == 2 and p.shape[0] == p.shape[1] == hf["num_experts"]:
                p.normal_(0, 1.0)  # the mlp gate's [E, E] layer: routing that depends on it
            elif "mlp_norm" in name:
                p.mul_(torch.rand_like(p) + 0.5)  # a trained weight norm
    return mlp


def _folder(tmp_path, **over):
    """A LLaMA-MoE folder: the reference model's state dict (LLaMA-MoE's names) as safetensors."""
    hf = {**LLAMA_MOE, **over}
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                            "rms_norm_eps", "rope_theta", "tie_word_embeddings")})
    ref = LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    for i, layer in enumerate(ref.model.layers):
        layer.mlp = _ref_layer(hf, i).eval()
    folder = tmp_path / "llama_moe"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf))
    return ref, folder


@pytest.mark.parametrize("case", list(CASES))
def test_llama_moe_folder_converts_with_llama_moes_logits(tmp_path, capsys, case):
    """Every case's logits within 1e-5 of the reference's; the random parts (the switch gate's Gumbel noise,
    SwitchDropTokenCalculator's drops: LLaMA-MoE draws them in evaluation too) from the same torch RNG state."""
    ref, folder = _folder(tmp_path, **CASES[case])
    ckpt = tmp_path / "nxdt"
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(ckpt)]) == 0, capsys.readouterr().err
    keys = OmegaConf.to_container(OmegaConf.load(ckpt / "nxdt_model.yaml"))
    moe = keys["model"]["moe"]
    if case in ("mlp", "linear"):
        assert (moe["num_experts"], moe["top_k"], moe["ffn_hidden_size"], moe["gate_type"], moe["gate_network"],
                moe["moe_calculator_score_scale_factor"], moe["gate_balance_loss_weight"]) == \
            (4, 2, 32, "top_k_balanced_noisy", case, 2.0, 1e-2)
    data = {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}
    model = build_model(config_from_dict({**keys, "data": data}), vocab_size=1000).eval()
    weights = load_weights(ckpt)
    model.load_state_dict(weights, strict=True)  # every tensor placed, none left over
    ids = torch.arange(24).reshape(2, 12) * 37 % 1000
    with torch.no_grad():
        torch.manual_seed(1)
        want = ref(input_ids=ids).logits
        torch.manual_seed(1)
        got = logits_of(model(input_ids=ids))
    assert (got - want).abs().max().item() < 1e-5
    if case == "mlp":
        with pytest.raises(Exception, match="a LLaMA-MoE checkpoint; nxdt-to-hf back to LLaMA-MoE's names is not "
                                            "supported yet"):
            nxdt_to_hf(ckpt, tmp_path / "back", max_shard_bytes=10**9)


@pytest.mark.parametrize("case", ["unequal+weight_norm+raw_logits", "unweighted+no_balance",
                                  "switch_drops_input_padding", "residual_unweighted"])
def test_llama_moe_layer_trains_as_llama_moes(case):
    """One MoE layer in training mode: output, balance loss gradient and every parameter's gradient (LLaMA-MoE's,
    renamed and padded by the converter: the unequal experts' padding gets exactly 0) within 1e-5."""
    hf = {**LLAMA_MOE, **CASES[case], "gate_add_noise": "switch" in case}  # the noisy top-k gate's load: test_moe_gates
    torch.manual_seed(0)
    ref = _ref_layer(hf, 0).train()
    prefix = "model.layers.0.mlp."
    native = llama_moe_to_native({prefix + k: v for k, v in ref.state_dict().items()}, hf)
    keys = llama_moe_model_keys(hf)
    args = moe_for_layer(moe_args_from_cfg(config_from_dict({"model_source": "megatron", "model": keys}).model.moe), 0)
    layer = LlamaMoE(64, keys["moe"]["ffn_hidden_size"], args).train()
    layer.load_state_dict({k[len(prefix):]: v for k, v in native.items()}, strict=True)
    x = torch.randn(24, 64)
    probe = torch.randn(24, 64)
    set_aux_loss_scale(1.0)
    outs = []
    for module in (ref, layer):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(3)
        out = module(xi)
        loss = (out * probe).sum()
        if module is ref and ref.balance_loss > 0:  # LlamaMoEForCausalLM adds it when positive
            loss = loss + ref.balance_loss
        loss.backward()
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=1e-5)
    zero_if_none = lambda p: torch.zeros_like(p) if p.grad is None else p.grad  # noqa: E731
    want = llama_moe_to_native({prefix + k: zero_if_none(p) for k, p in ref.named_parameters()}, hf)
    got = {prefix + k: zero_if_none(p) for k, p in layer.named_parameters()}
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    if case.startswith("unequal"):
        grad = got[prefix + "experts.gate_up_proj"]
        assert grad[0, 16:48].abs().max() == 0 and grad[0, 64:].abs().max() == 0  # expert 0: 16 of 48 rows
        assert grad[0, :16].abs().min() > 0 and grad[0, 48:64].abs().min() > 0


@pytest.mark.parametrize("over, message", [
    ({"gate_type": "UniformPlainGate"},
     "gate_type='UniformPlainGate' (nxdt builds TopKBalancedNoisyGate and SwitchBalancedGate): not supported yet"),
    ({"calculator_type": "UniformCalculator"}, "calculator_type='UniformCalculator' (nxdt builds UniversalCalculator "
                                               "and SwitchDropTokenCalculator): not supported yet"),
    ({"gate_type": "SwitchBalancedGate", "num_selects": 1},
     "SwitchBalancedGate with UniversalCalculator: LLaMA-MoE's forward fails"),
    ({"calculator_type": "SwitchDropTokenCalculator"},
     "SwitchDropTokenCalculator with num_selects 2: LLaMA-MoE's forward fails"),
    ({"size_experts": [[16, 48, 32, 30], [32, 32, 32, 32]]},
     "size_experts of layer 0 = [16, 48, 32, 30]: LLaMA-MoE needs 4 widths summing to 128"),
    ({"score_scale_factor": [2.0, 1.0]}, "score_scale_factor per layer [2.0, 1.0]: not supported yet"),
    ({**RESIDUAL, "use_weighting": True}, "use_weighting=True (LLaMA-MoE's own residual layer fails with it"),
    ({**RESIDUAL, "size_experts": UNEQUAL, "size_experts_residual": [[16, 48], [32, 32]]},
     "size_experts_residual [[16, 48], [32, 32]] (unequal residual experts): not supported yet"),
])
def test_what_nxdt_does_not_build_is_refused_at_convert_time(tmp_path, capsys, over, message):
    folder = tmp_path / "llama_moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA_MOE, **over}))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(tmp_path / "c")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "cannot convert this LLaMA-MoE model: " in errors[0] and message in errors[0], errors
    assert not (tmp_path / "c").exists()


MOE_MODEL = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4}


@pytest.mark.parametrize("moe, extra, message", [
    ({"use_weighting": True}, {}, r"^'model.moe.use_weighting' \(LLaMA-MoE's use_weighting\) is not supported yet: "
                                  r"LLaMA-MoE's own residual layer fails with it"),
    ({"calculator_type": "SwitchDropTokenCalculator", "top_k": 2}, {},
     r"^model.moe.calculator_type SwitchDropTokenCalculator computes one expert per token: model.moe.top_k"),
    ({"switch_gate_weight": "logit"}, {}, r"^model.moe.switch_gate_weight=logit: needs model.moe.gate_type switch_balanced"),
    ({"gate_type": "mixtral", "gate_use_softmax": False}, {}, r"^model.moe.gate_use_softmax=false: LLaMA-MoE's gates"),
    ({"size_experts": [[8, 8, 8, 8]]}, {}, r"^model.moe.size_experts: one list per layer \(2\), got 1"),
    ({"size_experts": [[8, 8, 8, 8], [8, 8, 8, 40]], "ffn_hidden_size": 32}, {},
     r"^model.moe.size_experts\[1\] = \[8, 8, 8, 40\]: needs 4 widths in \[1, 32\]"),
    ({"num_experts_residual": 2}, {"trainer": {"devices": 2}, "distributed_strategy": {"tensor_model_parallel_size": 2}},
     r"^'distributed_strategy.tensor_model_parallel_size' > 1 with model.moe.num_experts_residual \(LLaMA-MoE's "
     r"layer options\) is not supported yet \(got 2\)"),
    ({"calculator_type": "SwitchDropTokenCalculator", "dropless": True}, {},
     r"^model.moe.dropless=true with calculator_type SwitchDropTokenCalculator: set model.moe.drop_tokens false"),
])
def test_llama_moe_layer_keys_that_do_not_fit_are_one_line(moe, extra, message):
    """In a training config, LLaMA-MoE's layer keys that cannot be built as given: one ConfigError line."""
    cfg = {"model_source": "megatron", **extra,
           "model": {**MOE_MODEL, "moe": {"num_experts": 4, "top_k": 1, "gate_type": "TopKBalancedNoisyGate", **moe}}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cfg, check=True)


LORA_SH = {"lora_rank": 8, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
           "modules_to_save": "embed_tokens,lm_head"}  # scripts/cpt/lora.sh, its modules_to_save line uncommented


def test_lora_sh_modules_to_save_trains_them_in_full():
    """LLaMA-MoE's lora.sh `--modules_to_save embed_tokens,lm_head` (cpt_lora.py splits it on commas into peft's
    LoraConfig.modules_to_save; tests/test_lora.py holds nxdt's = peft's): on a LLaMA-MoE model the adapters and
    those two modules train, nothing else; combinations nxdt would build otherwise than peft are one line."""
    from nxdt.spec import build_spec
    from nxdt.spec.alignment import alignment_of
    from nxdt.training.finetuning import add_lora, check_lora_targets

    def cfg(peft, **strategies):
        return config_from_dict({"model_source": "megatron", "model": {**MOE_MODEL, "moe": {
            "num_experts": 4, "top_k": 2, "gate_type": "TopKBalancedNoisyGate"}},
            "model_alignment_strategy": {"peft": {**LORA_SH, **peft}, **strategies}}, check=True)

    peft = alignment_of(cfg({})).peft
    assert peft.modules_to_save == ["embed_tokens", "lm_head"]
    model = build_model(cfg({}), 64)
    assert "trained in full: embed_tokens, lm_head (modules_to_save)" in add_lora(model, peft)
    trained = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    assert trained == ["model.embed_tokens.weight", "lm_head.weight"]
    assert sum(".lora_" in n for n, p in model.named_parameters() if p.requires_grad) == 2 * 2 * 2
    model = build_model(cfg({}), 64)  # the routers (mlp.gate, LLaMA-MoE's name too) with their noise weights
    add_lora(model, alignment_of(cfg({"modules_to_save": ["gate"]})).peft)
    assert [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n] == [
        f"model.layers.{i}.mlp.gate.{w}" for i in range(2) for w in ("weight", "weight_noise")]
    key = r"^model_alignment_strategy\.peft\.modules_to_save"
    with pytest.raises(ConfigError, match=key + r": 'gate_network' matches no module with parameters"):
        check_lora_targets(build_spec(cfg({"modules_to_save": ["gate_network"]})), 64)  # nxdt's is mlp.gate itself
    with pytest.raises(ConfigError, match=key + r": '' in 'embed_tokens,,lm_head' is not a module name"):
        cfg({"modules_to_save": "embed_tokens,,lm_head"})
    dpo = r" with model_alignment_strategy\.dpo\.precompute_ref_log_probs false is not supported yet: the reference"
    with pytest.raises(ConfigError, match=key + dpo + r" is the base with the adapters off"):
        cfg({}, dpo={"precompute_ref_log_probs": False})
    with pytest.raises(ConfigError, match=key + r" with model_alignment_strategy\.grpo\.beta > 0 is not supported yet"):
        cfg({}, grpo={"beta": 0.04})
