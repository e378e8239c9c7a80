"""`nxdt plan`: exact parameter counts of the shipped configs, the JSON shape, and the memory
estimate against tensor bytes measured in real training steps."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from nxdt.tools.plan import main as plan_main

CONF = str(REPO / "conf")

# interface.md §9
EXPECTED = {
    "megatron_llama_7B_config": 6_738_415_616,
    "megatron_llama_70b_config": 68_976_648_192,
    "hf_llama3_8B_config": 8_030_261_248,
    "hf_llama3.1_8B_config": 8_030_261_248,
    "hf_llama3_70B_config": 70_553_706_496,
}


def _plan(capsys, name: str, *overrides: str) -> dict:
    assert plan_main(["--config-path", CONF, "--config-name", name, *overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_counts_match_the_reference(capsys, name):
    p = _plan(capsys, name)
    assert p["parameters"] == EXPECTED[name]
    for key in ("parameters", "parameters_per_rank", "memory_per_rank_bytes", "tokens_per_step", "layout"):
        assert key in p
    assert set(p["memory_per_rank_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert set(p["layout"]) >= {"dp", "tp", "pp", "cp"}
    lay = p["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == p["world_size"]
    if lay["pp"] > 1:  # the stages hold every parameter once
        assert sum(p["parameters_per_stage"]) == p["parameters"]
    assert p["parameters_per_rank"] < p["parameters"]


def test_hf_70b_per_rank_split(capsys):
    """Llama-3-70B at tp 32 x pp 8, mixed precision, ZeRO-1 over dp 2."""
    p = _plan(capsys, "hf_llama3_70B_config")
    assert p["layout"] == {**p["layout"], "dp": 2, "tp": 32, "pp": 8, "cp": 1}
    n = p["parameters_per_rank"]
    mem = p["memory_per_rank_bytes"]
    assert mem["params"] == 2 * n and mem["grads"] == 4 * n  # bf16 weights, fp32 grads
    assert mem["optimizer"] == -(-(12 * n) // 2)  # fp32 master + 2 Adam states, / dp (zero1)
    assert p["tokens_per_step"] == 1024 * 8192


def test_fsdp_flag_shards_over_dp_and_cp(capsys):
    """fms-fsdp's `fsdp: true` means full sharding (not replication), and with context parallel
    FSDP shards over dp × cp: per-rank parameters are the tp shard / (dp × cp)."""
    base = ["trainer.devices=8", "distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.zero1=false"]
    tp_only = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=false",
                    "data.global_batch_size=1024")
    fsdp = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=true")
    assert fsdp["layout"]["dp_replicate"] == 1 and fsdp["layout"]["dp_shard"] == 4
    assert fsdp["parameters_per_rank"] == pytest.approx(tp_only["parameters_per_rank"] / 4, abs=1000)
    cp = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=true",
               "distributed_strategy.context_parallel_size=2")
    assert cp["layout"]["cp"] == 2 and cp["layout"]["dp_shard"] == 2
    assert cp["parameters_per_rank"] == pytest.approx(tp_only["parameters_per_rank"] / 4, abs=1000)


def test_every_shipped_config_plans(capsys):
    for path in sorted((REPO / "conf").glob("*.yaml")):
        p = _plan(capsys, path.stem)
        assert p["parameters"] > 0 and p["memory_per_rank_bytes"]["total"] > 0, path.name


def test_text_output_and_bad_input(capsys):
    assert plan_main(["--config-path", CONF, "--config-name", "hf_llama3_70B_config"]) == 0
    out = capsys.readouterr().out
    assert "70,553,706,496" in out and "memory/rank" in out and "tp=32" in out
    from nxdt.cli import main as cli

    assert cli(["plan", "--config-path", CONF, "--config-name", "tiny_llama_cpu",
                "distributed_strategy.pipeline_model_parallel_size=2", "model.num_layers=3"]) == 2
    assert "not divisible by 2 pipeline stages" in capsys.readouterr().err


def test_memory_estimate_matches_measured_tensor_bytes(capsys):
    """Three real fp32 AdamW steps of a small model on one process: parameters, gradients and
    optimizer state bytes, plus the activations autograd keeps for one micro-batch (the peak of
    saved tensors), against the plan's estimate (within 15%)."""
    import torch

    from nxdt.config.load import load_config
    from nxdt.models import build_model
    from nxdt.training.loss import masked_token_loss

    overrides = ["trainer.devices=1", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176",
                 "model.num_attention_heads=4", "model.num_kv_heads=2", "model.encoder_seq_length=128",
                 "data.micro_batch_size=2", "data.global_batch_size=4"]
    p = _plan(capsys, "tiny_llama_cpu", *overrides)
    cfg = load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides],
                      check_paths=False, quiet=True)
    torch.manual_seed(0)
    model = build_model(cfg, 8192)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = 2, 128
    peak_saved = 0
    for _ in range(3):
        optimizer.zero_grad()
        for _mb in range(2):
            ids = torch.randint(0, 8192, (b, s + 1))
            saved: dict[int, int] = {}

            def pack(t, saved=saved):
                key = t.untyped_storage().data_ptr()
                if key not in params:
                    saved[key] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = masked_token_loss(model(ids[:, :-1]), ids[:, 1:], torch.ones(b, s)) / 2
            peak_saved = max(peak_saved, sum(saved.values()))
            loss.backward()
        optimizer.step()
    measured = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "optimizer": sum(t.numel() * t.element_size() for st in optimizer.state.values()
                         for t in st.values() if torch.is_tensor(t) and t.dim() > 0),
        "activations": peak_saved,
    }
    measured["total"] = sum(measured.values())
    est = p["memory_per_rank_bytes"]
    for key in ("params", "grads", "optimizer"):
        assert est[key] == measured[key], (key, est[key], measured[key])
    gap = abs(est["activations"] - measured["activations"]) / measured["activations"]
    print(f"activations estimated {est['activations']:,} measured {measured['activations']:,} gap {gap:.1%}")
    assert gap < 0.15, (est, measured)
    assert abs(est["total"] - measured["total"]) / measured["total"] < 0.15
