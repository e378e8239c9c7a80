"""`nxdt convert nxdt-to-hf` for a checkpoint of a LoRA run (its model keys include `.lora_A.` / `.lora_B.`).

    OUTPUT/            the merged model: adapters folded into the base (W += B A · alpha / r), a plain
                       transformers folder (AutoModelForCausalLM.from_pretrained(OUTPUT))
    OUTPUT/base/       the base model without the adapters
    OUTPUT/adapter/    a PEFT adapter of OUTPUT/base: adapter_config.json + adapter_model.safetensors
                       (PeftModel.from_pretrained(base_model, OUTPUT/adapter))

The LoRA settings (rank, alpha, dropout, bias) are the checkpoint's config.yaml
`model_alignment_strategy.peft`; target_modules lists the linears that actually have adapters,
in the model's own names (peft matches leaf names). Trained biases (lora_bias all / lora_only) and the
modules `modules_to_save` names (trained in full) go into the adapter file under the keys peft's
`get_peft_model_state_dict` gives them (`base_model.model.lm_head.weight`), adapter_config.json lists
the names. OUTPUT/base holds the base's own values of those modules when `--base` gives them; a
checkpoint with the base (save_lora_base) holds only the trained ones (nxdt trains them in place), so
its OUTPUT/base has those: PeftModel.from_pretrained over it is still the trained model.

A checkpoint that holds only the adapters (and trained biases; the default `save_lora_base: false`)
takes its base from `--base CKPT` (any weights checkpoint of the base: hf-to-nxdt's, or a full
checkpoint, whose own adapters are ignored); with `--adapter-only` only OUTPUT/adapter is written.

A native GPT-NeoX model (model_source megatron) is written with transformers' GPT-NeoX names; its
adapters on o_proj / up_proj / down_proj are renamed like their linears, but adapters on q/k/v have
no PEFT form over the fused query_key_value (three rank-r updates are not one): not supported yet as
an adapter; the merged model and the base are still written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nxdt.checkpoint.lora_merge import with_base
from nxdt.config.errors import ConfigError
from nxdt.config.load import load_saved_config
from nxdt.spec.alignment import modules_to_save_of
from nxdt.models.lora import (
    PEFT_EXPERT_KEY,
    PEFT_PREFIX,
    is_lora_key,
    lora_pairs,
    merged_state_dict,
    peft_adapter_config,
    peft_adapter_state,
    peft_target_modules,
    peft_target_parameters,
)
from nxdt.models.lora_experts import expert_pairs
from nxdt.models.neox import native_to_neox
from nxdt.tools.hf_folder import check_output_free, hf_config_for, write_hf_model

ADAPTER_DIR, BASE_DIR = "adapter", "base"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def lora_to_hf(ckpt: Path, tensors: dict[str, Any], output: Path, max_shard_bytes: int, dtype: str | None = None,
               *, base: Path | None = None, adapter_only: bool = False) -> None:
    """Write the folders of the module docstring for the LoRA checkpoint `ckpt` (its model tensors: `tensors`)."""
    cfg_file = ckpt / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} is missing: a LoRA checkpoint's adapters need its lora_rank and lora_alpha")
    cfg = load_saved_config(cfg_file)
    peft = peft_section(cfg, cfg_file)
    try:
        pairs = lora_pairs(tensors)
        experts = expert_pairs(tensors)
    except ValueError as err:
        raise ConfigError(f"{ckpt}: {err}") from None
    ranks = sorted({int(a.shape[0]) for a, _ in pairs.values()} | {int(a.shape[1]) for a, _ in experts.values()})
    if ranks != [peft.lora_rank]:
        raise ConfigError(f"{cfg_file}: model_alignment_strategy.peft.lora_rank is {peft.lora_rank} but the "
                          f"checkpoint's adapters have rank {', '.join(map(str, ranks))}")
    originals: dict[str, Any] = {}
    if base is not None:
        tensors = with_base(tensors, base, originals=originals)
    lacking = sorted(k for k in [f"{module}.weight" for module in pairs] + list(experts) if k not in tensors)
    if lacking and not adapter_only:
        raise ConfigError(f"{ckpt} holds LoRA adapters without the base weights (e.g. {lacking[0]}; "
                          "model_alignment_strategy.peft.save_lora_base: false): give the base model's checkpoint "
                          "with --base CKPT (e.g. the run's exp_manager.resume_from_checkpoint), or write only the "
                          "adapter with --adapter-only")
    config = hf_config_for(ckpt, tensors)
    check_output_free(output)
    saved = modules_to_save_of(peft.modules_to_save)
    adapter, why_not = adapter_state(tensors, config, cfg.model_source, peft.lora_bias, saved)
    if adapter is None and adapter_only:
        raise ConfigError(f"{ckpt}: {why_not}")
    if not adapter_only:
        try:
            merged = merged_state_dict(tensors, (peft.lora_rank, peft.lora_alpha))
        except ValueError as err:
            raise ConfigError(f"{ckpt}: {err}") from None
        write_hf_model(ckpt, merged, config, output, max_shard_bytes, dtype)
        plain = {k: originals.get(k, v) for k, v in tensors.items() if not is_lora_key(k)}
        write_hf_model(ckpt, plain, config, output / BASE_DIR, max_shard_bytes, dtype)
    if adapter is None:
        print(f"note: {output / ADAPTER_DIR} not written: {why_not}")
        return
    base_path = None if adapter_only else str((output / BASE_DIR).resolve())
    write_adapter(output / ADAPTER_DIR, adapter, peft, base_path, dtype, peft_target_parameters(tensors), saved)


def peft_section(cfg, cfg_file: Path):
    """The saved config's `model_alignment_strategy.peft` (typed), or a ConfigError naming what is missing."""
    mas = cfg.model_alignment_strategy
    peft = mas.peft if mas is not None else None
    if peft is None:
        raise ConfigError(f"{cfg_file}: the checkpoint holds LoRA adapters but its config has no "
                          "model_alignment_strategy.peft (lora_rank, lora_alpha unknown)")
    return peft


def adapter_state(tensors: dict[str, Any], config: dict[str, Any], model_source: str, bias: str,
                  modules_to_save: list[str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """(PEFT's adapter tensors, "") in transformers' names, or (None, why not)."""
    native_neox = config.get("model_type") == "gpt_neox" and model_source == "megatron"
    if not native_neox:
        return peft_adapter_state(tensors, bias, modules_to_save or ()), ""
    if modules_to_save:
        return None, (f"modules_to_save ({', '.join(modules_to_save)}) of a native GPT-NeoX model as a PEFT adapter "
                      "is not supported yet (transformers' GPT-NeoX names its modules otherwise); the merged model "
                      "is written without --adapter-only")
    qkv = sorted({k.split(".lora_")[0].rpartition(".")[2] for k in tensors
                  if is_lora_key(k) and k.split(".lora_")[0].endswith(("q_proj", "k_proj", "v_proj"))})
    if qkv:
        return None, (f"LoRA on {', '.join(qkv)} of a native GPT-NeoX model as a PEFT adapter of transformers' "
                      "fused query_key_value is not supported yet (target o_proj, up_proj, down_proj for an "
                      "adapter; the merged model is written without --adapter-only)")
    return peft_adapter_state(neox_names(tensors, int(config["num_attention_heads"]), bias), bias), ""


def neox_names(tensors: dict[str, Any], num_heads: int, bias: str) -> dict[str, Any]:
    """The adapters and biases of a native GPT-NeoX state in transformers' GPT-NeoX names.

    nxdt.models.neox.native_to_neox renames `<module>.<kind>` by module; an adapter's kind is spelt
    `lora_A_weight` for it (one dotted component) and split back afterwards."""
    wanted = {}
    for key, t in tensors.items():
        if is_lora_key(key):
            module, _, rest = key.rpartition(".lora_")
            wanted[f"{module}.lora_{rest.replace('.', '_')}"] = t
        elif bias != "none" and key.endswith(".bias"):
            wanted[key] = t
    renamed = native_to_neox(wanted, num_heads)
    return {k.replace(".lora_A_weight", ".lora_A.weight").replace(".lora_B_weight", ".lora_B.weight"): v
            for k, v in renamed.items()}


def write_adapter(folder: Path, adapter: dict[str, Any], peft, base_path: str | None, dtype: str | None,
                  expert_targets: list[str] | None = None, modules_to_save: list[str] | None = None) -> None:
    """adapter_model.safetensors + adapter_config.json into `folder`; `expert_targets`: peft's
    target_parameters of the expert adapters among them (peft_target_parameters of nxdt's keys)."""
    if dtype:
        adapter = {k: v.to(getattr(torch, dtype)) for k, v in adapter.items()}
    targets = peft_target_modules({k.removeprefix(PEFT_PREFIX): v for k, v in adapter.items()
                                   if not PEFT_EXPERT_KEY.search(k)})
    config = peft_adapter_config(targets, peft.lora_rank, peft.lora_alpha, peft.lora_dropout, peft.lora_bias,
                                 base_model_name_or_path=base_path, target_parameters=expert_targets,
                                 modules_to_save=modules_to_save)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
