"""Fine-tuning runs end to end (examples/train.py's entry, one process, one launch): LoRA from a
pre-trained checkpoint with adapter-only checkpoints that resume bit for bit, merge_lora's merged
model, a DPO run resumed bit for bit with its reference log-probs taken from the checkpoint, an SFT
run resumed bit for bit, and a
tiny DPO run that learns the corpus-derived preferences (reward accuracy above 0.9).

A restarted fine-tuning run (resume_from_checkpoint = the pre-trained start, weight_init_only,
resume_if_exists) continues from its own newest checkpoint; when that holds adapters only, the
frozen base comes from the pre-trained start again. The schedule's length is fixed
(sched.max_steps=6), so a run stopped at step 3 and restarted follows the uninterrupted run. The
LoRA, DPO and SFT fine-tunes' second halves are the `resume` commands their first halves printed,
pasted as a user would (nxdt.tools.next_steps).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, TINY_OVERRIDES, read_scalars, run_pool, tensor_bytes, train_in_process
from conftest import curve as _curve

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.exp.exp_manager import close_rank_log_file
from nxdt.models.lora import merged_state_dict
from nxdt.tools.preference_data import make_preference_rows, read_chapters, write_jsonl

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
LORA = [f"+model_alignment_strategy.peft.lora_rank={RANK}", f"+model_alignment_strategy.peft.lora_alpha={ALPHA}",
        "+model_alignment_strategy.peft.lora_dropout=0",
        "+model_alignment_strategy.peft.target_modules=[qkv_proj,o_proj,gate_up_proj,down_proj]"]
CKPT_EVERY_3 = ["exp_manager.create_checkpoint_callback=true", "exp_manager.checkpoint_callback_params.save_top_k=-1",
                "exp_manager.checkpoint_callback_params.every_n_train_steps=3", "exp_manager.resume_if_exists=true",
                "exp_manager.resume_ignore_no_checkpoint=true"]
NAME = "tiny_llama--step={step}-consumed_samples={samples}.0"  # tiny_llama_cpu's filename, global batch 8


def _args(log_dir: Path, steps: int, extra=()) -> list[str]:
    overrides = [*TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={steps}", "model.optim.sched.max_steps=6",
                 "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "model.optim.lr=1e-2",
                 "model.optim.sched.warmup_steps=1", f"exp_manager.explicit_log_dir={log_dir}", *extra]
    last = {o.split("=", 1)[0]: o for o in overrides}  # a later override of a key replaces the earlier one
    return ["--config-name", "tiny_llama_cpu", *last.values()]


@pytest.fixture(scope="module")
def runs(kjv_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("finetuning")
    pretrain = [f"data.data_prefix=[1.0,{kjv_prefix}]"]
    base = root / "base" / "checkpoints" / NAME.format(step=2, samples=16)
    start = [*pretrain, *LORA, f"exp_manager.resume_from_checkpoint='{base}'", "model.weight_init_only=true",
             *CKPT_EVERY_3, "+model_alignment_strategy.peft.merge_lora=true"]
    preference = root / "preference.jsonl"
    write_jsonl(make_preference_rows(read_chapters(CORPUS), 16, prompt_words=6, response_words=6), preference)
    rows = [f"data.train_dir={preference}", f"data.val_dir={preference}", "data.data_prefix=null"]
    dpo = [*rows, "+model_alignment_strategy.dpo.kl_beta=0.1", *CKPT_EVERY_3]
    # DPO fine-tunes the pre-trained model, started as documented (weights only)
    dpo_ft = [*dpo, f"exp_manager.resume_from_checkpoint='{base}'", "model.weight_init_only=true"]
    sft_rows = root / "sft.jsonl"  # input / output rows from the corpus: 3 to 14 answer words each
    words = [word for _, chapter in read_chapters(CORPUS)[:3] for word in chapter]
    sft_rows.write_text("".join(json.dumps({"input": " ".join(words[12 * i:12 * i + 4]),
                                            "output": " ".join(words[12 * i + 4:12 * i + 7 + i % 6])}) + "\n"
                                for i in range(32)))
    sft = [f"data.train_dir={sft_rows}", f"data.val_dir={sft_rows}", "data.data_prefix=null",
           "+model_alignment_strategy.sft.packing=false", *CKPT_EVERY_3,
           f"exp_manager.resume_from_checkpoint='{base}'", "model.weight_init_only=true"]
    jobs = {
        "base": _args(root / "base", 2, [*pretrain, "exp_manager.create_checkpoint_callback=true"]),
        "lora_whole": _args(root / "lora_whole", 6, start),
        "lora_first": _args(root / "lora_split", 3, start),
        "dpo_whole": _args(root / "dpo_whole", 6, dpo_ft),
        "dpo_first": _args(root / "dpo_split", 3, dpo_ft),
        "sft_whole": _args(root / "sft_whole", 6, sft),
        "sft_first": _args(root / "sft_split", 3, sft),
        # 16 rows, 2 passes a step: the policy soon prefers every true continuation
        # bf16 compute with fp32 masters (the adapters'), the reference from the base with adapters off
        "dpo_lora_bf16": _args(root / "dpo_lora_bf16", 2, [*dpo, *LORA, "precision.type=mixed_precision",
                                                           "+model_alignment_strategy.dpo.precompute_ref_log_probs=false",
                                                           "exp_manager.create_checkpoint_callback=false"]),
        "orpo_bf16sr": _args(root / "orpo_bf16sr", 2, [*rows, "precision.type=bf16SR",
                                                       "+model_alignment_strategy.orpo.beta=0.1"]),
        "dpo_learns": _args(root / "dpo_learns", 12, [*dpo, "trainer.log_every_n_steps=1",
                                                      "model.optim.sched.max_steps=12", "data.global_batch_size=16",
                                                      "data.micro_batch_size=8"]),
    }
    procs = run_pool(jobs, 1, root / "pool")
    out = {name: (proc.stdout, read_scalars(root / name) if (root / name).is_dir() else None)
           for name, proc in procs.items()}
    for name in ("lora", "dpo", "sft"):  # the second half: the resume command the first half printed, pasted
        pasted = _printed_resume(out[f"{name}_first"][0])
        rest = train_in_process(pasted)
        close_rank_log_file()
        assert rest.rc == 0, rest.err[-3000:]
        out[f"{name}_rest"] = (rest.out, None)
        out[f"{name}_pasted"] = (pasted, None)
    return root, base, out


def _printed_resume(out: str) -> list[str]:
    """The overrides of the `resume` command a run printed (from --config-name on), as a shell reads them."""
    lines = [line for line in out.splitlines() if line.startswith("resume       ")]
    assert len(lines) == 1, out[-3000:]
    words = shlex.split(lines[0].removeprefix("resume"))
    return words[words.index("--config-name"):]


def test_lora_from_a_pretrained_start_resumes_bit_for_bit_from_adapter_only_checkpoints(runs):
    root, base, out = runs
    whole, split = read_scalars(root / "lora_whole"), read_scalars(root / "lora_split")
    assert _curve(split) == _curve(whole) and len(_curve(whole)) == 6  # bitwise
    assert f"loaded weights from {base}" in out["lora_first"][0]
    rest = out["lora_rest"][0]
    assert "resuming this run's checkpoint" in rest and f"loaded the LoRA base weights from {base}" in rest
    # the pasted command: the run's own, its base and weight_init_only kept, in its log dir, resume_if_exists
    pasted = out["lora_pasted"][0]
    assert [a for a in pasted if a.startswith(("exp_manager.resume", "model.weight_init_only", "trainer.max_steps",
                                               "exp_manager.explicit_log_dir"))] == [
        f"exp_manager.resume_from_checkpoint='{base}'", "model.weight_init_only=true",
        "exp_manager.resume_ignore_no_checkpoint=true", f"exp_manager.explicit_log_dir={root / 'lora_split'}",
        "exp_manager.resume_if_exists=true", "trainer.max_steps=6"]
    evaluate = [line for line in out["lora_first"][0].splitlines() if line.startswith("evaluate ")]
    assert len(evaluate) == 1 and evaluate[0].endswith(f"evaluate --checkpoint {root / 'lora_split' / 'checkpoints' / NAME.format(step=3, samples=24)}")
    assert "trainable 9,344 of" in out["lora_whole"][0]  # the run summary's LoRA line
    # adapter-only: the model tensors of a checkpoint are exactly the adapters, r x (in + out) each
    # (hidden 64, kv 2 heads of 16, ffn 176): q, o 4x(64+64); k, v 4x(64+32); gate, up, down 4x(64+176)
    ckpt = root / "lora_split" / "checkpoints" / NAME.format(step=3, samples=24)
    per_layer = RANK * (2 * 128 + 2 * 96 + 3 * 240)
    assert tensor_bytes(ckpt)["model."] == 2 * per_layer * 4 == 9_344 * 4
    assert "LoRA adapters only, 0.04 MiB of model tensors" in out["lora_first"][0]


def test_merge_lora_writes_the_merged_model(runs):
    """The merged model = the pre-trained base with the final adapters folded in, as a weights
    checkpoint beside checkpoints/ (a start for the next run, or for nxdt convert)."""
    root, base, out = runs
    final = root / "lora_whole" / "checkpoints" / NAME.format(step=6, samples=48)
    merged_path = root / "lora_whole" / "lora_merged" / final.name
    assert f"merged model (LoRA folded into the base): {merged_path}" in out["lora_whole"][0]
    merged = load_weights(merged_path)
    expected = merged_state_dict({**load_weights(base), **load_weights(final)}, (RANK, ALPHA))
    assert sorted(merged) == sorted(expected) and not any(".lora_" in k for k in merged)
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           load_weights(base)["model.layers.0.self_attn.q_proj.weight"])


def test_dpo_resumes_bit_for_bit_with_its_reference_from_the_checkpoint(runs):
    root, _, out = runs
    whole, split = read_scalars(root / "dpo_whole"), read_scalars(root / "dpo_split")
    for tag in ("reduced_train_loss", "rewards/margins", "rewards/accuracies", "rewards/chosen"):
        assert _curve(split, tag) == _curve(whole, tag), tag
    assert _curve(whole)[0] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference at step 0: log 2
    assert "reference log-probs (train): 16/16 rows" in out["dpo_first"][0]
    assert "resuming this run's checkpoint" in out["dpo_rest"][0] and "reference log-probs" not in out["dpo_rest"][0]
    # DPO checkpoints are not evaluable by `nxdt evaluate` (a preference loss): no evaluate line
    assert not [line for line in out["dpo_first"][0].splitlines() if line.startswith("evaluate ")]


def test_sft_from_a_pretrained_start_continues_bit_for_bit_with_the_printed_command(runs):
    root, _, out = runs
    whole, split = read_scalars(root / "sft_whole"), read_scalars(root / "sft_split")
    assert _curve(split) == _curve(whole) and len(_curve(whole)) == 6  # bitwise
    assert "resuming this run's checkpoint" in out["sft_rest"][0]
    assert [line for line in out["sft_first"][0].splitlines() if line.startswith("evaluate ")]


def test_a_tiny_dpo_run_learns_the_preferences(runs):
    """The reward margin rises and the reward accuracy passes 0.9 on the corpus-derived pairs."""
    root, _, _ = runs
    scalars = read_scalars(root / "dpo_learns")
    accuracy, margins = _curve(scalars, "rewards/accuracies"), _curve(scalars, "rewards/margins")
    assert len(accuracy) == 12 and margins[0] == pytest.approx(0.0, abs=1e-6)
    assert min(accuracy[-3:]) > 0.9, accuracy
    assert margins[-1] > margins[5] > 0.1, margins


def test_preference_losses_train_under_the_bf16_presets(runs):
    """DPO + LoRA under mixed_precision (reference: the bf16 base, adapters off) and ORPO under bf16SR
    run, log finite losses and their metrics."""
    import math

    root, _, out = runs
    for name, tags in (("dpo_lora_bf16", ("rewards/accuracies", "rewards/margins")),
                       ("orpo_bf16sr", ("nll_loss", "log_odds_ratio"))):
        scalars = read_scalars(root / name)
        losses = _curve(scalars)
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses), (name, losses)
        assert all(len(_curve(scalars, tag)) == 2 for tag in tags), (name, sorted(scalars))
    assert "precision=mixed_precision" in out["dpo_lora_bf16"][0] and "precision=bf16SR" in out["orpo_bf16sr"][0]
