"""nxdt.models: parity with transformers, parameter counts, padding, init, variants, masks."""

from __future__ import annotations

import json
from dataclasses import replace
import math
from pathlib import Path

import pytest
import torch

from nxdt.spec import config_from_dict
from nxdt.models.hf_export import hf_config_dict
from nxdt.models import (
    LlamaArgs,
    NxdtLlamaForCausalLM,
    build_model,
    count_parameters,
    init_model_weights,
    logits_of,
    padded_vocab_size,
)

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=176,
    max_position_embeddings=128,
    layernorm_epsilon=1e-5,
    init_method_std=0.02,
)


def tiny(**kw) -> LlamaArgs:
    return LlamaArgs(**{**TINY, **kw})


def native(args: LlamaArgs, seed: int = 0) -> NxdtLlamaForCausalLM:
    torch.manual_seed(seed)
    model = NxdtLlamaForCausalLM(args)
    model.init_weights()
    # Non-trivial norm weights and biases, so a wrong name or a skipped term shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_twin(model: NxdtLlamaForCausalLM):
    """The transformers LlamaForCausalLM of the same architecture, loaded with model's weights."""
    config = transformers.LlamaConfig(**hf_config_dict(model.args))
    config.use_cache = False
    hf = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    hf.load_state_dict(model.state_dict(), strict=True)  # identical names: no renaming
    return hf


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({}, id="mha"),
        pytest.param({"num_kv_heads": 2}, id="gqa"),
        pytest.param({"num_kv_heads": 1, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}, id="llama3-rope"),
        pytest.param({"has_bias": True, "share_embeddings_and_output_weights": True}, id="bias-tied"),
        pytest.param({"kv_channels": 32}, id="head-dim-override"),
        # GPT-NeoX's Llama-style files: MLP biases without attention biases (transformers' mlp_bias)
        pytest.param({"mlp_bias": True}, id="mlp-bias-only"),
        pytest.param({"has_bias": True, "mlp_bias": False}, id="attention-bias-only"),
    ],
)
def test_logits_match_transformers(kw):
    model = native(tiny(**kw))
    hf = hf_twin(model)
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = logits_of(hf(input_ids=ids))
        assert ours.shape == (2, 24, TINY["vocab_size"]) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        # Explicit (offset) positions go through the same rotary path on both sides.
        pos = torch.arange(24)[None].expand(2, 24) + 100
        torch.testing.assert_close(model(ids, pos), logits_of(hf(input_ids=ids, position_ids=pos)), atol=1e-5, rtol=1e-5)


def test_packed_documents_match_transformers_and_are_isolated():
    model = native(tiny(num_kv_heads=2))
    hf = hf_twin(model)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    # Row 0: documents of 5, 7 and 4 tokens; row 1: one document.
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]), torch.arange(16)])
    with torch.no_grad():
        ours = model(ids, pos)
        torch.testing.assert_close(ours, logits_of(hf(input_ids=ids, position_ids=pos)), atol=1e-5, rtol=1e-5)
        changed = ids.clone()
        changed[0, 2] = (changed[0, 2] + 1) % TINY["vocab_size"]  # inside document 0
        after = model(changed, pos)
    assert not torch.allclose(after[0, 2:5], ours[0, 2:5])  # its own document sees it
    torch.testing.assert_close(after[0, 5:], ours[0, 5:], atol=0, rtol=0)  # later documents do not
    torch.testing.assert_close(after[1], ours[1], atol=0, rtol=0)


def test_module_tree_matches_transformers():
    model = native(tiny(num_kv_heads=2))
    hf = hf_twin(model)
    assert list(model.state_dict()) == list(hf.state_dict())
    ours = {n for n, _ in model.named_modules()}
    assert {n for n, _ in hf.named_modules()} <= ours
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"CoreAttention", "LlamaMLP", "LlamaRMSNorm", "LlamaDecoderLayer", "LlamaAttention"} <= kinds
    assert "model.layers.1.self_attn.core_attention" in ours


# --------------------------------------------------------------------------- parameter counts

MEGATRON_SIZES = {
    "llama2_7B": (
        dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, num_kv_heads=32),
        32000,
        6_738_415_616,
    ),
    "llama3_8B": (
        dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_kv_heads=8,
             rope_theta=500000.0),
        128256,
        8_030_261_248,
    ),
    "llama3_70B": (
        dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_kv_heads=8,
             rope_theta=500000.0),
        128256,
        70_553_706_496,
    ),
}


@pytest.mark.parametrize("name", list(MEGATRON_SIZES))
def test_parameter_counts_on_meta(name):
    model_kw, vocab, expected = MEGATRON_SIZES[name]
    cfg = config_from_dict(
        {
            "model_source": "megatron",
            "model": {**model_kw, "make_vocab_size_divisible_by": 128, "max_position_embeddings": 4096},
            "distributed_strategy": {"tensor_model_parallel_size": 1},
        }
    )
    model = build_model(cfg, vocab, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == expected

    hf_cfg = config_from_dict({"model_source": "hf", "model": {"model_config": f"conf/model_configs/{name}/config.json"}})
    hf = build_model(hf_cfg, device="meta")
    assert count_parameters(hf) == expected
    assert list(hf.state_dict()) == list(model.state_dict())


def test_shipped_configs_are_the_published_ones():
    llama31 = build_model(
        config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/llama3.1_8B"}}), device="meta"
    )
    assert count_parameters(llama31) == 8_030_261_248
    assert llama31.config.max_position_embeddings == 131072
    assert llama31.config.rope_parameters["rope_type"] == "llama3"
    assert llama31.config.rope_parameters["factor"] == 8.0
    # Null overrides (the schema's defaults) keep the json's values.
    nulls = {"num_layers": None, "hidden_size": None, "rope_theta": None, "max_position_embeddings": None}
    llama3 = build_model(
        config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/llama3_8B", **nulls}}),
        device="meta",
    )
    assert llama3.config.rope_parameters["rope_theta"] == 500000.0
    assert (llama3.config.num_hidden_layers, llama3.config.max_position_embeddings) == (32, 8192)
    tiny_llama = build_model(config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/tiny_llama"}}))
    c = tiny_llama.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (8192, 256, 704, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (8, 4, 1024)
    assert not c.use_cache and c._attn_implementation == "sdpa"
    assert next(tiny_llama.parameters()).dtype == torch.float32


# --------------------------------------------------------------------------- builder


def test_vocab_padding():
    assert padded_vocab_size(31999, 8, 8) == 32000
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(32000, 128, 1) == 32000
    assert padded_vocab_size(50257, 128, 2) == 50432
    cfg = config_from_dict(
        {
            "model_source": "megatron",
            "model": {**{k: v for k, v in TINY.items() if k != "vocab_size"}, "make_vocab_size_divisible_by": 128},
            "distributed_strategy": {"tensor_model_parallel_size": 2},
        }
    )
    model = build_model(cfg, 50257, device="meta")
    assert model.lm_head.weight.shape[0] == 50432
    assert model.model.embed_tokens.weight.shape[0] == 50432


def test_partial_config_and_vocab_from_cfg():
    cfg = config_from_dict(
        {
            "model_source": "megatron",
            "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
                      "vocab_size": 1000, "make_vocab_size_divisible_by": 64,
                      "rope_scaling": LLAMA3_SCALING},
        }
    )
    model = build_model(cfg)  # vocab from model.vocab_size, tp defaults to 1
    assert isinstance(model, NxdtLlamaForCausalLM)
    assert model.args.vocab_size == 1024 and model.args.num_kv_heads == 4
    assert isinstance(model.args.rope_scaling, dict) and model.args.rope_scaling["rope_type"] == "llama3"
    out = model(torch.randint(0, 1000, (1, 8)))
    assert out.shape == (1, 8, 1024)
    assert model.args.ffn_hidden_size == 4 * 64 and model.args.rope_theta == 10000.0
    # Schema nulls mean what the schema documents, not None.
    nulls = config_from_dict({"model_source": "megatron", "model": {**TINY, "rope_theta": None, "num_kv_heads": None,
                                                                      "vocab_size": None}})
    args = build_model(nulls, 97, device="meta").args
    assert (args.rope_theta, args.num_kv_heads) == (10000.0, 4)
    assert args.vocab_size == 104  # the schema's make_vocab_size_divisible_by (8), not a builder default
    with pytest.raises(ValueError, match="model.ffn_hidden_size"):
        build_model(config_from_dict({"model_source": "megatron", "model": {**TINY, "ffn_hidden_size": None}}), 8)
    with pytest.raises(ValueError, match="vocabulary size"):
        build_model(config_from_dict({"model_source": "megatron", "model": {**TINY, "vocab_size": None}}))
    with pytest.raises(ValueError, match="model.hidden_size"):
        build_model(config_from_dict({"model_source": "megatron", "model": {"num_layers": 1, "num_attention_heads": 2}}), 8)
    with pytest.raises(ValueError, match="model_source"):
        build_model(replace(config_from_dict({}), model_source="nope"), 10)  # validation refuses it first


def test_hf_overrides(tmp_path):
    base = json.loads((REPO / "conf/model_configs/tiny_llama/config.json").read_text())
    base["head_dim"] = 32  # explicit head_dim must follow an overridden hidden size
    (tmp_path / "config.json").write_text(json.dumps(base))
    cfg = config_from_dict(
        {
            "model_source": "hf",
            "model": {"model_config": str(tmp_path), "num_layers": 2, "hidden_size": 128, "rope_theta": 1234.0,
                      "max_position_embeddings": None, "make_vocab_size_divisible_by": 128},
            "distributed_strategy": {"tensor_model_parallel_size": 8},
        }
    )
    model = build_model(cfg, vocab_size=50000)  # HF models use the config's vocab, unpadded
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim) == (2, 128, 16)
    assert c.max_position_embeddings == 1024  # None means: keep the json's value
    assert c.rope_parameters["rope_theta"] == 1234.0
    assert c.vocab_size == 8192 and model.lm_head.weight.shape == (8192, 128)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 128)
    assert logits_of(model(input_ids=torch.randint(0, 8192, (1, 5)))).shape == (1, 5, 8192)
    with pytest.raises(FileNotFoundError):
        build_model(config_from_dict({"model_source": "hf", "model": {"model_config": str(tmp_path / "none")}}))


# --------------------------------------------------------------------------- weights


def test_tied_embeddings_counted_once_and_shared():
    untied = NxdtLlamaForCausalLM(tiny())
    tied = NxdtLlamaForCausalLM(tiny(share_embeddings_and_output_weights=True))
    assert count_parameters(untied) - count_parameters(tied) == TINY["vocab_size"] * TINY["hidden_size"]
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    # Still one tensor after a meta build and materialisation.
    cfg = config_from_dict(
        {"model_source": "megatron",
         "model": {**TINY, "share_embeddings_and_output_weights": True, "make_vocab_size_divisible_by": 1}}
    )
    model = init_model_weights(build_model(cfg, device="meta"), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight[3].fill_(7.0)
    assert torch.all(model.lm_head.weight[3] == 7.0)
    assert count_parameters(model) == count_parameters(tied)


@pytest.mark.parametrize("scaled", [True, False])
def test_init_std(scaled):
    layers, std = 8, 0.02
    model = NxdtLlamaForCausalLM(
        tiny(hidden_size=256, ffn_hidden_size=512, num_layers=layers, vocab_size=512, has_bias=True,
             use_scaled_init_method=scaled)
    )
    # Garbage first (as after to_empty), then init.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    torch.manual_seed(0)
    model.init_weights()
    out_std = std / math.sqrt(2 * layers) if scaled else std
    for i in (0, layers - 1):
        layer = model.model.layers[i]
        assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.mlp.down_proj.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.03)
        assert layer.mlp.gate_proj.weight.std().item() == pytest.approx(std, rel=0.03)
        assert torch.all(layer.self_attn.o_proj.bias == 0) and torch.all(layer.mlp.up_proj.bias == 0)
        assert torch.all(layer.input_layernorm.weight == 1)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(std, rel=0.03)
    assert model.lm_head.weight.std().item() == pytest.approx(std, rel=0.03)
    assert torch.all(model.model.norm.weight == 1)


def test_build_on_real_device_uses_megatron_init():
    cfg = config_from_dict({"model_source": "megatron", "model": {**TINY, "init_method_std": 0.5}})
    model = build_model(cfg)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.5, rel=0.1)


# --------------------------------------------------------------------------- variants and masks


def _causality(model: NxdtLlamaForCausalLM, seq: int = 12, at: int = 7) -> torch.Tensor:
    ids = torch.randint(0, model.args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, at] = (changed[:, at] + 1) % model.args.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (2, seq, model.args.vocab_size)
    torch.testing.assert_close(a[:, :at], b[:, :at], atol=0, rtol=0)  # earlier positions unaffected
    assert not torch.allclose(a[:, at:], b[:, at:])
    return a


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(activation="gelu"), id="gelu"),
        pytest.param(dict(normalization="layernorm"), id="layernorm"),
        pytest.param(dict(position_embedding_type="learned_absolute"), id="learned-absolute"),
        pytest.param(dict(rotary_percentage=0.5), id="partial-rotary"),
        pytest.param(
            dict(activation="gelu", normalization="layernorm", position_embedding_type="learned_absolute", has_bias=True,
                 share_embeddings_and_output_weights=True),
            id="gpt-style",
        ),
    ],
)
def test_variants_forward_and_causal(kw):
    model = native(tiny(**kw))
    _causality(model)
    names = dict(model.named_parameters())
    if kw.get("activation") == "gelu":
        assert "model.layers.0.mlp.gate_proj.weight" not in names
        assert "model.layers.0.mlp.up_proj.weight" in names
    if kw.get("normalization") == "layernorm":
        assert "model.layers.0.input_layernorm.bias" in names
    if kw.get("position_embedding_type") == "learned_absolute":
        assert names["model.embed_positions.weight"].shape == (TINY["max_position_embeddings"], TINY["hidden_size"])


def test_partial_rotary_leaves_the_rest_unrotated():
    from nxdt.models.llama import apply_rotary, LlamaRotaryEmbedding

    args = tiny(rotary_percentage=0.25)  # head_dim 16 → 4 rotated dims
    x = torch.randn(1, 4, 10, 16)
    cos, sin = LlamaRotaryEmbedding(args)(x, torch.arange(10)[None] + 5)
    assert cos.shape == (1, 10, 4)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y[..., 4:], x[..., 4:], atol=0, rtol=0)
    assert not torch.allclose(y[..., :4], x[..., :4])
    # rotation preserves the norm of each rotated pair-block
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))


def test_sliding_window_restricts_attention():
    window, layers, seq = 4, 2, 16
    windowed = native(tiny(sliding_window_size=window, num_layers=layers))
    full = native(tiny(num_layers=layers))
    ids = torch.randint(0, TINY["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = windowed(ids), windowed(changed)
        fa, fb = full(ids), full(changed)
    # Each layer reaches back window-1 tokens, so `layers` layers reach layers*(window-1).
    reach = layers * (window - 1)
    torch.testing.assert_close(a[:, reach + 1 :], b[:, reach + 1 :], atol=0, rtol=0)
    assert not torch.allclose(a[:, : window], b[:, : window])
    assert not torch.allclose(fa[:, -1], fb[:, -1])  # without the window, the last token sees token 0
    # Inside the window the result equals plain causal attention (same weights, short input).
    full.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(windowed(ids[:, :window]), full(ids[:, :window]), atol=1e-6, rtol=1e-6)


def test_dropout_only_in_training():
    model = native(tiny(hidden_dropout=0.5, attention_dropout=0.5, ffn_dropout=0.5))
    ids = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids))
        model.train()
        torch.manual_seed(0)
        a = model(ids)
        torch.manual_seed(1)
        b = model(ids)
    assert not torch.allclose(a, b)


def test_invalid_args_rejected():
    with pytest.raises(ValueError):
        tiny(normalization="batchnorm")
    with pytest.raises(ValueError):
        tiny(num_kv_heads=3)
    with pytest.raises(ValueError):
        tiny(activation="relu")
    with pytest.raises(ValueError, match="cannot express"):
        hf_config_dict(tiny(activation="gelu"))
    assert tiny().to_hf_config_dict() == hf_config_dict(tiny())  # the method is the function


def test_backward_reaches_every_parameter():
    model = native(tiny(num_kv_heads=2, has_bias=True)).train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    model(ids).float().logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not missing


# --------------------------------------------------------------------------- Qwen3 and Qwen3-MoE

QWEN3 = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6)


def _qwen3_pair(moe: dict | None = None, **kw):
    """A transformers Qwen3 (or Qwen3-MoE with `moe`) with random weights and norm weights away from 1,
    and the native model built from the keys nxdt reads off its config.json (schema → builder),
    loaded with its state dict: no renaming."""
    from nxdt.models.qwen3 import qwen3_model_keys

    torch.manual_seed(0)
    if moe is None:
        config = transformers.Qwen3Config(**{**QWEN3, **kw})
    else:
        config = transformers.Qwen3MoeConfig(**{**QWEN3, **moe, **kw})
    config.use_cache = False
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    keys = qwen3_model_keys(config.to_dict())
    model = build_model(config_from_dict({"model_source": "megatron", "model": keys}), device="meta")
    model = init_model_weights(model, device="cpu").eval()
    assert set(model.state_dict()) == set(hf.state_dict())  # the MoE block lists router and experts in another order
    model.load_state_dict(hf.state_dict(), strict=True)
    return model, hf


QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])


@pytest.mark.parametrize("moe,kw", [
    pytest.param(None, {}, id="qwen3"),
    pytest.param(None, {"tie_word_embeddings": True}, id="qwen3-tied"),
    pytest.param(QWEN3_MOE, {}, id="qwen3-moe"),
    # MoE in layers 1 and 3 of 4 but layer 3 dense (decoder_sparse_step 2, mlp_only_layers [3]); top-k unnormalised
    pytest.param({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False}, {},
                 id="qwen3-moe-sparse-step"),
])
def test_qwen3_logits_match_transformers(moe, kw):
    model, hf = _qwen3_pair(moe, **kw)
    a = model.args
    assert a.qk_layernorm and a.head_dim == 24 != a.hidden_size // a.num_attention_heads
    if moe is not None:
        want = [i for i in range(4) if (i + 1) % moe["decoder_sparse_step"] == 0 and i not in moe["mlp_only_layers"]]
        assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")] == want
        assert a.moe.normalize_top_k_affinities is moe["norm_topk_prob"]
        assert model.model.layers[want[0]].mlp.experts.down_proj.shape == (4, 64, 40)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None].expand(2, 24) + 50
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits_of(hf(input_ids=ids)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(ids, pos), logits_of(hf(input_ids=ids, position_ids=pos)), atol=1e-5, rtol=1e-5)
    # and back: the exported config.json is transformers' own model again
    exported = hf_config_dict(a)
    assert exported["model_type"] == hf.config.model_type and exported["head_dim"] == 24
    config = type(hf.config)(**exported)
    again = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    again.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits_of(again(input_ids=ids)), atol=1e-5, rtol=1e-5)


def test_qwen3_published_counts_native_equals_transformers_on_meta():
    """Qwen3-8B and Qwen3-30B-A3B (conf/model_configs, the published config.json): the native model
    built from the keys nxdt reads off them counts exactly what transformers' model counts, and the
    published totals (30B-A3B: 3.35 B activated per token)."""
    from nxdt.models.param_count import parameter_counts
    from nxdt.models.qwen3 import qwen3_model_keys

    for name, total, activated in (("qwen3_8B", 8_190_735_360, 8_190_735_360),
                                   ("qwen3_30B_A3B", 30_532_122_624, 3_353_032_704)):
        hf = build_model(config_from_dict({"model_source": "hf", "model": {"model_config": f"model_configs/{name}"}}),
                         device="meta")
        keys = qwen3_model_keys(json.loads((REPO / f"conf/model_configs/{name}/config.json").read_text()))
        ours = build_model(config_from_dict({"model_source": "megatron", "model": keys}), device="meta")
        for model in (hf, ours):
            counts = parameter_counts(model)
            assert (counts.total, counts.activated) == (total, activated), name
        assert set(ours.state_dict()) == set(hf.state_dict())


def test_qwen3_keys_refused_where_they_mean_nothing():
    from nxdt.config.errors import ConfigError

    with pytest.raises(ConfigError, match="model.qk_layernorm"):
        config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/qwen3_8B", "qk_layernorm": True}},
                         check=True, check_paths=False)
    moe = {"num_experts": 4, "top_k": 2, "layers": [1, 4]}
    with pytest.raises(ConfigError, match=r"model.moe.layers \[1, 4\]"):
        config_from_dict({"model_source": "megatron", "model": {**TINY, "moe": moe, "encoder_seq_length": 128}},
                         check=True, check_paths=False)
    with pytest.raises(ValueError, match="moe_layers"):
        tiny(moe_layers=(0,))  # no MoE
    with pytest.raises(ValueError, match="Qwen3Config cannot express: has_bias=true"):
        hf_config_dict(tiny(qk_layernorm=True, has_bias=True))
