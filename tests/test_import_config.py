"""`nxdt import-config neox`: GPT-NeoX's published YAMLs import to configs with the reference
parameter counts, the shipped neox_* configs are what the importer writes, NeoX's merge rules
(file order, '-' = '_'), the block of keys not mapped, the mapping of the training settings, and
bad input (one line, exit 2, --output untouched). All in-process except one torch-free check."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from nxdt.cli import main as cli
from nxdt.spec import load_config
from nxdt.tools.neox_mapping import NeoxMapper
from nxdt.tools.plan import main as plan_main

CONF = REPO / "conf"
SOURCES = CONF / "neox_sources"

# shipped config -> (NeoX files in conf/neox_sources, import-config options, parameters: interface.md §9)
SHIPPED = {
    "neox_pythia_160M_config": (["pythia_160M.yml", "pythia_local_setup.yml"], ["--num-nodes", "4", "--num-gpus", "8"],
                                162_322_944),
    "neox_pythia_1.4B_config": (["pythia_1-4B.yml", "pythia_local_setup.yml"], ["--num-nodes", "8", "--num-gpus", "8"],
                                1_414_647_808),
    "neox_20B_config": (["20B.yml"], ["--num-nodes", "12", "--num-gpus", "8"], 20_554_567_680),
}

# a small NeoX config (every required key), written with '-' as NeoX's configs mostly are
TINY = {
    "num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 128,
    "max-position-embeddings": 128, "pos-emb": "rotary", "rotary-pct": 0.25, "gpt-j-residual": True,
    "no-weight-tying": True, "train-iters": 100, "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.95], "eps": 1.0e-8}},
    "lr-decay-style": "cosine", "min_lr": 0.00006, "warmup": 0.01, "distributed-backend": "nccl",
}


def _write(path: Path, values: dict, comment: str = "# a NeoX config") -> Path:
    """NeoX style: a JSON-like mapping with a comment and Python-style True/False."""
    text = json.dumps(values, indent=2).replace(": true", ": True").replace(": false", ": False")
    path.write_text(f"{comment}\n{text}\n", encoding="utf-8")
    return path


def _import(capsys, *args) -> tuple[int, str, str]:
    rc = cli(["import-config", "neox", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _load(path: Path):
    return load_config(["--config-path", str(path.parent), "--config-name", path.stem], check_paths=False, quiet=True)


def _tiny(tmp_path: Path, capsys, extra: dict | None = None, *options: str, name: str = "out"):
    src = _write(tmp_path / f"{name}.yml", {**TINY, **(extra or {})})
    out = tmp_path / f"{name}.yaml"
    rc, stdout, err = _import(capsys, src, *options, "--output", out)
    assert rc == 0, err
    return _load(out), out.read_text(encoding="utf-8"), stdout


def _diff(a, b) -> list[str]:
    """Dotted keys whose values differ between two typed configs."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v and k not in ("optim",):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    fa, fb = dict(flat(dataclasses.asdict(a))), dict(flat(dataclasses.asdict(b)))
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


@pytest.mark.parametrize("stem", list(SHIPPED))
def test_neox_yaml_imports_to_the_reference_count_and_the_shipped_config(tmp_path, capsys, stem):
    files, options, expected = SHIPPED[stem]
    out = tmp_path / f"{stem}.yaml"
    rc, stdout, err = _import(capsys, *(SOURCES / f for f in files), *options, "--output", out)
    assert rc == 0, err
    assert stdout.startswith(f"wrote {out}") and "NeoX keys not mapped:" in stdout
    assert plan_main(["--config-path", str(tmp_path), "--config-name", stem, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == expected
    # the shipped config is the importer's output with comments added: equal key by key
    assert _diff(_load(out), _load(CONF / f"{stem}.yaml")) == []


def test_imported_pythia_settings(capsys, tmp_path):
    stem = "neox_pythia_160M_config"
    files, options, _ = SHIPPED[stem]
    assert _import(capsys, *(SOURCES / f for f in files), *options, "--output", tmp_path / "p.yaml")[0] == 0
    cfg = _load(tmp_path / "p.yaml")
    m, ds = cfg.model, cfg.distributed_strategy
    assert (m.transformer_block_type, m.gpt_j_tied, m.normalization, m.activation, m.has_bias) == \
        ("gpt_j", False, "layernorm", "gelu_tanh", True)  # bias-gelu-fusion: NeoX's tanh GELU
    assert (m.position_embedding_type, m.rotary_percentage, m.share_embeddings_and_output_weights) == \
        ("rope", 0.25, False)
    assert (m.vocab_size, m.make_vocab_size_divisible_by, m.ffn_hidden_size) == (50277, 128, 3072)
    assert m.init_method_std == pytest.approx((2 / (5 * 768)) ** 0.5)  # small_init
    assert (m.activations_checkpoint_granularity, m.checkpoint_num_layers, m.fusions.flash_attention) == \
        ("full", 1, True)
    assert ds.zero1 and ds.sharding_strategy is None
    assert (cfg.trainer.devices, cfg.trainer.num_nodes, cfg.data.micro_batch_size, cfg.data.global_batch_size) == \
        (8, 4, 32, 1024)  # 32 GPUs x micro 32 x accumulation 1
    assert m.optim == {"name": "adamw", "lr": 0.0006, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                       "sched": {"name": "CosineAnnealing", "warmup_steps": 1430, "constant_steps": 0,
                                 "min_lr": 6e-05, "max_steps": 143000}}
    p = cfg.precision
    assert p.type == "mixed_precision" and p.fp16.enabled
    assert (p.fp16.loss_scale, p.fp16.initial_scale_power, p.fp16.loss_scale_window, p.fp16.hysteresis,
            p.fp16.min_loss_scale) == (0.0, 12, 1000, 2, 1.0)
    e = cfg.exp_manager
    assert (e.explicit_log_dir, e.resume_if_exists, e.checkpoint_callback_params.every_n_train_steps,
            e.checkpoint_callback_params.save_top_k) == ("checkpoints", True, 1000, -1)
    assert cfg.data.data_prefix == [1.0, "data/pile_deduped/pile_0.87_deduped_text_document"]
    assert (cfg.data.tokenizer.library, cfg.data.tokenizer.type) == ("huggingface", "data/gpt-neox-20b")
    assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches) == (143000, 40000, 10)


def test_later_files_override_earlier_ones(tmp_path, capsys):
    a = _write(tmp_path / "a.yml", {**TINY, "train-iters": 100})
    b = _write(tmp_path / "b.yml", {"train_iters": 200, "hidden-dropout": 0.1})
    out = tmp_path / "ab.yaml"
    assert _import(capsys, a, b, "--output", out)[0] == 0
    cfg = _load(out)
    assert (cfg.trainer.max_steps, cfg.model.hidden_dropout) == (200, 0.1)
    assert f"# Overridden: train_iters ({a} -> {b})" in out.read_text()
    out = tmp_path / "ba.yaml"
    assert _import(capsys, b, a, "--output", out)[0] == 0
    cfg = _load(out)
    assert (cfg.trainer.max_steps, cfg.model.hidden_dropout) == (100, 0.1)  # a wins; b's dropout stays


def test_dash_and_underscore_are_the_same_key(tmp_path, capsys):
    dashes = _tiny(tmp_path, capsys, None, "--name", "tiny", name="dashes")[0]
    under = _write(tmp_path / "under.yml", {k.replace("-", "_"): v for k, v in TINY.items()})
    assert _import(capsys, under, "--name", "tiny", "--output", tmp_path / "under.yaml")[0] == 0
    assert _diff(_load(tmp_path / "under.yaml"), dashes) == []


@pytest.mark.parametrize("extra, activation", [
    ({}, "gelu"), ({"bias-gelu-fusion": False}, "gelu"), ({"bias-gelu-fusion": True}, "gelu_tanh"),
    ({"bias-gelu-fusion": True, "activation": "swiglu"}, "swiglu"), ({"onnx-safe": True}, "gelu"),
])
def test_gelu_is_exact_unless_neox_fuses_it(tmp_path, capsys, extra, activation):
    """NeoX's get_activation: gelu is F.gelu (exact), with bias-gelu-fusion its tanh approximation."""
    cfg, text, _ = _tiny(tmp_path, capsys, extra)
    assert cfg.model.activation == activation
    if activation != "swiglu":  # read into model.activation, not listed (with swiglu: an inert fusion switch)
        assert "bias-gelu-fusion" not in text.split("NeoX keys not mapped:")[-1]


def test_keys_not_mapped_are_listed_once_in_the_output_and_printed(tmp_path, capsys):
    _, text, stdout = _tiny(tmp_path, capsys, {"frobnicate-level": 3, "z-loss": 0.1})
    assert text.count("NeoX keys not mapped:") == 1
    block = text[text.index("NeoX keys not mapped:"):]
    for line in ("#   unknown      frobnicate-level = 3: not a GPT-NeoX key import-config knows",
                 "#   inert        distributed-backend = nccl: ",
                 "#   not mapped   z-loss = 0.1: nxdt has no z-loss"):
        assert line in block
        assert line[2:] in stdout  # the same lines, printed
    assert "NeoX keys not mapped: 3" in stdout


@pytest.mark.parametrize("stage, zero1, strategy", [(0, False, None), (1, True, None), (2, False, "grad-shard"),
                                                    (3, False, "FSDP")])
def test_zero_stages(tmp_path, capsys, stage, zero1, strategy):
    cfg = _tiny(tmp_path, capsys, {"zero_optimization": {"stage": stage, "overlap_comm": True}})[0]
    assert (cfg.distributed_strategy.zero1, cfg.distributed_strategy.sharding_strategy) == (zero1, strategy)


def test_training_settings_map(tmp_path, capsys):
    extra = {
        "norm": "rmsnorm", "activation": "swiglu", "pos-emb": "learned", "no-weight-tying": False,
        "gpt-j-residual": False, "use_bias_in_mlp": False, "use_bias_in_attn_linear": False,
        "optimizer": {"type": "lion", "params": {"lr": "1e-4", "betas": [0.9, 0.99]}}, "weight-decay": 0.05,
        "lr-decay-style": "linear", "min_lr": 0.0, "warmup": 0.1, "lr-decay-iters": 80,
        "bf16": {"enabled": True}, "train_batch_size": 16, "gradient_accumulation_steps": 2,
        "train-data-paths": ["d/a", "d/b"], "train-data-weights": [1, 3], "valid-data-paths": ["d/c"],
        "tokenizer-type": "GPT2BPETokenizer", "vocab-file": "gpt2/vocab.json", "merge-file": "gpt2/merges.txt",
        "checkpoint-activations": True, "checkpoint-num-layers": 2, "gradient_clipping": 0.5, "seed": 7,
        "save": "ck", "load": "other", "save-interval": 50, "keep-last-n-checkpoints": 3,
    }
    cfg, text, _ = _tiny(tmp_path, capsys, extra, "--num-gpus", "4")
    m = cfg.model
    assert (m.normalization, m.layernorm_epsilon, m.activation, m.ffn_hidden_size, m.has_bias) == \
        ("rmsnorm", 1e-8, "swiglu", 85, False)  # NeoX's swiglu: 2/3 of 4h split in halves
    assert (m.position_embedding_type, m.share_embeddings_and_output_weights, m.transformer_block_type) == \
        ("learned_absolute", True, "pre_ln")
    assert (m.vocab_size, m.activations_checkpoint_granularity, m.checkpoint_num_layers) == (50257, "full", 2)
    assert m.optim == {"name": "lion", "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.05,
                       "sched": {"name": "LinearAnnealingWithWarmUp", "warmup_steps": 8, "max_steps": 80}}
    assert cfg.precision.type == "mixed_precision" and not cfg.precision.fp16.enabled
    assert (cfg.data.micro_batch_size, cfg.data.global_batch_size) == (2, 16)  # 16 / (4 GPUs x 2 steps)
    assert cfg.data.data_prefix == {"train": [1.0, "d/a", 3.0, "d/b"], "validation": [1.0, "d/c"]}
    tok = cfg.data.tokenizer
    assert (tok.library, tok.type, tok.vocab_file, tok.merge_file) == \
        ("megatron", "GPT2BPETokenizer", "gpt2/vocab.json", "gpt2/merges.txt")
    assert (cfg.trainer.gradient_clip_val, cfg.seed, cfg.exp_manager.explicit_log_dir) == (0.5, 7, "ck")
    cb = cfg.exp_manager.checkpoint_callback_params
    assert (cb.every_n_train_steps, cb.save_top_k, cfg.exp_manager.resume_if_exists) == (50, 3, False)
    assert "#   not mapped   load = other: " in text  # a NeoX checkpoint folder elsewhere


@pytest.mark.parametrize("kind, params, expect", [
    ("sm3", {"lr": 0.1, "momentum": 0.9}, {"name": "sm3", "lr": 0.1, "momentum": 0.9}),
    ("OneBitAdam", {"lr": 1e-4, "freeze_step": 2}, {"name": "adamw", "lr": 1e-4, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.1}),
])
def test_other_optimizers(tmp_path, capsys, kind, params, expect):
    cfg, text, _ = _tiny(tmp_path, capsys, {"optimizer": {"type": kind, "params": params}})
    assert {k: v for k, v in cfg.model.optim.items() if k != "sched"} == expect
    if kind == "OneBitAdam":
        assert "#   not mapped   optimizer.type = OneBitAdam: DeepSpeed's 1-bit Adam" in text


def test_fp16_block_and_vocab_from_a_local_tokenizer(tmp_path, capsys):
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 3}]}))
    extra = {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 4,
                      "min_loss_scale": 2, "initial_scale_power": 10}, "tokenizer-type": "HFTokenizer",
             "vocab-file": str(tok), "model-parallel-size": 2, "make-vocab-size-divisible-by": 64}
    cfg = _tiny(tmp_path, capsys, extra)[0]
    f = cfg.precision.fp16
    assert (f.enabled, f.loss_scale_window, f.hysteresis, f.min_loss_scale, f.initial_scale_power) == \
        (True, 500, 4, 2.0, 10)
    assert (cfg.model.vocab_size, cfg.data.tokenizer.type) == (4, str(tok.parent))
    assert (cfg.trainer.devices, cfg.data.global_batch_size) == (2, 2)  # default: tp x pp GPUs, dp 1


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ('{"num-layers": 2, "hidden-size": [1, }\n', "not valid YAML at line 1"),
    ("- num-layers\n- 2\n", "expected a mapping of NeoX keys at the top level, got a list"),
    ("just words\n", "expected a mapping of NeoX keys at the top level, got a str"),
])
def test_bad_input_is_one_line_and_leaves_the_output_alone(tmp_path, capsys, content, says):
    good = _write(tmp_path / "good.yml", TINY)
    bad = tmp_path / "bad.yml"
    if content is not None:
        bad.write_text(content)
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    old.write_text("sentinel\n")
    for out in (new, old):
        rc, stdout, err = _import(capsys, good, bad, "--output", out)
        assert rc == 2 and stdout == ""
        assert err.count("\n") == 1 and err.startswith(f"error: {bad}: ") and says in err
    assert not new.exists() and old.read_text() == "sentinel\n"


def test_an_output_nxdt_refuses_is_not_written(tmp_path, capsys):
    src = _write(tmp_path / "pp.yml", {**TINY, "pipe-parallel-size": 2, "no-weight-tying": False})
    rc, _, err = _import(capsys, src, "--output", tmp_path / "pp.yaml")
    assert rc == 2 and "does not validate" in err and "share_embeddings_and_output_weights" in err
    assert not (tmp_path / "pp.yaml").exists()


def test_cli_is_torch_free(tmp_path):
    """One process: the registered command imports no torch (the config side stays light)."""
    out = tmp_path / "x.yaml"
    code = ("import sys; from nxdt.cli import main; "
            f"rc = main(['import-config', 'neox', {str(SOURCES / '20B.yml')!r}, '--output', {str(out)!r}]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()


# --------------------------------------------------------------------------- never another model
NEOX_CONFIGS = REPO / "tests" / "neox_configs"  # NeoX's own files, unchanged (EleutherAI/gpt-neox ea7aefd8 configs/)
NEOX_ARGUMENTS = REPO / "tests" / "neox_arguments.json"  # every NeoXArgs field with its default, same commit


@pytest.mark.parametrize("files, refused", [
    (["mamba-130M.yml"], ["'activation' (in mamba-130M.yml) = silu: nxdt builds gelu and swiglu MLPs",
                          "'attention_config' (in mamba-130M.yml) = [[[\"mamba\"], 24]]: mamba: NeoX builds Mamba "
                          "(selective state-space) layers in 24 of 24 layers"]),
    (["rwkv_170M.yml"], ["'activation' (in rwkv_170M.yml) = silu: nxdt builds gelu and swiglu MLPs",
                         "'attention_config' (in rwkv_170M.yml) = [[[\"rwkv\"], 12]]: rwkv: NeoX builds RWKV layers in "
                         "12 of 12 layers"]),
    (["gmlp_small.yml"], ["'attention_config' (in gmlp_small.yml) = [[[\"gmlp\"], \"all\"]]: gmlp: NeoX builds gMLP "
                          "blocks in 12 of 12 layers"]),  # "all" is NeoX's: every layer
    (["125M.yml", "sparse.yml"], ["'attention_config' (in sparse.yml) = [[[\"local\", \"global\"], \"all\"]]: local: "
                                  "NeoX builds local (windowed) attention in 6 of 12 layers"]),
    (["mistral_7B.yml"], ["'intermediate_size' (in mistral_7B.yml) = 14336: NeoX's gated MLP (megatron/model/"
                          "transformer.py ParallelMLP) gets a gate+up projection of 9558 rows (4779 each) and a down "
                          "projection of 4778 inputs, which do not fit"]),
])
def test_neox_files_of_models_nxdt_cannot_build_are_refused(tmp_path, capsys, monkeypatch, files, refused):
    """NeoX's own files: every model setting nxdt cannot build is named, all in one error, exit 2, nothing
    written (before: Mamba / RWKV became transformers, gMLP failed on "all"). NeoX's MoE (125M-dmoe.yml)
    imports: tests/test_moe_neox.py."""
    monkeypatch.chdir(NEOX_CONFIGS)
    out = tmp_path / "out.yaml"
    rc, _, err = _import(capsys, *files, "local_setup.yml", "--output", out)
    lines = err.splitlines()
    assert rc == 2 and not out.exists()
    assert lines[0] == f"error: nxdt cannot build the model these NeoX files describe ({len(refused)} setting(s)); " \
                       f"nothing written:"
    assert len(lines) == 1 + len(refused)
    for line, want in zip(lines[1:], refused):
        assert line.startswith(f"  neox key {want}"), line


def test_every_model_setting_nxdt_lacks_is_refused_together(tmp_path, capsys):
    src = _write(tmp_path / "m.yml", {**TINY, "use-qk-layernorm": True, "num-unique-layers": 1, "norm": "scalenorm",
                                      "pos-emb": "alibi", "activation": "geglu", "use-bias-in-norms": False})
    out = tmp_path / "m.yaml"
    rc, _, err = _import(capsys, src, "--output", out)
    keys = [line.split("'")[1] for line in err.splitlines()[1:]]
    assert rc == 2 and not out.exists()
    assert keys == ["norm", "pos-emb", "activation", "use-qk-layernorm", "num-unique-layers"]  # scalenorm: no bias check


def test_attention_patterns_and_model_only_files(tmp_path, capsys):
    """[[types, "all"]] fills every layer; flash in some layers is the same attention (inert); a model-only
    file (no batch, no train-iters, as NeoX's llama2 / mistral files) takes nxdt's defaults, said once."""
    cfg, text, stdout = _tiny(tmp_path, capsys, {"attention-config": [[["global", "flash"], "all"]]})
    assert "inert        attention-config" in stdout and not cfg.model.fusions.flash_attention
    flat = _tiny(tmp_path, capsys, {"attention-config": ["flash", "flash"]}, name="flat")[0]
    assert flat.model.fusions.flash_attention
    model_only = {k: v for k, v in TINY.items() if k not in ("train-iters", "train_micro_batch_size_per_gpu")}
    src = _write(tmp_path / "model_only.yml", model_only)
    rc, _, err = _import(capsys, src, "--output", tmp_path / "model_only.yaml")
    assert rc == 0, err
    notices = [line for line in err.splitlines() if "a model-only file" in line]
    assert len(notices) == 1 and "train_micro_batch_size_per_gpu / train_batch_size, train-iters" in notices[0]
    cfg = _load(tmp_path / "model_only.yaml")
    assert (cfg.trainer.max_steps, cfg.data.micro_batch_size, cfg.data.global_batch_size) == (1000, 1, 1)


def test_every_neox_argument_is_classified():
    """NeoX's own argument list (its NeoXArgs dataclasses), each at NeoX's default: the importer knows every
    one (mapped, inert or not mapped: none 'unknown'), and NeoX's defaults ask for nothing it refuses."""
    fields = {k: v for cls, d in json.loads(NEOX_ARGUMENTS.read_text()).items() if not cls.startswith("_")
              for k, v in d.items()}
    assert len(fields) == 318  # 320 fields, two declared in two classes
    merged = {k: v for k, v in fields.items() if v is not None}
    merged.update({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128})
    out = NeoxMapper(merged, {}).run()
    assert [key for cat, key, _v, _w in out.listed if cat == "unknown"] == []
    assert [key for cat, key, _v, _w in out.listed if cat == "not mapped"] == []  # defaults: all off
    listed = {key.replace("-", "_") for _c, key, _v, _w in out.listed}
    assert {"te_fp8_format", "mamba_inner_func_fusion", "override_lr_scheduler", "te_mha",
            "temperature", "use_qk_layernorm", "moe_top_k"} <= listed


def test_neox_llama2_imports_with_neoxs_exact_count(tmp_path, capsys, monkeypatch):
    """NeoX's llama2 files put no biases on attention and (NeoX's default use-bias-in-mlp) biases on the MLP:
    model.has_bias false + model.mlp_bias true, the parameter count NeoX builds (was +835,584 off, approximated)."""
    monkeypatch.chdir(NEOX_CONFIGS)
    out = tmp_path / "llama2.yaml"
    rc, _, err = _import(capsys, "llama2_7B.yml", "local_setup.yml", "--vocab-size", "32000", "--output", out)
    assert rc == 0, err
    assert "a model-only file" in err  # no batch / train-iters in NeoX's llama2 files
    cfg = _load(out)
    assert (cfg.model.has_bias, cfg.model.mlp_bias, cfg.model.ffn_hidden_size) == (False, True, 11008)
    h, layers, vocab, ffn = 4096, 32, 32000, 11008
    # NeoX: q, k, v, o without bias; linear1 [2 x ffn, h] + bias, linear2 [h, ffn] + bias; 2 RMSNorms; untied
    layer = 4 * h * h + (2 * ffn * h + 2 * ffn) + (ffn * h + h) + 2 * h
    assert plan_main(["--config-path", str(tmp_path), "--config-name", "llama2"]) == 0
    assert f"parameters   {2 * vocab * h + layers * layer + h:,} total" in capsys.readouterr().out  # 6,739,251,200
