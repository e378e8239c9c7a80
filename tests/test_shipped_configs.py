"""Every shipped YAML composes, validates and builds its model (big ones on the meta device only).

Megatron configs name a tokenizer by a placeholder path, so their vocabulary is given here:
Llama-2's 32,000 tokens and GPT-2's 50,257.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdt.spec import load_config
from nxdt.models import build_model, count_parameters

CONF = Path(__file__).resolve().parents[1] / "conf"
SHIPPED = sorted(p.stem for p in CONF.glob("*.yaml"))

# name -> (vocab size for megatron configs, expected parameter count or None)
EXPECTED = {
    "megatron_llama_7B_config": (32000, 6_738_415_616),
    "megatron_llama_70b_config": (32000, 68_976_648_192),
    "hf_llama3_8B_config": (None, 8_030_261_248),
    "hf_llama3.1_8B_config": (None, 8_030_261_248),
    "hf_llama3_70B_config": (None, 70_553_706_496),
    "hf_llama3_405B_config": (None, 405_853_388_800),
    "hf_llama3_8B_SFT_config": (None, 8_030_261_248),
    "hf_llama3_8B_SFT_lora_config": (None, 8_030_261_248),
    "hf_llama3_8B_DPO_config": (None, 8_030_261_248),
    "hf_llama3_8B_ORPO_config": (None, 8_030_261_248),
    "hf_llama3_8B_GRPO_config": (None, 8_030_261_248),
    "megatron_gpt_config": (50257, None),
    "tiny_llama_cpu": (8192, None),
    "tiny_llama_lora_cpu": (8192, None),
    "tiny_llama_dpo_cpu": (8192, None),
    "tiny_llama_orpo_cpu": (8192, None),
    "tiny_llama_grpo_cpu": (8192, None),
    # Mixtral-8x7B: 46.7 B (interface.md); the tiny MoE by hand: embeddings 2 x 8192 x 256, per layer
    # attention 196,608 + 4 experts x 3 x 256 x 352 + gate 4 x 256 + norms 512, final norm 256
    "megatron_mixtral_8x7b_config": (32000, 46_702_792_704),
    "megatron_mixtral_8x7b_dropless_config": (32000, 46_702_792_704),
    "hf_mixtral_8x7b_config": (None, 46_702_792_704),
    "hf_mixtral_8x7b_dropless_config": (None, 46_702_792_704),
    "tiny_mixtral_cpu": (8192, 9_312_512),
    # LLaMA-MoE 4/16 from Llama-2-7B: see test_llama_moe_count_is_llama2_7b_plus_gates
    "llama_moe_7B_16select4_config": (32000, 6_742_609_920),
    # GPT-NeoX (interface.md §9): model.vocab_size 50,277 (GPT-NeoX-20B's tokenizer) padded as NeoX pads
    # it, to 50,304 (x128) and, at tp 2, 50,432; the tiny one: see test_tiny_neox_is_neox_shaped
    "neox_pythia_160M_config": (None, 162_322_944),
    "neox_pythia_1.4B_config": (None, 1_414_647_808),
    "neox_20B_config": (None, 20_554_567_680),
    "tiny_neox_cpu": (8192, 7_353_856),
    # Qwen3 (the published config.json; tests/test_models.py counts the native twin the same): 8.19 B, and
    # Qwen3-30B-A3B's 30.5 B, 3.35 B activated per token (test_qwen3_moe_activated_parameters)
    "hf_qwen3_8B_config": (None, 8_190_735_360),
    "hf_qwen3_30B_A3B_config": (None, 30_532_122_624),
    # tiny Qwen3: embeddings 8192 x 256 (tied); per layer q 256 x 512, k and v 256 x 256, o 512 x 256,
    # q/k norms 2 x 64, MLP 3 x 256 x 704, norms 2 x 256; final norm 256 (test_tiny_qwen3_counts)
    "tiny_qwen3_cpu": (8192, 5_835_520),
    "tiny_qwen3_moe_cpu": (8192, 7_639_808),
    # DeepSeek-V3: the published 671B (without its MTP layer; tests/test_deepseek_v3.py counts transformers'
    # model the same), and the tiny one by hand there (test_shipped_configs)
    "hf_deepseek_v3_config": (None, 671_026_404_352),
    "tiny_deepseek_v3_cpu": (8192, 8_119_168),
}


def test_tiny_neox_is_neox_shaped_and_trains_like_the_demo():
    """tiny_neox_cpu: GPT-NeoX's block (parallel residual, two LayerNorms, partial rotary, GELU MLP
    with biases, untied embeddings) on the demo's data, tokenizer, batches and schedule. Its count
    by hand: embeddings 2 x 8192 x 256; per layer q, k, v, o 4 x (256 x 256 + 256), MLP
    256 x 1024 + 1024 + 1024 x 256 + 256, two LayerNorms 4 x 256; final LayerNorm 2 x 256."""
    load = lambda name: load_config(["--config-name", name], default_config_dir=CONF, check_paths=False,  # noqa: E731
                                    quiet=True)
    neox, demo = load("tiny_neox_cpu"), load("tiny_llama_cpu")
    m = neox.model
    assert (m.transformer_block_type, m.gpt_j_tied, m.normalization, m.activation, m.has_bias) == \
        ("gpt_j", False, "layernorm", "gelu", True)
    assert (m.position_embedding_type, m.rotary_percentage, m.share_embeddings_and_output_weights) == \
        ("rope", 0.25, False)
    assert (neox.data, neox.trainer, neox.precision) == (demo.data, demo.trainer, demo.precision)
    assert m.optim == demo.model.optim and m.encoder_seq_length == demo.model.encoder_seq_length
    per_layer = 4 * (256 * 256 + 256) + (256 * 1024 + 1024 + 1024 * 256 + 256) + 4 * 256
    assert EXPECTED["tiny_neox_cpu"][1] == 2 * 8192 * 256 + 4 * per_layer + 2 * 256


def test_llama_moe_count_is_llama2_7b_plus_gates():
    """16 experts of 688 = 11008 / 16 neurons hold exactly the dense MLP's 3 x 4096 x 11008
    weights, so LLaMA-MoE adds per layer only the gate and the noisy gate's noise weight,
    each 16 x 4096."""
    layers, hidden, experts = 32, 4096, 16
    assert experts * 3 * hidden * 688 == 3 * hidden * 11008
    gates = layers * hidden * experts
    assert gates == 2_097_152
    assert EXPECTED["llama_moe_7B_16select4_config"][1] == 6_738_415_616 + gates + gates


def test_every_shipped_config_is_listed():
    assert set(SHIPPED) == set(EXPECTED), "add new shipped configs to EXPECTED"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_builds_its_model_on_meta(name):
    cfg = load_config(["--config-name", name], default_config_dir=CONF, check_paths=False,
                      check_supported=False, quiet=True)
    vocab, expected = EXPECTED[name]
    model = build_model(cfg, vocab, device="meta")
    assert all(p.device == torch.device("meta") for p in model.parameters())
    n = count_parameters(model)
    if expected is not None:
        assert n == expected
    assert len(model.model.layers) == (cfg.model.num_layers or model.config.num_hidden_layers)


def test_tiny_qwen3_counts():
    """tiny_qwen3_cpu by hand (tied embeddings, head_dim 64 of its own, q/k norms), and tiny_qwen3_moe_cpu:
    untied, layers 1 and 3 with 4 experts of 128 and a router instead of the dense MLP."""
    h, heads, kv, d, f, vocab = 256, 8, 4, 64, 704, 8192
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d
    dense = attention + 3 * h * f + 2 * h
    assert EXPECTED["tiny_qwen3_cpu"][1] == vocab * h + 4 * dense + h
    moe = attention + 4 * 3 * h * 128 + 4 * h + 2 * h
    assert EXPECTED["tiny_qwen3_moe_cpu"][1] == 2 * vocab * h + 2 * dense + 2 * moe + h


def test_qwen3_moe_activated_parameters():
    """nxdt plan's activated count of hf_qwen3_30B_A3B_config: 8 of 128 experts per token, on transformers'
    model on the meta device (the planner's count)."""
    from nxdt.models.param_count import parameter_counts

    cfg = load_config(["--config-name", "hf_qwen3_30B_A3B_config"], default_config_dir=CONF, check_paths=False,
                      quiet=True)
    model = build_model(cfg, device="meta")
    c = parameter_counts(model)
    assert (c.total, c.activated, c.num_experts, c.top_k) == (30_532_122_624, 3_353_032_704, 128, 8)
    assert c.experts == 48 * 128 * 3 * 2048 * 768 and c.router == 48 * 128 * 2048
    assert model.model.layers[0].self_attn.head_dim == 128  # Qwen3's own, not hidden / heads (64)
