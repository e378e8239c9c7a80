"""Fine-tuning keys (model_alignment_strategy.{sft, peft, dpo, orpo}, data.alignment_strategy.dpo):
typed, checked with the dotted key, read through one parser (nxdt.spec.alignment) by validation
and the run. In-process: no torch needed for any of this."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdt.spec.alignment import alignment_notices, alignment_of
from nxdt.config.errors import ConfigError
from nxdt.spec import load_config

CONF = Path(__file__).resolve().parents[1] / "conf"


def load(*overrides, name="hf_llama3_8B_SFT_lora_config", notices=None):
    return load_config(["--config-path", str(CONF), "--config-name", name, *overrides], world_size=None,
                       check_paths=False, quiet=True)


def error(*overrides, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, **kw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_shipped_configs_read_as_nxdt_writes_them():
    lora = alignment_of(load())
    assert lora.sft.packing is True and lora.peft.lora_rank == 16 and lora.peft.lora_alpha == 32.0
    assert lora.peft.target_modules == ["qkv_proj"] and lora.preference is None and lora.lora
    dpo = alignment_of(load(name="hf_llama3_8B_DPO_config"))  # NxDT puts the DPO block under data:
    assert dpo.preference == "dpo" and dpo.dpo_key == "data.alignment_strategy.dpo"
    assert (dpo.dpo.kl_beta, dpo.dpo.loss_type, dpo.dpo.max_dpo_prompt_length) == (0.01, "sigmoid", 2048)
    orpo = alignment_of(load(name="hf_llama3_8B_ORPO_config"))
    assert orpo.preference == "orpo" and orpo.orpo.beta == 0.1 and orpo.peft is None
    # model_alignment_strategy.dpo works as well, with the schema's defaults filled in
    moved = alignment_of(load("+model_alignment_strategy.dpo.kl_beta=0.2", "~data.alignment_strategy",
                              name="hf_llama3_8B_DPO_config"))
    assert moved.dpo.kl_beta == 0.2 and moved.dpo.loss_type == "sigmoid" and moved.dpo.precompute_ref_log_probs


@pytest.mark.parametrize("overrides, message", [
    (["model_alignment_strategy.peft.lora_rnk=4"],
     "unknown key 'model_alignment_strategy.peft.lora_rnk' (did you mean 'model_alignment_strategy.peft.lora_rank'"),
    (["model_alignment_strategy.peft.lora_rank=0"], "model_alignment_strategy.peft.lora_rank: must be > 0, got 0"),
    (["model_alignment_strategy.peft.lora_dropout=1.0"], "model_alignment_strategy.peft.lora_dropout: must be in [0, 1)"),
    (["model_alignment_strategy.peft.lora_bias=some"], "model_alignment_strategy.peft.lora_bias: expected one of"),
    (["model_alignment_strategy.peft.target_modules=[]"], "model_alignment_strategy.peft.target_modules: empty"),
    (["+model_alignment_strategy.orpo.beta=0.1"], "model_alignment_strategy.sft and orpo are both set"),
])
def test_bad_lora_keys_name_the_key(overrides, message):
    assert message in error(*overrides)


@pytest.mark.parametrize("overrides, message", [
    (["+model_alignment_strategy.orpo.beta=0.1"],
     "data.alignment_strategy.dpo and model_alignment_strategy.orpo are both set: pick one"),
    (["+model_alignment_strategy.dpo.kl_beta=0.5"],
     "data.alignment_strategy.dpo and model_alignment_strategy.dpo are both set and differ"),
    (["data.alignment_strategy.dpo.precompute_ref_log_probs=false"],
     "data.alignment_strategy.dpo.precompute_ref_log_probs: false is not supported yet without LoRA"),
    (["data.alignment_strategy.dpo.kl_beta=0"], "data.alignment_strategy.dpo.kl_beta: must be > 0"),
    (["data.alignment_strategy.dpo.loss_type=kto"], "data.alignment_strategy.dpo.loss_type: expected one of"),
    (["data.alignment_strategy.dpo.truncation_mode=middle"], "truncation_mode: expected one of"),
    (["data.alignment_strategy.dpo.max_dpo_prompt_length=4096"],
     "data.alignment_strategy.dpo.max_dpo_prompt_length (4096) must be below data.seq_length (4096)"),
    (["distributed_strategy.pipeline_model_parallel_size=2", "distributed_strategy.tensor_model_parallel_size=16"],
     "data.alignment_strategy.dpo with distributed_strategy.pipeline_model_parallel_size > 1 is not supported yet"),
])
def test_bad_dpo_keys_name_the_key(overrides, message):
    assert message in error(*overrides, name="hf_llama3_8B_DPO_config")


def test_reference_from_the_frozen_base_is_accepted_with_lora_and_inert_keys_are_reported():
    cfg = load("data.alignment_strategy.dpo.precompute_ref_log_probs=false", "+model_alignment_strategy.peft.lora_rank=8",
               "+model_alignment_strategy.peft.merge_sharded_lora=true", name="hf_llama3_8B_DPO_config")
    al = alignment_of(cfg)
    assert al.lora and al.peft.lora_rank == 8 and al.peft.lora_alpha == 32.0 and not al.dpo.precompute_ref_log_probs
    assert any("merge_sharded_lora: inert" in n for n in alignment_notices(al))
    assert alignment_notices(alignment_of(load())) == []
