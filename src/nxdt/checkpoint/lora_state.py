"""LoRA in checkpoints: what an adapter run saves, and which keys each kind of load reads.

With `model_alignment_strategy.peft` the base model is frozen; only the adapters (`...lora_A.weight`,
`...lora_B.weight`) and, with `lora_bias` all / lora_only, some biases train. A checkpoint then holds:

    save_lora_base false (default)   the trained tensors only ("adapter-only": megabytes for a 7B
                                     model), the optimizer state (adapters only anyway), the rest as usual
    save_lora_base true              every model tensor, as without LoRA

`meta.json` says which (`lora.adapter_only`), so a load knows what to ask for:

- full resume of an adapter-only checkpoint: only its keys are read; the frozen base stays as it
  was built or loaded (`ResumePlan.base`: the run's `exp_manager.resume_from_checkpoint`);
- weights-only start (`model.weight_init_only`) from a base checkpoint: every key but the
  adapters, which start fresh (B = 0: the model is the base), unless `load_lora_from_ckpt`;
- base-only load (`frozen_only`): the base under an adapter-only resume; never the trained keys.

`save_lora_config_adapter` writes PEFT's `adapter_config.json` next to the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nxdt.spec.alignment import alignment_of
from nxdt.config.errors import ConfigError
from nxdt.models.lora import is_lora_key, peft_adapter_config, trained_keys

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
        keep = trained_keys(model_keys, peft.lora_bias)
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model.") or k in keep}
    meta = {"adapter_only": adapter_only, "lora_rank": peft.lora_rank, "lora_alpha": peft.lora_alpha,
            "lora_bias": peft.lora_bias}
    return tensors, meta


def tensors_to_load(tensors: dict[str, Any], meta: dict[str, Any], cfg, path: Path, *, weights_only: bool,
                    frozen_only: bool) -> tuple[dict[str, Any], bool]:
    """(the tensors to request from checkpoint `path`, whether that is a part of the model)."""
    saved_lora = meta.get("lora") or {}
    peft = _peft(cfg)
    model_keys = [k for k in tensors if k.startswith("model.")]
    drop: set[str] = set()
    if frozen_only:  # the base under an adapter-only resume: never the keys the run trains
        drop = trained_keys(model_keys, peft.lora_bias if peft is not None else "none")
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
        drop = set(model_keys) - trained_keys(model_keys, saved_lora.get("lora_bias", "none"))
    elif weights_only and peft is not None and not peft.load_lora_from_ckpt:
        drop = {k for k in model_keys if is_lora_key(k)}  # fresh adapters on the loaded base
    if not drop:
        return tensors, False
    return {k: v for k, v in tensors.items() if k not in drop}, True


def is_adapter_only(path: Path) -> bool:
    from nxdt.checkpoint.state import META, read_json

    meta = read_json(Path(path) / META)
    return bool((meta.get("lora") or {}).get("adapter_only"))


def write_adapter_config(folder: Path, cfg, model_keys) -> None:
    """PEFT's adapter_config.json for the adapters among `model_keys` (`model.<fqn>` names)."""
    peft = _peft(cfg)
    if peft is None or not peft.save_lora_config_adapter:
        return
    targets = sorted({k.rsplit(".lora_A.", 1)[0].rsplit(".", 1)[-1] for k in model_keys if ".lora_A." in k})
    config = peft_adapter_config(targets, peft.lora_rank, peft.lora_alpha, peft.lora_dropout, peft.lora_bias)
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def merged_checkpoint_path(checkpoint: Path) -> Path:
    """Where `merge_lora` puts the merged model of a run checkpoint: `<log dir>/lora_merged/<name>`
    (beside, not inside, checkpoints/: it is a weights-only start, never a resume point)."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent / "lora_merged" / checkpoint.name


def save_merged_weights(strategy, cfg, path: Path) -> None:
    """`merge_lora`: the model with its adapters folded in (W + B A · alpha / r), written by every
    rank as a weights-only checkpoint (`exp_manager.resume_from_checkpoint=PATH model.weight_init_only=true`
    starts a run from it; `nxdt convert nxdt-to-hf` exports it). Sharded weights stay sharded: the
    fold is DTensor arithmetic (B A has the base weight's placement)."""
    import dataclasses

    from nxdt.checkpoint.checkpointer import CONFIG, save_weights
    from nxdt.checkpoint.state import model_and_optimizer_state
    from nxdt.config.typed import to_yaml
    from nxdt.models.lora import merged_state_dict

    peft = _peft(cfg)
    module = strategy.lightning_module
    state = model_and_optimizer_state(module.model, [], weights_only=True)
    merged = merged_state_dict({k[len("model."):]: v for k, v in state.items()}, (peft.lora_rank, peft.lora_alpha))
    plain = dataclasses.replace(cfg, model_alignment_strategy=dataclasses.replace(
        cfg.model_alignment_strategy, peft=None))  # the merged model is a plain one
    save_weights(merged, path, {"lora_merged": True, "step": module.global_step, "model_source": cfg.model_source},
                 strategy=strategy, files={CONFIG: to_yaml(plain)})
    if strategy.global_rank == 0:
        print(f"merged model (LoRA folded into the base): {path}", flush=True)


def with_base(tensors: dict[str, Any], base: Path, flag: str = "--base") -> dict[str, Any]:
    """The base checkpoint's weights (its own adapters, if any, left out) overlaid by the tensors of an
    adapter-only checkpoint; ConfigError (naming `flag`) when `base` is not that checkpoint's base."""
    from nxdt.checkpoint.checkpointer import load_weights
    from nxdt.models.lora import lora_pairs

    base_tensors = {k: v for k, v in load_weights(base).items() if not is_lora_key(k)}
    # the shapes the checkpoint implies: its own tensors', and [out, in] of each adapted weight (B A)
    implied = {k: tuple(t.shape) for k, t in tensors.items() if not is_lora_key(k)}
    implied.update({f"{module}.weight": (b.shape[0], a.shape[1]) for module, (a, b) in lora_pairs(tensors).items()})
    for key, shape in sorted(implied.items()):
        if key not in base_tensors:
            raise ConfigError(f"{flag} {base}: not the base of this checkpoint (it has no {key})")
        if tuple(base_tensors[key].shape) != shape:
            raise ConfigError(f"{flag} {base}: not the base of this checkpoint ({key} is "
                              f"{list(base_tensors[key].shape)} there, {list(shape)} here)")
    return {**base_tensors, **tensors}
