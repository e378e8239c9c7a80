"""NxDT's release configs train, not only plan: each of tests/nxdt_release/ (the 22 files of NxDT's
last release and the 2 removed earlier, tests/nxdt_release/README.md), shrunk by command-line
overrides only (2 layers, hidden 64, 4 heads, tp 2 on 2 CPU ranks, short sequences, a small
global batch, 3 steps) and pointed at the bundled corpus, starts and trains 3 steps with a finite
loss. Everything else stays as the file ships it: optimizer (capturable included), precision
preset, schedule, activation checkpointing, sequence parallel, ZeRO-1, fusions, alignment method.

One 2-rank launch runs them all (conftest.run_pool): imports are paid once.

The HF Mixtral ones (`hf_mixtral_8x7b_config`, `hf_mixtral_8x7b_dropless_config`) run nxdt's MoE
block in transformers' Mixtral with their capacity factor (2.0; dropless), 8 experts each split
over the 2 tp ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import CORPUS, TINY_OVERRIDES, TOKENIZER_DIR, read_scalars, run_pool
from omegaconf import OmegaConf

from nxdt.tools.preference_data import make_preference_rows, read_chapters, write_jsonl
from test_nxdt_release import HF as RELEASE_HF
from test_nxdt_release import MEGATRON, MODEL_CONFIGS, RELEASE

STEPS = 3
HIDDEN, HEADS, FFN, SEQ = 64, 4, 128, 64

# config -> the shipped config.json (conf/model_configs/<folder>) its shrunk copy starts from
HF = dict(RELEASE_HF)
NAMES = sorted([*HF, *MEGATRON])
SFT = {"hf_llama3_8B_SFT_config", "hf_llama3_8B_SFT_lora_config", "hf_mistral_7B_SFT_config",
       "megatron_llama2_7B_SFT_config"}
PREFERENCE = {"hf_llama3_8B_DPO_config": "dpo", "hf_llama3_8B_ORPO_config": "orpo"}
# context parallel is what this config is about: it keeps cp 2 (on the 2 ranks, so tp 1)
CP = {"hf_llama3_70B_CP_config"}
# SFT written before model_alignment_strategy (NxDT 2.20): the override the plan names (tests/test_nxdt_release.py)
PREDATES_SFT = {"hf_mistral_7B_SFT_config", "megatron_llama2_7B_SFT_config"}


def test_every_release_config_is_run():
    assert NAMES == sorted(p.stem for p in RELEASE.glob("*.yaml"))
    assert len(NAMES) == 24


def _tiny_config_json(name: str, out: Path) -> Path:
    """The shipped config.json of the model, shrunk: its model type, rope and the rest kept."""
    js = json.loads((MODEL_CONFIGS / HF[name] / "config.json").read_text())
    kv = 2 if js["num_key_value_heads"] < js["num_attention_heads"] else HEADS  # GQA stays GQA, MHA stays MHA
    js.update(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=kv,
              num_hidden_layers=2, vocab_size=8192, bos_token_id=1, eos_token_id=2)
    path = out / f"{name}.json"
    path.write_text(json.dumps(js))
    return path


def _overrides(name: str, root: Path, kjv_prefix: str, sft: Path, preference: Path) -> list[str]:
    y = OmegaConf.load(RELEASE / f"{name}.yaml")
    ds, m = y.distributed_strategy, y.model
    out = ["trainer.devices=2", "trainer.num_nodes=1", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
           "trainer.enable_progress_bar=false", "distributed_strategy.tensor_model_parallel_size=2",
           "data.micro_batch_size=1", "data.global_batch_size=2", "data.num_workers=0",
           f"exp_manager.explicit_log_dir={root / name}", "exp_manager.create_checkpoint_callback=false",
           "model.num_layers=2", f"model.hidden_size={HIDDEN}", f"model.encoder_seq_length={SEQ}",
           f"model.max_position_embeddings={2 * SEQ}", f"data.seq_length={SEQ}"]
    if ds.get("pipeline_model_parallel_size", 1) > 1:
        out.append("distributed_strategy.pipeline_model_parallel_size=1")
        if m.get("pipeline_cuts"):  # hand-written cuts of the shipped pp
            out.append("model.pipeline_cuts=null")
    if name in CP:  # the config is about context parallel (ring attention): cp 2 on the 2 ranks, tp 1
        out += ["distributed_strategy.context_parallel_size=2", "distributed_strategy.tensor_model_parallel_size=1"]
    if name in HF:
        out.append(f"model.model_config={_tiny_config_json(name, root)}")
    else:
        kv = 2 if m.num_kv_heads < m.num_attention_heads else HEADS
        out += [f"model.ffn_hidden_size={FFN}", f"model.num_attention_heads={HEADS}", f"model.num_kv_heads={kv}"]
    out += [f"data.tokenizer.type={TOKENIZER_DIR}", "data.tokenizer.library=huggingface"]
    if name == "megatron_gpt_config":  # GPT-2's BPE files -> the bundled tokenizer
        out += ["data.tokenizer.vocab_file=null", "data.tokenizer.merge_file=null"]
    if y.exp_manager.get("resume_from_checkpoint"):  # the fine-tuning configs' pretrained checkpoint: none here
        out.append("exp_manager.resume_from_checkpoint=null")
    if m.get("weight_init_only"):  # ... and so no weights to start from
        out.append("model.weight_init_only=false")
    if name in SFT:
        out += [f"data.train_dir={sft}", f"data.val_dir={sft}"]
        if name in PREDATES_SFT:
            out.append("model_alignment_strategy.sft.packing=true")
    elif name in PREFERENCE:
        out += [f"data.train_dir={preference}", "data.val_dir=null",
                f"model_alignment_strategy.{PREFERENCE[name]}.max_prompt_length={SEQ // 2}"]
    else:
        out += [f"data.data_prefix=[1.0,{kjv_prefix}]"]
        if name in HF:
            out.append("data.train_dir=null")
    return out


@pytest.fixture(scope="module")
def runs(kjv_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("release_runs")
    chapters = read_chapters(CORPUS)
    preference = root / "preference.jsonl"
    rows = make_preference_rows(chapters, 16, prompt_words=6, response_words=6)
    write_jsonl(rows, preference)
    sft = root / "sft.jsonl"  # the preference rows' prompt and true continuation as input / output
    write_jsonl([{"input": r["prompt"], "output": r["chosen"]} for r in rows], sft)
    jobs = {name: ["--config-path", str(RELEASE), "--config-name", name,
                   *_overrides(name, root, kjv_prefix, sft, preference)] for name in NAMES}
    jobs[UNEVEN] = ["--config-name", "tiny_llama_cpu", *[o for o in TINY_OVERRIDES if not o.startswith("model.num_layers=")],
                    "model.num_layers=3", "trainer.devices=2", "distributed_strategy.pipeline_model_parallel_size=2",
                    "data.use_dummy_dataset=true", "trainer.max_steps=2", "model.optim.capturable=true",
                    f"exp_manager.explicit_log_dir={root / UNEVEN}"]
    procs = run_pool(jobs, 2, root / "pool", freeze=True)
    return {name: (procs[name], read_scalars(root / name)) for name in [*NAMES, UNEVEN]}


UNEVEN = "uneven_pipeline_capturable"  # a run of the same launch, not a release config


def test_uneven_pipeline_with_capturable_trains_on_two_cpu_ranks(runs):
    """3 layers over pp 2 (NxD's split: 1 | 2) with `capturable: true`, as the Megatron configs set
    it: 2 steps train on CPU, the notice names capturable once."""
    proc, _ = runs[UNEVEN]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("model.optim.capturable=true: a CUDA-graph / XLA option") == 1
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64  # q, o; k, v (2 kv heads); mlp; 2 norms
    embed = 8192 * 64  # tiny tokenizer's vocab x hidden, once in the embedding and once in lm_head
    assert f"  stages       1F1B: {embed + layer:,}, {2 * layer + 64 + embed:,}" in out.splitlines()
    assert "final reduced_train_loss=" in out


@pytest.mark.parametrize("name", NAMES)
def test_release_config_trains_three_steps_shrunk(runs, name):
    proc, scalars = runs[name]
    assert proc.returncode == 0
    layout = "dp=1  tp=1  pp=1  cp=2" if name in CP else "dp=1  tp=2"
    assert layout in proc.stdout, proc.stdout[-2000:]
    losses = scalars.get("reduced_train_loss", {})
    assert sorted(losses) == list(range(1, STEPS + 1)), (name, losses)  # TensorBoard's steps 1, 2, 3
    assert all(math.isfinite(v) and v > 0 for v in losses.values()), (name, losses)
