"""GPT-NeoX / Pythia and the block types: parity with transformers' GPTNeoXForCausalLM both ways,
every block type against a reference forward written here, position_embedding_type none, the
GPT-NeoX export config, and transformers' GPT-NeoX as model_source hf."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nxdt.spec import config_from_dict
from nxdt.models import LlamaArgs, NxdtLlamaForCausalLM, build_model, logits_of
from nxdt.models.builder import llama_args_from_cfg
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.neox import fuse_qkv, native_to_neox, neox_model_keys, neox_rope, neox_to_native, split_qkv

transformers = pytest.importorskip("transformers")

VOCAB, HEADS = 96, 4
PYTHIA_TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                   intermediate_size=160, rotary_pct=0.25, rotary_emb_base=5000.0, max_position_embeddings=64,
                   hidden_act="gelu", tie_word_embeddings=False)
IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
OFFSET = torch.arange(20)[None].expand(2, 20) + 7  # explicit positions through both rotary paths


def _perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights ≠ 1 and biases ≠ 0, so a wrong name, a swapped norm or a skipped term shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def hf_neox(parallel: bool, **kw):
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(**{**PYTHIA_TINY, **kw}, use_parallel_residual=parallel)
    model = transformers.GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    _perturb(model)
    return model


def native_from_keys(keys: dict) -> NxdtLlamaForCausalLM:
    """The native model the nxdt `model:` keys describe (through the config schema and the builder)."""
    return NxdtLlamaForCausalLM(llama_args_from_cfg(config_from_dict({"model_source": "megatron", "model": keys}))).eval()


def _hf_output_key(hf) -> str:
    return next(k for k in hf.state_dict() if k in ("lm_head.weight", "embed_out.weight"))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-residual", "sequential"])
def test_transformers_neox_weights_give_equal_logits_in_the_native_model(parallel):
    hf = hf_neox(parallel)
    keys = neox_model_keys(hf.config.to_dict())
    assert (keys["transformer_block_type"], keys.get("gpt_j_tied")) == (("gpt_j", False) if parallel else ("pre_ln", None))
    assert (keys["rotary_percentage"], keys["rotary_emb_base"], keys["vocab_size"]) == (0.25, 5000.0, VOCAB)
    model = native_from_keys(keys)
    assert model.args.vocab_size == VOCAB and model.args.rotary_dim == 4  # no padding rows; a quarter of 16
    model.load_state_dict(neox_to_native(hf.state_dict(), HEADS), strict=True)
    with torch.no_grad():
        ours = model(IDS)
        torch.testing.assert_close(ours, hf(input_ids=IDS).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(IDS, OFFSET), hf(input_ids=IDS, position_ids=OFFSET).logits,
                                   atol=1e-5, rtol=1e-5)
    # the other residual wiring on the same weights is a different function: the test can fail
    other = native_from_keys({**keys, "transformer_block_type": "pre_ln" if parallel else "gpt_j", "gpt_j_tied": False})
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (other(IDS) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-residual", "sequential"])
def test_native_weights_give_equal_logits_in_transformers_from_the_exported_config(parallel):
    keys = neox_model_keys(hf_neox(parallel).config.to_dict())
    torch.manual_seed(3)
    model = native_from_keys(keys)
    model.init_weights()
    _perturb(model, seed=4)
    exported = hf_config_dict(model.args)
    assert exported["model_type"] == "gpt_neox" and exported["use_parallel_residual"] is parallel
    assert (exported["rotary_pct"], exported["rotary_emb_base"], exported["tie_word_embeddings"]) == (0.25, 5000.0, False)
    config = transformers.GPTNeoXConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    hf = transformers.GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    hf.load_state_dict(native_to_neox(model.state_dict(), HEADS, _hf_output_key(hf)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS).logits, model(IDS), atol=1e-5, rtol=1e-5)
    back = neox_to_native(native_to_neox(model.state_dict(), HEADS), HEADS)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_fused_qkv_rows_are_grouped_per_head():
    heads, d, hidden = 3, 2, 5
    fused = torch.arange(3 * heads * d * hidden, dtype=torch.float32).reshape(3 * heads * d, hidden)
    q, k, v = split_qkv(fused, heads)
    # head h's rows: q = [6h, 6h+1], k = [6h+2, 6h+3], v = [6h+4, 6h+5]
    assert torch.equal(q[:, 0] / hidden, torch.tensor([0., 1, 6, 7, 12, 13]))
    assert torch.equal(k[:, 0] / hidden, torch.tensor([2., 3, 8, 9, 14, 15]))
    assert torch.equal(v[:, 0] / hidden, torch.tensor([4., 5, 10, 11, 16, 17]))
    assert torch.equal(fuse_qkv(q, k, v, heads), fused)
    bias = torch.arange(3 * heads * d, dtype=torch.float32)
    assert torch.equal(split_qkv(bias, heads)[1], torch.tensor([2., 3, 8, 9, 14, 15]))


def test_neox_config_formats_and_what_the_native_model_refuses():
    # transformers 4 / the Hub's Pythia files, transformers 5's rope_parameters, and the defaults
    assert neox_rope({"rotary_pct": 0.5, "rotary_emb_base": 1000}) == (0.5, 1000.0, "default")
    assert neox_rope({"rope_parameters": {"rope_theta": 7.0, "partial_rotary_factor": 1.0, "rope_type": "default"},
                      "rotary_pct": 0.5}) == (1.0, 7.0, "default")
    assert neox_rope({}) == (0.25, 10000.0, "default")
    base = {**PYTHIA_TINY, "num_attention_heads": HEADS, "vocab_size": 50304}
    assert neox_model_keys(base)["make_vocab_size_divisible_by"] == 128  # Pythia's padded vocabulary stays 50304
    for act, native in [("gelu", "gelu"), ("gelu_fast", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
                        ("gelu_pytorch_tanh", "gelu_tanh")]:
        assert neox_model_keys({**base, "hidden_act": act})["activation"] == native
    for bad, name in [({"hidden_act": "relu"}, "hidden_act=relu"), ({"hidden_act": "gelu_10"}, "hidden_act=gelu_10"),
                      ({"attention_bias": False}, "attention_bias"),
                      ({"tie_word_embeddings": True}, "tie_word_embeddings"),
                      ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type=linear")]:
        with pytest.raises(ValueError, match=name):
            neox_model_keys({**base, **bad})


def test_export_names_what_no_transformers_family_expresses():
    neox = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=160,
                normalization="layernorm", activation="gelu", has_bias=True, rotary_percentage=0.25)
    assert hf_config_dict(LlamaArgs(**neox, transformer_block_type="pre_ln"))["model_type"] == "gpt_neox"
    assert hf_config_dict(LlamaArgs(**{**neox, "normalization": "rmsnorm", "activation": "swiglu",
                                       "has_bias": False, "rotary_percentage": 1.0}))["model_type"] == "llama"
    for kw, names in [
        ({"transformer_block_type": "gpt_j"}, ["gpt_j_tied=true"]),
        ({"transformer_block_type": "normformer"}, ["transformer_block_type=normformer"]),
        ({"num_kv_heads": 2}, ["num_kv_heads=2"]),
        ({"has_bias": False, "share_embeddings_and_output_weights": True},
         ["has_bias=false", "share_embeddings_and_output_weights=true"]),
        ({"position_embedding_type": "none"}, ["position_embedding_type=none"]),
        # the tanh GELU is a GPT-NeoX only: LlamaConfig names it (Llama and Mixtral are SwiGLU)
        ({"activation": "gelu_tanh", "transformer_block_type": "normformer"},
         ["activation=gelu_tanh", "transformer_block_type=normformer"]),
    ]:
        with pytest.raises(ValueError, match="LlamaConfig cannot express.*GPTNeoXConfig cannot express") as err:
            hf_config_dict(LlamaArgs(**{**neox, **kw}))
        assert all(n in str(err.value) for n in names), str(err.value)


@pytest.mark.parametrize("hidden_act", ["gelu_fast", "gelu_new", "gelu_pytorch_tanh"])
def test_tanh_gelu_neox_matches_transformers_both_ways(hidden_act):
    """GPT-NeoX-20B's hidden_act gelu_fast (and its two equals) is the native gelu_tanh: transformers'
    weights give its logits in the native model, and the native model exports as gelu_pytorch_tanh."""
    hf = hf_neox(True, hidden_act=hidden_act)
    with torch.no_grad():  # MLP inputs of a few units, where the tanh approximation is off by up to ~5e-4
        for layer in hf.gpt_neox.layers:
            layer.mlp.dense_h_to_4h.weight.mul_(30)
    keys = neox_model_keys(hf.config.to_dict())
    assert keys["activation"] == "gelu_tanh"
    model = native_from_keys(keys)
    act = model.model.layers[0].mlp.act_fn
    assert isinstance(act, torch.nn.GELU) and act.approximate == "tanh"
    model.load_state_dict(neox_to_native(hf.state_dict(), HEADS), strict=True)
    with torch.no_grad():
        want = hf(input_ids=IDS).logits
        torch.testing.assert_close(model(IDS), want, atol=1e-5, rtol=1e-5)
        # the exact GELU on the same weights is another function: off by over 3x the tolerance (~5e-5)
        exact = native_from_keys({**keys, "activation": "gelu"})
        exact.load_state_dict(model.state_dict())
        assert (exact(IDS) - want).abs().max() > 3e-5
    exported = hf_config_dict(model.args)
    assert (exported["model_type"], exported["hidden_act"]) == ("gpt_neox", "gelu_pytorch_tanh")
    assert hf_config_dict(exact.args)["hidden_act"] == "gelu"
    config = transformers.GPTNeoXConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    back = transformers.GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    back.load_state_dict(native_to_neox(model.state_dict(), HEADS, _hf_output_key(back)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=IDS).logits, model(IDS), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- block types vs a reference


def _norm(x, sd, prefix, kind, eps):
    if kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * sd[f"{prefix}.weight"] + sd[f"{prefix}.bias"]
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * sd[f"{prefix}.weight"]


def _linear(x, sd, prefix):
    y = x @ sd[f"{prefix}.weight"].T
    return y + sd[f"{prefix}.bias"] if f"{prefix}.bias" in sd else y


def _rotate(x, pos, rot, base):
    """GPT-NeoX/Llama rotary on the first `rot` dims: pairs (i, i + rot/2) turn by pos·base^(-2i/rot)."""
    half = rot // 2
    angle = pos[:, None].float() * base ** (-torch.arange(half, dtype=torch.float32) * 2 / rot)  # [S, half]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:rot]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rot:]], dim=-1)


def reference_forward(sd: dict, a: LlamaArgs, ids: torch.Tensor) -> torch.Tensor:
    """The model's function from its named weights, with plain torch ops (no nxdt module)."""
    b, s = ids.shape
    d, heads = a.head_dim, a.num_attention_heads
    pos = torch.arange(s)
    x = sd["model.embed_tokens.weight"][ids]
    if a.position_embedding_type == "learned_absolute":
        x = x + sd["model.embed_positions.weight"][pos]
    norm = lambda h, p: _norm(h, sd, p, a.normalization, a.layernorm_epsilon)  # noqa: E731

    def attn(h, p):
        q, k, v = (_linear(h, sd, f"{p}.self_attn.{n}_proj").view(b, s, heads, d).transpose(1, 2) for n in "qkv")
        if a.position_embedding_type == "rope":
            q, k = _rotate(q, pos, a.rotary_dim, a.rope_theta), _rotate(k, pos, a.rotary_dim, a.rope_theta)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * d)
        return _linear(out, sd, f"{p}.self_attn.o_proj")

    def mlp(h, p):
        up = _linear(h, sd, f"{p}.mlp.up_proj")
        if a.activation == "swiglu":
            inner = F.silu(_linear(h, sd, f"{p}.mlp.gate_proj")) * up
        elif a.activation == "gelu_tanh":
            inner = 0.5 * up * (1 + torch.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up ** 3)))
        else:
            inner = 0.5 * up * (1 + torch.erf(up / math.sqrt(2)))
        if a.transformer_block_type == "normformer":
            inner = norm(inner, f"{p}.mlp.ffn_layernorm")
        return _linear(inner, sd, f"{p}.mlp.down_proj")

    for i in range(a.num_layers):
        p = f"model.layers.{i}"
        kind = a.transformer_block_type
        if kind == "pre_ln":
            h = x + attn(norm(x, f"{p}.input_layernorm"), p)
            x = h + mlp(norm(h, f"{p}.post_attention_layernorm"), p)
        elif kind == "post_ln":
            h = norm(x + attn(x, p), f"{p}.post_attention_layernorm")
            x = norm(h + mlp(h, p), f"{p}.post_mlp_layernorm")
        elif kind == "normformer":
            h = x + norm(attn(norm(x, f"{p}.input_layernorm"), p), f"{p}.attention_output_layernorm")
            x = h + mlp(norm(h, f"{p}.post_attention_layernorm"), p)
        else:  # gpt_j: attention and MLP read the same x
            n2 = f"{p}.input_layernorm" if a.gpt_j_tied else f"{p}.post_attention_layernorm"
            x = x + attn(norm(x, f"{p}.input_layernorm"), p) + mlp(norm(x, n2), p)
    if kind != "post_ln":  # post_ln blocks end normalized: no final norm
        x = norm(x, "model.norm")
    return x @ sd["lm_head.weight"].T


NORMS = {  # each block's norms, by block type (the names the checkpoints and parallel plans use)
    "pre_ln": {"input_layernorm", "post_attention_layernorm"},
    "post_ln": {"post_attention_layernorm", "post_mlp_layernorm"},
    "normformer": {"input_layernorm", "post_attention_layernorm", "attention_output_layernorm", "mlp.ffn_layernorm"},
    "gpt_j": {"input_layernorm"},
    "gpt_j-untied": {"input_layernorm", "post_attention_layernorm"},
}
NEOXISH = dict(normalization="layernorm", activation="gelu", has_bias=True, rotary_percentage=0.5)


@pytest.mark.parametrize("block, kw", [
    ("pre_ln", {}), ("pre_ln", NEOXISH), ("post_ln", {}), ("post_ln", NEOXISH), ("normformer", {}),
    ("normformer", NEOXISH), ("gpt_j", {}), ("gpt_j", NEOXISH), ("gpt_j-untied", NEOXISH),
    ("pre_ln", {**NEOXISH, "position_embedding_type": "none"}), ("gpt_j-untied", {**NEOXISH, "activation": "gelu_tanh"}),
    ("gpt_j-untied", {**NEOXISH, "position_embedding_type": "none"}),
    ("post_ln", {"position_embedding_type": "learned_absolute"}),
])
def test_block_types_match_the_reference_forward(block, kw):
    kind = block.split("-")[0]
    args = LlamaArgs(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                     max_position_embeddings=32, rope_theta=500.0, transformer_block_type=kind,
                     gpt_j_tied=not block.endswith("untied"), **kw)
    torch.manual_seed(5)
    model = NxdtLlamaForCausalLM(args)
    model.init_weights()
    _perturb(model, seed=6)
    model.eval()
    norms = {n.split(".", 3)[3].rsplit(".", 1)[0] for n, _ in model.named_parameters()
             if n.startswith("model.layers.0.") and "layernorm" in n}
    assert norms == NORMS[block]
    assert ("model.norm.weight" in model.state_dict()) is (kind != "post_ln")
    none = kw.get("position_embedding_type") == "none"
    assert (hasattr(model.model, "rotary_emb") or hasattr(model.model, "embed_positions")) is not none
    ids = IDS[:, :12]
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(ours, reference_forward(model.state_dict(), args, ids), atol=1e-5, rtol=1e-5)
    if none:  # nothing but the causal mask tells positions apart: explicit positions change nothing
        with torch.no_grad():
            torch.testing.assert_close(model(ids, torch.arange(12)[None].expand(2, 12) + 5), ours, atol=0, rtol=0)


def test_normformer_has_no_moe_form():
    from nxdt.models.moe import MoEArgs

    with pytest.raises(ValueError, match="normformer"):
        LlamaArgs(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=48,
                  transformer_block_type="normformer", moe=MoEArgs(num_experts=2, top_k=1))


# --------------------------------------------------------------------------- model_source hf


def _hf_cfg(**model):
    """model_source hf over conf/model_configs/tiny_neox (Pythia-shaped: rotary_pct 0.25, parallel residual)."""
    return config_from_dict({"model_source": "hf", "precision": {"type": "fp32"},
                             "model": {"model_config": "model_configs/tiny_neox",
                                       "optim": {"name": "adamw", "lr": 3e-3}, **model}})


def test_hf_source_builds_transformers_neox_with_overrides_and_matches_native():
    cfg = _hf_cfg(num_layers=2, hidden_size=64, rotary_emb_base=2000.0)
    torch.manual_seed(0)
    hf = build_model(cfg).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM" and len(hf.gpt_neox.layers) == 2
    assert neox_rope(hf.config.to_dict()) == (0.25, 2000.0, "default")  # NeoX reads its base as rotary_emb_base
    assert neox_rope(build_model(_hf_cfg(num_layers=1, rope_theta=300.0)).config.to_dict())[1] == 300.0
    _perturb(hf)
    model = native_from_keys(neox_model_keys(hf.config.to_dict()))
    model.load_state_dict(neox_to_native(hf.state_dict(), 8), strict=True)
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits_of(hf(input_ids=ids)), atol=1e-5, rtol=1e-5)


def test_hf_source_neox_trains_in_one_process():
    from nxdt.training.builder import build_harness
    from nxdt.training.step import train_step

    cfg = _hf_cfg(num_layers=2, hidden_size=64)
    h = build_harness(cfg, 8192)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))  # a few tokens: learnable
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(4, 16)}

    def fwd_bwd(b):
        logits = logits_of(h.model(input_ids=b["input_ids"]))
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())
        loss.backward()
        return loss.detach()

    losses = [float(train_step(h.model, h.optimizer, None, h.precision, fwd_bwd, batch, step=i, clip=1.0).loss)
              for i in range(6)]
    assert abs(losses[0] - math.log(8192)) < 0.5 and losses[-1] < losses[0] - 1.0, losses
