"""`nxdt moe-split`: experts built from a dense Llama.

The proof that a split is right: with every expert selected, a zero router and score scale E,
the MoE model's logits equal the dense model's (1e-5), for both split methods, from an nxdt
checkpoint and from a transformers folder; a split with a misplaced expert, or LLaMA-MoE's E/k
scale at k = E, is far off. End to end, the split checkpoint trains through the training entry
(`model.weight_init_only`, the printed overrides) and its first-step loss is the dense model's.
"""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest
import torch
from conftest import TINY_OVERRIDES, curve, read_scalars, run_pool

from nxdt.checkpoint.checkpointer import load_weights, save_weights
from nxdt.cli import main as cli
from nxdt.config import to_yaml
from nxdt.spec import load_config
from nxdt.models import build_model
from nxdt.tools import moe_split
from nxdt.tools.convert import nxdt_to_hf

E = 4  # experts; TINY_OVERRIDES' ffn_hidden_size 176 = 4 x 44
VOCAB = 8192  # the bundled tokenizer's, as the training run sizes the model
BASE = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1"]
IDS = torch.arange(64).reshape(2, 32) * 37 % VOCAB


def _cfg(*overrides: str):
    return load_config([*BASE, *overrides], world_size=1, check_paths=False, quiet=True)


def _split(capsys, src, out, *extra: str) -> tuple[int, str, str]:
    rc = cli(["moe-split", "--input", str(src), "--output", str(out), "--num-experts", str(E), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _overrides(stdout: str) -> list[str]:
    """The printed `key=value` line (the last one)."""
    return shlex.split(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A dense tiny Llama (the model the e2e runs build) saved as a weights-only nxdt checkpoint."""
    torch.manual_seed(0)
    cfg = _cfg()
    model = build_model(cfg, VOCAB).eval()
    ckpt = tmp_path_factory.mktemp("dense") / "ckpt"
    save_weights(model.state_dict(), ckpt)
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    return model, ckpt


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS)


def _moe_model(ckpt, overrides: list[str]):
    model = build_model(_cfg(*overrides), VOCAB).eval()
    model.load_state_dict(load_weights(ckpt), strict=True)
    return model


# ----------------------------------------------------------------------------- the splits
def test_random_split_is_a_seeded_equal_partition():
    a = moe_split.random_split(176, E, torch.Generator().manual_seed(0))
    assert a.shape == (E, 44) and torch.equal(a.flatten().sort().values, torch.arange(176))
    assert torch.equal(a, moe_split.random_split(176, E, torch.Generator().manual_seed(0)))
    assert not torch.equal(a, moe_split.random_split(176, E, torch.Generator().manual_seed(1)))


def test_balanced_assignment_fills_every_cluster_with_its_closest():
    dist = torch.zeros(12, 3)
    dist[:, 0] = torch.arange(12.0)  # everyone prefers cluster 0 (distance 0 elsewhere is worse: +100)
    dist[:, 1:] = 100 + torch.arange(12.0)[:, None]
    labels = moe_split.balanced_assign(dist, 4)
    assert torch.bincount(labels, minlength=3).tolist() == [4, 4, 4]
    assert labels[:4].tolist() == [0, 0, 0, 0]  # cluster 0 keeps its four closest


def test_clustering_recovers_planted_groups_deterministically():
    g = torch.Generator().manual_seed(0)
    truth = torch.randperm(E * 11, generator=g).view(E, 11)
    features = torch.empty(E * 11, 16)
    for e in range(E):  # E far-apart centres, 11 neurons around each, scattered over the indices
        features[truth[e]] = torch.randn(16, generator=g) * 10 + torch.randn(11, 16, generator=g) * 0.1
    groups, _ = moe_split.clustering_split(features, E, torch.Generator().manual_seed(3))
    assert sorted(map(sorted, groups.tolist())) == sorted(map(sorted, truth.tolist()))
    again, _ = moe_split.clustering_split(features, E, torch.Generator().manual_seed(3))
    assert torch.equal(groups, again)


@pytest.fixture(scope="module")
def splits(dense, tmp_path_factory):
    """Both methods through the CLI, printing the overrides for top_k = E (the identity):
    {method: (checkpoint, stdout)}."""
    root = tmp_path_factory.mktemp("splits")
    out = {}
    for method in moe_split.METHODS:
        ckpt, printed = root / method, io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = cli(["moe-split", "--input", str(dense[1]), "--output", str(ckpt), "--num-experts", str(E),
                      "--method", method, "--top-k", str(E)])
        assert rc == 0
        out[method] = (ckpt, printed.getvalue())
    return out


@pytest.mark.parametrize("method", moe_split.METHODS)
def test_all_experts_uniform_gate_reproduce_the_dense_logits(dense, splits, method):
    ckpt, stdout = splits[method]
    assert sum(line.startswith("layer ") for line in stdout.splitlines()) == 2  # one progress line per layer
    overrides = _overrides(stdout)
    assert f"model.moe.moe_calculator_score_scale_factor={float(E)}" in overrides
    assert "model.ffn_hidden_size=44" in overrides and f"model.moe.num_selects={E}" in overrides
    want = _logits(dense[0])
    moe = _moe_model(ckpt, overrides)
    assert (_logits(moe) - want).abs().max().item() < 1e-5
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()

    # LLaMA-MoE's E/k (= 1 at k = E) under nxdt's normalised gate: the MLPs shrink by 1/E
    for layer in moe.model.layers:
        layer.mlp.args.score_scale = 1.0
    assert (_logits(moe) - want).abs().max().item() > 1e-3
    for layer in moe.model.layers:
        layer.mlp.args.score_scale = float(E)

    # a misplaced expert: layer 0's experts 0 and 1 swap their down projections
    down = moe.model.layers[0].mlp.experts.down_proj
    with torch.no_grad():
        down.copy_(down[[1, 0, 2, 3]])
    assert (_logits(moe) - want).abs().max().item() > 1e-3


def test_llama_moe_noisy_gate_gets_its_zero_noise_weight(dense, tmp_path, capsys):
    rc, stdout, _ = _split(capsys, dense[1], tmp_path / "moe", "--gate-type", "top_k_balanced_noisy",
                           "--top-k", str(E), "--router-init-std", "0.02")
    assert rc == 0
    weights = load_weights(tmp_path / "moe")
    assert torch.equal(weights["model.layers.1.mlp.gate.weight_noise"], torch.zeros(E, 64))
    assert 0.01 < weights["model.layers.1.mlp.gate.weight"].std().item() < 0.04
    overrides = _overrides(stdout)
    assert "model.moe.gate_type=top_k_balanced_noisy" in overrides
    moe = _moe_model(tmp_path / "moe", overrides)  # strict: every key of the noisy gate is there
    for layer in moe.model.layers:
        with torch.no_grad():
            layer.mlp.gate.weight.zero_()
    # evaluation draws no noise: a zero gate over all E experts is uniform, as for the mixtral gate
    assert (_logits(moe) - _logits(dense[0])).abs().max().item() < 1e-5


def test_layer_check_catches_a_misplaced_expert(dense):
    mlp = dense[0].model.layers[1].mlp
    gate, up, down = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
    groups = moe_split.random_split(176, E, torch.Generator().manual_seed(0))
    gate_up, expert_down = moe_split.expert_weights(gate, up, down, groups)
    err, size = moe_split.check_layer(gate, up, down, gate_up, expert_down)
    assert err < 1e-6 * size
    err, size = moe_split.check_layer(gate, up, down, gate_up, expert_down.roll(1, dims=0))
    assert err > 0.05 * size
    err, size = moe_split.check_layer(gate, up, down, gate_up, expert_down, score_scale=1.0)
    assert err > 0.5 * size  # scale 1 with weights 1/4: the layer gives a quarter of the MLP


def test_verify_refuses_to_write_a_wrong_split(dense, tmp_path, capsys, monkeypatch):
    right = moe_split.expert_weights

    def misplaced(*args):
        gate_up, down = right(*args)
        return gate_up, down.roll(1, dims=0)

    monkeypatch.setattr(moe_split, "expert_weights", misplaced)
    rc, _, err = _split(capsys, dense[1], tmp_path / "bad")
    assert rc == 1 and "do not add up to the dense MLP" in err and not (tmp_path / "bad").exists()


def test_a_transformers_folder_gives_the_same_split(dense, splits, tmp_path, capsys):
    hf = tmp_path / "hf"
    nxdt_to_hf(dense[1], hf, max_shard_bytes=10**9)
    rc, _, _ = _split(capsys, hf, tmp_path / "moe", "--method", "random")
    assert rc == 0
    got, want = load_weights(tmp_path / "moe"), load_weights(splits["random"][0])
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    clustered = load_weights(splits["clustering"][0])
    key = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(clustered[key], want[key])  # the methods group the neurons differently
    assert torch.equal(want["model.layers.0.mlp.gate.weight"], torch.zeros(E, 64))  # LLaMA-MoE's linear gate


def test_bad_input_exits_2_with_one_line_and_writes_nothing(dense, splits, tmp_path, capsys):
    rc, _, err = _split(capsys, dense[1], tmp_path / "o", "--num-experts", "3")  # the last flag wins: E = 3
    assert rc == 2 and err.count("error:") == 1 and "--num-experts 3" in err and "176" in err
    assert not (tmp_path / "o").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    rc, _, err = _split(capsys, dense[1], taken)
    assert rc == 2 and f"--output {taken} exists" in err and (taken / "keep.txt").read_text() == "mine"
    assert list(taken.iterdir()) == [taken / "keep.txt"]
    rc, _, err = _split(capsys, tmp_path / "taken", tmp_path / "o")
    assert rc == 2 and "neither an nxdt checkpoint" in err
    rc, _, err = _split(capsys, dense[1], tmp_path / "o", "--gate-type", "switch_balanced")
    assert rc == 2 and "--top-k 1" in err and not (tmp_path / "o").exists()
    rc, _, err = _split(capsys, splits["random"][0], tmp_path / "o")
    assert rc == 2 and "already a mixture of experts" in err and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- training from a split
def test_split_checkpoint_trains_from_the_dense_first_loss(dense, splits, kjv_prefix, tmp_path, capsys):
    rc, stdout, _ = _split(capsys, dense[1], tmp_path / "moe_top2")  # the default: top-2 of 4
    assert rc == 0
    common = [*BASE, f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.max_steps=3", "model.optim.lr=1e-2",
              "model.optim.sched.warmup_steps=1", "trainer.val_check_interval=3", "trainer.limit_val_batches=1"]
    runs = {
        "dense": [*common, f"exp_manager.resume_from_checkpoint={dense[1]}", "model.weight_init_only=true"],
        "moe_all": [*common, *_overrides(splits["random"][1])],  # exactly as printed
        "moe_top2": [*common, *_overrides(stdout)],
    }
    runs = {name: [*argv, f"exp_manager.explicit_log_dir={tmp_path / name}"] for name, argv in runs.items()}
    procs = run_pool(runs, 1, tmp_path / "pool")
    losses = {name: curve(read_scalars(tmp_path / name)) for name in runs}
    for name in runs:
        assert "loaded weights from" in procs[name].stdout
        assert len(losses[name]) == 3 and losses[name][-1] < losses[name][0], (name, losses[name])
    assert abs(losses["moe_all"][0] - losses["dense"][0]) < 1e-5, losses
    assert abs(losses["moe_top2"][0] - losses["dense"][0]) > 1e-4, losses  # top-2 is not the identity
