"""Build a `transformers` causal LM ("hf" model source) from a local config.json.

Only the architecture is read (no weights, no network): `cfg.model.model_config` names a
config.json (or a folder holding one), and a few YAML keys override it, as in NxDT:

    model.num_layers              → num_hidden_layers
    model.hidden_size             → hidden_size (an explicit head_dim is then recomputed)
    model.rope_theta              → rope_theta
    model.max_position_embeddings → max_position_embeddings

An override applies only when the key is present and not None. The vocabulary size is
the config.json's (HF models are not padded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Where shipped model configs live when running from a source checkout: <repo>/conf.
_REPO_ROOT = Path(__file__).resolve().parents[3]
_CONF_DIR = _REPO_ROOT / "conf"

# YAML key under `model.` → transformers config attribute.
HF_OVERRIDES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "rope_theta": "rope_theta",
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
    raise FileNotFoundError(f"model.model_config {str(path)!r} not found; tried: {', '.join(tried)}")


def load_config_dict(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json as a dict with the YAML overrides (keys as under `model.`) applied."""
    with open(resolve_model_config(path)) as f:
        d = json.load(f)
    for yaml_key, value in (overrides or {}).items():
        if value is None or yaml_key not in HF_OVERRIDES:
            continue
        d[HF_OVERRIDES[yaml_key]] = value
        if yaml_key == "hidden_size" and d.get("head_dim") is not None:
            # An explicit head_dim belonged to the old width; keep heads × head_dim == hidden.
            d["head_dim"] = value // d["num_attention_heads"]
        if yaml_key == "rope_theta" and isinstance(d.get("rope_parameters"), dict):
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
    return model
