"""A transformers model folder, read and written: safetensors shards (with their index), config.json
and the tokenizer files, for `nxdt convert` (nxdt.tools.convert, nxdt.tools.convert_lora) and
`nxdt moe-split`. Only safetensors and JSON are read: nothing is unpickled. A checkpoint's config.json
is the HF one kept at import, else made from its config.yaml (`model.model_config` for model_source
hf, the native model's arguments for megatron: nxdt.models.hf_export); a native GPT-NeoX is written
with GPT-NeoX's names (nxdt.models.neox)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nxdt.checkpoint.locate import INDEX, read_hf_folder, read_hf_weights  # noqa: F401 - this module's readers
from nxdt.checkpoint.state import META, read_json
from nxdt.config.errors import ConfigError
from nxdt.config.load import load_saved_config
from nxdt.models.builder import llama_args_from_cfg
from nxdt.models.hf import HF_OVERRIDES, load_config_dict
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.neox import native_to_neox

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def copy_tokenizer(src: Path | None, dst: Path) -> list[str]:
    if src is None or not src.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def hf_config_for(ckpt: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    meta = read_json(ckpt / META)
    if (meta.get("hf_config") or {}).get("model_type") in ("llama_moe", "llama_moe_residual"):  # converted to nxdt's names by hf-to-nxdt
        raise ConfigError(f"{ckpt}: a LLaMA-MoE checkpoint; nxdt-to-hf back to LLaMA-MoE's names is not supported yet")
    if meta.get("hf_config"):
        return dict(meta["hf_config"])
    cfg_file = ckpt / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} is missing: cannot tell the model's architecture")
    cfg = load_saved_config(cfg_file)
    if cfg.model_source == "hf":
        d = load_config_dict(cfg.model.model_config, {k: getattr(cfg.model, k) for k in HF_OVERRIDES})
        d.setdefault("model_type", "llama")
        return d
    embed = tensors.get("model.embed_tokens.weight")
    rows = embed.shape[0] if embed is not None else 1  # 1: an adapter-only export, which writes no config.json
    try:
        return hf_config_dict(llama_args_from_cfg(cfg, vocab_size=rows))
    except ValueError as err:  # e.g. an MoE that transformers' Mixtral cannot express
        raise ConfigError(f"{ckpt}: cannot be written as a transformers model: {err}") from None


def tokenizer_dir_for(ckpt: Path) -> Path | None:
    if (ckpt / "tokenizer").is_dir():
        return ckpt / "tokenizer"
    cfg_file = ckpt / "config.yaml"
    if cfg_file.is_file():
        tok = load_saved_config(cfg_file).data.tokenizer
        if tok.library == "huggingface" and tok.type:
            return Path(tok.type)
    return None


def _normal_mode(path: Path) -> None:
    """Read-write for the owner, readable by others as umask allows (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_safetensors(tensors: dict[str, Any], output: Path, max_shard_bytes: int) -> list[str]:
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(output / "model.safetensors"), metadata={"format": "pt"})
        _normal_mode(output / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(output / name), metadata={"format": "pt"})
        _normal_mode(output / name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (output / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def check_output_free(output: Path) -> None:
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output {output} exists and is not empty (nothing is overwritten)")


def write_hf_model(ckpt: Path, tensors: dict[str, Any], config: dict[str, Any], output: Path,
                   max_shard_bytes: int, dtype: str | None = None) -> None:
    """A transformers folder at `output` from nxdt-named tensors and the model's config.json dict:
    safetensors shards (GPT-NeoX names where the config says gpt_neox), config.json, tokenizer files."""
    config = dict(config)
    if config.get("model_type") == "gpt_neox":
        tensors = neox_tensors(tensors, config, ckpt)
    if config.get("tie_word_embeddings"):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    if dtype:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    config["torch_dtype"] = dtype or str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config.pop("dtype", None)
    output.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, output, max_shard_bytes)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir_for(ckpt), output)


def neox_tensors(tensors: dict[str, Any], config: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """GPT-NeoX names for the tensors of a native checkpoint; a model_source hf checkpoint already
    has them (its output layer is stored as `embed_out`, the name GPT-NeoX folders use)."""
    if "gpt_neox.embed_in.weight" in tensors:
        return {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in tensors.items()}
    try:
        return native_to_neox(tensors, int(config["num_attention_heads"]))
    except ValueError as err:
        raise ConfigError(f"{ckpt}: cannot be written as a GPT-NeoX model: {err}") from None
