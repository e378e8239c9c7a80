"""`nxdt convert`: nxdt checkpoint → HF folder that plain transformers loads (no nxdt import), and back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TOKENIZER_DIR

from nxdt.checkpoint.checkpointer import load_weights, save_weights
from nxdt.config import to_yaml
from nxdt.spec import config_from_dict
from nxdt.models import build_model, logits_of
from nxdt.models.neox import native_to_neox
from nxdt.tools.convert import hf_to_nxdt, nxdt_to_hf, parse_size

TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4, "num_kv_heads": 2,
        "max_position_embeddings": 128, "make_vocab_size_divisible_by": 8, "init_method_std": 0.02}

# Runs with nxdt made unimportable: the exported folder must stand on transformers alone.
LOAD_IN_TRANSFORMERS = r"""
import sys
sys.modules["nxdt"] = None
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for i, folder in enumerate(sys.argv[2:]):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    AutoTokenizer.from_pretrained(folder)
    ids = torch.arange(24).reshape(2, 12) * 37 % model.config.vocab_size
    with torch.no_grad():
        out[f"logits{i}"] = model(input_ids=ids).logits.contiguous()
save_file(out, sys.argv[1])
"""


# the native GPT-NeoX / Pythia architecture (parallel residual with two norms, a quarter rotated)
NEOX = {"normalization": "layernorm", "activation": "gelu", "has_bias": True, "transformer_block_type": "gpt_j",
        "gpt_j_tied": False, "rotary_percentage": 0.25, "num_kv_heads": 4, "rotary_emb_base": 5000.0}


def assert_converted_logits(keys, folder, ckpt, weights, ids, want, out) -> None:
    """A converted checkpoint's weights give transformers' logits (`want`, within 1e-5) in the native model
    its nxdt_model.yaml keys build and under model_source hf with the published config.json; exported
    back (`out`) they load in transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    data = {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}
    hf_cfg = {"model_source": "hf", "model": {"model_config": str(folder)}}
    for source, cfg in (("megatron", {**keys, "data": data}), ("hf", hf_cfg)):
        model = build_model(config_from_dict(cfg), vocab_size=1000).eval()
        model.load_state_dict(weights, strict=True)
        with torch.no_grad():
            assert (logits_of(model(input_ids=ids)) - want).abs().max().item() < 1e-5, source
    nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - want).abs().max().item() < 1e-5


def per_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as published Qwen3-MoE / DeepSeek-V3 folders store it: transformers' fused expert
    tensors (`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]) split into each expert's
    gate_proj / up_proj / down_proj weights; the other tensors as they are."""
    tensors = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.clone()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            tensors.update({name.replace("down_proj", f"{e}.down_proj.weight"): w.clone() for e, w in enumerate(t)})
        else:
            tensors[name] = t.contiguous()
    return tensors

def _cfg(source: str):
    """megatron, hf, moe: the megatron source with Mixtral-style experts (4, top-2), neox: the
    megatron source with GPT-NeoX's architecture (neox_tanh: with activation gelu_tanh), hf_neox: transformers' GPTNeoX
    (model_source hf), hf_moe: transformers' Mixtral."""
    model = dict(TINY) if source in ("megatron", "moe", "neox", "neox_tanh") else {
        "model_config": {"hf_neox": "model_configs/tiny_neox", "hf_moe": "model_configs/tiny_mixtral"}.get(
            source, "model_configs/tiny_llama"),
        "num_layers": 2, "hidden_size": 64}
    if source in ("moe", "hf_moe"):
        model["moe"] = {"num_experts": 4, "top_k": 2, "output_router_logits": True}
    if source == "neox":
        model.update(NEOX)
    if source == "neox_tanh":  # GPT-NeoX-20B's tanh GELU
        model.update(NEOX, activation="gelu_tanh")
    return config_from_dict({
        "model_source": "hf" if source.startswith("hf") else "megatron", "model": model,
        "distributed_strategy": {"tensor_model_parallel_size": 1},
        "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}},
    })


def _nxdt_checkpoint(tmp_path, source: str):
    torch.manual_seed(0)
    cfg = _cfg(source)
    model = build_model(cfg, vocab_size=8192).eval()
    if "neox" in source:  # biases and norms away from their init, so a misplaced one shows in the logits
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
            if source == "neox_tanh":  # MLP inputs of a few units: tanh and exact GELU differ by ~1e-4 there
                for layer in model.model.layers:
                    layer.mlp.up_proj.weight.mul_(30)
    ckpt = tmp_path / f"ckpt_{source}"
    save_weights(model.state_dict(), ckpt)
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    return model, ckpt


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("1234") == 1234


def test_export_loads_in_plain_transformers_with_equal_logits(tmp_path):
    ids = torch.arange(24).reshape(2, 12) * 37 % 8192
    folders, expected = [], []
    # moe: exported as a MixtralForCausalLM, neox: as a GPTNeoXForCausalLM (renamed, QKV fused),
    # hf_neox: transformers' own GPTNeoX names (the output layer stored as embed_out)
    for source in ("megatron", "hf", "moe", "neox", "hf_neox", "neox_tanh"):
        model, ckpt = _nxdt_checkpoint(tmp_path, source)
        out = tmp_path / f"hf_{source}"
        nxdt_to_hf(ckpt, out, max_shard_bytes=600_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and all((out / f).is_file() for f in files)
        names = native_to_neox(model.state_dict(), 4) if source.startswith("neox") else model.state_dict()
        if source == "hf_neox":
            names = [k.replace("lm_head.", "embed_out.") for k in names]
        assert set(index["weight_map"]) == set(names)
        assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
        if source == "neox_tanh":
            assert json.loads((out / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"
        with torch.no_grad():
            expected.append(logits_of(model(input_ids=ids)))
        folders.append(str(out))

    result = tmp_path / "logits.safetensors"
    proc = subprocess.run([sys.executable, "-I", "-c", LOAD_IN_TRANSFORMERS, str(result), *folders],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    got = load_file(str(result))
    for i, want in enumerate(expected):
        assert (got[f"logits{i}"] - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("source", ["megatron", "moe"])
def test_round_trip_hf_to_nxdt_is_a_copy(tmp_path, source):
    model, ckpt = _nxdt_checkpoint(tmp_path, source)
    hf = tmp_path / "hf"
    nxdt_to_hf(ckpt, hf, max_shard_bytes=10**9)
    assert (hf / "model.safetensors").is_file()  # one shard: no index
    back = tmp_path / "back"
    hf_to_nxdt(hf, back)
    weights = load_weights(back)
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert (back / "tokenizer" / "tokenizer.json").is_file()
    # and back again, now with the kept HF config
    again = tmp_path / "again"
    nxdt_to_hf(back, again, max_shard_bytes=10**9)
    assert json.loads((again / "config.json").read_text())["hidden_size"] == 64


def test_cli_errors_exit_2_with_the_path(tmp_path, capsys):
    from nxdt.cli import main

    missing = tmp_path / "nope"
    assert main(["convert", "nxdt-to-hf", "--input", str(missing), "--output", str(tmp_path / "o")]) == 2
    assert str(missing) in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"pickle")
    assert main(["convert", "hf-to-nxdt", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "c")]) == 2
    assert "only safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["megatron", "moe"])
def test_exported_config_matches_model(tmp_path, source):
    _, ckpt = _nxdt_checkpoint(tmp_path, source)
    out = tmp_path / "hf"
    nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2 and config["vocab_size"] == 8192
    if source == "moe":
        assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
        assert config["intermediate_size"] == 176 and config["output_router_logits"] is True


def _hf_to_nxdt(original, folder, tmp_path, capsys):
    """`nxdt convert hf-to-nxdt` of a transformers folder: (input ids, the original's logits on them, the
    converted checkpoint, its nxdt_model.yaml as a dict)."""
    from omegaconf import OmegaConf

    from nxdt.cli import main

    ids = torch.arange(24).reshape(2, 12) * 37 % 1000
    with torch.no_grad():
        want = original(input_ids=ids).logits
    ckpt = tmp_path / "nxdt"
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(ckpt)]) == 0
    assert "nxdt_model.yaml" in capsys.readouterr().out
    return ids, want, ckpt, OmegaConf.to_container(OmegaConf.load(ckpt / "nxdt_model.yaml"))


def _hf_neox_folder(tmp_path, parallel: bool, hidden_act: str = "gelu"):
    """A transformers GPTNeoX folder (save_pretrained, safetensors) with random weights and the tokenizer;
    a tanh-GELU one with MLP inputs of a few units (where the approximation differs from exact GELU)."""
    import shutil

    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=160, rotary_pct=0.25, rotary_emb_base=5000.0,
                                        max_position_embeddings=64, use_parallel_residual=parallel,
                                        hidden_act=hidden_act)
    model = transformers.GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        if hidden_act != "gelu":
            for layer in model.gpt_neox.layers:
                layer.mlp.dense_h_to_4h.weight.mul_(30)
    folder = tmp_path / "neox_hf"
    model.save_pretrained(folder, safe_serialization=True)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, folder / f.name)
    return model, folder


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-residual", "sequential"])
def test_neox_hf_folder_to_nxdt_and_back(tmp_path, capsys, parallel):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original, folder = _hf_neox_folder(tmp_path, parallel)
    ids, want, ckpt, keys = _hf_to_nxdt(original, folder, tmp_path, capsys)
    # the written model keys build the native twin; the converted weights fit it exactly
    m = keys["model"]
    assert keys["model_source"] == "megatron"
    assert (m["transformer_block_type"], m.get("gpt_j_tied")) == (("gpt_j", False) if parallel else ("pre_ln", None))
    assert (m["normalization"], m["activation"], m["has_bias"], m["position_embedding_type"]) == (
        "layernorm", "gelu", True, "rope")
    assert (m["rotary_percentage"], m["rotary_emb_base"], m["share_embeddings_and_output_weights"]) == (0.25, 5000.0, False)
    cfg = config_from_dict({**keys, "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}})
    native = build_model(cfg, vocab_size=1000).eval()
    assert native.args.vocab_size == 1000  # make_vocab_size_divisible_by pads nothing
    weights = load_weights(ckpt)
    native.load_state_dict(weights, strict=True)
    with torch.no_grad():
        assert (native(ids) - want).abs().max().item() < 1e-5
    # back to a GPT-NeoX folder that plain transformers loads
    out = tmp_path / "back"
    nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_neox"
    again, before = load_file(str(out / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert again.keys() == before.keys() and all(torch.equal(again[k], before[k]) for k in before)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - want).abs().max().item() < 1e-5


def test_neox_the_native_model_cannot_express_is_one_line(tmp_path, capsys):
    from nxdt.cli import main

    _, folder = _hf_neox_folder(tmp_path, True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(tmp_path / "c")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hidden_act=relu" in errors[0] and str(folder) in errors[0]
    assert not (tmp_path / "c").exists()


def test_neox_20b_tanh_gelu_folder_to_nxdt_and_back(tmp_path, capsys):
    """GPT-NeoX-20B's config.json says hidden_act gelu_fast: it converts to activation gelu_tanh, and
    back to a folder (hidden_act gelu_pytorch_tanh) that plain transformers loads, logits unchanged."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from nxdt.cli import main

    original, folder = _hf_neox_folder(tmp_path, True, hidden_act="gelu_fast")
    ids = torch.arange(24).reshape(2, 12) * 37 % 1000
    with torch.no_grad():
        want = original(input_ids=ids).logits
    ckpt = tmp_path / "nxdt"
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(ckpt)]) == 0
    keys = OmegaConf.to_container(OmegaConf.load(ckpt / "nxdt_model.yaml"))
    assert keys["model"]["activation"] == "gelu_tanh"
    data = {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}
    native = build_model(config_from_dict({**keys, "data": data}), vocab_size=1000).eval()
    native.load_state_dict(load_weights(ckpt), strict=True)
    with torch.no_grad():
        assert (native(ids) - want).abs().max().item() < 1e-5
        exact = build_model(config_from_dict({**keys, "model": {**keys["model"], "activation": "gelu"}, "data": data}),
                            vocab_size=1000).eval()
        exact.load_state_dict(native.state_dict())
        assert (exact(ids) - want).abs().max().item() > 3e-5  # the exact GELU is another function
    out = tmp_path / "back"
    nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "gelu_fast"  # the kept config.json
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - want).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- Qwen3 / Qwen3-MoE

def _hf_qwen3_folder(tmp_path, moe: bool):
    """A transformers Qwen3 (tied embeddings) or Qwen3-MoE folder with random weights, written as the
    published ones are: config.json with `num_experts`, each expert's weights apart
    (`mlp.experts.<e>.gate_proj.weight`, transformers 4's layout), and the tokenizer."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                             decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False)
    else:
        config = transformers.Qwen3Config(**common, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    tensors = per_expert_tensors({name: t for name, t in model.state_dict().items()
                                  if not (name == "lm_head.weight" and config.tie_word_embeddings)})
    folder = tmp_path / ("qwen3_moe_hf" if moe else "qwen3_hf")
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    d = config.to_dict()
    if moe:
        d["num_experts"] = d.pop("num_local_experts")  # the published name (transformers 4)
    (folder / "config.json").write_text(json.dumps(d))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, folder / f.name)
    return model, folder


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3-tied", "qwen3-moe-per-expert"])
def test_qwen3_hf_folder_to_nxdt_and_back(tmp_path, capsys, moe):
    """hf-to-nxdt: the written model keys build the native twin (both sources load the weights) with
    transformers' logits; nxdt-to-hf: a folder plain transformers loads, logits unchanged."""

    original, folder = _hf_qwen3_folder(tmp_path, moe)
    ids, want, ckpt, keys = _hf_to_nxdt(original, folder, tmp_path, capsys)
    m = keys["model"]
    assert (m["qk_layernorm"], m["kv_channels"], m["share_embeddings_and_output_weights"]) == (True, 24, not moe)
    if moe:
        assert (m["moe"]["layers"], m["moe"]["ffn_hidden_size"], m["moe"]["num_experts"]) == ([1, 3], 40, 4)
    weights = load_weights(ckpt)
    assert set(weights) == set(original.state_dict())  # per-expert weights fused, the tied head materialised
    assert_converted_logits(keys, folder, ckpt, weights, ids, want, tmp_path / "back")


def test_qwen3_native_checkpoint_exports_as_qwen3(tmp_path):
    """A native checkpoint with q/k norms (model_source megatron, no HF config kept) becomes a
    Qwen3MoeForCausalLM folder: experts in layers 1 and 3 only (mlp_only_layers 0 and 2)."""
    from transformers import AutoModelForCausalLM

    model_keys = {**TINY, "num_layers": 4, "qk_layernorm": True, "kv_channels": 24,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 40, "layers": [1, 3]}}
    cfg = config_from_dict({"model_source": "megatron", "model": model_keys,
                            "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}})
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=8192).eval()
    ckpt = tmp_path / "ckpt"
    save_weights(model.state_dict(), ckpt)
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    out = tmp_path / "hf"
    nxdt_to_hf(ckpt, out, max_shard_bytes=10**9)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["mlp_only_layers"], config["moe_intermediate_size"]) == ("qwen3_moe", [0, 2], 40)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.arange(24).reshape(2, 12) * 37 % 8192
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - model(ids)).abs().max().item() < 1e-5


def test_a_model_type_nxdt_cannot_build_is_refused_in_one_line(tmp_path, capsys):
    """Gemma 3 (or any model_type no nxdt model builds): one error line, rc 2, nothing written,
    no weight read (the folder's safetensors file is not even valid)."""
    from nxdt.cli import main

    folder = tmp_path / "gemma3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"not read")
    assert main(["convert", "hf-to-nxdt", "--input", str(folder), "--output", str(tmp_path / "c")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model_type 'gemma3'" in errors[0] and str(folder) in errors[0]
    assert not (tmp_path / "c").exists()
