"""LoRA on MoE experts (nxdt.models.lora_experts), against peft's `target_parameters` (lora.ParamWrapper)
on transformers' Mixtral and Qwen3-MoE: the same base and adapters give the same logits both ways
(a peft adapter loaded into nxdt; nxdt's adapter, trained a few steps, exported and loaded by
`PeftModel.from_pretrained`), for the native Mixtral-style and Qwen3-MoE models and model_source hf's
Mixtral. In-process, tiny models. The ep2 / FSDP layouts are in tests/test_lora_parallel.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from nxdt.config.errors import ConfigError
from nxdt.models import build_model, init_model_weights, logits_of
from nxdt.models.lora import (
    adapters_disabled,
    inject_lora,
    lora_parameter_counts,
    merge_lora_,
    merged_state_dict,
    nxdt_adapter_state,
    peft_adapter_state,
    peft_target_parameters,
)
from nxdt.models.lora_experts import lora_experts
from nxdt.spec import config_from_dict
from nxdt.tools.convert_lora import write_adapter

BOTH = ["experts.gate_up_proj", "experts.down_proj"]
LINEARS = ["q_proj", "v_proj"]
RANK, ALPHA = 2, 6.0
NATIVE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
          "max_position_embeddings": 64, "layernorm_epsilon": 1e-5, "make_vocab_size_divisible_by": 8,
          "moe": {"num_experts": 4, "top_k": 2}}
QWEN3_MOE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=24, intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)


def _pair(kind: str):
    """(nxdt model, a function building transformers' model with the same base weights, vocabulary)."""
    torch.manual_seed(0)
    if kind == "qwen3-moe":
        from nxdt.models.qwen3 import qwen3_model_keys

        config = transformers.Qwen3MoeConfig(**QWEN3_MOE)
        model = build_model(config_from_dict({"model_source": "megatron", "model": qwen3_model_keys(config.to_dict())}),
                            device="meta")
        model = init_model_weights(model, device="cpu")
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "native-mixtral":
        model = build_model(config_from_dict({"model_source": "megatron", "model": NATIVE}), 96)
        config = transformers.MixtralConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        cls = transformers.MixtralForCausalLM
    else:  # model_source hf: transformers' Mixtral with nxdt's MoE blocks
        model = build_model(config_from_dict({"model_source": "hf", "model": {
            "model_config": "model_configs/tiny_mixtral", "moe": {"num_experts": 4, "top_k": 2}}}))
        config, cls = model.config, transformers.MixtralForCausalLM
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    config.use_cache = False

    def hf():
        twin = cls(config).eval()
        twin.load_state_dict(base, strict=True)
        return twin

    return model.eval(), hf, config.vocab_size


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind,targets", [("native-mixtral", BOTH), ("qwen3-moe", BOTH), ("hf-mixtral", BOTH),
                                          ("native-mixtral", ["experts.down_proj"])])
def test_peft_adapter_on_experts_loads_into_nxdt(kind, targets, tmp_path):
    model, hf, vocab = _pair(kind)
    peft_model = get_peft_model(hf(), LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                 target_modules=LINEARS, target_parameters=targets))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(tmp_path)
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    wrapped = inject_lora(model, LINEARS, RANK, ALPHA, 0.0, target_parameters=targets)
    assert len(wrapped) == 2 * (2 + len(targets))  # 2 layers x (q, v + the expert weights)
    state = nxdt_adapter_state(adapter, config, num_experts=4)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    ids = _ids(vocab)
    with torch.no_grad():
        ours, theirs = model(ids), logits_of(peft_model(input_ids=ids))
        base = logits_of(hf()(input_ids=ids))
    assert (theirs - base).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(logits_of(ours), theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["native-mixtral", "qwen3-moe", "hf-mixtral"])
def test_nxdt_expert_adapter_trained_exports_to_peft(kind, tmp_path):
    model, hf, vocab = _pair(kind)
    inject_lora(model, LINEARS, RANK, ALPHA, 0.0, target_parameters=BOTH)
    trainable, total = lora_parameter_counts(model)
    experts = next(iter(lora_experts(model).values()))
    e, out2f, h = experts.gate_up_proj.shape
    f = experts.down_proj.shape[2]
    per_layer = e * RANK * (h + out2f) + e * RANK * (f + h)  # gate_up (A, B) + down (A, B)
    attn = sum(m.lora_A.weight.numel() + m.lora_B.weight.numel() for n, m in model.named_modules()
               if n.endswith(("q_proj", "v_proj")) and hasattr(m, "lora_A"))
    assert trainable == 2 * per_layer + attn
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(vocab)
    for _ in range(3):
        opt.zero_grad()
        logits = logits_of(model(ids))
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
    model.eval()
    state = model.state_dict()
    assert float(experts.lora_B.gate_up_proj.detach().abs().max()) > 0  # trained away from B = 0
    peft = SimpleNamespace(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.0, lora_bias="none")
    write_adapter(tmp_path, peft_adapter_state(state), peft, None, None, peft_target_parameters(state))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_parameters"] == sorted(BOTH) and config["target_modules"] == LINEARS
    loaded = PeftModel.from_pretrained(hf(), tmp_path).eval()
    with torch.no_grad():
        ours = logits_of(model(ids))
        torch.testing.assert_close(ours, logits_of(loaded(input_ids=ids)), rtol=0, atol=1e-5)
        assert (ours - logits_of(hf()(input_ids=ids))).abs().max() > 1e-3
        # merged: the state dict folded (no model needed) and the model folded in place, as transformers' model
        plain = hf()
        plain.load_state_dict(merged_state_dict(state, (RANK, ALPHA)), strict=True)
        torch.testing.assert_close(ours, logits_of(plain(input_ids=ids)), rtol=0, atol=1e-5)
        with adapters_disabled(model):  # the frozen base alone (DPO's reference)
            torch.testing.assert_close(logits_of(model(ids)), logits_of(hf()(input_ids=ids)), rtol=0, atol=1e-5)
        merge_lora_(model)
        assert not lora_experts(model) and not any(".lora_" in k for k in model.state_dict())
        torch.testing.assert_close(ours, logits_of(model(ids)), rtol=0, atol=1e-5)


def test_expert_targets_refused_where_they_mean_nothing():
    dense = build_model(config_from_dict({"model_source": "megatron", "model": {k: v for k, v in NATIVE.items() if k != "moe"}}), 96)
    with pytest.raises(ValueError, match=r"peft.target_parameters \['experts.down_proj'\]: .* has no MoE experts"):
        inject_lora(dense, LINEARS, RANK, ALPHA, 0.0, target_parameters=["experts.down_proj"])
    moe, _, _ = _pair("native-mixtral")
    with pytest.raises(ValueError, match=r"target_parameters: 'experts.w1' is not an expert weight; valid"):
        inject_lora(moe, LINEARS, RANK, ALPHA, 0.0, target_parameters=["experts.w1"])
    with pytest.raises(ValueError, match=r"lora_dropout: must be 0 with target_parameters"):
        inject_lora(moe, LINEARS, RANK, ALPHA, 0.05, target_parameters=BOTH)


def test_convert_adapter_only_checkpoint_with_expert_adapters(tmp_path):
    """`nxdt convert nxdt-to-hf --base`: a run's adapter-only checkpoint (experts and qkv_proj adapted) →
    the merged Mixtral, its base and a peft adapter with target_parameters that PeftModel loads."""
    from conftest import TOKENIZER_DIR

    from nxdt.checkpoint.checkpointer import save_weights
    from nxdt.cli import main
    from nxdt.config import to_yaml
    from nxdt.models.lora import trainable_state_keys

    def cfg(peft=None):
        values = {"model_source": "megatron", "model": NATIVE,
                  "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}}
        return config_from_dict({**values, **({"model_alignment_strategy": {"peft": peft}} if peft else {})})

    peft = {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": ["qkv_proj"],
            "target_parameters": BOTH}
    torch.manual_seed(0)
    model = build_model(cfg(peft), 96).eval()
    base, adapter_only, out = tmp_path / "base", tmp_path / "adapter_only", tmp_path / "hf"
    save_weights(model.state_dict(), base)
    (base / "config.yaml").write_text(to_yaml(cfg()))
    inject_lora(model, ["qkv_proj"], RANK, ALPHA, 0.0, target_parameters=BOTH)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    state = model.state_dict()
    save_weights({k: state[k] for k in trainable_state_keys(model)}, adapter_only)
    (adapter_only / "config.yaml").write_text(to_yaml(cfg(peft)))
    assert main(["convert", "nxdt-to-hf", "--input", str(adapter_only), "--output", str(out), "--base", str(base)]) == 0
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == sorted(BOTH) and config["target_modules"] == ["k_proj", "q_proj", "v_proj"]
    ids = _ids(96)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(hf_base, out / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = logits_of(model(ids))
        torch.testing.assert_close(logits_of(loaded(input_ids=ids)), want, rtol=0, atol=1e-5)
        with loaded.disable_adapter():  # the adapters matter; the base folder is the base
            assert (logits_of(loaded(input_ids=ids)) - want).abs().max() > 1e-3
        torch.testing.assert_close(logits_of(merged(input_ids=ids)), want, rtol=0, atol=1e-5)


def test_config_refuses_expert_targets_with_dropout_or_without_experts():
    from nxdt.spec import build_spec
    from nxdt.training.finetuning import check_lora_targets

    peft = {"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": [], "target_parameters": BOTH}
    with pytest.raises(ConfigError, match=r"peft.lora_dropout: must be 0 with target_parameters .* got 0.05"):
        config_from_dict({"model": NATIVE, "data": {"seq_length": 64}, "model_alignment_strategy": {"peft": peft}},
                         check=True)
    cfg = config_from_dict({"model": NATIVE, "model_alignment_strategy": {"peft": {**peft, "lora_dropout": 0.0}},
                            "distributed_strategy": {"tensor_model_parallel_size": 2}, "trainer": {"devices": 2}})
    check_lora_targets(build_spec(cfg), 96)  # tp takes them (tests/test_lora_parallel.py moe_tp2)
    dense = config_from_dict({"model": {k: v for k, v in NATIVE.items() if k != "moe"},
                              "model_alignment_strategy": {"peft": {**peft, "lora_dropout": 0.0}}})
    with pytest.raises(ConfigError, match=r"target_parameters \['experts.gate_up_proj', 'experts.down_proj'\]: "
                                          r"NxdtLlamaForCausalLM has no MoE experts"):
        check_lora_targets(build_spec(dense), 96)
