"""`build_model(cfg, vocab_size)`: the one place the `model.*` keys become a module.

`cfg.model_source` picks the implementation:
- 'megatron' → nxdt's own Llama (`NxdtLlamaForCausalLM`), architecture from `cfg.model.*`,
  vocabulary padded Megatron-style;
- 'hf'       → a `transformers` model from the local `cfg.model.model_config` json.

Keys are read by full path with defaults, so a partial config (e.g. in a test) also works.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from nxdt.models.hf import HF_OVERRIDES, build_hf_model
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Smallest multiple of divisible_by × tp that is ≥ vocab_size (Megatron's padding:
    each tensor-parallel rank then holds an equal, aligned slice of the embedding)."""
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(vocab_size) // multiple) * multiple


def count_parameters(model: nn.Module) -> int:
    """Number of parameters; a shared (tied) tensor counts once. Works on meta tensors."""
    return sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates


def logits_of(output: Any) -> torch.Tensor:
    """Logits from either model source: the native model returns them, transformers wraps them."""
    return output if isinstance(output, torch.Tensor) else output.logits


def llama_args_from_cfg(cfg: Any, vocab_size: int | None = None) -> LlamaArgs:
    """LlamaArgs from `cfg.model.*` (megatron source), with the vocabulary padded.

    A key that is absent or null takes the default below; num_layers, hidden_size and
    num_attention_heads have none (a silent default size would be a surprise).
    """
    m = cfg.model

    def get(key: str, default: Any = None) -> Any:
        value = m.get(key, None)
        return default if value is None else value

    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if get(k) is None]
    if missing:
        raise ValueError(f"model_source megatron needs model.{', model.'.join(missing)}")
    if vocab_size is None:
        vocab_size = get("vocab_size")
    if vocab_size is None:
        raise ValueError("model_source megatron needs a vocabulary size (from the tokenizer, or model.vocab_size)")
    block = get("transformer_block_type", "pre_ln")
    if block != "pre_ln":
        raise NotImplementedError(f"model.transformer_block_type {block!r}: only 'pre_ln' is implemented")
    rope_scaling = get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        from omegaconf import OmegaConf

        rope_scaling = OmegaConf.to_container(rope_scaling, resolve=True)
    tp = _get(cfg, "distributed_strategy", "tensor_model_parallel_size", 1)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    return LlamaArgs(
        vocab_size=padded_vocab_size(vocab_size, get("make_vocab_size_divisible_by", 128), tp),
        hidden_size=hidden,
        num_layers=get("num_layers"),
        num_attention_heads=heads,
        num_kv_heads=get("num_kv_heads", heads),
        ffn_hidden_size=get("ffn_hidden_size", 4 * hidden),  # Megatron's default width
        kv_channels=get("kv_channels"),
        max_position_embeddings=get("max_position_embeddings", get("encoder_seq_length", 4096)),
        normalization=get("normalization", "rmsnorm"),
        layernorm_epsilon=get("layernorm_epsilon", 1e-5),
        activation=get("activation", "swiglu"),
        has_bias=bool(get("has_bias", False)),
        share_embeddings_and_output_weights=bool(get("share_embeddings_and_output_weights", False)),
        position_embedding_type=get("position_embedding_type", "rope"),
        rotary_percentage=get("rotary_percentage", 1.0),
        rope_theta=get("rope_theta", 10000.0),
        rope_scaling=rope_scaling,
        sliding_window_size=get("sliding_window_size"),
        hidden_dropout=get("hidden_dropout", 0.0),
        attention_dropout=get("attention_dropout", 0.0),
        ffn_dropout=get("ffn_dropout", 0.0),
        init_method_std=get("init_method_std", 0.02),
        use_scaled_init_method=bool(get("use_scaled_init_method", True)),
        apply_query_key_layer_scaling=bool(get("apply_query_key_layer_scaling", False)),
    )


def build_model(cfg: Any, vocab_size: int | None = None, device: str | torch.device | None = None) -> nn.Module:
    """The model for `cfg` (see module docstring), fp32.

    device='meta' builds the structure without allocating memory (for models larger than
    host memory, or to count parameters); materialise later with `init_model_weights`.
    On a real device the weights are initialised here.
    """
    source = cfg.get("model_source", "megatron")
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        if source == "megatron":
            model = NxdtLlamaForCausalLM(llama_args_from_cfg(cfg, vocab_size))
        elif source == "hf":
            model_config = cfg.model.get("model_config")
            if not model_config:
                raise ValueError("model_source hf needs model.model_config (path to a config.json)")
            overrides = {k: cfg.model.get(k) for k in HF_OVERRIDES}
            model = build_hf_model(model_config, overrides)
        else:
            raise ValueError(f"model_source must be 'megatron' or 'hf', got {source!r}")
    if not _is_meta(model) and isinstance(model, NxdtLlamaForCausalLM):
        model.init_weights()  # Megatron init, not nn.Linear's default kaiming-uniform
    return model


@torch.no_grad()
def init_model_weights(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Materialise a meta-device model on `device` (if given) and (re)initialise its weights,
    for either model source. Tied weights are re-tied."""
    if device is not None:
        model.to_empty(device=device)
    if isinstance(model, NxdtLlamaForCausalLM):
        model.init_weights()
    else:  # transformers PreTrainedModel
        for module in model.modules():
            # transformers skips modules it has already initialised; after to_empty none are.
            if hasattr(module, "_is_hf_initialized"):
                module._is_hf_initialized = False
        model.init_weights()
    return model


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _get(cfg: Any, section: str, key: str, default: Any) -> Any:
    sec = cfg.get(section)
    if sec is None:
        return default
    value = sec.get(key, default)
    return default if value is None else value
