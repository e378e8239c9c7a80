"""Build a `transformers` causal LM ("hf" model source) from a local config.json.

Only the architecture is read (no weights, no network): `cfg.model.model_config` names a
config.json (or a folder holding one), and a few YAML keys override it, as in NxDT:

    model.num_layers              → num_hidden_layers
    model.hidden_size             → hidden_size (an explicit head_dim is then recomputed)
    model.rope_theta              → rope_theta (gpt_neox: rotary_emb_base)
    model.rotary_emb_base         → the same (GPT-NeoX's name for it; validation refuses both differing)
    model.max_position_embeddings → max_position_embeddings

An override applies only when the key is present and not None. The rotary base goes where the
config's model_type reads it: transformers' GPT-NeoX ignores a `rope_theta` key (it reads
`rotary_emb_base`, or `rope_parameters.rope_theta` in transformers >= 5 files). The vocabulary size is
the config.json's (HF models are not padded). With `model.moe.num_experts` > 0 the MoE keys
override a Mixtral-style config too (num_local_experts, num_experts_per_tok,
router_aux_loss_coef, output_router_logits), and each MoE block gets nxdt's load-balancing
loss and routing statistics (nxdt.models.moe.attach_router_aux_loss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxdt.models.moe import attach_router_aux_loss

# Where shipped model configs live when running from a source checkout: <repo>/conf.
_REPO_ROOT = Path(__file__).resolve().parents[3]
_CONF_DIR = _REPO_ROOT / "conf"

# YAML key under `model.` → transformers config attribute.
HF_OVERRIDES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "rope_theta": "rope_theta",
    "rotary_emb_base": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
}


def resolve_model_config(path: str | Path) -> Path:
    """Find the config.json: as given (absolute or relative to the working directory),
    else relative to the repository root or to `conf/` (e.g. `model_configs/tiny_llama`).
    A folder means the config.json inside it."""
    given = Path(str(path)).expanduser()
    tried = []
    for candidate in (given, _REPO_ROOT / given, _CONF_DIR / given):
        if candidate.is_dir():
            candidate = candidate / "config.json"
        tried.append(str(candidate))
        if candidate.is_file():
            return candidate
    tried = list(dict.fromkeys(tried))  # an absolute path is the same candidate three times
    where = f"; tried: {', '.join(tried)}" if tried != [str(given)] else ""
    raise FileNotFoundError(f"model.model_config {str(path)!r} not found{where}")


# `model.moe.<key>` → transformers MoE config attribute (with num_experts > 0)
HF_MOE_OVERRIDES = {
    "num_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "output_router_logits": "output_router_logits",
}


def load_config_dict(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json as a dict with the YAML overrides (keys as under `model.`; the MoE ones
    as `moe.<key>`) applied."""
    with open(resolve_model_config(path)) as f:
        d = json.load(f)
    for key, attr in HF_MOE_OVERRIDES.items():
        value = (overrides or {}).get(f"moe.{key}")
        if value is not None:
            d[attr] = value
    for yaml_key, value in (overrides or {}).items():
        if value is None or yaml_key not in HF_OVERRIDES:
            continue
        attr = HF_OVERRIDES[yaml_key]
        if attr == "rope_theta" and d.get("model_type") == "gpt_neox":
            attr = "rotary_emb_base"
        d[attr] = value
        if yaml_key == "hidden_size" and d.get("head_dim") is not None:
            # An explicit head_dim belonged to the old width; keep heads × head_dim == hidden.
            d["head_dim"] = value // d["num_attention_heads"]
        if HF_OVERRIDES[yaml_key] == "rope_theta" and isinstance(d.get("rope_parameters"), dict):
            # transformers >= 5 format keeps rope_theta inside rope_parameters.
            d["rope_parameters"]["rope_theta"] = value
    # Drop the checkpoint's storage dtype: precision is nxdt's business, parameters start fp32.
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    return d


def build_hf_model(model_config: str | Path, overrides: dict[str, Any] | None = None) -> nn.Module:
    """A randomly initialised transformers model (fp32, SDPA attention, no KV cache).

    Built on the current default device: call it under `with torch.device("meta"):` to
    allocate nothing.
    """
    # transformers' model classes only for model_source: hf (seconds to import; native models never need them)
    from transformers import AutoConfig, AutoModelForCausalLM

    d = load_config_dict(model_config, overrides)
    model_type = d.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **d)
    config.use_cache = False
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(prev)
    if getattr(config, "num_local_experts", None):  # Mixtral-style MoE: nxdt's aux loss and statistics
        coef = config.router_aux_loss_coef if config.output_router_logits else 0.0
        blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        if not blocks:  # e.g. model.moe keys over a dense Llama config.json: never train it as dense silently
            raise ValueError(f"model.model_config {str(model_config)!r} (model_type {model_type!r}) has no MoE "
                             "blocks; model.moe needs a Mixtral-style config.json")
        for block in blocks:
            attach_router_aux_loss(block, config.num_local_experts, config.num_experts_per_tok, coef)
    return model
