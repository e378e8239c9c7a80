"""`nxdt import-config fms`: fms-fsdp's train_config (a YAML/JSON file of its fields and/or its
`--key=value` arguments as scripts/train.sh passes them) to an nxdt config. Every field of
train_config is classified (tests/fms_train_config.py: fms-fsdp's training.py at 5a296af), the
model_variant presets have fms-fsdp's dimensions (parameters counted exactly against transformers'
Llama on the meta device), fms-fsdp's own spellings work inside nxdt's YAML too, and bad input is
one line with nothing written. The 2-rank training runs of imported configs are in
tests/test_data_arrow.py (one launch with its other runs)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from transformers import LlamaConfig, LlamaForCausalLM

from nxdt.cli import main as cli
from nxdt.config.errors import ConfigError
from nxdt.spec import load_config
from nxdt.tools.fms_mapping import FIELDS, PRESETS, parse_cli_value, preset_model, preset_parameters
from nxdt.tools.plan import main as plan_main

FIXTURE = REPO / "tests" / "fms_train_config.py"
CATEGORIES = ("mapped", "approximated", "inert", "not mapped")


def _fixture_fields() -> list[str]:
    tree = ast.parse(FIXTURE.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "train_config"]
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]


def test_every_train_config_field_is_classified():
    fields = _fixture_fields()
    assert len(fields) == 51 and "model_variant" in fields and "stage2_seq_length" in fields
    missing = [f for f in fields if f not in FIELDS]
    assert not missing, f"fms-fsdp train_config fields not classified in nxdt.tools.fms_mapping.FIELDS: {missing}"
    assert sorted(FIELDS) == sorted(fields), "FIELDS names a field train_config does not have"
    assert all(cat in CATEGORIES and why for cat, why in FIELDS.values())
    counts = {c: sum(1 for cat, _ in FIELDS.values() if cat == c) for c in CATEGORIES}
    assert counts == {"mapped": 35, "approximated": 3, "inert": 13, "not mapped": 0}, counts


def test_the_docs_table_names_every_field_and_preset():
    doc = (REPO / "docs" / "migrating-from-fms-fsdp.md").read_text(encoding="utf-8")
    for field, (category, _) in FIELDS.items():
        assert f"| `{field}` |" in doc and f"| {category} |" in doc, field
    for variant in PRESETS:
        assert f"| `{variant}` | {preset_model(variant)['num_layers']} |" in doc
        assert f"{preset_parameters(variant):,} |" in doc


def _hf_count(variant: str) -> int:
    m = preset_model(variant)
    cfg = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                      num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                      num_key_value_heads=m["num_kv_heads"], tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False)
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def test_model_variant_presets_have_fms_fsdps_dimensions():
    # fms's MLP width: int(hidden_grow_factor x emb_dim) rounded up to multiple_of (256; 4096 for llama2_70b)
    widths = {v: preset_model(v)["ffn_hidden_size"] for v in PRESETS}
    assert widths["llama2_7b"] == 11008 and widths["llama2_70b"] == 28672 and widths["llama3_8b"] == 14336
    assert widths["llama3_3.2b"] == 8192  # int(8/3 x 3072) = 8191 -> 8192
    assert widths["llama3_194m_4k"] == 2816  # int(8/3 x 1024) = 2730 -> 2816
    assert preset_model("llama3_194m_4k")["num_kv_heads"] == 8  # fms's kvheads 0: one per query head
    assert preset_model("llama2_34b")["max_position_embeddings"] == 16384
    for variant in PRESETS:
        assert preset_parameters(variant) == _hf_count(variant), variant
    # the published sizes
    assert preset_parameters("llama2_7b") == 6_738_415_616 and preset_parameters("llama3_8b") == 8_030_261_248
    assert preset_parameters("llama2_70b") == 68_976_648_192 and preset_parameters("llama3_70b") == 70_553_706_496


def _import(tmp_path, capsys, *args) -> tuple[int, str, str, Path]:
    out = tmp_path / "imported.yaml"
    rc = cli(["import-config", "fms", *map(str, args), "--output", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, out


# scripts/train.sh's MODEL_ARGS, with a model_variant (train.sh leaves it at train_config's '7b', which
# get_model_config refuses)
TRAIN_SH = ["--use_dummy_dataset=False", "--ckpt_load_path=/lustre/pretrain/ckpt", "--ckpt_save_path=/lustre/pretrain/ckpt",
            "--data_path=/lustre/bluepile-processing/rel0_7/tokens/llama2/high_quality_rerun_fuzzy_deduped",
            "--fsdp_activation_checkpointing=False", "--selective_checkpointing=1", "--sharding_strategy=hsdp",
            "--low_cpu_fsdp=False", "--batch_size=2", "--report_interval=200", "--checkpoint_interval=20000",
            "--use_torch_compile=False", "--use_profiler=False"]


def test_train_sh_arguments_import(tmp_path, capsys):
    rc, out, err, path = _import(tmp_path, capsys, "--model_variant=llama2_7b", *TRAIN_SH, "--num-nodes", "2")
    assert rc == 0, err
    cfg = yaml.safe_load(path.read_text())
    assert cfg["trainer"] == {"devices": 8, "num_nodes": 2, "max_steps": 1000000, "gradient_clip_val": 1.0,
                              "log_every_n_steps": 200}
    assert cfg["data"]["global_batch_size"] == 32 and cfg["data"]["micro_batch_size"] == 2
    assert len(cfg["data"]["datasets"]) == 13 and cfg["data"]["weights"][:2] == [7725.0, 500.0]
    assert cfg["data"]["sep_token"] == 0 and "bos_token" not in cfg["data"]
    assert "tokenizer" not in cfg["data"] and "notice: tokenizer_path not given: fms-fsdp reads no tokenizer" in err
    assert cfg["distributed_strategy"] == {"sharding_strategy": "HSDP"}
    assert cfg["precision"] == {"type": "mixed_precision", "grad_reduce_dtype": "bf16"}
    assert cfg["model"]["ffn_hidden_size"] == 11008 and cfg["model"]["num_kv_heads"] == 32
    assert cfg["model"]["optim"]["sched"] == {"name": "CosineAnnealing", "warmup_steps": 2000, "constant_steps": 0,
                                              "min_lr": 3e-05}
    assert cfg["exp_manager"]["resume_if_exists"] is True and "selective_checkpointing" not in cfg["model"]
    typed = load_config(["--config-path", str(tmp_path), "--config-name", "imported"], check_paths=False, quiet=True)
    assert typed.precision.grad_reduce_dtype == "bf16" and typed.data.logical_shards == 1024
    assert "fms-fsdp keys not mapped: 0" in out
    # nxdt's own model of the imported config: fms-fsdp's llama2_7b, parameter for parameter
    assert plan_main(["--config-path", str(tmp_path), "--config-name", "imported", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == preset_parameters("llama2_7b") == 6_738_415_616


def test_a_yaml_file_then_arguments_with_fms_fsdps_forms(tmp_path, capsys):
    (tmp_path / "fms.yaml").write_text(
        "model_variant: llama3_1.8b_4k\ndatasets: 'a, b'\nweights: '3,1'\nstrip_tokens: '5,6'\nbol_token: 7\n"
        "eol_token: 8\nfsdp_activation_checkpointing: true\nselective_checkpointing: 1/3\ntraining_stage: annealing\n"
        "tracker: aim\nmixed_precision: false\nvocab_size: 128256\nn_speculator_heads: 4\nlearning_rat: 0.1\n")
    rc, out, err, path = _import(tmp_path, capsys, tmp_path / "fms.yaml", "--weights=7725,500", "--num-gpus", "2",
                                 "--ckpt_load_path", "/elsewhere", "--seed", "7")  # fire's --key value too
    assert rc == 0, err
    cfg = yaml.safe_load(path.read_text())
    d = cfg["data"]
    assert d["datasets"] == ["a", "b"] and d["weights"] == [7725.0, 500.0]  # fire parsed 7725,500 as a tuple
    assert d["strip_tokens"] == [5, 6] and d["bol_token"] == 7 and d["eol_token"] == 8
    assert cfg["model"]["selective_checkpointing"] == pytest.approx(1 / 3)
    assert cfg["model"]["optim"]["sched"] == {"name": "LinearAnnealingWithWarmUp", "warmup_steps": 0}
    assert cfg["precision"] == {"type": "fp32"} and cfg["model"]["vocab_size"] == 128256
    assert cfg["exp_manager"]["resume_if_exists"] is False and cfg["seed"] == 7
    for cat, key in (("not mapped", "tracker"), ("not mapped", "ckpt_load_path"), ("inert", "vocab_size"),
                     ("inert", "n_speculator_heads"), ("unknown", "learning_rat"), ("approximated", "training_stage")):
        assert f"  {cat:<12} {key} = " in out and f"#   {cat:<12} {key} = " in path.read_text(), (key, out)
    assert "fms-fsdp keys not mapped: 6" in out
    assert plan_main(["--config-path", str(tmp_path), "--config-name", "imported", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == preset_parameters("llama3_1.8b_4k") == 1_884_391_424
    assert "did you mean 'learning_rate'?" in out
    assert [parse_cli_value(v) for v in ("False", "3e-4", "None", "a,b", "1/3", "7725,500")] == [
        False, 3e-4, None, "a,b", "1/3", [7725, 500]]


@pytest.mark.parametrize("args, says", [
    (["--model_variant=mamba_9.8b"], "model_variant=mamba_9.8b: a Mamba model"),
    (["--model_variant=llama3_8", "--batch_size=2"], "did you mean 'llama3_8b'?"),
    (["--batch_size=2"], "model_variant: not given, and train_config's default '7b'"),
    (["--model_variant=llama2_7b", "--batch_size=two"], "fms-fsdp batch_size: expected an integer, got 'two'"),
    (["--model_variant=llama2_7b", "--weights=1,2"], "fms-fsdp weights: 2 weights for 13 datasets"),
    (["--model_variant=llama2_7b", "--strip_tokens=1,x"], "fms-fsdp strip_tokens: expected comma-separated integers"),
    (["--model_variant=llama2_7b", "--selective_checkpointing=4/3", "--fsdp_activation_checkpointing"],
     "selective_checkpointing: expected a fraction in [0, 1]"),
    (["--model_variant=llama2_7b", "--file_type=json"], "file_type: 'json' is not one of"),
    (["model_variant=llama2_7b"], "model_variant=llama2_7b: no such file"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, says):
    rc, out, err, path = _import(tmp_path, capsys, *args)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and says in errors[0], err
    assert not path.exists()


def _nxdt(*overrides):
    return load_config(["--config-name", "tiny_llama_cpu", *overrides], check_paths=False, quiet=True)


def test_fms_spellings_inside_nxdt_yaml():
    cfg = _nxdt("data.datasets='a,b , c'", "data.weights='7725,500,1'", "data.eos_token=5", "data.strip_tokens='3,4'")
    assert cfg.data.datasets == ["a", "b", "c"] and cfg.data.weights == [7725.0, 500.0, 1.0]
    assert cfg.data.sep_token == 5 and cfg.data.strip_tokens == [3, 4]
    assert _nxdt("data.eos_token=5", "data.sep_token=5").data.sep_token == 5
    with pytest.raises(ConfigError, match=r"^data.eos_token \(5\) and data.sep_token \(6\) differ: eos_token is "):
        _nxdt("data.eos_token=5", "data.sep_token=6")
    with pytest.raises(ConfigError, match=r"^data.weights: item 1 of '1,x' is not a number: 'x'$"):
        _nxdt("data.datasets='a,b'", "data.weights='1,x'")
    with pytest.raises(ConfigError, match=r"unknown key 'data.eos_tokn' \(did you mean 'data.eos_token'\?\)"):
        _nxdt("+data.eos_tokn=5")
    with pytest.raises(ConfigError, match=r"unknown key 'data.bol_tok' \(did you mean 'data.bol_token'\?\)"):
        _nxdt("+data.bol_tok=5")


def test_grad_reduce_dtype_switch():
    """bf16 reduction: the FSDP policy's reduce_dtype (its numbers: tests/fms_runs.py, 2 ranks); refused
    where it cannot act."""
    import types

    from nxdt.parallel.data_parallel import data_parallel_config
    from nxdt.spec.precision import precision_settings

    def settings(ptype, reduce, fp16=False):
        return precision_settings(types.SimpleNamespace(type=ptype, fp16=types.SimpleNamespace(enabled=fp16),
                                                        grad_reduce_dtype=reduce))

    fsdp, ddp = (types.SimpleNamespace(shard=s, reshard_after_forward=True) for s in (True, False))
    assert data_parallel_config(fsdp, settings("mixed_precision", "fp32")).mp_policy.reduce_dtype == torch.float32
    policy = data_parallel_config(fsdp, settings("mixed_precision", "bf16")).mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)  # fms-fsdp's bfSixteen
    policy = data_parallel_config(fsdp, settings("fp32", "bf16")).mp_policy  # fp32 compute, bf16 reduction
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"^precision.grad_reduce_dtype=bf16 needs a sharding data-parallel mode"):
        data_parallel_config(ddp, settings("mixed_precision", "bf16"))
    with pytest.raises(ConfigError, match=r"^precision.grad_reduce_dtype=bf16: cannot be combined with precision.fp16"):
        settings("mixed_precision", "bf16", fp16=True)
    assert _nxdt("precision.type=mixed_precision", "precision.grad_reduce_dtype=bf16").precision.grad_reduce_dtype \
        == "bf16"
