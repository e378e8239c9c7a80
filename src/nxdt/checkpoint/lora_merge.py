"""LoRA adapters merged with their base, over whole checkpoints: the merged model a run writes at its
end (`model_alignment_strategy.peft.merge_lora`), and an adapter-only checkpoint read over the base
checkpoint it was trained on (`nxdt generate`, `nxdt convert nxdt-to-hf`). What each checkpoint
holds, and which keys a load reads, is nxdt.checkpoint.lora_state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nxdt.checkpoint.checkpointer import CONFIG, load_weights, save_weights
from nxdt.checkpoint.state import model_and_optimizer_state
from nxdt.config.errors import ConfigError
from nxdt.config.typed import to_yaml
from nxdt.models.lora import is_lora_key, lora_pairs, merged_state_dict
from nxdt.spec.alignment import alignment_of


def save_merged_weights(strategy, cfg, path: Path) -> None:
    """`merge_lora`: the model with its adapters folded in (W + B A · alpha / r), written by every
    rank as a weights-only checkpoint (`exp_manager.resume_from_checkpoint=PATH model.weight_init_only=true`
    starts a run from it; `nxdt convert nxdt-to-hf` exports it). Sharded weights stay sharded: the
    fold is DTensor arithmetic (B A has the base weight's placement)."""
    peft = alignment_of(cfg).peft
    module = strategy.lightning_module
    state = model_and_optimizer_state(module.model, [], weights_only=True)
    merged = merged_state_dict({k[len("model."):]: v for k, v in state.items()}, (peft.lora_rank, peft.lora_alpha))
    plain = dataclasses.replace(cfg, model_alignment_strategy=dataclasses.replace(
        cfg.model_alignment_strategy, peft=None))  # the merged model is a plain one
    save_weights(merged, path, {"lora_merged": True, "step": module.global_step, "model_source": cfg.model_source},
                 strategy=strategy, files={CONFIG: to_yaml(plain)})
    if strategy.global_rank == 0:
        print(f"merged model (LoRA folded into the base): {path}", flush=True)


def with_base(tensors: dict[str, Any], base: Path, flag: str = "--base",
              originals: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base checkpoint's weights (its own adapters, if any, left out) overlaid by the tensors of an
    adapter-only checkpoint; ConfigError (naming `flag`) when `base` is not that checkpoint's base.
    `originals`, when given, receives the base's own values of the keys the overlay replaces (trained
    biases, modules_to_save)."""
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
    if originals is not None:
        originals.update({k: base_tensors[k] for k in tensors if k in base_tensors})
    return {**base_tensors, **tensors}
