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
router_aux_loss_coef, output_router_logits).

Mixtral (model_type mixtral) is built as NxDT builds its HF Mixtral, with NxD's MoE layer in the
MLP's place: each `MixtralSparseMoeBlock` is replaced by nxdt's own block (nxdt.models.moe.LlamaMoE)
holding the same parameters under the same names (`mlp.gate.weight`, `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), so HF weights load and export unchanged, and `model.moe`'s routing applies
(capacity_factor, dropless, sinkhorn, router_activation, normalize_top_k_affinities, dropout, the
score scale), as do nxdt's tensor and expert parallel plans for its experts. With the default
routing the logits are transformers' own. Other transformers MoE blocks (a `gate` and `experts`)
keep their own forward and get nxdt's load-balancing loss and routing statistics by hooks
(nxdt.models.moe.attach_router_aux_loss).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxdt.models.moe import LlamaMoE, MoEArgs, MoEExperts, MoERouter, attach_router_aux_loss

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


# transformers' rope validation warns when a Llama 3.1 rope_scaling's original_max_position_embeddings
# (8192) is not below max_position_embeddings, which NxDT's Llama 3.1 configs set to their 8192-token
# sequence: the scaled frequencies are the model's own either way
ROPE_NOTE = "original_max_position_embeddings field must be less than max_position_embeddings"


@contextmanager
def dropped_log_lines(logger_name: str, fragment: str):
    """Records of the logger `logger_name` holding `fragment` are dropped while the block runs
    (a filter on that logger alone: its other records, and every other logger, are untouched)."""
    logger = logging.getLogger(logger_name)

    def keep(record: logging.LogRecord) -> bool:
        return fragment not in record.getMessage()

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def build_hf_model(model_config: str | Path, overrides: dict[str, Any] | None = None,
                   moe: MoEArgs | None = None) -> nn.Module:
    """A randomly initialised transformers model (fp32, SDPA attention, no KV cache).

    `moe`: model.moe's routing (nxdt.models.builder.moe_args_from_cfg; None: Mixtral's own) for a
    Mixtral config.json; its experts, top-k and loss weight are the config's after the overrides.
    Built on the current default device: call it under `with torch.device("meta"):` to
    allocate nothing.
    """
    # transformers' model classes only for model_source: hf (seconds to import; native models never need them)
    from transformers import AutoConfig, AutoModelForCausalLM

    d = load_config_dict(model_config, overrides)
    model_type = d.pop("model_type", "llama")
    with dropped_log_lines("transformers.modeling_rope_utils", ROPE_NOTE):
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
        blocks = [(name, m) for name, m in model.named_modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        if not blocks:  # e.g. model.moe keys over a dense Llama config.json: never train it as dense silently
            raise ValueError(f"model.model_config {str(model_config)!r} (model_type {model_type!r}) has no MoE "
                             "blocks; model.moe needs a Mixtral-style config.json")
        if model_type == "mixtral":
            args = replace(moe or MoEArgs(), num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                           aux_loss_coef=coef)
            _use_nxdt_moe(model, blocks, config, args)
        else:
            for _, block in blocks:
                attach_router_aux_loss(block, config.num_local_experts, config.num_experts_per_tok, coef)
    return model


def _use_nxdt_moe(model: nn.Module, blocks: list[tuple[str, nn.Module]], config: Any, args: MoEArgs) -> None:
    """Replace each Mixtral MoE block by nxdt's (LlamaMoE), handing it the block's own parameters
    (same names and layouts; on a real device the values transformers initialised)."""
    if config.hidden_act != "silu":
        raise ValueError(f"Mixtral experts with hidden_act {config.hidden_act!r}: nxdt's experts are SwiGLU (silu)")
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise {config.router_jitter_noise}: nxdt's MoE block has no router jitter; "
                         "set it to 0 in the config.json")
    for name, block in blocks:
        ours = LlamaMoE(config.hidden_size, config.intermediate_size, args)
        ours.gate.weight = block.gate.weight
        ours.experts.gate_up_proj, ours.experts.down_proj = block.experts.gate_up_proj, block.experts.down_proj
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ours)
    # transformers records router logits from its own router class, none of which is left: its own
    # loss (over no logits) is off; nxdt's block attaches the load-balancing loss itself
    config.output_router_logits = False


@torch.no_grad()
def init_nxdt_moe(model: nn.Module) -> None:
    """After transformers' init_weights (which knows only its own classes): nxdt's MoE blocks in a
    transformers model drawn as transformers draws Mixtral's, N(0, initializer_range)."""
    std = model.config.initializer_range
    for module in model.modules():
        if isinstance(module, MoERouter):
            module.reset_parameters(std)
        elif isinstance(module, MoEExperts):
            for p in module.parameters(recurse=False):
                nn.init.normal_(p, mean=0.0, std=std)
