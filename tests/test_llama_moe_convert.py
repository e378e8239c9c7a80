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
from nxdt.spec import config_from_dict
from nxdt.tools.convert import nxdt_to_hf


class RefGate(nn.Module):
    """TopKBalancedNoisyGate (its parameters and its evaluation forward: no noise)."""

    def __init__(self, hidden, experts, k, network, add_noise):
        super().__init__()
        self.num_selects = k
        if network == "linear":
            self.gate_network = nn.Linear(hidden, experts, bias=False)
        else:
            self.gate_network = nn.Sequential(nn.Linear(hidden, experts, bias=False), nn.Tanh(),
                                              nn.Linear(experts, experts, bias=False))
        if add_noise:
            self.weight_noise = nn.Linear(hidden, experts, bias=False)

    def forward(self, x):
        logits = self.gate_network(x)
        top_logits, top_indices = logits.topk(min(self.num_selects + 1, logits.shape[1]), dim=1)
        top_k_scores = torch.softmax(top_logits[:, :self.num_selects].to(torch.float32), 1).to(logits.dtype)
        return top_indices[:, :self.num_selects], top_k_scores


class RefExperts(nn.Module):
    """LinearGLUExperts(bias=False): per expert weight_gate / weight_up [size, H], weight_down [H, size]."""

    def __init__(self, hidden, sizes):
        super().__init__()
        self.weight_gate = nn.ParameterList([nn.Parameter(torch.randn(s, hidden) * 0.1) for s in sizes])
        self.weight_up = nn.ParameterList([nn.Parameter(torch.randn(s, hidden) * 0.1) for s in sizes])
        self.weight_down = nn.ParameterList([nn.Parameter(torch.randn(hidden, s) * 0.1) for s in sizes])

    def forward(self, x, i):
        return F.linear(F.silu(F.linear(x, self.weight_gate[i])) * F.linear(x, self.weight_up[i]), self.weight_down[i])


class RefCalculator(nn.Module):
    def __init__(self, experts, score_scale):
        super().__init__()
        self.experts, self.score_scale_factor = experts, score_scale

    def forward(self, x, topK_indices, topK_scores):
        """UniversalCalculator.forward (multiply_gate_scores, no weight norm)."""
        batch_size, num_selects = topK_indices.shape
        topK_indices, topK_scores = topK_indices.flatten(), topK_scores.flatten()
        batch_indices = torch.arange(batch_size).repeat_interleave(num_selects)
        _, index_sorted = topK_indices.sort(0)
        sorted_scores = topK_scores.index_select(0, index_sorted)
        sorted_batch = batch_indices.index_select(0, index_sorted)
        sizes = topK_indices.bincount(minlength=len(self.experts.weight_gate)).tolist()
        split_x = torch.split(x.index_select(0, sorted_batch), sizes, dim=0)
        outs = torch.cat([self.experts(split_x[i], i) for i in range(len(sizes)) if split_x[i].shape[0] > 0], 0)
        outs = outs * (sorted_scores.reshape(-1, 1) * self.score_scale_factor)
        return torch.zeros((batch_size, outs.size(1)), dtype=outs.dtype).index_add(0, sorted_batch, outs)


class RefMoE(nn.Module):
    """LinearGLUMoELayer: the decoder layer's mlp (BaseMoELayer.forward; the hidden states only)."""

    def __init__(self, hidden, sizes, k, network, add_noise, score_scale):
        super().__init__()
        self.gate = RefGate(hidden, len(sizes), k, network, add_noise)
        self.calculator = RefCalculator(RefExperts(hidden, sizes), score_scale)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        indices, scores = self.gate(x)
        return self.calculator(x, indices, scores).reshape(shape)


LLAMA_MOE = {"model_type": "llama_moe", "architectures": ["LlamaMoEForCausalLM"], "vocab_size": 1000,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "num_experts": 4, "num_selects": 2,
             "size_experts": None, "gate_type": "TopKBalancedNoisyGate", "gate_network": "mlp",
             "gate_use_softmax": True, "gate_use_balance": True, "gate_balance_loss_weight": 1e-2,
             "gate_add_noise": True, "gate_noise_epsilon": 1e-2, "calculator_type": "UniversalCalculator",
             "multiply_gate_scores": True, "score_scale_factor": 2.0, "add_weight_norm": False}


def _folder(tmp_path, **over):
    """A LLaMA-MoE folder: the reference model's state dict (LLaMA-MoE's names) as safetensors."""
    hf = {**LLAMA_MOE, **over}
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                            "rms_norm_eps", "rope_theta", "tie_word_embeddings")})
    ref = LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    sizes = [hf["intermediate_size"] // hf["num_experts"]] * hf["num_experts"]
    for layer in ref.model.layers:
        layer.mlp = RefMoE(hf["hidden_size"], sizes, hf["num_selects"], hf["gate_network"], hf["gate_add_noise"],
                           hf["score_scale_factor"])
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2 and p.shape[0] == p.shape[1] == hf["num_experts"]:
                p.normal_(0, 1.0)  # the mlp gate's [E, E] layer: routing that depends on it
    folder = tmp_path / "llama_moe"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf))
    return ref, folder


@pytest.mark.parametrize("network", ["mlp", "linear"])
def test_llama_moe_folder_converts_with_llama_moes_logits(tmp_path, capsys, network):
    ref, folder = _folder(tmp_path, gate_network=network)
    ckpt = tmp_path / "nxdt"
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(ckpt)]) == 0, capsys.readouterr().err
    keys = OmegaConf.to_container(OmegaConf.load(ckpt / "nxdt_model.yaml"))
    moe = keys["model"]["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["ffn_hidden_size"], moe["gate_type"], moe["gate_network"],
            moe["moe_calculator_score_scale_factor"], moe["gate_balance_loss_weight"]) == \
        (4, 2, 32, "top_k_balanced_noisy", network, 2.0, 1e-2)
    data = {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}
    model = build_model(config_from_dict({**keys, "data": data}), vocab_size=1000).eval()
    weights = load_weights(ckpt)
    model.load_state_dict(weights, strict=True)  # every tensor placed, none left over
    ids = torch.arange(24).reshape(2, 12) * 37 % 1000
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = logits_of(model(input_ids=ids))
    assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(Exception, match="a LLaMA-MoE checkpoint; nxdt-to-hf back to LLaMA-MoE's names is not supported yet"):
        nxdt_to_hf(ckpt, tmp_path / "back", max_shard_bytes=10**9)


@pytest.mark.parametrize("over, message", [
    ({"calculator_type": "SwitchDropTokenCalculator"},
     "calculator_type='SwitchDropTokenCalculator' (nxdt builds calculator_type='UniversalCalculator'): not supported yet"),
    ({"size_experts": [[16, 48, 32, 32], [32, 32, 32, 32]]},
     "size_experts of layer 0 = [16, 48, 32, 32] (unequal experts; nxdt's are 32 wide each): not supported yet"),
    ({"gate_type": "SwitchBalancedGate", "num_selects": 1}, "gate_type='SwitchBalancedGate' (nxdt converts"),
    ({"add_weight_norm": True}, "add_weight_norm=True (nxdt builds add_weight_norm=False): not supported yet"),
    ({"gate_use_softmax": False}, "gate_use_softmax=False (nxdt builds gate_use_softmax=True): not supported yet"),
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


@pytest.mark.parametrize("key, value, why", [
    ("calculator_type", "SwitchDropTokenCalculator", "nxdt computes UniversalCalculator's rule"),
    ("size_experts", [16, 48, 32, 32], "nxdt's experts are equal"),
    ("gate_use_softmax", False, "the gates weigh by the softmax"),
    ("add_weight_norm", True, "no WeightNorm"),
])
def test_llama_moe_names_nxdt_does_not_build_are_not_supported_yet(key, value, why):
    """In a training config, LLaMA-MoE's calculator / expert names are refused as not built, one line."""
    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
             "moe": {"num_experts": 4, "gate_type": "TopKBalancedNoisyGate", key: value}}
    with pytest.raises(ConfigError, match=rf"^'model.moe.{key}' \(LLaMA-MoE's {key}\) is not supported yet: {why}"):
        config_from_dict({"model_source": "megatron", "model": model}, check=True)
