"""Dynamic data selection (`data.dynamic_data_selection: sheared_llama`): the weight update, the
per-step domain draw, reference losses, bad input, and two in-process runs on synthetic domains:
the domain kept above its reference gains weight exactly as the formula predicts, and a run
resumed from a checkpoint taken between updates continues with the same weights and the same
losses, bit for bit (with a DataLoader worker prefetching ahead)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import types
from pathlib import Path

import numpy as np
import torch
import pytest
from conftest import TINY_OVERRIDES, read_scalars
from test_data_modules import fake_trainer

from nxdt.spec.data import domain_names, reference_losses
from nxdt.config.errors import ConfigError
from nxdt.config.load import main_guard
from nxdt.spec import build_spec, config_from_dict
from nxdt.data.dynamic_selection import DomainDraw, WeightSchedule, draw_domains, updated_weights

SETTINGS = types.SimpleNamespace(eta=1.0, smoothing=1e-4, update_interval=2, eval_batches=1)


# ----------------------------------------------------------------------------- the formula and the draw


def test_the_paper_rule_counts_only_the_excess():
    w, losses, ref = [0.5, 0.3, 0.2], [2.5, 1.0, 3.0], [2.0, 1.5, 1.0]
    got = updated_weights(w, losses, ref, eta=0.7, smoothing=0.01, rule="sheared_llama_paper")
    # by hand: excess = (0.5, 0, 2.0)
    alpha = np.array([0.5 * math.exp(0.35), 0.3, 0.2 * math.exp(1.4)])
    alpha /= alpha.sum()
    np.testing.assert_allclose(got, 0.99 * alpha + 0.01 / 3, rtol=1e-15)
    assert got.sum() == pytest.approx(1.0, abs=1e-15)
    # no domain above its reference: only the smoothing moves the weights
    np.testing.assert_allclose(updated_weights(w, [1, 1, 1], [2, 2, 2], 1.0, 0.0, "sheared_llama_paper"), w, rtol=1e-15)
    # LLaMA-MoE's rule: a domain below its reference loses weight
    signed = updated_weights(w, losses, ref, eta=0.7, smoothing=0.01)
    assert signed[1] < got[1] and signed.sum() == pytest.approx(1.0, abs=1e-15)


# LLaMA-MoE's example (smoe/data/dynamic_selection.py at b17aff4, its __main__): LLaMA's blend, Llama-2-7B's
# SlimPajama reference losses, and one round of held-out losses
LLAMA_PORTION = {"en_cc": 0.67, "en_c4": 0.15, "github": 0.045, "en_wikipedia": 0.045, "en_book": 0.045,
                 "en_arxiv": 0.025, "en_stack": 0.02}
REF_LOSS = {"en_book": 1.925248146057129, "en_wikipedia": 1.5899001359939575, "en_stack": 1.4974864721298218,
            "github": 0.6984495520591736, "en_c4": 2.074881076812744, "en_cc": 1.6916865110397339,
            "en_arxiv": 1.2408167123794556}
CURR_LOSS = {"en_book": 2.071, "en_wikipedia": 1.572, "en_stack": 1.491, "github": 0.705, "en_c4": 2.117,
             "en_cc": 1.728, "en_arxiv": 1.287}


def _llama_moe_sheared_llama(prob_map, ref_loss, curr_loss):
    """LLaMA-MoE's update_weight_sheared_llama, as written there (torch, float32, eta 1, c 1e-4)."""
    tasks = list(prob_map)
    original = torch.tensor([prob_map[k] for k in tasks])
    diff = torch.tensor([curr_loss[k] - ref_loss[k] for k in tasks])
    alpha = torch.nn.functional.softmax(torch.log(original) + 1.0 * diff, dim=0)
    out = ((1 - 1e-4) * alpha + 1e-4 / len(tasks)).numpy().astype("float64")
    return out / out.sum()


def _llama_moe_sheared_llama_paper(prob_map, ref_loss, curr_loss):
    """LLaMA-MoE's update_weight_sheared_llama_paper (numpy, no eta, no smoothing)."""
    tasks = list(prob_map)
    alpha = np.array([prob_map[k] for k in tasks]) * np.exp(np.array([max(0, curr_loss[k] - ref_loss[k])
                                                                       for k in tasks]))
    return alpha / alpha.sum()


def test_both_rules_equal_llama_moes_functions_on_its_example():
    names = list(LLAMA_PORTION)
    args = ([LLAMA_PORTION[k] for k in names], [CURR_LOSS[k] for k in names], [REF_LOSS[k] for k in names])
    signed = updated_weights(*args, eta=1.0, smoothing=1e-4, rule="sheared_llama")
    paper = updated_weights(*args, eta=1.0, smoothing=0.0, rule="sheared_llama_paper")
    np.testing.assert_allclose(signed, _llama_moe_sheared_llama(LLAMA_PORTION, REF_LOSS, CURR_LOSS), atol=1e-7)
    np.testing.assert_allclose(paper, _llama_moe_sheared_llama_paper(LLAMA_PORTION, REF_LOSS, CURR_LOSS), rtol=1e-14)
    wiki = names.index("en_wikipedia")
    assert (round(signed[wiki], 6), round(paper[wiki], 6)) == (0.042559, 0.043279)  # docs/data.md


def test_domain_draw_is_per_step_and_follows_the_weights():
    w = [0.7, 0.2, 0.1]
    a, b = draw_domains(3, 10, w, 4096), draw_domains(3, 10, w, 4096)
    assert (a == b).all() and not (a == draw_domains(3, 11, w, 4096)).all()
    np.testing.assert_allclose(np.bincount(a, minlength=3) / 4096, w, atol=0.03)
    schedule = WeightSchedule([1, 1])
    schedule.add(5, [0.0, 1.0])
    draw = DomainDraw(schedule, seed=1, global_batch_size=64)
    assert set(draw.domains(4).tolist()) == {0, 1} and set(draw.domains(5).tolist()) == {1}
    assert WeightSchedule.from_state(schedule.state()).state() == [[0, [0.5, 0.5]], [5, [0.0, 1.0]]]


def _indexed(path: Path, docs: list[np.ndarray]):
    from nxdt.data.indexed import IndexedDataset, IndexedDatasetBuilder

    with IndexedDatasetBuilder(str(path), dtype=np.uint16) as builder:
        for doc in docs:
            builder.add_document(doc)
    return IndexedDataset(str(path))


def test_dynamic_draw_reads_every_sample_once_across_a_rank_change(tmp_path):
    """2 ranks read 3 steps with one schedule, 1 rank resumes from the merged table while the
    weights change: within an epoch no sample is read twice or skipped."""
    from nxdt.data.logical_shards import LogicalShardSampler, ShardedStreams, merge_tables

    rng = np.random.RandomState(0)
    parts = []
    for name, n in (("a", 40), ("b", 24)):
        ix = _indexed(tmp_path / name, [rng.randint(3, 900, size=rng.randint(5, 40)) for _ in range(n)])
        parts.append((ix, np.arange(n)))
    streams = ShardedStreams(parts, logical_shards=4, seq_length=8, seed=3)
    schedule = WeightSchedule([0.5, 0.5])
    schedule.add(2, [0.9, 0.1])
    draw = DomainDraw(schedule, seed=5, global_batch_size=4)
    seen, reports, start = [], [], np.zeros((2, 4), dtype=np.int64)
    for rank in (0, 1):
        sampler = LogicalShardSampler(streams, start, [1, 1], 2, rank, 2, num_batches=6, draw=draw)
        batches = list(sampler)  # prefetched 6, trained 3
        seen += [key for batch in batches[:3] for key in batch]
        reports.append((rank, 2, sampler.consumed_after(3)))
        # each slot's domain is the global draw's
        assert [d for d, _, _ in batches[0]] == draw.domains(0)[2 * rank: 2 * rank + 2].tolist()
    table = merge_tables(reports, 4)
    schedule.add(4, [0.2, 0.8])
    one = LogicalShardSampler(streams, table, [1, 1], 4, 0, 1, num_batches=200, draw=draw, first_step=3)
    for step, batch in enumerate(one, start=3):
        assert [d for d, _, _ in batch] == draw.domains(step).tolist()
        seen += batch
    first_epoch = [key for key in seen if key[2] < streams.samples_per_epoch[key[0], key[1]]]
    assert len(first_epoch) == len(set(first_epoch))
    epoch = {(d, k, j) for d in range(2) for k in range(4) for j in range(int(streams.samples_per_epoch[d, k]))}
    assert set(first_epoch) == epoch


# ----------------------------------------------------------------------------- reference losses, bad input


def test_reference_losses_from_a_list_a_mapping_or_a_file(tmp_path):
    paths = ["data/web/web_text_document", "data/code/code_text_document"]
    names = domain_names(paths)
    assert names == ["web_text_document", "code_text_document"]
    assert domain_names(["a/x", "b/x"]) == ["x#0", "x#1"]
    assert reference_losses([2.0, 1.5], paths) == [2.0, 1.5]
    assert reference_losses({"code_text_document": 1.5, paths[0]: 2}, paths) == [2.0, 1.5]
    (tmp_path / "ref.json").write_text(json.dumps({"web_text_document": 2.25, "code_text_document": 0.5}))
    (tmp_path / "ref.yaml").write_text("- 3.0\n- 0.25\n")
    assert reference_losses(str(tmp_path / "ref.json"), paths) == [2.25, 0.5]
    assert reference_losses(str(tmp_path / "ref.yaml"), paths) == [3.0, 0.25]
    bad = [
        (None, "required with data.dynamic_data_selection"),
        ([1.0], "1 losses for 2 domains"),
        ({"web_text_document": 1.0}, "no reference loss for domain 'code_text_document'"),
        ({"web": 1.0, "code_text_document": 1.0}, "unknown domain 'web'"),
        ([1.0, -2], r"reference_losses\[1\]: a reference loss must be a finite number >= 0"),
        (str(tmp_path / "missing.json"), "file not found"),
    ]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message):
            reference_losses(value, paths)


def _cfg(**data):
    return {"model": {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2},
            "data": {"dynamic_data_selection": "sheared_llama", **data}}


@pytest.mark.parametrize("data, message", [
    ({"data_prefix": [1, "a"], "dynamic_selection": {"reference_losses": [1.0]}}, "at least two domains"),
    ({"data_prefix": {"train": [1, "a", 1, "b"]}}, "use data_prefix: \\[w1, path1"),
    ({"data_prefix": [1, "a", 1, "b"], "dynamic_selection": {"reference_losses": [1.0, 2.0, 3.0]}},
     "data.dynamic_selection.reference_losses: 3 losses for 2 domains"),
    ({"datasets": ["a", "b", "c"], "weights": [1, 2]}, "data.weights has 2 entries but data.datasets has 3"),
    ({"use_dummy_dataset": True}, "this config's data is 'dummy'"),
])
def test_bad_selection_configs_are_one_line(data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_cfg(**data), world_size=1, check=True)


# ----------------------------------------------------------------------------- two in-process runs

STEPS, INTERVAL = 8, 3
REFERENCE = {"noise": 0.0, "pattern": 50.0}  # noise always above its reference, pattern never


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from nxdt.exp.exp_manager import close_rank_log_file
    from nxdt.tools.train import main

    root = tmp_path_factory.mktemp("dynamic")
    rng = np.random.RandomState(0)
    _indexed(root / "noise", [rng.randint(3, 8000, size=rng.randint(20, 60)) for _ in range(200)])
    _indexed(root / "pattern", [np.tile(np.arange(10, 30), 3) for _ in range(200)])
    (root / "ref.json").write_text(json.dumps(REFERENCE))

    def train(log_dir, *extra):
        argv = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                f"trainer.max_steps={STEPS}", "model.optim.sched.warmup_steps=1", "trainer.val_check_interval=100",
                f"data.data_prefix=[1,{root / 'noise'},1,{root / 'pattern'}]", "data.splits_string='90,10,0'",
                "data.num_workers=1",  # a worker prefetching ahead of the step: the weights must wait for it
                "data.dynamic_data_selection=sheared_llama", f"data.dynamic_selection.update_interval={INTERVAL}",
                f"data.dynamic_selection.reference_losses={root / 'ref.json'}", "data.dynamic_selection.eta=0.5",
                "exp_manager.create_checkpoint_callback=true", "exp_manager.checkpoint_callback_params.save_top_k=-1",
                "exp_manager.checkpoint_callback_params.every_n_train_steps=4",
                f"exp_manager.explicit_log_dir={log_dir}", *extra]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main_guard(main)(argv)
        assert not rc, out.getvalue()[-3000:]
        return read_scalars(log_dir)

    environ = dict(os.environ)
    try:
        whole = train(root / "whole")
        ckpt = root / "whole" / "checkpoints" / "tiny_llama--step=4-consumed_samples=32.0"
        resumed = train(root / "resumed", f"exp_manager.resume_from_checkpoint={ckpt}")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        close_rank_log_file()
        logging.captureWarnings(False)
    return whole, resumed


def test_the_domain_above_its_reference_gains_weight_as_the_formula_says(runs):
    whole, _ = runs
    w = {name: whole[f"data/weight/{name}"] for name in REFERENCE}
    loss = {name: whole[f"data/loss/{name}"] for name in REFERENCE}
    updates = [s for s in range(1, STEPS + 1) if s % INTERVAL == 0 and s < STEPS]
    assert sorted(loss["noise"]) == updates  # logged at the update steps (steps done)
    assert w["noise"][1] == pytest.approx(0.5, abs=1e-7)
    lookahead = 1 + 2 * 1  # Lightning's prefetch + 2 batches of the one worker
    weights = np.array([0.5, 0.5])
    for step in range(STEPS):  # step = the 0-based step the weights drew
        for s in updates:
            if step == s + lookahead:  # the update measured after s steps draws from here on
                losses = [loss[name][s] for name in REFERENCE]
                weights = updated_weights(weights, losses, list(REFERENCE.values()), eta=0.5, smoothing=1e-4)
                assert losses[0] > 5.0  # the noise domain stays far above 0
        np.testing.assert_allclose([w["noise"][step + 1], w["pattern"][step + 1]], weights, rtol=2e-7)
    assert w["noise"][STEPS] > 0.9


def test_a_resumed_run_continues_bit_for_bit(runs):
    whole, resumed = runs
    tags = ["reduced_train_loss", "data/weight/noise", "data/weight/pattern", "data/loss/noise"]
    for tag in tags:
        later = {s: v for s, v in whole[tag].items() if s > 4}  # after the checkpoint at step 4
        assert later and resumed[tag] == later, tag


def test_data_datasets_with_selection_state_round_trip(tmp_path):
    """data.datasets (fms-fsdp) under dynamic selection: held-out batches are this rank's slice of fixed
    samples, and the checkpointed state carries the weight schedule into a module on another rank count."""
    from nxdt.data.select import build_datamodule, datamodule_kind

    rng = np.random.RandomState(1)
    for name in ("a", "b"):
        _indexed(tmp_path / name, [rng.randint(3, 900, size=rng.randint(20, 40)) for _ in range(60)])
    cfg = config_from_dict({
        "seed": 7, "trainer": {"max_steps": 6, "val_check_interval": 6},
        "data": {"seq_length": 16, "micro_batch_size": 2, "global_batch_size": 4, "num_workers": 0,
                 "splits_string": "80,20,0", "datasets": [str(tmp_path / "a"), str(tmp_path / "b")], "weights": [3, 1],
                 "dynamic_data_selection": "sheared_llama",
                 "dynamic_selection": {"reference_losses": {"a": 1.0, "b": 2.0}, "eval_batches": 2}}})
    assert datamodule_kind(cfg) == "logical_shards"

    two = [build_datamodule(build_spec(cfg), fake_trainer(r, 2)) for r in (0, 1)]
    for dm in two:
        batches = iter(dm.train_dataloader())
        next(batches), next(batches)  # steps 0 and 1 drawn (and trained)
    one = build_datamodule(build_spec(cfg), fake_trainer(0, 1))
    one.setup("fit")
    halves = [dm.heldout_batches(1) for dm in two]
    whole = one.heldout_batches(1)
    assert len(whole) == 2 and whole[0]["input_ids"].shape == (4, 16)
    for b in range(2):  # rank 0 and rank 1 hold the two halves of the same fixed global batch
        assert (np.concatenate([h[b]["input_ids"].numpy() for h in halves]) == whole[b]["input_ids"].numpy()).all()
    assert two[0].selection.schedule.weights_at(0).tolist() == [0.75, 0.25]
    new = two[0].update_selection([4.0, 1.0], steps_done=2)  # only 'a' is above its reference
    np.testing.assert_allclose(new, updated_weights([0.75, 0.25], [4.0, 1.0], [1.0, 2.0], 1.0, 1e-4))
    ahead = build_datamodule(build_spec(cfg), fake_trainer(0, 1))
    list(ahead.train_dataloader())  # a loader that drew every step already: an update would come too late
    with pytest.raises(RuntimeError, match="the loader drew step 5 before the weights for step 3 were known"):
        ahead.update_selection([4.0, 1.0], steps_done=2)
    for dm in two:
        dm.trainer.lightning_module.consumed_samples = 8
    state = two[0].state_dict()
    assert state["selection"]["schedule"] == [[0, [0.75, 0.25]], [3, new.tolist()]]
    resumed = build_datamodule(build_spec(cfg), fake_trainer(0, 1, consumed=8))
    resumed.load_state_dict(state)
    keys = list(resumed.train_dataloader().batch_sampler)
    assert [[d for d, _, _ in batch] for batch in keys] == [
        resumed.selection.draw.domains(s).tolist() for s in range(2, 6)]
    assert resumed.selection.schedule.weights_at(3).tolist() == new.tolist()


def test_prob_map_presets_weigh_the_domains_by_name():
    """LLaMA-MoE's --prob_map presets (data.prob_map) and its reference losses (llama2_7b_slimpajama), matched
    to the datasets by SlimPajama domain: a folder named after it, or Megatron's <domain>_text_document."""
    from nxdt.spec.data import data_blend, reference_losses

    def data(**extra):
        return config_from_dict({"data": {"datasets": ["/d/en_cc", "/d/github_text_document", "/d/en_book"],
                                          **extra}}).data

    blend = data_blend(data(prob_map="sheared_llama"))
    assert blend.blend == ((0.361, "/d/en_cc"), (0.008, "/d/github_text_document"), (0.091, "/d/en_book"))
    assert [w for w, _ in data_blend(data(prob_map="llama")).blend] == [0.67, 0.045, 0.045]
    assert reference_losses("llama2_7b_slimpajama", ["/d/en_cc", "/d/github_text_document", "/d/en_book"]) == [
        REF_LOSS["en_cc"], REF_LOSS["github"], REF_LOSS["en_book"]]
    with pytest.raises(ConfigError, match="data.prob_map llama: dataset 'web' is not a SlimPajama domain"):
        data_blend(config_from_dict({"data": {"datasets": ["/d/en_cc", "/d/web"], "prob_map": "llama"}}).data)
    with pytest.raises(ConfigError, match=r"data.prob_map \(uniform\) sets the blend's weights: remove data.weights"):
        data_blend(config_from_dict({"data": {"datasets": ["/d/en_cc", "/d/github"], "weights": [1, 2],
                                              "prob_map": "uniform"}}).data)
