"""NxDT's last release, moved over unchanged: its 22 training configs (and the 2 removed earlier,
tests/nxdt_release/README.md) plan as shipped, with only `model.model_config` given for the
HF-source ones, and the parameter count equals transformers' for the same architecture (built
on the meta device here). Beside it, the NxDT keys and values those files write, read as NxDT
reads them: the new DPO prompt-length name, the reduce dtype, NxDT's recompute class names,
'None' strings, `capturable`, and NxD's uneven pipeline split."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import REPO
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, MixtralConfig

from nxdt.cli import main as cli
from nxdt.config.errors import ConfigError
from nxdt.config.inert import inert_notice
from nxdt.models.builder import build_model
from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing
from nxdt.spec import build_spec, config_from_dict, load_config
from nxdt.spec.parallel import pipeline_stage_starts
from nxdt.tools.plan import main as plan_main

RELEASE = REPO / "tests" / "nxdt_release"
MODEL_CONFIGS = REPO / "conf" / "model_configs"

# config -> the config.json (conf/model_configs/<folder>) a user gives as model.model_config
HF = {
    "hf_llama3.1_405B_trn1_config": "llama3.1_405B", "hf_llama3_405B_config": "llama3.1_405B",
    "hf_llama3.1_70B_config": "llama3.1_70B", "hf_llama3.1_8B_config": "llama3.1_8B",
    "hf_llama3_70B_CP_config": "llama3_70B", "hf_llama3_70B_config": "llama3_70B",
    "hf_llama3_70B_trn2_config": "llama3_70B",
    "hf_llama3_8B_DPO_config": "llama3_8B", "hf_llama3_8B_ORPO_config": "llama3_8B",
    "hf_llama3_8B_SFT_config": "llama3_8B", "hf_llama3_8B_SFT_lora_config": "llama3_8B",
    "hf_llama3_8B_config": "llama3_8B", "hf_llama3_8B_trn2_config": "llama3_8B",
    "hf_llama_7B_config": "llama2_7B", "hf_mistral_7B_SFT_config": "mistral_7B",
    "hf_mixtral_8x7b_config": "mixtral_8x7b", "hf_mixtral_8x7b_dropless_config": "mixtral_8x7b",
}
MEGATRON = ["megatron_gpt_config", "megatron_llama2_7B_SFT_config", "megatron_llama_70b_config",
            "megatron_llama_7B_config", "megatron_mistral_config", "megatron_mixtral_8x7b_config",
            "megatron_mixtral_8x7b_dropless_config"]
ALL = sorted([*HF, *MEGATRON])

# SFT before model_alignment_strategy (NxDT 2.20): one line that names the override to paste
SFT_FIX = "model_alignment_strategy.sft.packing=true"
PREDATES_SFT = {"hf_mistral_7B_SFT_config", "megatron_llama2_7B_SFT_config"}
# NxDT's HF Mixtral runs NxD's MoE layer: nxdt builds its own MoE block under transformers' names, so
# their capacity factor (2.0; 0.0 with dropless) applies, and its experts split over tp as NxD's do.
HF_MIXTRAL = ("hf_mixtral_8x7b_config", "hf_mixtral_8x7b_dropless_config")


def test_the_release_is_all_here():
    assert sorted(p.stem for p in RELEASE.glob("*.yaml")) == ALL and len(ALL) == 24


def _argv(name: str, *extra: str) -> list[str]:
    model_config = [f"model.model_config={MODEL_CONFIGS / HF[name] / 'config.json'}"] if name in HF else []
    return ["--config-path", str(RELEASE), "--config-name", name, *model_config, *extra]


def _plan(capsys, name: str, *extra: str) -> dict:
    assert plan_main([*_argv(name, *extra), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _refusal(capsys, name: str, *extra: str) -> list[str]:
    assert cli(["plan", *_argv(name, *extra)]) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --------------------------------------------------------------------------- transformers' counts
def _padded_vocab(yaml_cfg) -> int:
    """Megatron's padding of the tokenizer's size to make_vocab_size_divisible_by x tp."""
    base = 50257 if yaml_cfg.data.tokenizer.type == "GPT2BPETokenizer" else 32000  # GPT-2 BPE | Llama-2 SP
    step = yaml_cfg.model.make_vocab_size_divisible_by * yaml_cfg.distributed_strategy.tensor_model_parallel_size
    return -(-base // step) * step


def _transformers_config(name: str):
    """transformers' config of the architecture the YAML describes (as NxDT builds it)."""
    y = OmegaConf.load(RELEASE / f"{name}.yaml")
    m = y.model
    if name in HF:  # NxDT's HF modules: config.json, num_layers / hidden_size from the YAML
        js = json.loads((MODEL_CONFIGS / HF[name] / "config.json").read_text())
        js["num_hidden_layers"], js["hidden_size"] = m.num_layers, m.hidden_size
        return AutoConfig.for_model(js.pop("model_type"), **js)
    vocab = _padded_vocab(y)
    if m.activation == "gelu":  # GPT: layernorm, biases, learned positions, tied embeddings = GPT-2's tree
        assert m.position_embedding_type == "learned_absolute" and m.has_bias and m.share_embeddings_and_output_weights
        return GPT2Config(vocab_size=vocab, n_positions=m.encoder_seq_length, n_embd=m.hidden_size,
                          n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size)
    common = dict(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_kv_heads, tie_word_embeddings=m.share_embeddings_and_output_weights)
    if m.get("moe") and m.moe.num_experts > 0:
        return MixtralConfig(num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k, **common)
    return LlamaConfig(attention_bias=m.has_bias, mlp_bias=m.has_bias, **common)


@functools.cache
def transformers_count(name: str) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_transformers_config(name))
    return sum(p.numel() for p in model.parameters())


def test_reference_counts_are_the_published_ones():
    """The reference itself: transformers' counts of the published models (their model cards)."""
    assert transformers_count("hf_llama3_8B_config") == 8_030_261_248  # Meta-Llama-3-8B
    assert transformers_count("hf_llama3.1_70B_config") == 70_553_706_496  # Llama-3.1-70B
    assert transformers_count("hf_llama3_405B_config") == 405_853_388_800  # Llama-3.1-405B
    assert transformers_count("hf_mistral_7B_SFT_config") == 7_241_732_096  # Mistral-7B-v0.1
    assert transformers_count("megatron_llama_7B_config") == 6_738_415_616  # Llama-2-7b


@pytest.mark.parametrize("name", [n for n in ALL if n not in PREDATES_SFT])
def test_every_release_config_plans_exactly_as_shipped(capsys, name):
    p = _plan(capsys, name)
    assert p["parameters"] == transformers_count(name), name
    if name not in HF:
        assert p["vocab_size"] == _padded_vocab(OmegaConf.load(RELEASE / f"{name}.yaml"))
    if p["layout"]["pp"] > 1:
        assert sum(p["parameters_per_stage"]) == p["parameters"]
        assert sum(p["layers_per_stage"]) == OmegaConf.load(RELEASE / f"{name}.yaml").model.num_layers


@pytest.mark.parametrize("name", sorted(PREDATES_SFT))
def test_sft_before_model_alignment_strategy_names_the_override(capsys, name):
    assert _refusal(capsys, name) == [
        "error: data.packing: SFT is model_alignment_strategy.sft since NxDT 2.21; this config predates it: "
        f"add {SFT_FIX} to the command line"]
    p = _plan(capsys, name, SFT_FIX)  # pasted as printed, it plans
    assert p["parameters"] == transformers_count(name)


@pytest.mark.parametrize("name", HF_MIXTRAL)
def test_hf_mixtral_plans_at_nxdts_layout_within_a_neuron_core(capsys, name):
    """As shipped: tp 32 x pp 4 (8 layers a stage), sequence parallel, ZeRO-1 over dp 2 of 256 ranks.
    Each expert's intermediate dimension is split over tp as NxD splits it, so a rank holds 1/32 of
    every expert: 4.7 GiB per rank (126.8 GiB while experts were whole on each tp rank), under
    the 16 GiB of the Trn1 NeuronCore NxDT ran it on."""
    p = _plan(capsys, name)
    assert (p["layout"]["tp"], p["layout"]["pp"], p["layers_per_stage"]) == (32, 4, [8, 8, 8, 8])
    hidden, ffn, experts, kv_dim, vocab = 4096, 14336, 8, 1024, 32000
    attention = (2 * hidden * hidden) // 32 + 2 * hidden * kv_dim // 8  # q, o over tp; one K/V head per rank (8 heads)
    layer = attention + experts * 3 * hidden * ffn // 32 + experts * hidden + 2 * hidden  # experts / tp, router, norms
    assert p["parameters_per_rank"] == 8 * layer + vocab * hidden // 32 + hidden == 373_526_528  # the last stage
    assert p["memory_per_rank_bytes"]["total"] < 16 * 2**30
    cfg = _cfg(name)
    moe = build_model(cfg, None, device="meta").model.layers[0].mlp
    assert (moe.args.capacity_factor, moe.args.dropless) == ((0.0, True) if "dropless" in name else (2.0, False))


# --------------------------------------------------------------------------- uneven pipeline splits
def nxd_create_partitions(pipeline_parallel_size, model_layer_names):
    """NxD's own function, verbatim but for its asserts (aws-neuron/neuronx-distributed,
    src/neuronx_distributed/pipeline/partition.py at fbac349b61a3adbb123c2983835af692840ff62f)."""
    num_hidden_layers = len(model_layer_names)
    num_layer_per_partition = num_hidden_layers // pipeline_parallel_size
    layers_per_partition = [num_layer_per_partition for x in range(pipeline_parallel_size)]
    remainder = num_hidden_layers % pipeline_parallel_size
    if remainder > 0:
        for i in range(-remainder, 0):
            layers_per_partition[i] += 1
    pipeline_cuts = []
    current_cut = 0
    for layers in layers_per_partition[:-1]:
        current_cut += layers
        pipeline_cuts.append(model_layer_names[current_cut - 1])
    return pipeline_cuts


@pytest.mark.parametrize("layers,stages", [(126, 32), (126, 8), (80, 8), (32, 3), (7, 4), (5, 5), (33, 2)])
def test_uneven_split_is_nxds(layers, stages):
    names = [f"model.layers.{i}" for i in range(layers)]
    cuts = nxd_create_partitions(stages, names)
    assert pipeline_stage_starts(layers, stages) == pipeline_stage_starts(layers, stages, cuts)
    sizes = [b - a for a, b in zip(pipeline_stage_starts(layers, stages), pipeline_stage_starts(layers, stages)[1:])]
    assert sizes == sorted(sizes) and max(sizes) - min(sizes) <= 1 and sum(sizes) == layers
    with pytest.raises(ConfigError, match=r"model.num_layers \(3\) is fewer than the 4 pipeline stages"):
        pipeline_stage_starts(3, 4)


def test_405b_splits_as_nxd_and_cuts_still_override(capsys):
    p = _plan(capsys, "hf_llama3_405B_config")  # 126 layers over pp 8
    assert p["layers_per_stage"] == [15, 15, 16, 16, 16, 16, 16, 16]
    trn1 = _plan(capsys, "hf_llama3.1_405B_trn1_config")  # over pp 32
    assert trn1["layers_per_stage"] == [3, 3] + [4] * 30
    cuts = "model.pipeline_cuts=[" + ",".join(f"model.layers.{15 + 16 * i}" for i in range(7)) + "]"
    p = _plan(capsys, "hf_llama3_405B_config", cuts)
    assert p["layers_per_stage"] == [16] * 7 + [14]
    assert plan_main(_argv("hf_llama3_405B_config")) == 0
    assert "  layers/stage 15 x 2, 16 x 6" in capsys.readouterr().out.splitlines()


# --------------------------------------------------------------------------- keys and values NxDT writes
def _cfg(name: str, *extra: str):
    return load_config(_argv(name, *extra), check_paths=False, quiet=True)


def test_none_strings_are_null():
    cfg = _cfg("megatron_mixtral_8x7b_config")
    assert OmegaConf.load(RELEASE / "megatron_mixtral_8x7b_config.yaml").model.moe.sinkhorn_tol == "None"
    assert cfg.model.moe.sinkhorn_tol is None
    tol = [config_from_dict({"model": {"moe": {"sinkhorn_tol": v}}}).model.moe.sinkhorn_tol for v in ("None", "1e-3")]
    assert tol == [None, 0.001]
    with pytest.raises(ConfigError, match=r"^model.moe.sinkhorn_tol: expected float, got 'abc' \(str\)$"):
        config_from_dict({"model": {"moe": {"sinkhorn_tol": "abc"}}})  # refused before the model is built


def test_dpo_prompt_length_under_both_names(capsys):
    key = "model_alignment_strategy.dpo"
    new = build_spec(_cfg("hf_llama3_8B_DPO_config")).alignment  # NxDT >= 2.23: max_prompt_length: 2048
    assert (new.dpo_prompt_length, new.dpo_prompt_length_key) == (2048, f"{key}.max_prompt_length")
    old = build_spec(_cfg("hf_llama3_8B_DPO_config", f"~{key}.max_prompt_length",
                          f"+{key}.max_dpo_prompt_length=1024")).alignment
    assert (old.dpo_prompt_length, old.dpo_prompt_length_key) == (1024, f"{key}.max_dpo_prompt_length")
    both = build_spec(_cfg("hf_llama3_8B_DPO_config", f"+{key}.max_dpo_prompt_length=2048")).alignment
    assert both.dpo_prompt_length == 2048
    assert _refusal(capsys, "hf_llama3_8B_DPO_config", f"+{key}.max_dpo_prompt_length=1024") == [
        f"error: {key}.max_prompt_length (2048) and {key}.max_dpo_prompt_length (1024) differ: they are one "
        "setting (NxDT's new and old name); give one"]
    assert _refusal(capsys, "hf_llama3_8B_DPO_config", f"{key}.max_prompt_length=8192") == [
        f"error: {key}.max_prompt_length (8192) must be below data.seq_length (4096): the response needs room"]


def test_reduce_dtype_is_inert_only_where_it_differs_from_the_compute_dtype():
    cfg = _cfg("hf_llama3_70B_trn2_config")  # mixed_precision, parallel_layers_reduce_dtype: 'bf16'
    assert cfg.precision.parallel_layers_reduce_dtype == "bf16"
    assert "parallel_layers_reduce_dtype" not in (inert_notice(cfg, "cpu") or "")
    fp32 = _cfg("hf_llama3_70B_trn2_config", "precision.parallel_layers_reduce_dtype=fp32")
    assert "precision.parallel_layers_reduce_dtype=fp32: tensor/sequence-parallel reductions run in the compute " \
           "dtype" in inert_notice(fp32, "cuda")
    same = _cfg("hf_llama3_70B_trn2_config", "precision.type=fp32", "precision.parallel_layers_reduce_dtype=fp32")
    assert "parallel_layers_reduce_dtype" not in (inert_notice(same, "cpu") or "")


def test_nxdt_recompute_classes_map_to_nxdts_modules(capsys):
    cfg = _cfg("hf_llama3_70B_trn2_config")  # [LlamaRMSNorm, ActivationMultiplyMLP]
    assert cfg.model.activations_checkpoint_recompute == ["LlamaRMSNorm", "LlamaMLP"]
    tiny = config_from_dict({"model_source": "hf", "data": {"seq_length": 64}, "model": {
        "model_config": str(MODEL_CONFIGS / "tiny_llama" / "config.json"), "activations_checkpoint_granularity":
        "selective", "activations_checkpoint_recompute": ["ActivationMultiplyMLP", "LlamaMLP"]}}, check=True)
    assert tiny.model.activations_checkpoint_recompute == ["LlamaMLP"]
    model = apply_activation_checkpointing(build_model(tiny, None, device="meta"), tiny.model)
    recomputed = [name for name, m in model.named_modules() if getattr(m, "_nxdt_checkpointed", False)]
    assert recomputed == [f"model.layers.{i}.mlp" for i in range(4)]  # tiny_llama: 4 layers


@pytest.mark.parametrize("names, expected", [
    (["MixtralRMSNorm", "LlamaRotaryEmbedding"], [f"model.layers.{i}.{n}" for i in range(2)
                                                 for n in ("input_layernorm", "post_attention_layernorm")]),
    (["MixtralDecoderLayer"], ["model.layers.0", "model.layers.1"]),
    (["MixtralRotaryEmbedding"], []),  # nxdt computes the rotary tables once per forward, outside the blocks
])
def test_nxdt_mixtral_recompute_classes_on_the_native_moe_model(names, expected):
    cfg = config_from_dict({"model": {
        "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
        "vocab_size": 256, "moe": {"num_experts": 4, "top_k": 2},
        "activations_checkpoint_granularity": "selective", "activations_checkpoint_recompute": names},
        "data": {"seq_length": 64}}, check=True)
    model = apply_activation_checkpointing(build_model(cfg, 256, device="meta"), cfg.model)
    assert [name for name, m in model.named_modules() if getattr(m, "_nxdt_checkpointed", False)] == expected


def test_capturable_is_inert_off_cuda_and_xla():
    cfg = _cfg("megatron_llama_7B_config")  # optim.capturable: True
    assert "model.optim.capturable=true: a CUDA-graph / XLA option" in inert_notice(cfg, "cpu")
    assert "capturable" not in (inert_notice(cfg, "cuda") or "") and "capturable" not in (inert_notice(cfg, "xla") or "")
