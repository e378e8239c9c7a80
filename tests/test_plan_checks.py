"""What training refuses, `nxdt plan` refuses with the same line; every path problem at once.

All in-process: the config errors stop before any process group starts.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from conftest import REPO, train_in_process

from nxdt.config.errors import ConfigError, ConfigErrors
from nxdt.config.load import main_guard
from nxdt.models.hf import resolve_model_config
from nxdt.spec import load_config
from nxdt.spec.paths import MAKE_DATA_HINT, check_files
from nxdt.tools.plan import main as plan_main

CONF = str(REPO / "conf")


def _plan_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """`nxdt plan` through the entry's guard (one line, exit 2): (exit status, stdout, stderr)."""
    try:
        rc = int(main_guard(plan_main)(["--config-path", CONF, *argv]) or 0)
    except SystemExit as stop:
        rc = int(stop.code)
    out = capsys.readouterr()
    return rc, out.out, out.err


# --------------------------------------------------------------------------- item 6: every path at once


def test_sft_config_lists_every_missing_path_in_one_error(tmp_path):
    """The shipped SFT config with nothing on this machine: one error, a first line with the count,
    then one line per missing path with its dotted key; exit 2, no process group started."""
    argv = ["--config-path", CONF, "--config-name", "hf_llama3_8B_SFT_config",
            f"data.train_dir={tmp_path / 'train.jsonl'}", f"data.val_dir={tmp_path / 'val.jsonl'}",
            f"data.tokenizer.type={tmp_path / 'tok'}", f"model.model_config={tmp_path / 'cfg/config.json'}",
            f"exp_manager.resume_from_checkpoint={tmp_path / 'ckpt'}",
            f"exp_manager.explicit_log_dir={tmp_path / 'logs'}"]
    run = train_in_process(argv)
    assert run.rc == 2, (run.out[-2000:], run.err[-2000:])
    assert not dist.is_initialized()
    assert "Traceback" not in run.err
    lines = [line for line in run.err.splitlines() if line.strip()]
    assert lines == [
        "error: 5 missing or unusable paths:",
        f"  data.train_dir: data path not found: {tmp_path / 'train.jsonl'}",
        f"  data.val_dir: data path not found: {tmp_path / 'val.jsonl'}",
        f"  data.tokenizer.type: tokenizer directory not found: {tmp_path / 'tok'}",
        f"  model.model_config: transformers config.json not found: {tmp_path / 'cfg/config.json'}",
        f"  exp_manager.resume_from_checkpoint: checkpoint not found: {tmp_path / 'ckpt'}",
    ]
    assert not (tmp_path / "logs").exists()  # nothing written


def test_path_problems_of_every_kind_collected(tmp_path):
    """Megatron data (two prefixes, one missing its .idx, one both files) and a log dir that is a file:
    every problem in one ConfigErrors, in the order of the keys; a single problem keeps its one line."""
    (tmp_path / "a.bin").write_bytes(b"x")
    afile = tmp_path / "afile"
    afile.write_text("x")
    cfg = load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu",
                       f"data.data_prefix=[0.5,{tmp_path}/a,0.5,{tmp_path}/b]",
                       f"exp_manager.explicit_log_dir={afile}"], check_paths=False, quiet=True)
    with pytest.raises(ConfigErrors) as info:
        check_files(cfg)
    problems = info.value.problems
    assert len(problems) == 3, problems  # a prefix missing both files is one problem (its .bin)
    assert problems[0] == f"data.data_prefix: indexed dataset file not found: {tmp_path / 'a.idx'} ({MAKE_DATA_HINT})"
    assert problems[1] == f"data.data_prefix: indexed dataset file not found: {tmp_path / 'b.bin'} ({MAKE_DATA_HINT})"
    assert problems[2] == f"exp_manager.explicit_log_dir: {afile} is a file, not a directory"
    assert str(info.value).splitlines()[0] == "3 missing or unusable paths:"
    # one problem: the one line as before, a plain ConfigError
    (tmp_path / "a.idx").write_bytes(b"x")
    cfg = load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", f"data.data_prefix=[1.0,{tmp_path}/a]",
                       f"exp_manager.explicit_log_dir={afile}"], check_paths=False, quiet=True)
    with pytest.raises(ConfigError) as one:
        check_files(cfg)
    assert not isinstance(one.value, ConfigErrors)
    assert str(one.value) == f"exp_manager.explicit_log_dir: {afile} is a file, not a directory"


def test_missing_model_config_names_its_path_once(capsys, tmp_path):
    """A missing absolute model_config: its path once, from `nxdt plan` (which reads config.json and
    checks it as training does) and from the model builder (which tried it three times over)."""
    missing = tmp_path / "config.json"
    rc, _, err = _plan_in_process(capsys, "--config-name", "hf_llama3_8B_config", f"model.model_config={missing}")
    assert (rc, err.splitlines()) == (2, [f"error: model.model_config: transformers config.json not found: {missing}"])
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_config(missing)
    assert str(info.value) == f"model.model_config '{missing}' not found"
    with pytest.raises(FileNotFoundError) as info:  # a relative path: the three places it looked
        resolve_model_config("no_such_dir/config.json")
    assert str(info.value).startswith("model.model_config 'no_such_dir/config.json' not found; tried: no_such_dir/")
    assert str(info.value).count("no_such_dir/config.json") == 4


# --------------------------------------------------------------------------- item 5: the plan checks as training


REFUSED = {
    "MoE dropping tokens with cp > 1": ("hf_mixtral_8x7b_config", ["distributed_strategy.context_parallel_size=2",
                                                                    "model.moe.dropless=false",
                                                                    "model.moe.capacity_factor=1.25"],
                                       "error: 'distributed_strategy.context_parallel_size' > 1 with "
                                       "model.moe.capacity_factor (an expert's capacity is the whole micro-batch's; "
                                       "set model.moe.dropless) is not supported yet (got 2)"),
    "weight_init_only without weights": ("tiny_llama_cpu", ["model.weight_init_only=true"],
                                         "error: model.weight_init_only: needs exp_manager.resume_from_checkpoint "
                                         "(the weights to load)"),
    "checkpoint mode": ("tiny_llama_cpu", ["exp_manager.checkpoint_callback_params.mode=min"],
                        "error: exp_manager.checkpoint_callback_params.mode: 'min' with monitor 'step' would keep "
                        "the oldest checkpoints; use mode: max (or monitor a metric such as val_loss)"),
    "profiler ranks": ("tiny_llama_cpu", ["exp_manager.profiler.enabled=true", "exp_manager.profiler.ranks=[7]"],
                       "error: exp_manager.profiler.ranks: [7] has [7] outside the world of 2 ranks (0..1)"),
    "user callback": ("tiny_llama_cpu", ["trainer.callbacks=[{_target_: nope_pkg.Thing}]"],
                      "error: trainer.callbacks[0]: cannot import module 'nope_pkg' for 'nope_pkg.Thing' "
                      "(No module named 'nope_pkg')"),
    "custom data module": ("tiny_llama_cpu", ["data.data_module=collections.OrderedDict"],
                           "error: data.data_module: 'collections.OrderedDict' is not a "
                           "lightning.pytorch.LightningDataModule subclass"),
    "logger argument": ("tiny_llama_cpu", ["exp_manager.create_mlflow_logger=true",
                                           "+exp_manager.mlflow_logger_kwargs.bogus=1"],
                        "error: exp_manager.mlflow_logger_kwargs.bogus: not an argument of MLFlowLogger; known: "),
    "SFT prompt template": ("hf_llama3_8B_SFT_config", ['+model_alignment_strategy.sft.prompt_template="Q: A:"'],
                            "error: model_alignment_strategy.sft.prompt_template: must contain '{input}'"),
    "LoRA target": ("tiny_llama_lora_cpu", ["model_alignment_strategy.peft.target_modules=[nope]",
                                            "exp_manager.resume_if_exists=false"],
                    "error: model_alignment_strategy.peft.target_modules: 'nope' is not a linear layer of this "
                    "model; valid: ['down_proj', 'gate_proj', 'gate_up_proj', 'k_proj', 'o_proj', 'q_proj', "
                    "'qkv_proj', 'up_proj', 'v_proj']"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_plan_refuses_what_training_refuses(capsys, tmp_path, kjv_prefix, case):
    """Each config the training entry refuses before it starts, `nxdt plan` refuses with the same
    one line and exit 2 (before: the plan printed, then training refused). `expected`: the line, or
    its start where the rest is a library's list of names."""
    name, overrides, expected = REFUSED[case]
    data = [f"data.data_prefix=[1.0,{kjv_prefix}]"] if name.startswith("tiny") else []
    run = train_in_process(["--config-path", CONF, "--config-name", name, *data, *overrides,
                            f"exp_manager.explicit_log_dir={tmp_path / 'logs'}"])
    trained = [line for line in run.err.splitlines() if line.startswith("error:")]
    assert run.rc == 2 and len(trained) == 1 and trained[0].startswith(expected), (run.rc, run.err[-2000:])
    assert not dist.is_initialized()
    assert not (tmp_path / "logs").exists()  # refused before anything is written
    rc, out, err = _plan_in_process(capsys, "--config-name", name, *overrides)
    assert rc == 2 and out == ""
    assert err.splitlines() == trained  # the same line


def test_plan_lists_the_paths_it_did_not_check(capsys, tmp_path):
    """The plan looks at no file but the config.json it reads: the others, by key, in one line (and
    in --json); a missing data source (no file needed) is refused as training refuses it."""
    rc, out, err = _plan_in_process(capsys, "--config-name", "hf_llama3_8B_SFT_config")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.startswith("  not checked")]
    assert lines == ["  not checked  the paths of data.train_dir, data.val_dir, data.tokenizer.type, "
                     "exp_manager.resume_from_checkpoint, exp_manager.exp_dir (nxdt train checks them before it "
                     "starts)"]
    rc, out, _ = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu",
                                  f"exp_manager.explicit_log_dir={tmp_path}", "--json")
    assert rc == 0
    assert json.loads(out)["not_checked"] == ["data.data_prefix", "data.tokenizer.type",
                                              "exp_manager.explicit_log_dir"]
    # resuming from the log dir's newest checkpoint, none being an error: that is not checked either
    rc, out, _ = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu", "exp_manager.resume_if_exists=true",
                                  "--json")
    assert rc == 0
    assert json.loads(out)["not_checked"] == ["data.data_prefix", "data.tokenizer.type", "exp_manager.exp_dir",
                                              "exp_manager.resume_if_exists"]
    rc, out, err = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu", "data.data_prefix=null")
    assert rc == 2 and err.splitlines() == [
        "error: data.data_prefix is required for model_source megatron (or set data.train_dir, "
        "data.use_dummy_dataset or data.data_module)"]


def test_plan_of_an_evaluation_refuses_what_evaluate_refuses(capsys, tmp_path):
    """trainer.max_epochs=0 (evaluate only): the plan runs evaluate's checks (a DPO config has no
    token cross entropy to report), as `nxdt train` would before evaluating."""
    rc, out, err = _plan_in_process(capsys, "--config-name", "tiny_llama_dpo_cpu", "trainer.max_epochs=0",
                                    f"exp_manager.resume_from_checkpoint={tmp_path / 'ckpt'}")
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        "error: model_alignment_strategy: evaluate reports the token cross entropy of language-model data; "
        "DPO / ORPO configs validate on the preference loss instead (train's val_loss)"]


def test_plan_refuses_a_compile_backend_this_machine_lacks(capsys, tmp_path, kjv_prefix, monkeypatch):
    """model.fusions.torch_compile where torch cannot compile for the device: training's pre-flight
    line (nxdt.training.trainer.check_compile_backend), from the plan as well."""
    import nxdt.training.trainer as trainer

    monkeypatch.setattr(trainer, "compile_backend_missing", lambda device: f"no C compiler for {device}")
    overrides = ["model.fusions.torch_compile=true"]
    run = train_in_process(["--config-path", CONF, "--config-name", "tiny_llama_cpu",
                            f"data.data_prefix=[1.0,{kjv_prefix}]", *overrides,
                            f"exp_manager.explicit_log_dir={tmp_path / 'logs'}"])
    expected = ["error: model.fusions.torch_compile: no C compiler for cpu; install it, or set "
                "model.fusions.torch_compile=false (and model.use_torch_compile=false)"]
    assert run.rc == 2 and [line for line in run.err.splitlines() if line.startswith("error:")] == expected
    assert not (tmp_path / "logs").exists()
    rc, out, err = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu", *overrides)
    assert (rc, out, err.splitlines()) == (2, "", expected)


def test_model_vocab_size_sizes_the_trained_model_as_the_plan_says(capsys, tmp_path, kjv_prefix):
    """`model.vocab_size` larger than the tokenizer's (8,192) builds that output layer in training, as
    `nxdt plan` counts it (before: the tokenizer's size won in training, the key's in the plan); a
    smaller one is refused in one line, exit 2 (the ids past it would index out of range)."""
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
            "model.num_kv_heads=2", "data.seq_length=32", "model.encoder_seq_length=32", "data.num_workers=0",
            "trainer.max_steps=1", "trainer.devices=1"]
    rc, out, err = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu", *tiny, "model.vocab_size=9000", "--json")
    assert rc == 0, err
    planned = json.loads(out)["parameters"]
    rc, out, err = _plan_in_process(capsys, "--config-name", "tiny_llama_cpu", *tiny, "model.vocab_size=8192", "--json")
    assert rc == 0 and planned - json.loads(out)["parameters"] == 2 * (9000 - 8192) * 64  # embedding + output rows
    run = train_in_process(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *tiny, "model.vocab_size=9000",
                            f"data.data_prefix=[1.0,{kjv_prefix}]", f"exp_manager.explicit_log_dir={tmp_path / 'a'}"])
    assert run.rc == 0, run.err[-2000:]
    assert f"parameters   {planned:,}" in run.out, run.out[-3000:]
    run = train_in_process(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *tiny, "model.vocab_size=100",
                            f"data.data_prefix=[1.0,{kjv_prefix}]", f"exp_manager.explicit_log_dir={tmp_path / 'b'}"])
    assert run.rc == 2 and [line for line in run.err.splitlines() if line.startswith("error:")] == [
        "error: model.vocab_size (100) is smaller than the tokenizer's vocabulary (8192): set it >= 8192 or null "
        "(the tokenizer's size)"], run.err[-2000:]
