"""`nxdt convert`: nxdt checkpoint → HF folder that plain transformers loads (no nxdt import), and back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TOKENIZER_DIR

from nxdt.checkpoint.checkpointer import load_weights, save_weights
from nxdt.config import config_from_dict, to_yaml
from nxdt.models import build_model, logits_of
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


def _cfg(source: str):
    """megatron, hf, or moe: the megatron source with Mixtral-style experts (4, top-2)."""
    model = dict(TINY) if source in ("megatron", "moe") else {"model_config": "model_configs/tiny_llama",
                                                              "num_layers": 2, "hidden_size": 64}
    if source == "moe":
        model["moe"] = {"num_experts": 4, "top_k": 2, "output_router_logits": True}
    return config_from_dict({
        "model_source": "megatron" if source == "moe" else source, "model": model,
        "distributed_strategy": {"tensor_model_parallel_size": 1},
        "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}},
    })


def _nxdt_checkpoint(tmp_path, source: str):
    torch.manual_seed(0)
    cfg = _cfg(source)
    model = build_model(cfg, vocab_size=8192).eval()
    ckpt = tmp_path / f"ckpt_{source}"
    save_weights(model.state_dict(), ckpt)
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    return model, ckpt


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("1234") == 1234


def test_export_loads_in_plain_transformers_with_equal_logits(tmp_path):
    ids = torch.arange(24).reshape(2, 12) * 37 % 8192
    folders, expected = [], []
    for source in ("megatron", "hf", "moe"):  # moe: exported as a MixtralForCausalLM
        model, ckpt = _nxdt_checkpoint(tmp_path, source)
        out = tmp_path / f"hf_{source}"
        nxdt_to_hf(ckpt, out, max_shard_bytes=600_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and all((out / f).is_file() for f in files)
        assert set(index["weight_map"]) == set(model.state_dict())
        assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
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
