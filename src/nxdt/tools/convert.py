"""`nxdt convert`: Hugging Face folders ⇄ nxdt checkpoints.

    nxdt convert hf-to-nxdt --input HF_DIR --output CKPT
    nxdt convert nxdt-to-hf --input CKPT --output HF_DIR [--max-shard-size 5GB] [--dtype bfloat16]
                            [--base BASE_CKPT] [--adapter-only]

Llama and Mixtral: both model sources use transformers' parameter names, so the tensors are
copied as they are. GPT-NeoX / Pythia (config.json model_type gpt_neox): the weights are renamed
to the native model's and the fused QKV is split (nxdt.models.neox), and the checkpoint gets an
`nxdt_model.yaml`: the `model_source: megatron` + `model:` keys (block type, layernorm, gelu,
biases, rotary_percentage, ...) that build that native model; put them in the training YAML.
hf-to-nxdt writes a weights-only nxdt checkpoint (start training from it with
`exp_manager.resume_from_checkpoint=CKPT model.weight_init_only=true`) and keeps the config.json
and tokenizer files inside it. nxdt-to-hf writes safetensors shards with their
`model.safetensors.index.json`, a config.json (the HF one kept at import, else from the
checkpoint's config.yaml: `model.model_config` for model_source hf, the native model's
arguments for megatron, nxdt.models.hf_export) and the tokenizer files; a native GPT-NeoX is
renamed back (the output layer as `embed_out`, as GPT-NeoX folders store it). Only safetensors
and JSON are read: nothing is unpickled. A checkpoint with LoRA adapters (`model_alignment_strategy.peft`)
becomes the merged model, its base and a PEFT adapter folder (nxdt.tools.convert_lora; `--base` supplies
the base weights an adapter-only checkpoint lacks, `--adapter-only` writes the adapter alone).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.config.load import load_saved_config

NXDT_MODEL_FILE = "nxdt_model.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", str(text), flags=re.I)
    if not m:
        raise ConfigError(f"--max-shard-size: cannot read '{text}' (e.g. 5GB, 500MB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit])


# --------------------------------------------------------------------------- HF folder
def read_hf_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ConfigError(f"{index}: not a safetensors index ({err})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"{folder}: no model.safetensors or {INDEX} (only safetensors weights are read)")
    tensors: dict[str, Any] = {}
    for name in files:
        try:
            tensors.update(load_file(str(folder / name)))
        except Exception as err:
            raise ConfigError(f"{folder / name}: unreadable safetensors file ({err})") from None
    return tensors


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


def read_hf_folder(input_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json as a dict, the tensors) of a transformers folder; a tied lm_head is
    materialised (nxdt's model has both keys, one tensor)."""
    config_file = input_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file} is missing")
    try:
        hf_config = json.loads(config_file.read_text())
    except ValueError as err:
        raise ConfigError(f"{config_file}: not JSON ({err})") from None
    tensors = read_hf_weights(input_dir)
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return hf_config, tensors


def hf_to_nxdt(input_dir: Path, output: Path) -> dict[str, Any] | None:
    """Returns the nxdt model section written to `nxdt_model.yaml` (GPT-NeoX), else None."""
    from nxdt.checkpoint.checkpointer import save_weights

    hf_config, tensors = read_hf_folder(input_dir)
    if output.exists():
        raise ConfigError(f"--output {output} exists; choose a new path (nothing is overwritten)")
    meta: dict[str, Any] = {"hf_config": hf_config, "source": str(input_dir)}
    nxdt_model = None
    if hf_config.get("model_type") == "gpt_neox":
        from nxdt.models.neox import neox_model_keys, neox_to_native

        try:
            nxdt_model = {"model_source": "megatron", "model": neox_model_keys(hf_config)}
            tensors = neox_to_native(tensors, int(hf_config["num_attention_heads"]))
        except (ValueError, KeyError) as err:
            raise ConfigError(f"{input_dir}: cannot convert this GPT-NeoX model: {err}") from None
        meta["nxdt_model"] = nxdt_model
    save_weights(tensors, output, meta)
    if nxdt_model is not None:
        from omegaconf import OmegaConf

        header = f"# the native model of {input_dir} (nxdt convert hf-to-nxdt): merge into the training YAML\n"
        (output / NXDT_MODEL_FILE).write_text(header + OmegaConf.to_yaml(OmegaConf.create(nxdt_model)))
    copy_tokenizer(input_dir, output / "tokenizer")
    return nxdt_model


# --------------------------------------------------------------------------- nxdt checkpoint
def hf_config_for(ckpt: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    from nxdt.checkpoint.state import META, read_json

    meta = read_json(ckpt / META)
    if meta.get("hf_config"):
        return dict(meta["hf_config"])
    cfg_file = ckpt / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} is missing: cannot tell the model's architecture")
    cfg = load_saved_config(cfg_file)
    if cfg.model_source == "hf":
        from nxdt.models.hf import HF_OVERRIDES, load_config_dict

        d = load_config_dict(cfg.model.model_config, {k: getattr(cfg.model, k) for k in HF_OVERRIDES})
        d.setdefault("model_type", "llama")
        return d
    from nxdt.models.builder import llama_args_from_cfg
    from nxdt.models.hf_export import hf_config_dict

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


def write_safetensors(tensors: dict[str, Any], output: Path, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

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
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(output / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (output / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def nxdt_to_hf(ckpt: Path, output: Path, max_shard_bytes: int, dtype: str | None = None,
               base: Path | None = None, adapter_only: bool = False) -> None:
    from nxdt.checkpoint.checkpointer import load_weights
    from nxdt.models.lora import is_lora_key

    tensors = load_weights(ckpt)
    if any(is_lora_key(k) for k in tensors):
        from nxdt.tools.convert_lora import lora_to_hf

        lora_to_hf(ckpt, tensors, output, max_shard_bytes, dtype, base=base, adapter_only=adapter_only)
        return
    if base is not None or adapter_only:
        flag = "--base" if base is not None else "--adapter-only"
        raise ConfigError(f"{flag}: {ckpt} has no LoRA adapters (the flag is for checkpoints of LoRA runs)")
    config = hf_config_for(ckpt, tensors)
    check_output_free(output)
    write_hf_model(ckpt, tensors, config, output, max_shard_bytes, dtype)


def check_output_free(output: Path) -> None:
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output {output} exists and is not empty (nothing is overwritten)")


def write_hf_model(ckpt: Path, tensors: dict[str, Any], config: dict[str, Any], output: Path,
                   max_shard_bytes: int, dtype: str | None = None) -> None:
    """A transformers folder at `output` from nxdt-named tensors and the model's config.json dict:
    safetensors shards (GPT-NeoX names where the config says gpt_neox), config.json, tokenizer files."""
    import torch

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
    from nxdt.models.neox import native_to_neox

    try:
        return native_to_neox(tensors, int(config["num_attention_heads"]))
    except ValueError as err:
        raise ConfigError(f"{ckpt}: cannot be written as a GPT-NeoX model: {err}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxdt convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-nxdt", help="HF folder (safetensors) → nxdt weights-only checkpoint")
    a.add_argument("--input", required=True, type=Path)
    a.add_argument("--output", required=True, type=Path)
    b = sub.add_parser("nxdt-to-hf", help="nxdt checkpoint → HF folder loadable by transformers")
    b.add_argument("--input", required=True, type=Path)
    b.add_argument("--output", required=True, type=Path)
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="store the weights in this dtype (default: as in the checkpoint)")
    b.add_argument("--base", type=Path, default=None, metavar="CKPT",
                   help="LoRA: a weights checkpoint of the base model, for a checkpoint that holds only the "
                        "adapters (save_lora_base: false), e.g. the run's exp_manager.resume_from_checkpoint")
    b.add_argument("--adapter-only", action="store_true",
                   help="LoRA: write only the PEFT adapter folder (OUTPUT/adapter), no merged or base model")
    args = parser.parse_args(argv)
    if args.direction == "hf-to-nxdt":
        if hf_to_nxdt(args.input, args.output) is not None:
            print(f"model keys of the native model: {args.output / NXDT_MODEL_FILE}")
    else:
        nxdt_to_hf(args.input, args.output, parse_size(args.max_shard_size), args.dtype,
                   base=args.base, adapter_only=args.adapter_only)
    print(f"wrote {args.output}")
    return 0
