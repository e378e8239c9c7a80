"""`nxdt evaluate` and the evaluate-only mode (trainer.max_epochs=0), end to end.

A tiny Llama trains 4 steps in this process (the product's entry, `nxdt train`) and saves a
checkpoint; a LoRA run continues from it with adapter-only checkpoints. Then:
- `nxdt evaluate` in one process: the JSON beside the checkpoint, perplexity = exp(loss), and the
  loss equal (1e-5) to a direct computation: the weights read with `load_weights` into a model from
  `build_model`, the per-token cross entropy summed over the same validation batches / their tokens;
  the same on SFT rows (prompt tokens masked: every micro-batch has its own number of loss tokens,
  so a mean of micro-batch means would differ from the token-weighted loss);
- other layouts give the same numbers (1e-5): one torchrun launch (2 ranks, gloo) evaluates the
  checkpoint on SFT rows with dp2, tp2, pp2, FSDP and cp2 in turn (tests/run_pool.py);
- the LoRA checkpoint (adapters only, base from the run's resume_from_checkpoint) evaluates to the
  loss its run validated with at its last step;
- trainer.max_epochs=0 on the training command line gives the same JSON numbers, from the run's
  newest checkpoint (resume_if_exists: the .eval.json beside it is not taken for a checkpoint);
- bad input is one line, exit 2, before anything runs.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import CORPUS, TINY_OVERRIDES, read_scalars, run_pool

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.checkpoint.retention import complete_checkpoints, to_keep
from nxdt.cli import main as nxdt
from nxdt.data.select import build_datamodule
from nxdt.spec import build_spec
from nxdt.exp.exp_manager import close_rank_log_file
from nxdt.models import build_model, logits_of
from nxdt.tools.evaluate import load_checkpoint_config

STEPS = 4
TOL = 1e-5
NAME = "tiny_llama--step={step}-consumed_samples={samples}.0"  # tiny_llama_cpu's filename, global batch 8
LORA = ["+model_alignment_strategy.peft.lora_rank=4", "+model_alignment_strategy.peft.lora_alpha=8",
        "+model_alignment_strategy.peft.lora_dropout=0",
        "+model_alignment_strategy.peft.target_modules=[qkv_proj,o_proj,gate_up_proj,down_proj]"]
TP2 = "distributed_strategy.tensor_model_parallel_size=2"
LAYOUTS = {
    "dp2": [],
    "tp2_sp": [TP2, "distributed_strategy.sequence_parallel=true"],
    "pp2": ["distributed_strategy.pipeline_model_parallel_size=2"],
    "fsdp_dp2": ["distributed_strategy.sharding_strategy=FSDP"],
    "cp2": ["distributed_strategy.context_parallel_size=2"],
}


def _train_args(log_dir: Path, extra=()) -> list[str]:
    overrides = [*TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={STEPS}",
                 f"trainer.val_check_interval={STEPS}",
                 "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "model.optim.lr=1e-2",
                 "model.optim.sched.warmup_steps=1", "exp_manager.create_checkpoint_callback=true",
                 f"exp_manager.explicit_log_dir={log_dir}", *extra]
    last = {o.split("=", 1)[0]: o for o in overrides}  # a later override of a key replaces the earlier one
    return ["--config-name", "tiny_llama_cpu", *last.values()]


def _nxdt(*argv) -> int:
    """`nxdt ...` in this process: the exit status (bad input ends in SystemExit(2) via main_guard).
    The environment is restored afterwards: Lightning leaves MASTER_PORT & co. in it, which later
    tests' subprocesses would inherit (a port that may be taken by then)."""
    environ = dict(os.environ)
    try:
        return int(nxdt([str(a) for a in argv]) or 0)
    except SystemExit as stop:
        return int(stop.code)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _sft_rows(path: Path, n: int = 48) -> list[str]:
    """SFT rows from the corpus whose outputs have 3..14 words: each micro-batch its own token count.
    Returns the overrides that evaluate on them."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as corpus:
        words = " ".join(json.loads(next(corpus))["text"] for _ in range(3)).split()
    rows, at = [], 0
    for i in range(n):
        k = 3 + (i * 7) % 12
        rows.append(json.dumps({"input": " ".join(words[at:at + 4]), "output": " ".join(words[at + 4:at + 4 + k])}))
        at += 4 + k
    path.write_text("\n".join(rows) + "\n")
    return [f"data.train_dir={path}", f"data.val_dir={path}", f"data.test_dir={path}",
            "+model_alignment_strategy.sft.packing=false"]


@pytest.fixture(scope="module")
def trained(kjv_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    data = [f"data.data_prefix=[1.0,{kjv_prefix}]"]
    assert _nxdt("train", *_train_args(root / "run", data)) == 0
    ckpt = root / "run" / "checkpoints" / NAME.format(step=STEPS, samples=8 * STEPS)
    lora_run = root / "lora"
    assert _nxdt("train", *_train_args(lora_run, [*data, *LORA, f"exp_manager.resume_from_checkpoint='{ckpt}'",
                                                   "model.weight_init_only=true"])) == 0
    lora_ckpt = lora_run / "checkpoints" / NAME.format(step=STEPS, samples=8 * STEPS)
    sft = _sft_rows(root / "sft.jsonl")
    yield SimpleNamespace(root=root, ckpt=ckpt, lora_run=lora_run, lora_ckpt=lora_ckpt, sft=sft)
    # the in-process runs' log file (and warnings routed to it) end with this module
    close_rank_log_file()
    logging.captureWarnings(False)


def _evaluate(ckpt: Path, *overrides: str) -> dict:
    assert _nxdt("evaluate", "--checkpoint", ckpt, *overrides) == 0
    return json.loads(ckpt.with_name(ckpt.name + ".eval.json").read_text())


@torch.no_grad()
def _direct(ckpt: Path, overrides: list[str], split: str, batches: int) -> tuple[float, int]:
    """Token-weighted cross entropy of the checkpoint's weights over the first `batches` global batches
    of a split, computed here with a plain model (one process, no Lightning, no nxdt loss code)."""
    cfg = load_checkpoint_config(ckpt, overrides)
    dm = build_datamodule(build_spec(cfg), None)
    dm.setup()
    model = build_model(cfg, dm.vocab_size)
    model.load_state_dict(load_weights(ckpt))
    model.eval()
    loader = dm.val_dataloader() if split == "validation" else dm.test_dataloader()
    total, tokens = 0.0, 0
    for i, batch in enumerate(loader):
        if i == batches:
            break
        logits = logits_of(model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")))
        per_token = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none")
        mask = batch["loss_mask"].flatten().double()
        total += float((per_token.double() * mask).sum())
        tokens += int(mask.sum())
    return total / tokens, tokens


@pytest.fixture(scope="module")
def megatron_result(trained):
    return _evaluate(trained.ckpt)


@pytest.fixture(scope="module")
def sft_result(trained):
    return _evaluate(trained.ckpt, *trained.sft)


def test_evaluate_one_process_equals_a_direct_computation(trained, megatron_result):
    result = megatron_result
    assert result["step"] == STEPS and result["consumed_samples"] == 8 * STEPS
    assert result["layout"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1}
    assert set(result["splits"]) == {"validation", "test"}
    for split, r in result["splits"].items():
        assert math.isfinite(r["loss"]) and r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
        assert r["batches"] == 2 and r["tokens"] == 2 * 8 * 32  # limit 2 global batches of 8 x 32 tokens
        loss, tokens = _direct(trained.ckpt, [], split, 2)
        assert tokens == r["tokens"] and abs(r["loss"] - loss) < TOL, (split, r, loss)


def test_token_weighted_on_sft_rows(trained, sft_result):
    """Micro-batches with different numbers of loss tokens: the loss is sum / tokens, not a mean of means."""
    r = sft_result["splits"]["validation"]
    loss, tokens = _direct(trained.ckpt, trained.sft, "validation", 2)
    assert r["tokens"] == tokens and abs(r["loss"] - loss) < TOL, (r, loss)


def test_a_split_without_data_is_left_out(trained):
    result = _evaluate(trained.ckpt, "data.splits_string='98,0,2'")  # no validation documents
    assert set(result["splits"]) == {"test"} and result["splits"]["test"]["tokens"] == 2 * 8 * 32


@pytest.mark.slow
def test_other_layouts_give_the_same_numbers(trained, sft_result):
    links = {}
    for name in LAYOUTS:  # each layout writes beside its own link: <layout>/<checkpoint>.eval.json
        (trained.root / name).mkdir(exist_ok=True)
        links[name] = trained.root / name / trained.ckpt.name
        if not links[name].exists():
            links[name].symlink_to(trained.ckpt, target_is_directory=True)
    jobs = {name: ["--checkpoint", str(links[name]), *trained.sft, *extra] for name, extra in LAYOUTS.items()}
    procs = run_pool(jobs, 2, trained.root / "pool", entry="nxdt.tools.evaluate")
    reference = sft_result["splits"]
    for name, link in links.items():
        result = json.loads(link.with_name(link.name + ".eval.json").read_text())
        assert result["layout"]["world_size"] == 2, (name, result["layout"])
        for split, r in result["splits"].items():
            assert r["tokens"] == reference[split]["tokens"], (name, split)
            assert abs(r["loss"] - reference[split]["loss"]) < TOL, (name, split, r, reference[split])
        assert "evaluated" in procs[name].stdout
    assert json.loads((trained.root / "pp2" / (trained.ckpt.name + ".eval.json")).read_text())["layout"]["pp"] == 2


def test_a_run_folder_of_a_tensor_parallel_run_evaluates_in_one_process(trained, megatron_result, tmp_path, capsys):
    """`--checkpoint RUN_DIR`: its newest complete checkpoint (a newer, incomplete one skipped), named in
    one line; a run saved with tp 2 + sequence parallel evaluates in one process with the whole model
    (on main: "... does not divide the world size 1"), to the numbers of the one-process run."""
    from omegaconf import OmegaConf

    ckpts = tmp_path / "run" / "checkpoints"
    chosen = ckpts / trained.ckpt.name
    shutil.copytree(trained.ckpt, chosen)
    saved = OmegaConf.load(chosen / "config.yaml")
    saved.distributed_strategy.tensor_model_parallel_size = 2
    saved.distributed_strategy.sequence_parallel = True
    OmegaConf.save(saved, chosen / "config.yaml")
    unfinished = ckpts / NAME.format(step=2 * STEPS, samples=16 * STEPS)
    shutil.copytree(chosen, unfinished)
    (unfinished / "COMPLETE").unlink()
    capsys.readouterr()
    assert _nxdt("evaluate", "--checkpoint", tmp_path / "run") == 0
    err = capsys.readouterr().err
    assert f"note: checkpoint {chosen} (the newest complete one in {tmp_path / 'run'}; 1 incomplete skipped)" in err
    assert "tensor_model_parallel_size 2 -> 1, sequence_parallel True -> false" in err
    result = json.loads(chosen.with_name(chosen.name + ".eval.json").read_text())
    assert result["layout"]["world_size"] == 1 and result["layout"]["tp"] == 1
    for split, r in megatron_result["splits"].items():
        assert abs(result["splits"][split]["loss"] - r["loss"]) < TOL and result["splits"][split]["tokens"] == r["tokens"]


def test_a_transformers_folder_starts_a_run_and_is_evaluated(trained, megatron_result, kjv_prefix, tmp_path):
    """exp_manager.resume_from_checkpoint=HF_DIR model.weight_init_only=true (on main: "is incomplete: file
    .../COMPLETE is missing"): the checkpoint's nxdt-to-hf export evaluates (`nxdt evaluate --checkpoint
    HF_DIR --config-name NAME`, i.e. trainer.max_epochs=0 from those weights) to the checkpoint's own numbers, and a run trained from it takes its first step on those weights (the loss
    of a run started from the checkpoint itself)."""
    from nxdt.tools.convert import nxdt_to_hf

    hf = tmp_path / "hf"
    nxdt_to_hf(trained.ckpt, hf, max_shard_bytes=10**9)
    start = [f"data.data_prefix=[1.0,{kjv_prefix}]", "model.weight_init_only=true"]
    # nxdt evaluate --checkpoint HF_DIR --config-name NAME ...: the training command line's evaluate-only mode
    assert _nxdt("evaluate", "--checkpoint", hf, *_train_args(tmp_path / "eval", start[:1])) == 0
    result = json.loads((tmp_path / "hf.eval.json").read_text())
    for split, r in megatron_result["splits"].items():
        assert abs(result["splits"][split]["loss"] - r["loss"]) < TOL, split
    losses = {}
    for name, weights in (("from_hf", hf), ("from_ckpt", trained.ckpt)):
        argv = _train_args(tmp_path / name, [*start, f"exp_manager.resume_from_checkpoint='{weights}'",
                                              "trainer.max_steps=1", "exp_manager.create_checkpoint_callback=false"])
        assert _nxdt("train", *argv) == 0
        losses[name] = read_scalars(tmp_path / name)["reduced_train_loss"]
    # the trained weights, not a fresh init (whose loss is about ln(8192) = 9.0)
    assert losses["from_hf"] == losses["from_ckpt"] and losses["from_hf"][1] < 8.0


def test_lora_adapter_only_checkpoint(trained):
    """The adapters from the checkpoint, the base from the run's resume_from_checkpoint: the loss the
    LoRA run validated with at its last step (same weights, same batches)."""
    meta = json.loads((trained.lora_ckpt / "meta.json").read_text())
    assert meta["lora"]["adapter_only"]
    result = _evaluate(trained.lora_ckpt)
    assert result["lora_base"] == str(trained.ckpt)
    val_loss = read_scalars(trained.lora_run)["val_loss"]
    assert abs(result["splits"]["validation"]["loss"] - val_loss[max(val_loss)]) < TOL


def test_evaluate_only_mode_gives_the_same_numbers(trained, megatron_result, kjv_prefix):
    # the newest checkpoint of the run (resume_if_exists), with the .eval.json files beside it
    found = complete_checkpoints(trained.ckpt.parent)
    assert [p for _, p in found] == [trained.ckpt]
    assert to_keep(found, 1, "step", "max") == {trained.ckpt}
    argv = _train_args(trained.root / "run", [f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.max_epochs=0",
                                              "exp_manager.resume_if_exists=true"])
    assert _nxdt("train", *argv) == 0
    result = json.loads(trained.ckpt.with_name(trained.ckpt.name + ".eval.json").read_text())
    for split, r in megatron_result["splits"].items():
        assert result["splits"][split] == r, split
    assert not any(p.name.endswith(".eval.json") for p in trained.ckpt.iterdir())  # never inside it


def _one_line_error(capsys, *argv) -> str:
    code = _nxdt(*argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def test_bad_input_is_one_line_exit_2(trained, tmp_path, capsys, kjv_prefix):
    ckpt = trained.ckpt
    assert "does not exist" in _one_line_error(capsys, "evaluate", "--checkpoint", tmp_path / "nope")
    incomplete = tmp_path / "incomplete"
    shutil.copytree(ckpt, incomplete)
    (incomplete / "COMPLETE").unlink()
    assert "is incomplete" in _one_line_error(capsys, "evaluate", "--checkpoint", incomplete)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "COMPLETE").write_text("{}")
    (foreign / "meta.json").write_text("{}")
    assert "not an nxdt checkpoint" in _one_line_error(capsys, "evaluate", "--checkpoint", foreign)
    no_config = tmp_path / "no_config"
    shutil.copytree(ckpt, no_config)
    (no_config / "config.yaml").unlink()
    assert "has no config.yaml" in _one_line_error(capsys, "evaluate", "--checkpoint", no_config)
    line = _one_line_error(capsys, "evaluate", "--checkpoint", ckpt, "trainer.limit_val_bathces=3")
    assert "trainer.limit_val_bathces" in line and "trainer.limit_val_batches" in line  # did you mean
    assert "--checkpoint" in _one_line_error(capsys, "evaluate", "trainer.devices=1")
    line = _one_line_error(capsys, "evaluate", "--checkpoint", ckpt, "trainer.limit_val_batches=0",
                           "trainer.limit_test_batches=0")
    assert "nothing to evaluate" in line
    # no validation and no test documents: found once the data is read; still one line
    line = _one_line_error(capsys, "evaluate", "--checkpoint", ckpt, "data.splits_string='100,0,0'")
    assert "no validation or test data" in line
    # evaluate only, with nothing to evaluate: refused, never random weights
    argv = _train_args(tmp_path / "fresh", [f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.max_epochs=0"])
    assert "no weights to evaluate" in _one_line_error(capsys, "train", *argv)
    argv = _train_args(tmp_path / "fresh", [f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.max_epochs=0",
                                            "exp_manager.resume_if_exists=true"])
    assert "no complete checkpoint" in _one_line_error(capsys, "train", *argv)
    assert "trainer.max_epochs" in _one_line_error(capsys, "train", *_train_args(tmp_path, ["trainer.max_epochs=-2"]))
