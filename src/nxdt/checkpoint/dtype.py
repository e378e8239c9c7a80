"""Which dtype a checkpoint's weights are written in, and which copy of the weights a load takes:
`exp_manager.save_bf16` and `exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt`.

NxDT (ZeRO-1 on Neuron) trains bf16 parameters with fp32 master weights held by the optimizer;
`save_bf16` writes the model's weights as bf16 and `use_master_weights_in_ckpt` also writes the
fp32 masters, which a load then puts into the model. In nxdt the fp32 copy lives in one of
three places, and the two keys mean:

| parameters between steps | fp32 copy | save_bf16 | + use_master_weights_in_ckpt |
|---|---|---|---|
| fp32 (fp32, autocast, mixed_precision*, fp16: the parameters are the masters; FSDP shards too) | the parameters | `model.*` bf16 (half the bytes); the fp32 values are lost: resume not exact (one notice line) | `model.*` bf16 + `master.*` fp32 (same sharding); a load takes `master.*`: exact |
| bf16 with `adamw_fp32OptState` | `optim0.state.<fqn>.master` | nothing to cast (already bf16) | nothing extra: the optimizer's fp32 masters are in the checkpoint anyway; exact |
| bf16 (bf16SR with plain AdamW) | none | nothing to cast | nothing to write (one notice line); bf16 is all there is; exact |

Whatever the flags, a checkpoint that holds `master.*` tensors is loaded from them (resume,
`model.weight_init_only`, `nxdt convert nxdt-to-hf`), so a bf16 checkpoint with masters loses
nothing; loading bf16-only weights into fp32 parameters prints one notice line.
"""

from __future__ import annotations

from typing import Any

import torch

MODEL = "model."
MASTER = "master."  # fp32 master weights, keyed like the model's weights: master.<fqn>


def flags(cfg) -> tuple[bool, bool]:
    """(save_bf16, use_master_weights_in_ckpt) from the config (both False without one)."""
    if cfg is None:
        return False, False
    exp = cfg.exp_manager
    return exp.save_bf16, exp.checkpoint_callback_params.use_master_weights_in_ckpt


def weights_for_save(tensors: dict[str, torch.Tensor], save_bf16: bool, keep_master: bool) -> tuple[dict, list[str]]:
    """The tensors to write, and the notices this combination calls for (at most one).

    With save_bf16 every fp32 model tensor is written as bf16 (a DTensor keeps its placements,
    so each rank still writes only its shard); with keep_master its fp32 value is written too,
    as `master.<fqn>`. Optimizer state keeps its dtype (the moments are what an exact resume
    needs besides the weights).
    """
    out: dict[str, torch.Tensor] = {}
    cast = 0
    for key, t in tensors.items():
        if save_bf16 and key.startswith(MODEL) and t.dtype == torch.float32:
            out[key] = t.detach().to(torch.bfloat16)
            cast += 1
            if keep_master:
                out[MASTER + key[len(MODEL):]] = t
        else:
            out[key] = t
    notes = []
    if cast and not keep_master:
        notes.append("exp_manager.save_bf16: checkpoints hold the fp32 weights rounded to bf16 and no fp32 copy "
                     "(checkpoint_callback_params.use_master_weights_in_ckpt is false): resuming from them is not "
                     "exact")
    has_fp32 = any(k.startswith(MODEL) and t.dtype == torch.float32 for k, t in tensors.items())
    has_opt_master = any(k.startswith("optim") and k.endswith(".master") for k in tensors)
    if keep_master and not (has_fp32 or has_opt_master):
        notes.append("checkpoint_callback_params.use_master_weights_in_ckpt: this run has no fp32 master weights "
                     "(bf16 parameters, optimizer without an fp32 copy); checkpoints hold the bf16 weights")
    return out, notes


def weights_for_load(tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> tuple[dict, list[str]]:
    """The DCP load request: `model.<fqn>` targets are read from `master.<fqn>` when the
    checkpoint has it. The targets are the same tensor objects (DCP loads in place).

    `saved` is DCP's state_dict_metadata of the checkpoint. Returns (request, notes): one note
    when bf16-only weights are loaded into fp32 parameters (values rounded, resume not exact).
    """
    request: dict[str, torch.Tensor] = {}
    rounded = []
    for key, t in tensors.items():
        if key.startswith(MODEL) and MASTER + key[len(MODEL):] in saved:
            request[MASTER + key[len(MODEL):]] = t
            continue
        request[key] = t
        md = saved.get(key)  # DCP metadata, or the tensor itself (xser)
        dtype = md.dtype if isinstance(md, torch.Tensor) else getattr(getattr(md, "properties", None), "dtype", None)
        if key.startswith(MODEL) and dtype is not None and dtype != t.dtype and t.dtype == torch.float32:
            rounded.append(str(dtype).removeprefix("torch."))
    notes = []
    if rounded:
        notes.append(f"checkpoint holds {len(rounded)} model tensors as {rounded[0]} "
                     "with no fp32 master weights (saved with exp_manager.save_bf16 and without "
                     "use_master_weights_in_ckpt): loaded into fp32 parameters, the run continues from rounded "
                     "weights (not an exact resume)")
    return request, notes


def model_keys_for_export(saved: dict[str, Any]) -> dict[str, str]:
    """{fqn: checkpoint key} of the weights to export: the fp32 masters where the checkpoint has them."""
    out = {}
    for key, md in saved.items():
        if key.startswith(MODEL) and hasattr(md, "size"):
            fqn = key[len(MODEL):]
            out[fqn] = MASTER + fqn if MASTER + fqn in saved else key
    return out
