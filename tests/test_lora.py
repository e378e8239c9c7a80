"""LoRA (nxdt.models.lora), one process: the same logits as `peft` on the same weights for every model
source, NxDT's target names, what is trained, merging, the base on demand, meta-device init, precision
presets, and `nxdt convert nxdt-to-hf` of LoRA checkpoints into a merged model, a base and a PEFT adapter
that peft and transformers load. Multi-process layouts: tests/test_lora_parallel.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import TOKENIZER_DIR
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from torch import nn
from transformers import AutoModelForCausalLM

from nxdt.checkpoint.checkpointer import save_weights
from nxdt.config import to_yaml
from nxdt.spec import build_spec, config_from_dict
from nxdt.spec.alignment import alignment_of
from nxdt.models import build_model, init_model_weights, logits_of
from nxdt.models.lora import (
    LoraLinear,
    adapters_disabled,
    inject_lora,
    is_lora_key,
    lora_modules,
    lora_parameter_counts,
    lora_scalings,
    merge_lora_,
    merged_state_dict,
    peft_adapter_state,
    trainable_state_keys,
)

V = 512
RANK, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NXDT_NAMES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # the same seven, as NxDT spells them
NEOX_HF_NAMES = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4, "num_kv_heads": 2,
        "max_position_embeddings": 128, "make_vocab_size_divisible_by": 8, "init_method_std": 0.02}
# the native GPT-NeoX / Pythia architecture (as tests/test_convert.py): gelu (no gate_proj), biases, layernorm
NEOX = {"normalization": "layernorm", "activation": "gelu", "has_bias": True, "transformer_block_type": "gpt_j",
        "gpt_j_tied": False, "rotary_percentage": 0.25, "num_kv_heads": 4}
IDS = torch.arange(24).reshape(2, 12) * 37 % V


def _cfg(source: str = "megatron", peft: dict | None = None, **model):
    """megatron (native), hf (transformers Llama), hf_neox (transformers GPT-NeoX), mixtral (hf MoE)."""
    if source == "megatron":
        model_keys = {**TINY, **model}
    else:
        folder = {"hf": "tiny_llama", "hf_neox": "tiny_neox", "mixtral": "tiny_mixtral"}[source]
        model_keys = {"model_config": f"model_configs/{folder}", "num_layers": 2, "hidden_size": 64, **model}
    values = {"model_source": "megatron" if source == "megatron" else "hf", "model": model_keys,
              "distributed_strategy": {"tensor_model_parallel_size": 1},
              "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}}
    if peft is not None:
        values["model_alignment_strategy"] = {"peft": peft}
    return config_from_dict(values)


def _model(source: str = "megatron", seed: int = 0, **model) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(_cfg(source, **model), vocab_size=V).eval()


def _random_b(model: nn.Module, seed: int = 1) -> None:
    """B away from its zero init, so the adapters change the logits (and A gets gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model(input_ids=ids))


def _as_transformers(native: nn.Module) -> nn.Module:
    """transformers' model (Llama or GPT-NeoX) with the native model's weights."""
    from transformers import AutoConfig

    from nxdt.models.hf_export import hf_config_dict
    from nxdt.models.neox import native_to_neox

    d = hf_config_dict(native.args)
    config = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    state = native.state_dict()
    if config.model_type == "gpt_neox":
        state = native_to_neox(state, native.args.num_attention_heads, output_key="lm_head.weight")
    hf.load_state_dict(state, strict=True)
    return hf


def _peft_twin(base: nn.Module, nxdt_lora: nn.Module, targets: list[str], bias: str = "none",
               modules_to_save: list[str] | None = None) -> nn.Module:
    """peft's LoRA on `base` (the same base weights) with nxdt's adapter weights copied in, by name."""
    twin = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0,
                                           bias=bias, modules_to_save=modules_to_save))
    mine = dict(nxdt_lora.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if ".lora_" in name:
                p.copy_(mine[_nxdt_name(name)])
                copied += 1
    assert copied == sum(is_lora_key(n) for n in mine)
    return twin.eval()


def _nxdt_name(peft_name: str) -> str:
    """nxdt's name of a peft parameter (adapter or modules_to_save copy)."""
    return peft_name.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".").replace(
        ".default", "")


# ----------------------------------------------------------------------------- parity with peft
@pytest.mark.parametrize("source", ["megatron", "hf", "hf_neox"])
def test_logits_equal_peft_on_the_same_weights(source):
    """nxdt's LoRA on NxDT's names = peft's on transformers' model with the same weights and adapters.
    (A native GPT-NeoX's adapters are checked through `nxdt convert`: test_convert_native_neox.)"""
    if source == "megatron":
        model = _model()
        base, peft_targets = _as_transformers(model), ALL
    else:
        model = _model(source)
        base, peft_targets = copy.deepcopy(model), ALL if source == "hf" else NEOX_HF_NAMES
    wrapped = inject_lora(model, NXDT_NAMES, RANK, ALPHA, dropout=0.0)
    assert len(wrapped) == 2 * len(peft_targets)
    _random_b(model)
    twin = _peft_twin(base, model, peft_targets)
    assert (_logits(model) - _logits(twin)).abs().max().item() < 1e-5
    trained = {_nxdt_name(n) for n, p in twin.named_parameters() if p.requires_grad}
    assert set(trainable_state_keys(model)) == trained


def test_adapter_state_has_peft_keys_in_every_bias_mode():
    """peft_adapter_state of a biased model = the keys peft's own get_peft_model_state_dict saves."""
    for bias in ("none", "lora_only", "all"):
        model = _model(has_bias=True)
        base = _as_transformers(model)
        inject_lora(model, ["qkv_proj", "down_proj"], RANK, ALPHA, bias=bias)
        twin = _peft_twin(base, model, ["q_proj", "k_proj", "v_proj", "down_proj"], bias=bias)
        ours = peft_adapter_state(model.state_dict(), bias)
        theirs = get_peft_model_state_dict(twin)
        assert set(ours) == {f"base_model.model.{k}" if not k.startswith("base_model.") else k for k in theirs}
        for key, t in theirs.items():
            assert torch.equal(ours[key if key.startswith("base_model.") else f"base_model.model.{key}"], t)


# ----------------------------------------------------------------------------- targets
def test_nxdt_aliases_mean_the_plain_names():
    fused = inject_lora(_model(), ["qkv_proj", "gate_up_proj"], RANK, ALPHA)
    plain = inject_lora(_model(), ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], RANK, ALPHA)
    assert fused == plain and len(fused) == 10
    assert fused[:3] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def test_invalid_target_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        inject_lora(_model(), ["qkv_proj", "lm_head"], RANK, ALPHA)
    assert str(err.value) == (
        "model_alignment_strategy.peft.target_modules: 'lm_head' is not a linear layer of this model; valid: "
        "['down_proj', 'gate_proj', 'gate_up_proj', 'k_proj', 'o_proj', 'q_proj', 'qkv_proj', 'up_proj', 'v_proj']")
    with pytest.raises(ValueError, match=r"'gate_proj' is not a linear.*valid: \['down_proj', 'gate_up_proj', "
                                         r"'k_proj', 'o_proj', 'q_proj', 'qkv_proj', 'up_proj', 'v_proj'\]"):
        inject_lora(_model(**NEOX), ["gate_proj"], RANK, ALPHA)  # gelu: no gate
    with pytest.raises(ValueError, match=r"'q_proj' is not a linear.*valid: \['dense', 'dense_4h_to_h', "
                                         r"'dense_h_to_4h', 'down_proj', 'gate_up_proj', 'o_proj', 'qkv_proj', "
                                         r"'query_key_value', 'up_proj'\]"):
        inject_lora(_model("hf_neox"), ["q_proj"], RANK, ALPHA)  # one fused QKV linear


def test_transformers_neox_takes_nxdt_and_its_own_names():
    ours = inject_lora(_model("hf_neox"), NXDT_NAMES, RANK, ALPHA)
    own = inject_lora(_model("hf_neox"), NEOX_HF_NAMES, RANK, ALPHA)
    assert ours == own and ours[:4] == [f"gpt_neox.layers.0.{m}" for m in
                                        ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                                         "mlp.dense_4h_to_h")]


@pytest.mark.parametrize("source", ["megatron", "mixtral"])
def test_moe_experts_and_router_are_not_targets(source):
    """Stacked expert weights are no nn.Linear; `gate_proj` never matches the router `mlp.gate`."""
    keys = {"moe": {"num_experts": 4, "top_k": 2}} if source == "megatron" else {}
    model = _model(source, **keys)
    with pytest.raises(ValueError, match=r"'gate_proj' is not a linear layer.*valid: \['k_proj', 'o_proj', "
                                         r"'q_proj', 'qkv_proj', 'v_proj'\]"):
        inject_lora(model, ["gate_proj"], RANK, ALPHA)
    wrapped = inject_lora(model, ["qkv_proj", "o_proj"], RANK, ALPHA)
    assert all(".self_attn." in path for path in wrapped) and len(wrapped) == 8
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".mlp." in n)


@pytest.mark.parametrize("key, kwargs", [
    ("lora_rank", {"rank": 0}), ("lora_rank", {"rank": -2}), ("lora_alpha", {"alpha": 0.0}),
    ("lora_dropout", {"dropout": 1.0}), ("lora_dropout", {"dropout": -0.1}), ("lora_bias", {"bias": "some"}),
])
def test_bad_values_name_the_key(key, kwargs):
    args = {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "bias": "none", **kwargs}
    with pytest.raises(ValueError, match=rf"^model_alignment_strategy\.peft\.{key}: must"):
        inject_lora(_model(), ["qkv_proj"], **args)


# ----------------------------------------------------------------------------- modules_to_save
SAVE = ["embed_tokens", "lm_head", "norm"]  # peft's suffix rule: norm is model.norm and every layer's two norms


@pytest.mark.parametrize("source", ["megatron", "hf"])
def test_modules_to_save_train_and_save_as_peft(source):
    """peft's modules_to_save (LLaMA-MoE's cpt_lora.py passes its --modules_to_save to LoraConfig): the same
    parameters require grad, the same values after 2 AdamW steps, the same adapter file as peft's own."""
    model = _model(source)
    base = _as_transformers(model) if source == "megatron" else copy.deepcopy(model)
    inject_lora(model, ["qkv_proj", "o_proj"], RANK, ALPHA, modules_to_save=SAVE)
    _random_b(model)
    twin = _peft_twin(base, model, ["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=SAVE).train()
    model.train()
    saved = [n for n in trainable_state_keys(model) if not is_lora_key(n)]
    assert saved == ["model.embed_tokens.weight"] + [f"model.layers.{i}.{n}_layernorm.weight" for i in range(2)
                                                     for n in ("input", "post_attention")] + [
        "model.norm.weight", "lm_head.weight"]
    assert set(trainable_state_keys(model)) == {_nxdt_name(n) for n, p in twin.named_parameters() if p.requires_grad}
    originals = {n: p.detach().clone() for n, p in twin.named_parameters() if ".original_module." in n}
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, twin)]
    for _ in range(2):
        for m, opt in zip((model, twin), opts):
            logits = logits_of(m(input_ids=IDS))
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
    mine = dict(model.named_parameters())
    trained = {_nxdt_name(n): p for n, p in twin.named_parameters() if p.requires_grad}
    assert max((mine[k] - p).abs().max().item() for k, p in trained.items()) < 1e-5
    assert (mine["lm_head.weight"] - originals["base_model.model.lm_head.original_module.weight"]).abs().max() > 1e-3
    assert all(torch.equal(p, originals[n]) for n, p in twin.named_parameters() if n in originals)  # peft's frozen
    ours, theirs = peft_adapter_state(model.state_dict(), "none", SAVE), get_peft_model_state_dict(twin)
    assert set(ours) == set(theirs) and len(theirs) == 2 * 4 * 2 + 7, sorted(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-5


def test_modules_to_save_refused_where_nxdt_would_differ():
    """One line each: a name matching nothing, a module with adapters, a tied weight (peft unties it)."""
    for names, targets, message in (
            (["embed"], ["qkv_proj"], r"'embed' matches no module with parameters"),
            (["self_attn"], ["qkv_proj"], r"model\.layers\.0\.self_attn\.q_proj\.weight is in a module with LoRA"),
            (["q_proj"], ["q_proj"], r"model\.layers\.0\.self_attn\.q_proj\.weight is in a module with LoRA")):
        with pytest.raises(ValueError, match=rf"^model_alignment_strategy\.peft\.modules_to_save: {message}"):
            inject_lora(_model(), targets, RANK, ALPHA, modules_to_save=names)
    with pytest.raises(ValueError, match=r"names a weight shared with (lm_head|model\.embed_tokens)\.weight \(tied"):
        inject_lora(_model(share_embeddings_and_output_weights=True), ["qkv_proj"], RANK, ALPHA,
                    modules_to_save=["lm_head"])
    model = _model(share_embeddings_and_output_weights=True)  # the tied pair untouched: the norms only
    inject_lora(model, ["qkv_proj"], RANK, ALPHA, modules_to_save=["norm"])
    assert sum(not is_lora_key(n) for n in trainable_state_keys(model)) == 5


# ----------------------------------------------------------------------------- what is trained
def test_only_adapters_train_and_the_optimizer_holds_only_them():
    from nxdt.optim.optimizers import build_optimizer

    model = _model()
    inject_lora(model, NXDT_NAMES, RANK, ALPHA)
    adapters = {n for n, _ in model.named_parameters() if is_lora_key(n)}
    assert set(trainable_state_keys(model)) == adapters and len(adapters) == 28
    opt = build_optimizer(model, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01})
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in adapters}
    trainable, total = lora_parameter_counts(model)
    per_layer = sum(RANK * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 176), (64, 176),
                                                (176, 64)])
    assert trainable == 2 * per_layer
    assert total == sum(p.numel() for p in _model().parameters()) + trainable


def test_counts_take_a_tied_embedding_once():
    model = _model(share_embeddings_and_output_weights=True)
    inject_lora(model, ["qkv_proj"], RANK, ALPHA)
    assert lora_parameter_counts(model)[1] == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.requires_grad


@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_bias_modes(bias):
    model = _model(**NEOX)  # biases on every linear, layernorms with biases
    inject_lora(model, ["qkv_proj"], RANK, ALPHA, bias=bias)
    trained = set(trainable_state_keys(model)) - {n for n, _ in model.named_parameters() if is_lora_key(n)}
    every_bias = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    qkv_biases = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}
    assert trained == {"none": set(), "all": every_bias, "lora_only": qkv_biases}[bias]
    assert "model.norm.bias" in every_bias and len(every_bias) > len(qkv_biases)


def test_lora_linear_keeps_the_base_parameters():
    linear = nn.Linear(8, 6)
    lora = LoraLinear.from_linear(linear, rank=2, alpha=4.0, dropout=0.1)
    assert lora.weight is linear.weight and lora.bias is linear.bias and lora.scaling == 2.0
    assert isinstance(lora, nn.Linear) and isinstance(lora.lora_dropout, nn.Dropout)
    assert sorted(dict(lora.named_parameters())) == ["bias", "lora_A.weight", "lora_B.weight", "weight"]
    assert torch.equal(lora.lora_B.weight, torch.zeros(6, 2)) and lora.lora_A.weight.abs().max() > 0
    assert isinstance(LoraLinear(8, 6, rank=2, alpha=4.0).lora_dropout, nn.Identity)  # dropout 0


# ----------------------------------------------------------------------------- merge, base on demand
@pytest.mark.parametrize("source", ["megatron", "hf"])
def test_merge_keeps_the_logits(source):
    model = _model(source)
    inject_lora(model, NXDT_NAMES, RANK, ALPHA)
    _random_b(model)
    before = _logits(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model.get_submodule("model.layers.1.mlp.down_proj").weight
    merged = merge_lora_(model)
    assert len(merged) == 14 and not lora_modules(model)
    down = model.get_submodule("model.layers.1.mlp.down_proj")
    assert type(down) is nn.Linear and down.weight is weight
    assert (_logits(model) - before).abs().max().item() < 1e-5
    # the same arithmetic on a plain state dict, with no model (what nxdt convert does)
    for scaling in ((RANK, ALPHA), {p: ALPHA / RANK for p in merged}):
        folded = merged_state_dict(state, scaling)
        assert set(folded) == set(model.state_dict())
        assert max((folded[k] - v).abs().max().item() for k, v in model.state_dict().items()) < 1e-6


def test_merged_state_dict_refuses_a_lonely_adapter():
    model = _model()
    inject_lora(model, ["qkv_proj"], RANK, ALPHA)
    state = model.state_dict()
    with pytest.raises(ValueError, match="lora_B.weight"):
        merged_state_dict({k: v for k, v in state.items() if "q_proj.lora_B" not in k}, (RANK, ALPHA))
    with pytest.raises(ValueError, match="without the base weight"):
        merged_state_dict({k: v for k, v in state.items() if is_lora_key(k)}, (RANK, ALPHA))
    with pytest.raises(ValueError, match="rank 4, expected"):
        merged_state_dict(state, (8, ALPHA))
    assert lora_scalings(model) == {p: 2.0 for p in lora_modules(model)}


@pytest.mark.parametrize("source", ["megatron", "hf"])
def test_adapters_disabled_gives_the_base(source):
    model = _model(source)
    base = _logits(model)
    inject_lora(model, NXDT_NAMES, RANK, ALPHA)
    _random_b(model)
    with_adapters = _logits(model)
    assert (with_adapters - base).abs().max() > 1e-3
    with adapters_disabled(model):
        with adapters_disabled(model):
            assert torch.equal(_logits(model), base)
        assert torch.equal(_logits(model), base)  # the inner exit restores the outer state
    assert torch.equal(_logits(model), with_adapters)


# ----------------------------------------------------------------------------- meta-device init
@pytest.mark.parametrize("source", ["megatron", "hf"])
def test_meta_init_draws_adapters_like_peft_after_the_base(source):
    cfg = _cfg(source)
    torch.manual_seed(5)
    model = build_model(cfg, V, device="meta")
    inject_lora(model, NXDT_NAMES, RANK, ALPHA)
    assert all(p.is_meta for p in model.parameters())
    init_model_weights(model, "cpu")
    torch.manual_seed(5)
    plain = init_model_weights(build_model(cfg, V, device="meta"), "cpu")
    for name, p in plain.named_parameters():  # the base as without LoRA, same seed
        assert torch.equal(model.get_parameter(name), p), name
    for m in lora_modules(model).values():
        bound = 1 / math.sqrt(m.in_features)  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), as peft
        assert torch.equal(m.lora_B.weight, torch.zeros_like(m.lora_B.weight))
        assert 0 < m.lora_A.weight.abs().max() <= bound and m.lora_A.weight.std() > bound / 4
    assert (_logits(model) - _logits(plain)).abs().max() == 0  # B = 0: the base's logits


# ----------------------------------------------------------------------------- precision presets
@pytest.mark.parametrize("ptype", ["mixed_precision", "bf16SR"])
def test_precision_presets_train_only_the_adapters(ptype):
    from nxdt.precision.precision import Precision
    from nxdt.optim.optimizers import build_optimizer
    from nxdt.training.step import microbatch_forward_backward, train_step

    cfg = _cfg()
    cfg.precision.type = ptype
    prec = Precision.from_spec(build_spec(cfg))
    model = _model()
    inject_lora(model, NXDT_NAMES, RANK, ALPHA)
    _random_b(model)
    prec.convert_model(model)
    prec.attach(model)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, {"name": "adamw", "lr": 1e-2})
    fwd_bwd = microbatch_forward_backward(model, prec, 2)
    batch = {"input_ids": IDS.repeat(2, 1), "labels": IDS.repeat(2, 1), "loss_mask": torch.ones(4, 12)}
    for step in range(2):
        metrics = train_step(model, opt, None, prec, fwd_bwd, batch, step=step, clip=1.0)
        assert metrics.applied and math.isfinite(float(metrics.loss))
    for n, p in model.named_parameters():
        assert p.dtype == before[n].dtype
        assert torch.equal(p, before[n]) != is_lora_key(n), n  # adapters moved, the base did not


# ----------------------------------------------------------------------------- nxdt convert nxdt-to-hf
def _lora_checkpoints(tmp_path, targets=NXDT_NAMES, bias="none", modules_to_save=None, **model_keys):
    """(LoRA model, full checkpoint, adapter-only checkpoint, base checkpoint) as a run would write them."""
    peft = {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "lora_bias": bias,
            "target_modules": list(targets), "modules_to_save": modules_to_save}
    cfg = _cfg(peft=peft, **model_keys)
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=V).eval()
    base = tmp_path / "base_ckpt"
    save_weights(model.state_dict(), base)
    (base / "config.yaml").write_text(to_yaml(_cfg(**model_keys)))
    inject_lora(model, targets, RANK, ALPHA, bias=bias, modules_to_save=alignment_of(cfg).peft.modules_to_save)
    _random_b(model)
    if bias != "none" or modules_to_save:  # trained biases and saved modules away from the base's
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad and not is_lora_key(n):
                    p.add_(0.05)
    state = model.state_dict()
    paths = []
    for name, keys in (("full", list(state)), ("adapter_only", trainable_state_keys(model))):
        ckpt = tmp_path / name
        save_weights({k: state[k] for k in keys}, ckpt)
        (ckpt / "config.yaml").write_text(to_yaml(cfg))
        paths.append(ckpt)
    return model, paths[0], paths[1], base


def _load_peft(folder):
    base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(base, folder / "adapter").eval()


def test_convert_writes_merged_base_and_a_peft_adapter(tmp_path):
    from safetensors.torch import load_file

    from nxdt.tools.convert import nxdt_to_hf

    model, full, _, _ = _lora_checkpoints(tmp_path)
    want = _logits(model)
    out = tmp_path / "hf"
    nxdt_to_hf(full, out, max_shard_bytes=10**9)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "bias": "none"}
    assert config["target_modules"] == sorted(ALL)
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    peft_model = _load_peft(out)
    assert (_logits(peft_model) - want).abs().max().item() < 1e-5
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert set(saved) == set(get_peft_model_state_dict(peft_model)) and len(saved) == 28
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert (_logits(merged) - want).abs().max().item() < 1e-5
    assert (out / "tokenizer.json").is_file() and (out / "base" / "tokenizer.json").is_file()
    with adapters_disabled(model), peft_model.disable_adapter():  # the base folder is the base
        assert (_logits(peft_model) - _logits(model)).abs().max().item() < 1e-5


def test_convert_adapter_only_checkpoint_needs_the_base(tmp_path, capsys):
    from nxdt.cli import main

    model, full, adapter_only, base = _lora_checkpoints(tmp_path, bias="lora_only", has_bias=True)
    want = _logits(model)
    # without --base: one line, exit 2, naming the fix
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--base CKPT" in err and "--adapter-only" in err, err
    assert not (tmp_path / "x").exists()
    # with it: the same folders as from the full checkpoint (trained biases in the adapter, peft's keys)
    out = tmp_path / "hf"
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(out), "--base", str(base)]) == 0
    peft_model = _load_peft(out)
    assert (_logits(peft_model) - want).abs().max().item() < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (_logits(merged) - want).abs().max().item() < 1e-5
    from safetensors.torch import load_file

    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert set(saved) == set(get_peft_model_state_dict(peft_model))
    assert sum(k.endswith(".base_layer.bias") for k in saved) == 2 * 7  # each wrapped linear's bias, 2 layers
    # --adapter-only: the adapter folder alone, loadable onto the base written above
    only = tmp_path / "only"
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(only), "--adapter-only"]) == 0
    assert sorted(p.name for p in only.iterdir()) == ["adapter"]
    assert json.loads((only / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert load_file(str(only / "adapter" / "adapter_model.safetensors")).keys() == saved.keys()
    # a checkpoint without adapters refuses the LoRA flags
    assert main(["convert", "nxdt-to-hf", "--input", str(base), "--output", str(tmp_path / "y"), "--adapter-only"]) == 2
    assert "has no LoRA adapters" in capsys.readouterr().err


def test_modules_to_save_checkpoint_and_convert(tmp_path, capsys):
    """LLaMA-MoE's `--modules_to_save embed_tokens,lm_head` (a comma string): an adapter-only checkpoint keeps
    them, a resume reads them, and `nxdt convert` writes peft's adapter over the untouched base."""
    from safetensors.torch import load_file

    from nxdt.checkpoint.lora_state import tensors_to_load, tensors_to_save
    from nxdt.cli import main

    model, full, adapter_only, base = _lora_checkpoints(tmp_path, modules_to_save="embed_tokens,lm_head")
    cfg = _cfg(peft={"target_modules": NXDT_NAMES, "modules_to_save": "embed_tokens,lm_head"})
    run_keys = {f"model.{k}": 0 for k in model.state_dict()}
    kept, meta = tensors_to_save(run_keys, cfg)
    saved_keys = {"model.model.embed_tokens.weight", "model.lm_head.weight"}
    assert set(kept) - {k for k in kept if is_lora_key(k)} == saved_keys
    assert meta["modules_to_save"] == ["embed_tokens", "lm_head"] and len(kept) == 28 + 2
    assert set(tensors_to_load(run_keys, {"lora": meta}, cfg, full, weights_only=False, frozen_only=False)[0]) == \
        set(kept)  # a resume reads the saved modules from the adapter-only checkpoint; the frozen base skips them
    assert not set(kept) & set(tensors_to_load(run_keys, {}, cfg, base, weights_only=False, frozen_only=True)[0])
    out = tmp_path / "hf"
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(out), "--base", str(base)]) == 0
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == [
        "embed_tokens", "lm_head"]
    peft_model = _load_peft(out)
    assert (_logits(peft_model) - _logits(model)).abs().max().item() < 1e-5
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert set(saved) == set(get_peft_model_state_dict(peft_model)) and len(saved) == 28 + 2
    assert torch.equal(saved["base_model.model.lm_head.weight"], model.lm_head.weight)
    with peft_model.disable_adapter():  # base/ is the base: its own embed_tokens and lm_head
        assert (_logits(peft_model) - _logits(_model())).abs().max().item() < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (_logits(merged) - _logits(model)).abs().max().item() < 1e-5


def test_convert_native_neox(tmp_path, capsys):
    """Adapters on o/up/down become a PEFT adapter of transformers' GPT-NeoX; on q/k/v (fused there) not yet."""
    from nxdt.cli import main

    model, full, adapter_only, base = _lora_checkpoints(tmp_path / "a", targets=["o_proj", "up_proj", "down_proj"],
                                                        bias="all", **NEOX)
    out = tmp_path / "a" / "hf"
    assert main(["convert", "nxdt-to-hf", "--input", str(full), "--output", str(out)]) == 0
    peft_model = _load_peft(out)
    assert (_logits(peft_model) - _logits(model)).abs().max().item() < 1e-5
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"] == [
        "dense", "dense_4h_to_h", "dense_h_to_4h"]

    model, full, adapter_only, base = _lora_checkpoints(tmp_path / "b", targets=["qkv_proj"], **NEOX)
    capsys.readouterr()
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(tmp_path / "b" / "x"),
                 "--adapter-only"]) == 2
    assert "not supported yet" in capsys.readouterr().err
    out = tmp_path / "b" / "hf"
    assert main(["convert", "nxdt-to-hf", "--input", str(full), "--output", str(out)]) == 0
    assert "not supported yet" in capsys.readouterr().out and not (out / "adapter").exists()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (_logits(merged) - _logits(model)).abs().max().item() < 1e-5


def test_convert_refuses_a_wrong_base_and_a_config_without_peft(tmp_path, capsys):
    from nxdt.cli import main

    _, full, adapter_only, _ = _lora_checkpoints(tmp_path / "a")
    other_base = tmp_path / "other"
    save_weights(_model(hidden_size=32, ffn_hidden_size=96).state_dict(), other_base)
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(tmp_path / "x"),
                 "--base", str(other_base)]) == 2
    assert "not the base of this checkpoint" in capsys.readouterr().err
    (full / "config.yaml").write_text(to_yaml(_cfg()))  # a LoRA checkpoint whose config lost its peft section
    assert main(["convert", "nxdt-to-hf", "--input", str(full), "--output", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model_alignment_strategy.peft" in err, err
