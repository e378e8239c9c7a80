"""LoRA in checkpoints: what an adapter run saves, and which keys each kind of load reads.

With `model_alignment_strategy.peft` the base model is frozen; only the adapters (`...lora_A.weight`,
`...lora_B.weight`), with `lora_bias` all / lora_only some biases, and the modules `modules_to_save` names
(peft's: trained in full) train. A checkpoint then holds:

    save_lora_base false (default)   the trained tensors only ("adapter-only": megabytes for a 7B
                                     model), the optimizer state (adapters only anyway), the rest as usual
    save_lora_base true              every model tensor, as without LoRA

`meta.json` says which (`lora.adapter_only`), so a load knows what to ask for:

- full resume of an adapter-only checkpoint: only its keys are read; the frozen base stays as it
  was built or loaded (`ResumePlan.base`: the run's `exp_manager.resume_from_checkpoint`);
- weights-only start (`model.weight_init_only`) from a base checkpoint: every key but the
  adapters, which start fresh (B = 0: the model is the base), unless `load_lora_from_ckpt`;
- base-only load (`frozen_only`): the base under an adapter-only resume; never the trained keys.

`save_lora_config_adapter` writes PEFT's `adapter_config.json` next to the tensors. The merged model
(`merge_lora`) and an adapter-only checkpoint read over its base are nxdt.checkpoint.lora_merge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nxdt.checkpoint.state import META, read_json
from nxdt.config.errors import ConfigError
from nxdt.models.lora import is_lora_key, peft_adapter_config, trained_keys
from nxdt.models.lora_experts import is_expert_lora_key
from nxdt.spec.alignment import alignment_of

ADAPTER_CONFIG = "adapter_config.json"


def _peft(cfg):
    return alignment_of(cfg).peft if cfg is not None else None


def tensors_to_save(tensors: dict[str, Any], cfg) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the tensors to write, meta.json's `lora` entry) for a run with or without LoRA."""
    peft = _peft(cfg)
    if peft is None:
        return tensors, None
    model_keys = [k for k in tensors if k.startswith("model.")]
    adapter_only = not peft.save_lora_base
    if adapter_only:
        keep = trained_keys(model_keys, peft.lora_bias, peft.modules_to_save, "model.")
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model.") or k in keep}
    meta = {"adapter_only": adapter_only, "lora_rank": peft.lora_rank, "lora_alpha": peft.lora_alpha,
            "lora_bias": peft.lora_bias, "modules_to_save": list(peft.modules_to_save)}
    return tensors, meta


def tensors_to_load(tensors: dict[str, Any], meta: dict[str, Any], cfg, path: Path, *, weights_only: bool,
                    frozen_only: bool) -> tuple[dict[str, Any], bool]:
    """(the tensors to request from checkpoint `path`, whether that is a part of the model)."""
    saved_lora = meta.get("lora") or {}
    peft = _peft(cfg)
    model_keys = [k for k in tensors if k.startswith("model.")]
    drop: set[str] = set()
    if frozen_only:  # the base under an adapter-only resume: never the keys the run trains
        drop = trained_keys(model_keys, peft.lora_bias, peft.modules_to_save, "model.") if peft is not None \
            else trained_keys(model_keys, "none")
        if saved_lora.get("adapter_only"):
            raise ConfigError(f"checkpoint {path} holds LoRA adapters only (save_lora_base was false): "
                              "it cannot provide the base weights; point exp_manager.resume_from_checkpoint "
                              "at the base model's checkpoint")
    elif saved_lora.get("adapter_only"):
        if weights_only:
            raise ConfigError(f"checkpoint {path} holds LoRA adapters only (save_lora_base was false): "
                              "start from the base model's checkpoint (exp_manager.resume_from_checkpoint) and "
                              "let resume_if_exists pick up this run's adapters, or save with "
                              "model_alignment_strategy.peft.save_lora_base: true")
        drop = set(model_keys) - trained_keys(model_keys, saved_lora.get("lora_bias", "none"),
                                              saved_lora.get("modules_to_save") or (), "model.")
    elif weights_only and peft is not None and not peft.load_lora_from_ckpt:
        drop = {k for k in model_keys if is_lora_key(k)}  # fresh adapters on the loaded base
    if not drop:
        return tensors, False
    return {k: v for k, v in tensors.items() if k not in drop}, True


def is_adapter_only(path: Path) -> bool:
    meta = read_json(Path(path) / META)
    return bool((meta.get("lora") or {}).get("adapter_only"))


def write_adapter_config(folder: Path, cfg, model_keys) -> None:
    """PEFT's adapter_config.json for the adapters among `model_keys` (`model.<fqn>` names)."""
    peft = _peft(cfg)
    if peft is None or not peft.save_lora_config_adapter:
        return
    experts = sorted({"experts." + k.rpartition(".")[2] for k in model_keys if is_expert_lora_key(k)})
    targets = sorted({k.rsplit(".lora_A.", 1)[0].rsplit(".", 1)[-1] for k in model_keys
                      if ".lora_A." in k and not is_expert_lora_key(k)})
    config = peft_adapter_config(targets, peft.lora_rank, peft.lora_alpha, peft.lora_dropout, peft.lora_bias,
                                 target_parameters=experts, modules_to_save=peft.modules_to_save)
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def merged_checkpoint_path(checkpoint: Path) -> Path:
    """Where `merge_lora` puts the merged model of a run checkpoint: `<log dir>/lora_merged/<name>`
    (beside, not inside, checkpoints/: it is a weights-only start, never a resume point)."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent / "lora_merged" / checkpoint.name
