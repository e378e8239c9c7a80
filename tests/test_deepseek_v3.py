"""DeepSeek-V3 as the native model (nxdt.models.deepseek_v3, nxdt.models.mla): logits equal transformers'
DeepseekV3ForCausalLM for the same random weights (MLA with and without the query latent, YaRN, group-limited
sigmoid routing with a selection bias, shared experts, dense-first layers), the published 671B counted exactly
on the meta device, the shipped configs, nxdt convert both ways (per-expert folders, the MTP layer left out),
and the configuration checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_DIR
from test_convert import assert_converted_logits, per_expert_tensors

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.config.errors import ConfigError
from nxdt.models import build_model, init_model_weights, logits_of
from nxdt.models.deepseek_v3 import deepseek_v3_model_keys
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.param_count import parameter_counts
from nxdt.spec import config_from_dict, load_config
from nxdt.tools.convert import hf_to_nxdt

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]

# 3 layers (layer 0 dense), 8 routed experts in 2 groups (a token picks 3 within 1 group), 1 shared expert
DS = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
          kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2,
          topk_group=1, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=256,
          rms_norm_eps=1e-6, rope_theta=10000.0,
          rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64})


def _random_hf(**kw):
    """transformers' DeepseekV3ForCausalLM with random weights, norms away from 1 and a non-zero selection bias."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**DS, **kw})
    config.use_cache = False
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf


def _native_twin(hf):
    keys = deepseek_v3_model_keys(hf.config.to_dict())
    model = build_model(config_from_dict({"model_source": "megatron", "model": keys}), device="meta")
    model = init_model_weights(model, device="cpu").eval()
    assert set(model.state_dict()) == set(hf.state_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    return model, keys


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="q-latent-yarn-norm-topk"),
    # V2-Lite style: one q_proj; plain rope not interleaved; top-k weights not renormalised; 4 groups, pick 2
    pytest.param({"q_lora_rank": None, "rope_scaling": None, "rope_interleave": False, "norm_topk_prob": False,
                  "n_group": 4, "topk_group": 2}, id="q-proj-plain-rope"),
])
def test_logits_match_transformers(kw):
    hf = _random_hf(**kw)
    model, keys = _native_twin(hf)
    a = model.args
    assert a.mla.q_lora_rank == kw.get("q_lora_rank", 24) and a.moe_layers == (1, 2)
    assert a.moe.router_activation == "sigmoid" and a.moe.score_scale == 2.5 and a.moe.num_shared_experts == 1
    assert keys.get("rope_scaling", {}).get("rope_type") == ("yarn" if "rope_scaling" not in kw else None)
    layer = model.model.layers[1]
    assert layer.mlp.shared_experts.down_proj.weight.shape == (64, 32) and not hasattr(model.model.layers[0].mlp, "gate")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None].expand(2, 24) + 100  # beyond YaRN's original 64 positions
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits_of(hf(input_ids=ids)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(ids, pos), logits_of(hf(input_ids=ids, position_ids=pos)), atol=1e-5, rtol=1e-5)
        before = model(ids)
    # and back: the exported config.json is transformers' own model again
    exported = hf_config_dict(a)
    assert (exported["model_type"], exported["first_k_dense_replace"], exported["n_group"]) == \
        ("deepseek_v3", 1, kw.get("n_group", 2))
    again = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**exported),
                                                          attn_implementation="sdpa").eval()
    again.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(before, logits_of(again(input_ids=ids)), atol=1e-5, rtol=1e-5)


def test_selection_bias_changes_the_picks_not_the_weights():
    """A large bias on one expert makes every token pick it, with its plain (unbiased) score as weight."""
    from nxdt.models.moe import MoEArgs, route

    args = MoEArgs(num_experts=8, top_k=2, router_activation="sigmoid", normalize_top_k_affinities=False,
                   load_balancing="loss_free")
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    bias[5] = 10.0
    weights, experts = route(logits, args, bias)
    assert (experts == 5).any(-1).all()
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, experts))


def test_published_671b_counts_exactly_on_meta():
    """The published config.json: nxdt's model (model_source hf builds the native one) counts exactly what
    transformers' DeepseekV3ForCausalLM counts on the meta device, names equal, and 37.55 B activated."""
    d = json.loads((REPO / "conf/model_configs/deepseek_v3/config.json").read_text())
    d.pop("torch_dtype")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "model_type"}))
    ours = build_model(config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/deepseek_v3"}}),
                       device="meta")
    assert set(ours.state_dict()) == set(hf.state_dict())
    experts = 58 * 256 * 3 * 7168 * 2048
    for model in (hf, ours):
        c = parameter_counts(model)
        assert (c.total, c.activated, c.experts, c.router) == (671_026_404_352, 37_552_282_624, experts, 58 * 256 * 7168)
        assert c.activated == c.dense + c.router + experts // 32


def test_shipped_configs():
    """tiny_deepseek_v3_cpu is its config.json twin (same count, same names); hf_deepseek_v3_config plans the
    671B on 1024 ranks (pp 16 x dp 64, ep 64), the fullest rank stage 0's 2,677,129,216 parameters."""
    from nxdt.tools.plan import main as plan_main

    conf = REPO / "conf"
    cfg = load_config(["--config-name", "tiny_deepseek_v3_cpu"], default_config_dir=conf, check_paths=False, quiet=True)
    tiny = build_model(cfg, 8192, device="meta")
    twin = build_model(config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/tiny_deepseek_v3"}}),
                       device="meta")
    assert set(tiny.state_dict()) == set(twin.state_dict())
    h, e = 256, 8
    attention = h * 96 + 96 + 96 * 8 * 48 + h * (64 + 16) + 64 + 64 * 8 * 64 + 8 * 32 * h
    moe = attention + e * 3 * h * 128 + 3 * h * 128 + e * h + 2 * h
    dense = attention + 3 * h * 704 + 2 * h
    for model in (tiny, twin):
        c = parameter_counts(model)
        assert (c.total, c.activated) == (8_119_168, 6_349_696) == (2 * 8192 * h + dense + 3 * moe + h,
                                                                      8_119_168 - 3 * 6 * 3 * h * 128)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--config-path", str(conf), "--config-name", "hf_deepseek_v3_config", "--json"]) == 0
    p = json.loads(out.getvalue())
    assert (p["parameters"], p["parameters_activated"], p["parameters_per_rank"]) == \
        (671_026_404_352, 37_552_282_624, 2_677_129_216)
    assert p["layout"] == {**p["layout"], "dp": 64, "tp": 1, "pp": 16, "ep": 64} and p["world_size"] == 1024


def _published_style_folder(tmp_path, hf):
    """hf's weights as DeepSeek's folders store them: each expert apart, plus an MTP layer (num_hidden_layers)."""
    from safetensors.torch import save_file

    tensors = per_expert_tensors(hf.state_dict())
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer's
    folder = tmp_path / "deepseek_hf"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    d = hf.config.to_dict()
    d.update(num_nextn_predict_layers=1, n_routed_experts=d.pop("num_local_experts", 8))
    (folder / "config.json").write_text(json.dumps(d))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, folder / f.name)
    return folder


def test_convert_both_ways(tmp_path, capsys):
    hf = _random_hf(vocab_size=1000)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = logits_of(hf(input_ids=ids))
    folder = _published_style_folder(tmp_path, hf)
    ckpt = tmp_path / "ckpt"
    keys = hf_to_nxdt(folder, ckpt)
    assert "num_nextn_predict_layers=1: multi-token prediction is not supported yet" in capsys.readouterr().out
    weights = load_weights(ckpt)
    assert set(weights) == set(hf.state_dict())  # experts fused, the MTP layer left out
    assert_converted_logits(keys, folder, ckpt, weights, ids, want, tmp_path / "back")


def test_bad_configs_one_line():
    tiny = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, vocab_size=97,
                encoder_seq_length=32)
    cases = [({"mtp_num_layers": 1}, "model.mtp_num_layers=1: multi-token prediction is not supported yet"),
             ({"moe": {"num_experts": 8, "top_k": 2, "num_groups": 3}}, r"model.moe.num_groups \(3\) does not divide"),
             ({"moe": {"num_experts": 8, "top_k": 2, "group_top_k": 1}}, "model.moe.group_top_k needs model.moe.num_groups"),
             ({"moe": {"num_experts": 8, "top_k": 1, "load_balancing": "loss_free", "gate_type": "switch_balanced"}},
              "model.moe.load_balancing loss_free: built for the mixtral gate"),
             ({"moe": {"num_experts": 8, "top_k": 2, "load_balancing": "balanced"}}, "model.moe.load_balancing"),
             ({"num_kv_heads": 2, "mla": {"kv_lora_rank": 16}}, r"model.num_kv_heads \(2\): multi-head latent attention")]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"model_source": "megatron", "model": {**tiny, **extra}}, check=True, check_paths=False)
    with pytest.raises(ConfigError, match="model.mla.kv_lora_rank: the native model's"):
        config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/deepseek_v3",
                                                          "mla": {"kv_lora_rank": 4}}}, check=True, check_paths=False)


# --------------------------------------------------------------------------- loss-free balancing

def _skewed_loads(load_balancing: str, activation: str, steps: int = 60) -> list[float]:
    """An MoE block whose router prefers expert 0 for every token (its gate row along the inputs' mean),
    trained `steps` steps on such tokens (SGD on the router and experts); after each step the bias update.
    Returns the largest expert share of each step's routed tokens."""
    from nxdt.models.moe import LlamaMoE, MoEArgs
    from nxdt.models.moe_balance import update_expert_bias

    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, router_activation=activation, load_balancing=load_balancing,
                   bias_update_rate=1e-3, aux_loss_coef=0.0)
    block = LlamaMoE(32, 16, args)
    mean = torch.randn(32)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.02)
        block.gate.weight[0] += 0.02 * mean / mean.norm()
        block.experts.gate_up_proj.normal_(0, 0.02)
        block.experts.down_proj.normal_(0, 0.02)
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    shares = []
    for _ in range(steps):
        x = mean + 0.5 * torch.randn(256, 32)
        block(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        load = block.stats.pop()
        shares.append(load["expert_share_max"])
        update_expert_bias(block)  # one process: no group; a block without loss_free is left alone
    return shares


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_loss_free_balancing_evens_out_a_skewed_router(activation):
    """Every token first picks expert 0 (a share of 0.5 of the top-2 assignments; 0.125 is balanced). With
    loss_free (the default rate, 1e-3) the largest share of each of steps 55-59 is below 0.2 (measured 0.174
    for both scores, at step 59 0.139 / 0.146); with none it never falls below 0.45."""
    free, none = _skewed_loads("loss_free", activation), _skewed_loads("none", activation)
    assert free[0] == none[0] >= 0.45
    assert max(free[-5:]) < 0.2 and min(none) >= 0.45


def test_bias_update_sums_loads_and_logs_per_layer():
    """The update: bias += rate x sign(mean - load), per layer logged as shares (min/max/std)."""
    from nxdt.models.moe import LlamaMoE, MoEArgs
    from nxdt.models.moe_balance import update_expert_bias

    block = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Module()])})
    block.layers[0].mlp = moe = LlamaMoE(8, 4, MoEArgs(num_experts=4, top_k=1, load_balancing="loss_free",
                                                       bias_update_rate=0.5))
    moe.gate.e_score_correction_bias.zero_()
    moe.stats.load = torch.tensor([6.0, 2.0, 0.0, 0.0])
    logged = update_expert_bias(block)
    assert moe.gate.e_score_correction_bias.tolist() == [-0.5, 0.0, 0.5, 0.5]  # mean load 2: expert 1 stays
    assert logged == {"moe/layer0/load_min": 0.0, "moe/layer0/load_max": 0.75,
                      "moe/layer0/load_std": pytest.approx(0.3062, abs=1e-4)}
    assert moe.stats.take_load() is None  # taken
    assert "layers.0.mlp.gate.e_score_correction_bias" in block.state_dict()  # a buffer: checkpointed


def test_mixtral_export_with_a_loss_free_bias(tmp_path):
    """A native Mixtral-style checkpoint trained loss-free exports to transformers' Mixtral (a router without a
    bias) only while its bias is zero (dropped: the same picks, logits within 1e-5); a moved bias is refused in
    one line, since folding it into the gate is not exact for top-k selection."""
    from transformers import AutoModelForCausalLM

    from nxdt.checkpoint.checkpointer import save_weights
    from nxdt.config import to_yaml
    from nxdt.tools.convert import nxdt_to_hf

    keys = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
            "max_position_embeddings": 64, "make_vocab_size_divisible_by": 8,
            "moe": {"num_experts": 4, "top_k": 2, "load_balancing": "loss_free"}}
    cfg = config_from_dict({"model_source": "megatron", "model": keys,
                            "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}})
    torch.manual_seed(0)
    model = init_model_weights(build_model(cfg, vocab_size=8192, device="meta"), device="cpu").eval()
    ids = torch.arange(24).reshape(2, 12) * 37 % 8192
    for moved in (False, True):
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.3, -0.2]) * moved)
        ckpt, out = tmp_path / f"ckpt{moved}", tmp_path / f"hf{moved}"
        save_weights(model.state_dict(), ckpt)
        (ckpt / "config.yaml").write_text(to_yaml(cfg))
        if moved:
            with pytest.raises(ConfigError) as info:
                nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
            assert str(info.value) == (
                f"nxdt-to-hf: {ckpt} was trained with model.moe.load_balancing loss_free and its selection bias "
                "(model.layers.1.mlp.gate.e_score_correction_bias) is not zero: transformers' mixtral router has no "
                "bias and folding it into the gate is not exact for top-k selection; nothing written")
            assert not out.exists()
            continue
        nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
        assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
        with torch.no_grad():
            assert (reloaded(input_ids=ids).logits - logits_of(model(input_ids=ids))).abs().max().item() < 1e-5


def test_mla_decoding_caches_the_latent():
    """Incremental decoding (prefill of 8 tokens, then 4 one at a time, left padding in one row) caches per
    layer the normed latent and the rotated shared key, kv_lora_rank + qk_rope_head_dim = 24 numbers per
    token instead of heads x (qk_head_dim + v_head_dim) = 144: its logits equal the whole sequence's forward
    within 1e-5 (the path that caches nothing), and the greedy continuation of nxdt's generate equals
    transformers' (whose cache holds full keys and values)."""
    from nxdt.models.kv_cache import KVCache

    hf = _random_hf()
    model, _ = _native_twin(hf)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :2] = False  # row 1's prompt is 6 tokens, left-padded
    cache = KVCache(max_length=12, valid=valid)
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # row 1's tokens from position 0, as nxdt's generate
    with torch.no_grad():
        steps = [logits_of(model(input_ids=ids[:, :8], position_ids=pos, kv_cache=cache))]
        steps += [logits_of(model(input_ids=ids[:, t:t + 1], position_ids=pos[:, -1:] + t - 7, kv_cache=cache))
                  for t in range(8, 12)]
        full = logits_of(model(input_ids=ids))
        row1 = logits_of(model(input_ids=ids[1:, 2:]))  # row 1 unpadded, positions from 0
    decoded = torch.cat(steps, dim=1)
    assert (decoded[0] - full[0]).abs().max().item() < 1e-5
    assert (decoded[1, 2:] - row1[0]).abs().max().item() < 1e-5
    latent, rot = cache._keys[1], cache._values[1]  # what the cache holds for layer 1
    assert tuple(latent.shape) == (2, 1, 12, 16) and tuple(rot.shape) == (2, 1, 12, 8)
    with torch.no_grad():  # greedy decoding, transformers' own cache vs nxdt's latent one
        want = hf.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, use_cache=True)[0, 8:]
        got, cache = [], KVCache(max_length=14, batch_size=1)
        nxt = logits_of(model(input_ids=ids[:1, :8], kv_cache=cache))[:, -1].argmax(-1)
        for _ in range(6):
            got.append(int(nxt))
            nxt = logits_of(model(input_ids=nxt[:, None], kv_cache=cache))[:, -1].argmax(-1)
    assert got == want.tolist()
