"""nxdt.config: shipped YAMLs, schema errors, cross-checks, resolvers, env vars, layout, CLI guard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nxdt.config import ConfigError, apply_env, compose, describe, main_guard

from nxdt.spec.layout import compute_layout

from nxdt.spec import load_config, validate
from nxdt.config import env as nenv
from nxdt.config import resolvers
from nxdt.config.schema import NxdtConfig
from nxdt.spec.paths import MAKE_DATA_HINT
from nxdt.config.validate import NOT_SUPPORTED_YET

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHIPPED = sorted(p.stem for p in CONF.glob("*.yaml"))  # every shipped config


def load(*overrides, name="tiny_llama_cpu", world_size=2, check_paths=False, check_supported=True, config_dir=CONF):
    argv = ["--config-path", str(config_dir), "--config-name", name, *overrides]
    return load_config(argv, world_size=world_size, check_paths=check_paths, check_supported=check_supported,
                       quiet=True)


def error(*overrides, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, **kw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def make_kjv(root: Path) -> None:
    d = root / "data" / "kjv"
    d.mkdir(parents=True)
    for ext in (".bin", ".idx"):
        (d / f"kjv_text_document{ext}").write_bytes(b"x")


# ----------------------------------------------------------------------------- shipped configs
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_compose_and_validate(name):
    cfg = load(name=name, world_size=None, check_supported=False)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    validate(cfg, world_size=world, check_paths=False, check_supported=False)
    assert cfg.model.optim["sched"]["max_steps"] == cfg.trainer.max_steps  # model.optim: an open dict
    assert cfg.distributed_strategy.virtual_pipeline_model_parallel_size == 1
    # the typed config (every schema key an attribute); NxDT's interpolations resolved
    assert isinstance(cfg, NxdtConfig) and hasattr(cfg, "aync_exec_max_inflight_requests")
    # fp16 only where the original training used it: GPT-NeoX's configs (Pythia, NeoX-20B)
    assert cfg.precision.fp16.enabled is name.startswith("neox_")
    mps = cfg.distributed_strategy.tensor_model_parallel_size * cfg.distributed_strategy.pipeline_model_parallel_size
    assert cfg.exp_manager.checkpoint_callback_params.model_parallel_size == mps
    if cfg.model_source == "hf":
        assert Path(cfg.model.model_config).is_absolute()
        assert cfg.model.model_config.endswith("config.json")


def test_shipped_values():
    cfg = load(name="megatron_llama_7B_config", world_size=None, check_supported=False)
    assert cfg.model.max_position_embeddings == 4096 and cfg.data.seq_length == 4096
    assert cfg.model.optim["lr"] == pytest.approx(3e-4) and cfg.model.optim["sched"]["name"] == "CosineAnnealing"
    assert list(cfg.data.data_prefix)[0] == 1.0
    sft = load(name="hf_llama3_8B_SFT_config", world_size=None, check_supported=False)
    assert sft.model_alignment_strategy.sft.packing is True and sft.model.weight_init_only is True
    assert sft.model.model_config == str(CONF / "model_configs" / "llama3_8B" / "config.json")


def test_tiny_config_values_and_layout():
    cfg = load()
    assert cfg.trainer.max_steps == 300 and cfg.data.seq_length == 128 and cfg.model.num_kv_heads == 4
    assert cfg.data.tokenizer.type == str(REPO / "src" / "nxdt" / "assets" / "tokenizer")
    lay = compute_layout(cfg, 2)
    assert (lay.dp, lay.num_microbatches, lay.local_batch_size, lay.tokens_per_step) == (2, 2, 8, 16 * 128)


def test_tiny_config_full_validation(tmp_path, monkeypatch):
    if not (REPO / "src" / "nxdt" / "assets" / "tokenizer").is_dir():
        pytest.skip("bundled tokenizer not built yet")
    monkeypatch.chdir(tmp_path)
    make_kjv(tmp_path)
    load(check_paths=True)


def test_not_supported_check_is_skippable():
    # a combination validation refuses as not built ('not supported yet'), skippable for tools such as plan
    moe_cp = ["model.moe.num_experts=4", "model.moe.capacity_factor=1.25", "distributed_strategy.context_parallel_size=2"]
    assert "is not supported yet" in error(*moe_cp, name="megatron_llama_7B_config", world_size=None)
    cfg = load(*moe_cp, name="megatron_llama_7B_config", world_size=None, check_supported=False)
    assert cfg.distributed_strategy.context_parallel_size == 2


def test_block_types_are_built_not_refused():
    # no longer a NOT_SUPPORTED_YET key: every block type validates (the schema's enumeration is the check)
    assert not any(k.startswith("model.transformer_block_type") for k in NOT_SUPPORTED_YET)
    assert load("model.transformer_block_type=normformer").model.transformer_block_type == "normformer"


def test_hf_gpt_neox_refuses_the_layouts_it_is_not_built_for():
    neox = ["model_source=hf", "model.model_config=model_configs/tiny_neox"]  # a folder, found under conf/
    msg = error(*neox, "distributed_strategy.pipeline_model_parallel_size=2")
    assert msg.startswith("'distributed_strategy.pipeline_model_parallel_size' > 1 with model_source hf and a "
                          "gpt_neox model_config is not supported yet (got 2)"), msg
    assert load(*neox).model_source == "hf"  # data parallel (world 2) is built
    llama = str(CONF / "model_configs" / "tiny_llama" / "config.json")
    assert load("model_source=hf", f"model.model_config={llama}",
                "distributed_strategy.tensor_model_parallel_size=2").model_source == "hf"


# ----------------------------------------------------------------------------- error messages
@pytest.mark.parametrize("overrides, expected", [
    (["model.hiden_size=3"], "unknown key 'model.hiden_size' (did you mean 'model.hidden_size'?)"),
    (["trainer.devise=2"], "unknown key 'trainer.devise' (did you mean 'trainer.devices'?)"),
    (["+exp_manager.checkpoint_callback_params.save_topk=2"],
     "unknown key 'exp_manager.checkpoint_callback_params.save_topk' (did you mean "
     "'exp_manager.checkpoint_callback_params.save_top_k'?)"),
    (["+trainr.x=1"], "unknown key 'trainr' (did you mean 'trainer'?)"),
    (["model.num_layers=abc"], "model.num_layers: expected int, got 'abc' (str)"),
    (["trainer.devices=true"], "trainer.devices: expected int, got True (bool)"),
    (["trainer.gradient_clip_val=abc"], "trainer.gradient_clip_val: expected float, got 'abc' (str)"),
    (["model.normalization=batchnorm"], "model.normalization: expected one of ['rmsnorm', 'layernorm']"),
    (["precision.type=bf16"], "precision.type: expected one of ['fp32', 'autocast', 'mixed_precision'"),
    (["data.dataloader_type=random"], "data.dataloader_type: expected one of ['single', 'cyclic']"),
    (["model.activations_checkpoint_granularity=partial"], "expected one of ['selective', 'full']"),
    (["distributed_strategy.sharding_strategy=ZERO3"], "expected one of ['FSDP', 'HSDP'"),
    (["model_source=torch"], "model_source: expected one of ['megatron', 'hf']"),
    (["trainer.accumulate_grad_batches=2"],
     "trainer.accumulate_grad_batches: 2 is not allowed: gradient accumulation is derived from "
     "data.global_batch_size"),
    (["data.global_batch_size=18"],
     "data.global_batch_size (18) is not divisible by data.micro_batch_size (4) x data-parallel size (2) = 8"),
    (["model.hidden_size=260"], "model.hidden_size (260) is not divisible by model.num_attention_heads (8)"),
    (["model.num_kv_heads=3"], "model.num_attention_heads (8) is not divisible by model.num_kv_heads (3)"),
    (["model.encoder_seq_length=2048"], "data.seq_length (2048) exceeds model.max_position_embeddings (1024)"),
    (["distributed_strategy.context_parallel_size=2", "model.encoder_seq_length=126"],
     "data.seq_length (126) must be divisible by 2 x distributed_strategy.context_parallel_size (4)"),
    (["distributed_strategy.context_parallel_size=2", "data.reset_attention_mask=true"],
     "distributed_strategy.context_parallel_size > 1 with data.reset_position_ids / reset_attention_mask "
     "(document masks) is not supported yet (got distributed_strategy.context_parallel_size=2)"),
    (["distributed_strategy.context_parallel_size=2", "+model_alignment_strategy={sft: {packing: true}}"],
     "context_parallel_size > 1 with SFT packing (document masks) is not supported yet"),
    (["distributed_strategy.context_parallel_size=2", "data.reset_position_ids=true"],
     "context_parallel_size > 1 with data.reset_position_ids / reset_attention_mask (document masks)"),
    (["distributed_strategy.context_parallel_size=2", "model.attention_dropout=0.1"],
     "context_parallel_size > 1 with model.attention_dropout > 0 is not supported yet"),
    (["distributed_strategy.context_parallel_size=2", "trainer.accelerator=gpu"],
     "context_parallel_size > 1 with trainer.accelerator gpu is not supported yet"),
    (["model.fusions.ring_attention=true"],
     "model.fusions.ring_attention: true needs distributed_strategy.context_parallel_size > 1"),
    (["model.moe.num_experts=4", "model.moe.gate_balance_loss_weight=0.01"],
     "model.moe.gate_balance_loss_weight=0.01 weighs LLaMA-MoE's balance loss: needs model.moe.gate_type"),
    (["trainer.accelerator=xla", "distributed_strategy.pipeline_model_parallel_size=2"],
     "trainer.accelerator xla with 2 devices: distributed_strategy.pipeline_model_parallel_size = 2 is not supported "
     "yet on XLA"),
    (["trainer.accelerator=xla", "distributed_strategy.context_parallel_size=2"],
     "trainer.accelerator xla with 2 devices: distributed_strategy.context_parallel_size = 2 is not supported yet on XLA"),
    (["precision.fp16.enabled=true", "precision.type=bf16SR"],
     "precision.fp16.enabled: cannot be combined with precision.type bf16SR"),
    (["data.data_prefix=[1.0]"], "data.data_prefix: expected [weight, path, weight, path, ...]"),
    (["data.data_prefix=[0,a]"], "data.data_prefix: the weights sum to zero"),
    (["data.data_prefix={validation: a}"], "data.data_prefix.train: the dict form needs a train entry"),
    (["data.data_prefix={train: a, tset: b}"], "unknown key 'data.data_prefix.tset' (did you mean 'data.data_prefix.test'?)"),
    (["data.datasets=[a,b]", "data.weights=[1]"], "data.weights has 1 entries but data.datasets has 2"),
    (["data.datasets=[a]", "data.weights=[-1]"], "data.weights: [-1] must be non-negative with a positive sum"),
    (["data.splits_string=90-10"], "data.splits_string: expected three comma-separated numbers"),
    (["model.optim.name=adamx"], "model.optim.name: unknown optimizer 'adamx'"),
    (["trainer.max_steps=${nope}"], "cannot resolve interpolation at 'trainer.max_steps'"),
    (["trainer.max_steps=[1,"], "bad override 'trainer.max_steps=[1,'"),
    (["trainer.max_steps"], "bad override 'trainer.max_steps'"),
    (["~model.no_such_key"], "bad override '~model.no_such_key': 'model.no_such_key' is not in the config"),
    (["--foo"], "unknown option '--foo'"),
    (["+model_alignment_strategy.sfd.packing=true"], "unknown key 'model_alignment_strategy.sfd' (did you mean"),
    (["model.transformer_block_type=gptj"],
     "model.transformer_block_type: expected one of ['pre_ln', 'post_ln', 'normformer', 'gpt_j'], got 'gptj'"),
    (["model.rotary_percentage=0"], "model.rotary_percentage: must be in (0, 1], got 0.0"),
    (["model.rotary_percentage=1.5"], "model.rotary_percentage: must be in (0, 1], got 1.5"),
    (["model.rotary_percentage=0.1"],  # of head_dim 32: 3 dimensions
     "model.rotary_percentage: 0.1 of the head dimension 32 is 3 dimensions; rotary embedding needs an even number"),
    (["model.rotary_emb_base=500", "model.rope_theta=10000"],
     "model.rotary_emb_base (500.0) and model.rope_theta (10000.0) are the same setting"),
    (["model.transformer_block_type=normformer", "model.moe.num_experts=4"],
     "model.transformer_block_type normformer with model.moe: the experts have no FFN norm"),
])
def test_error_messages(overrides, expected):
    assert expected in error(*overrides)


def test_one_parser_per_concept():
    """data_prefix split aliases, fms-fsdp sharding spellings and the precision rules: validation
    and the run read the same table (nxdt.spec.data / sharding / precision_settings)."""
    from nxdt.spec.data import data_blend
    from nxdt.spec.precision import precision_settings
    from nxdt.spec.parallel import SHARDING_MODES, sharding_mode, sharding_mode_of

    cfg = load("data.data_prefix={train: a, val: b}")
    assert data_blend(cfg.data).pairs("validation") == ((1.0, "b"),)
    for name, (shard, reshard, hybrid) in {"FSDP": (1, 1, 0), "fsdp": (1, 1, 0), "full_shard": (1, 1, 0),
                                           "grad-shard": (1, 0, 0), "HSDP": (1, 1, 1), "hybrid_shard": (1, 1, 1),
                                           "hybrid-grad-shard": (1, 0, 1), "DDP": (0, 1, 0), "no_shard": (0, 1, 0),
                                           }.items():
        mode = sharding_mode(name)
        assert (mode.shard, mode.reshard_after_forward, mode.hybrid) == (shard, reshard, hybrid), name
    assert sharding_mode_of(load("distributed_strategy.fsdp=true").distributed_strategy).shard
    assert sharding_mode_of(load("distributed_strategy.sharding_strategy=hsdp").distributed_strategy).hybrid
    assert not sharding_mode_of(load().distributed_strategy).shard
    assert list(SHARDING_MODES)[:2] == ["FSDP", "HSDP"]
    s = precision_settings(load("precision.fp16.enabled=true").precision)
    assert (s.mode, s.compute_dtype, s.fp16) == ("master", "fp16", True)
    assert precision_settings(load("precision.type=mixed_precision_SR").precision).stochastic


def test_run_spec_resolves_each_piece_once():
    """build_spec: the pieces a run reads, every alias resolved (nxdt.spec.RunSpec)."""
    import dataclasses

    from nxdt.spec import build_spec

    spec = build_spec(load("distributed_strategy.sharding_strategy=hsdp", "precision.type=mixed_precision_SR",
                           "model.fusions.torch_compile=true"), 2)
    assert (spec.layout.world_size, spec.layout.dp) == (2, 2)
    assert spec.sharding.hybrid and spec.compile and spec.precision.ptype == "mixed_precisionSR"
    assert spec.alignment.preference is None and spec.moe.num_experts == 0
    assert spec.model.num_layers == spec.cfg.model.num_layers and spec.model.head_dim
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.compile = False  # type: ignore[misc]
    mix = build_spec(load(name="tiny_mixtral_cpu", world_size=None, check_supported=False))
    assert mix.moe.enabled and mix.moe.gate_type == "mixtral"
    dpo = build_spec(load(name="tiny_llama_dpo_cpu", world_size=None))
    assert dpo.alignment.preference == "dpo" and dpo.data_kind == "preference"


def test_world_size_mismatch():
    assert error(world_size=4) == ("trainer.devices (2) x trainer.num_nodes (1) = 2 does not match the world size 4")


def test_parallel_degrees_must_divide_world():
    msg = error("distributed_strategy.tensor_model_parallel_size=3", check_supported=False)
    assert "= 3 does not divide the world size 2" in msg


def test_heads_not_divisible_by_tp():
    msg = error("distributed_strategy.tensor_model_parallel_size=3", "trainer.devices=6", world_size=6,
                check_supported=False)
    assert msg == "model.num_attention_heads (8) is not divisible by distributed_strategy.tensor_model_parallel_size (3)"


def test_missing_config_and_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'nope' not found in .*conf \(available: .*tiny_llama_cpu"):
        load(name="nope")
    with pytest.raises(ConfigError, match="no config given: pass --config-name"):
        compose(["--config-path", str(CONF)])
    with pytest.raises(ConfigError, match="config directory not found"):
        compose(["-cp", str(tmp_path / "absent"), "-cn", "x"])


def test_malformed_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "bad.yaml").write_text("name: x\ntrainer:\n  devices: [1, 2\n  num_nodes: 1\n")
    with pytest.raises(ConfigError) as info:
        compose(["--config-path=conf", "--config-name=bad.yaml"])
    msg = str(info.value)
    assert msg.startswith("conf/bad.yaml: malformed YAML at line 4:"), msg
    assert "\n" not in msg
    (tmp_path / "conf" / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        compose(["-cp", "conf", "-cn", "list"])


def test_missing_data_files_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    msg = error(f"data.tokenizer.type={tok}", check_paths=True)
    assert msg == (f"data.data_prefix: indexed dataset file not found: "
                   f"{tmp_path / 'data/kjv/kjv_text_document.bin'} ({MAKE_DATA_HINT})")
    make_kjv(tmp_path)
    msg = error(f"data.tokenizer.type={tmp_path / 'missing_tok'}", check_paths=True)
    assert msg == f"data.tokenizer.type: tokenizer directory not found: {tmp_path / 'missing_tok'}"
    load(f"data.tokenizer.type={tok}", check_paths=True)
    # weighted blend with two prefixes, the second missing its .idx
    (tmp_path / "b.bin").write_bytes(b"x")
    msg = error(f"data.tokenizer.type={tok}", f"data.data_prefix=[0.5,data/kjv/kjv_text_document,0.5,{tmp_path}/b]",
                check_paths=True)
    assert msg == f"data.data_prefix: indexed dataset file not found: {tmp_path / 'b.idx'} ({MAKE_DATA_HINT})"


def test_hf_paths(tmp_path):
    msg = error(f"data.train_dir={tmp_path / 'none'}", name="hf_llama3_8B_config", world_size=None,
                check_supported=False, check_paths=True)
    assert msg == f"data.train_dir: data path not found: {tmp_path / 'none'}"
    msg = error(f"data.train_dir={tmp_path}", "model.model_config=/no/config.json", name="hf_llama3_8B_config",
                world_size=None, check_supported=False, check_paths=True)
    assert msg == "model.model_config: transformers config.json not found: /no/config.json"


# ----------------------------------------------------------------------------- coercion and normalisation
def test_numbers_as_strings_and_ints_for_floats():
    cfg = load("trainer.gradient_clip_val='0.5'", "model.optim.lr='3e-4'", "model.init_method_std=1",
               "model.layernorm_epsilon='1e-6'")
    assert cfg.trainer.gradient_clip_val == 0.5 and isinstance(cfg.model.init_method_std, float)
    assert cfg.model.optim["lr"] == pytest.approx(3e-4) and isinstance(cfg.model.optim["lr"], float)
    assert cfg.model.layernorm_epsilon == pytest.approx(1e-6)


def test_yaml_string_numbers(tmp_path):
    # pyyaml (YAML 1.1) reads 3e-4 as a string; a file written that way must still work
    text = (CONF / "tiny_llama_cpu.yaml").read_text().replace("lr: 1e-3", "lr: '3e-4'")
    (tmp_path / "t.yaml").write_text(text)
    cfg = load(name="t", config_dir=tmp_path)
    assert cfg.model.optim["lr"] == pytest.approx(3e-4)


def test_both_sr_spellings_and_normalisation():
    for spelling in ("mixed_precisionSR", "mixed_precision_SR"):
        cfg = load(f"precision.type={spelling}", check_supported=False)
        assert nenv.precision_env(cfg) == nenv.PRECISION_PRESETS["mixed_precisionSR"]
    notices = []
    cfg = compose(["-cp", str(CONF), "-cn", "tiny_llama_cpu", "distributed_strategy.sequence_parallel=true",
                   "distributed_strategy.virtual_pipeline_model_parallel_size=null"], notices=notices)
    assert cfg.distributed_strategy.sequence_parallel is False
    assert cfg.distributed_strategy.virtual_pipeline_model_parallel_size == 1
    assert notices == ["distributed_strategy.sequence_parallel needs tensor_model_parallel_size > 1: turned off"]


def test_schema_defaults_overrides_and_struct():
    cfg = load("model.rope_theta=500000", "~model.init_method_std", "model.sliding_window_size=64")
    assert cfg.model.rope_theta == 500000.0 and cfg.model.init_method_std == 0.02  # ~key -> default
    assert cfg.model.sliding_window_size == 64 and cfg.model.vocab_size is None
    assert cfg.exp_manager.version is None and cfg.trainer.accelerator == "auto"
    with pytest.raises(AttributeError):
        cfg.model.not_a_key  # noqa: B018 - typed config: unknown reads fail
    # open mappings are replaced as a whole, not merged with the default optimizer
    tiny_sched = load().model.optim["sched"]
    assert set(tiny_sched) == {"name", "warmup_steps", "constant_steps", "min_lr", "max_steps"}
    optim = load("model.optim={name: sgd, lr: 0.1}").model.optim
    assert optim["name"] == "sgd" and "betas" not in optim and "sched" not in optim
    assert load("model.optim.lr=0.5").model.optim["betas"] == [0.9, 0.95]  # a leaf override keeps the rest


def test_free_form_sections():
    assert "unknown key 'data.my_key'" in error("+data.my_key=1")
    cfg = load("data.data_module=my_pkg.data.MyModule", "+data.my_key=1", "+data.nested.x=[1,2]",
               check_supported=False)
    assert cfg.data.custom == {"my_key": 1, "nested": {"x": [1, 2]}}  # the keys nxdt does not know
    assert "unknown key 'data.custom'" in error("+data.custom={a: 1}")  # filled by nxdt, not a YAML key
    assert "data.data_module: expected 'package.module.ClassName'" in error("data.data_module=oops",
                                                                               check_supported=False)
    cfg = load("model.rope_scaling={rope_type: llama3, factor: 8.0}")
    assert cfg.model.rope_scaling["rope_type"] == "llama3"


def test_saved_yaml_round_trips(tmp_path):
    """to_yaml (the saved config.yaml) loads back to the same typed config, custom data keys
    back under data: (and into data.custom again)."""
    from nxdt.config import to_yaml

    cfg = load("data.data_module=my_pkg.data.MyModule", "+data.chapters=7", check_supported=False)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert "  chapters: 7" in (tmp_path / "config.yaml").read_text()
    again = load(name="config", config_dir=tmp_path, check_supported=False)
    assert again == cfg and again.data.custom == {"chapters": 7}


def test_not_supported_table_is_consistent():
    from nxdt.config.schema import NxdtConfig
    from nxdt.config.typed import select

    d = NxdtConfig()
    for key, predicate in NOT_SUPPORTED_YET.items():
        assert not predicate(select(d, key)), f"schema default of {key} would be rejected"  # a typo raises


# ----------------------------------------------------------------------------- resolvers
def test_resolvers():
    resolvers.register()
    resolvers.register()  # idempotent
    cfg = OmegaConf.create({"a": "${multiply:2,3}", "b": "${nxdt_asset:tokenizer}",
                            "c": "${nxdt_conf:model_configs/llama3_8B/config.json}"})
    assert cfg.a == 6
    assert cfg.b == str(REPO / "src" / "nxdt" / "assets" / "tokenizer")
    resolvers.set_config_dir(None)
    assert cfg.c == str(CONF / "model_configs" / "llama3_8B" / "config.json")


def test_nxdt_conf_prefers_the_config_dir(tmp_path):
    (tmp_path / "model_configs" / "mine").mkdir(parents=True)
    (tmp_path / "model_configs" / "mine" / "config.json").write_text("{}")
    text = (CONF / "hf_llama3_8B_config.yaml").read_text()
    (tmp_path / "h.yaml").write_text(text)
    cfg = load(name="h", config_dir=tmp_path, world_size=None, check_supported=False)
    # not in tmp_path -> the shipped conf/ one
    assert cfg.model.model_config == str(CONF / "model_configs" / "llama3_8B" / "config.json")
    cfg = load("model.model_config=${nxdt_conf:model_configs/mine/config.json}", name="h", config_dir=tmp_path,
               world_size=None, check_supported=False)
    assert cfg.model.model_config == str(tmp_path / "model_configs" / "mine" / "config.json")


# ----------------------------------------------------------------------------- env
EXPECTED_ENV = {
    "mixed_precision": ("0", "1", "0", "--enable-mixed-precision-accumulation"),
    "mixed_precisionSR": ("0", "1", "1", "--enable-mixed-precision-accumulation"),
    "mixed_precision_SR": ("0", "1", "1", "--enable-mixed-precision-accumulation"),
    "bf16SR": ("1", "0", "1", "--enable-mixed-precision-accumulation"),
    "fp32": ("0", "0", None, "--auto-cast none"),
    "autocast": ("0", "0", "0", "--enable-mixed-precision-accumulation --auto-cast none"),
}


@pytest.mark.parametrize("ptype", sorted(EXPECTED_ENV))
def test_precision_env_table(ptype):
    cfg = load(f"precision.type={ptype}", check_supported=False)
    environ: dict[str, str] = {}
    assert apply_env(cfg, environ, is_xla=True) == []
    bf16, down, sr, flags = EXPECTED_ENV[ptype]
    assert environ["XLA_USE_BF16"] == bf16 and environ["XLA_DOWNCAST_BF16"] == down
    assert environ.get("NEURON_RT_STOCHASTIC_ROUNDING_EN") == sr
    assert environ["NEURON_CC_FLAGS"] == flags
    assert environ["NEURON_FUSE_SOFTMAX"] == "1"


def test_manual_precision_env():
    cfg = load("precision.type=manual", "precision.xla_use_bf16=1", "precision.xla_downcast_bf16='0'",
               "precision.neuron_rt_stochastic_rounding_en=1", check_supported=False)
    environ: dict[str, str] = {}
    apply_env(cfg, environ, is_xla=True)
    assert (environ["XLA_USE_BF16"], environ["XLA_DOWNCAST_BF16"], environ["NEURON_RT_STOCHASTIC_ROUNDING_EN"]) == (
        "1", "0", "1")
    assert "NEURON_CC_FLAGS" not in environ


def test_neuron_knobs_respect_user_env():
    cfg = load(name="megatron_llama_7B_config", world_size=None, check_supported=False)
    environ = {"XLA_DOWNCAST_BF16": "0", "BUCKET_CAP_MB": "64",
               "NEURON_CC_FLAGS": "--model-type=transformer --enable-mixed-precision-accumulation -O1"}
    apply_env(cfg, environ, is_xla=True)
    assert environ["XLA_DOWNCAST_BF16"] == "0" and environ["BUCKET_CAP_MB"] == "64"  # kept
    assert environ["NEURON_CC_FLAGS"] == ("--model-type=transformer --enable-mixed-precision-accumulation -O1 "
                                          "--distribution-strategy=llm-training")
    assert environ["NEURON_COMPILE_CACHE_URL"] == "/home/ubuntu/neuron_cache"
    assert environ["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "5"
    assert environ["NEURON_RT_EXEC_TIMEOUT"] == "100" and environ["NEURON_EXPERIMENTAL_COMPRESS_RG"] == "0"


def test_inert_keys_off_xla():
    cfg = load(name="megatron_llama_7B_config", world_size=None, check_supported=False)
    environ: dict[str, str] = {}
    inert = apply_env(cfg, environ, is_xla=False)
    assert environ == {}
    assert {"compiler_flags", "compiler_cache_url", "aync_exec_max_inflight_requests", "bucket_size_collectives",
            "neuron_rt_exec_timeout", "exp_manager.save_xser"} <= set(inert)
    assert nenv.format_inert(inert).startswith("Neuron-only settings have no effect on this device: ")
    assert apply_env(load(), {}, is_xla=False) == []  # the tiny config sets none
    assert nenv.detect_xla(load("trainer.accelerator=xla", "trainer.devices=1", world_size=1), {}) is True
    assert nenv.detect_xla(load("trainer.accelerator=cpu"), {"PJRT_DEVICE": "NEURON"}) is False


def test_compile_smoke_mode():
    cfg = load("exp_manager.create_checkpoint_callback=true")
    apply_env(cfg, {"COMPILE": "1"}, is_xla=False)
    assert cfg.trainer.max_steps == 10
    assert cfg.exp_manager.create_tensorboard_logger is False and cfg.exp_manager.create_checkpoint_callback is False
    cfg = load()
    apply_env(cfg, {}, is_xla=False)
    assert cfg.trainer.max_steps == 300


# ----------------------------------------------------------------------------- layout
def test_layout_numbers():
    from dataclasses import replace

    from nxdt.config.typed import to_typed

    cfg = to_typed({
        "trainer": {"devices": 8, "num_nodes": 1},
        "distributed_strategy": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        "data": {"micro_batch_size": 2, "global_batch_size": 32, "seq_length": 128},
    })
    lay = compute_layout(cfg, 8)
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.vpp) == (2, 2, 1, 2, 1)
    assert (lay.num_microbatches, lay.local_batch_size, lay.tokens_per_step) == (8, 16, 32 * 128)
    assert compute_layout(cfg).world_size == 8
    with pytest.raises(ConfigError, match=r"data.global_batch_size \(32\) is not divisible by "
                                          r"data.micro_batch_size \(3\) x data-parallel size \(2\) = 6"):
        compute_layout(replace(cfg, data=replace(cfg.data, micro_batch_size=3)), 8)


# ----------------------------------------------------------------------------- entry helpers
def test_main_guard(capsys, monkeypatch):
    def bad():
        raise ConfigError("model.x: broken")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("NXDT_FULL_ERROR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        main_guard(bad)()
    assert info.value.code == 2 and capsys.readouterr().err == "error: model.x: broken\n"
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        main_guard(bad)()
    assert info.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("NXDT_FULL_ERROR", "1")
    with pytest.raises(ConfigError):
        main_guard(bad)()
    assert main_guard(lambda x: x + 1)(1) == 2


def test_describe_and_light_import():
    text = describe("model")
    assert "model.hidden_size (int >= 1 or null, default null)" in text and "\ntrainer." not in text
    assert "aync_exec_max_inflight_requests" in describe()
    code = ("import sys, nxdt.config, nxdt.config.load, nxdt.config.env; "
            "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
