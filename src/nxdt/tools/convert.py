"""`nxdt convert`: Hugging Face folders ⇄ nxdt checkpoints.

    nxdt convert hf-to-nxdt --input HF_DIR --output CKPT
    nxdt convert nxdt-to-hf --input CKPT --output HF_DIR [--max-shard-size 5GB] [--dtype bfloat16]
                            [--base BASE_CKPT] [--adapter-only]
    nxdt convert nxd-to-nxdt --input NXDT_CKPT --output CKPT --config NXDT_YAML [KEY=VALUE ...]
                             (a checkpoint NxDT wrote, NxD's layout: nxdt.tools.convert_nxd)

Llama, Mixtral, Qwen3, Qwen3-MoE and DeepSeek-V3: both model sources use transformers' parameter
names, so the tensors are copied as they are (a Qwen3-MoE or DeepSeek-V3 folder's per-expert weights
are stacked into the fused layout, nxdt.models.qwen3; DeepSeek-V3's multi-token-prediction layer is
left out with a notice, its fp8 weights refused: dequantize first); a Qwen3 or DeepSeek-V3 checkpoint
gets an `nxdt_model.yaml` too (the native model's keys, below); a LLaMA-MoE folder (model_type llama_moe)
is renamed to nxdt's MoE (nxdt.models.llama_moe), its settings nxdt does not build refused in one line.
Another model_type is refused in one line (no nxdt model would load its weights). GPT-NeoX / Pythia (config.json model_type gpt_neox): the weights are renamed
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
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from nxdt.checkpoint.checkpointer import load_weights, save_weights
from nxdt.checkpoint.locate import resolve_checkpoint
from nxdt.config.errors import ConfigError
from nxdt.models.deepseek_v3 import DEEPSEEK_V3_MODEL_TYPES, deepseek_v3_model_keys, mtp_notice
from nxdt.models.llama_moe import MODEL_TYPES as LLAMA_MOE_MODEL_TYPES, llama_moe_model_keys, llama_moe_to_native
from nxdt.models.lora import is_lora_key
from nxdt.models.neox import neox_model_keys, neox_to_native
from nxdt.models.qwen3 import QWEN3_MODEL_TYPES, fuse_experts, qwen3_model_keys
from nxdt.tools.convert_lora import lora_to_hf
from nxdt.tools.convert_nxd import ALIASES as NXD_ALIASES, COMMAND as NXD_COMMAND, nxd_to_nxdt
from nxdt.tools.hf_folder import check_output_free, copy_tokenizer, hf_config_for, read_hf_folder, write_hf_model

NXDT_MODEL_FILE = "nxdt_model.yaml"
# config.json model_types whose weights an nxdt model loads (both sources; qwen3*, gpt_neox also native)
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "gpt_neox") + LLAMA_MOE_MODEL_TYPES + QWEN3_MODEL_TYPES + DEEPSEEK_V3_MODEL_TYPES


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", str(text), flags=re.I)
    if not m:
        raise ConfigError(f"--max-shard-size: cannot read '{text}' (e.g. 5GB, 500MB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit])


def check_model_type(input_dir: Path) -> None:
    """Refuse, before any weight is read, a folder whose config.json names a model_type no nxdt
    model builds (e.g. deepseek_v3): its weights would convert into a checkpoint nothing loads."""
    try:
        model_type = json.loads((input_dir / "config.json").read_text()).get("model_type", "llama")
    except (OSError, ValueError, AttributeError):
        return  # read_hf_folder says what is wrong with the folder
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{input_dir}: model_type '{model_type}' is not a model nxdt builds (hf-to-nxdt converts "
                          f"{', '.join(HF_MODEL_TYPES)}); nothing written")


def hf_to_nxdt(input_dir: Path, output: Path) -> dict[str, Any] | None:
    """Returns the nxdt model section written to `nxdt_model.yaml` (GPT-NeoX, Qwen3, Qwen3-MoE), else
    None. A model_type no nxdt model builds is refused before anything is written."""
    check_model_type(input_dir)
    hf_config, tensors = read_hf_folder(input_dir)
    if output.exists():
        raise ConfigError(f"--output {output} exists; choose a new path (nothing is overwritten)")
    meta: dict[str, Any] = {"hf_config": hf_config, "source": str(input_dir)}
    nxdt_model = None
    model_type = hf_config.get("model_type", "llama")
    if model_type in DEEPSEEK_V3_MODEL_TYPES:
        nxdt_model, tensors = _deepseek_v3(input_dir, hf_config, tensors)
        meta["nxdt_model"] = nxdt_model
    if model_type in QWEN3_MODEL_TYPES:
        try:
            nxdt_model = {"model_source": "megatron", "model": qwen3_model_keys(hf_config)}
            tensors = fuse_experts(tensors)  # published Qwen3-MoE folders keep each expert apart
        except (ValueError, KeyError) as err:
            raise ConfigError(f"{input_dir}: cannot convert this {model_type} model: {err}") from None
        meta["nxdt_model"] = nxdt_model
    if model_type in LLAMA_MOE_MODEL_TYPES:  # LLaMA-MoE and its residual variant (nxdt.models.llama_moe)
        try:
            nxdt_model = {"model_source": "megatron", "model": llama_moe_model_keys(hf_config)}
            tensors = llama_moe_to_native(tensors, hf_config)
        except (ValueError, KeyError) as err:
            raise ConfigError(f"{input_dir}: cannot convert this LLaMA-MoE model: {err}; nothing written") from None
        meta["nxdt_model"] = nxdt_model
    if model_type == "gpt_neox":
        try:
            nxdt_model = {"model_source": "megatron", "model": neox_model_keys(hf_config)}
            tensors = neox_to_native(tensors, int(hf_config["num_attention_heads"]))
        except (ValueError, KeyError) as err:
            raise ConfigError(f"{input_dir}: cannot convert this GPT-NeoX model: {err}") from None
        meta["nxdt_model"] = nxdt_model
    save_weights(tensors, output, meta)
    if nxdt_model is not None:
        header = f"# the native model of {input_dir} (nxdt convert hf-to-nxdt): merge into the training YAML\n"
        (output / NXDT_MODEL_FILE).write_text(header + OmegaConf.to_yaml(OmegaConf.create(nxdt_model)))
    copy_tokenizer(input_dir, output / "tokenizer")
    return nxdt_model


def _deepseek_v3(input_dir: Path, hf_config: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """The native model's keys of a DeepSeek-V3 folder and its tensors as that model names them: experts
    stacked (published folders keep each apart), the multi-token-prediction layer(s) left out with a notice."""
    scaled = sorted(k for k in tensors if k.endswith("_scale_inv"))
    if scaled:
        raise ConfigError(f"{input_dir}: fp8 block-quantized weights ({scaled[0]} and {len(scaled) - 1} more): "
                          "dequantize them to bf16 first (DeepSeek's fp8_cast_bf16.py), then convert")
    try:
        keys = deepseek_v3_model_keys(hf_config)
        layers = int(hf_config["num_hidden_layers"])
        kept = {k: t for k, t in tensors.items()
                if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)}
        tensors = fuse_experts(kept)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{input_dir}: cannot convert this deepseek_v3 model: {err}") from None
    notice = mtp_notice(hf_config)
    if notice:
        print(notice)
    return {"model_source": "megatron", "model": keys}, tensors


# --------------------------------------------------------------------------- nxdt checkpoint
def nxdt_to_hf(ckpt: Path, output: Path, max_shard_bytes: int, dtype: str | None = None,
               base: Path | None = None, adapter_only: bool = False) -> None:
    tensors = load_weights(ckpt)
    if any(k.endswith(SCORE_BIAS) for k in tensors):
        tensors = without_score_bias(ckpt, tensors, hf_config_for(ckpt, tensors).get("model_type", "llama"))
    if any(is_lora_key(k) for k in tensors):
        lora_to_hf(ckpt, tensors, output, max_shard_bytes, dtype, base=base, adapter_only=adapter_only)
        return
    if base is not None or adapter_only:
        flag = "--base" if base is not None else "--adapter-only"
        raise ConfigError(f"{flag}: {ckpt} has no LoRA adapters (the flag is for checkpoints of LoRA runs)")
    config = hf_config_for(ckpt, tensors)
    if config.get("model_type") in DEEPSEEK_V3_MODEL_TYPES:
        tensors = with_score_bias(tensors)
    check_output_free(output)
    write_hf_model(ckpt, tensors, config, output, max_shard_bytes, dtype)


SCORE_BIAS = ".mlp.gate.e_score_correction_bias"


def without_score_bias(ckpt: Path, tensors: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Loss-free balancing's selection bias for a model_type whose router has none (Mixtral, Qwen3-MoE):
    dropped when zero (selection by the scores alone, as before any update); else refused, since adding it
    to the gate weights is not exact (a per-expert constant on the scores is not a function of the token's
    hidden state through a bias-free linear, and top-k selection is not invariant to it)."""
    if model_type in DEEPSEEK_V3_MODEL_TYPES:
        return tensors
    moved = [k for k, t in tensors.items() if k.endswith(SCORE_BIAS) and bool(t.abs().max() > 0)]
    if moved:
        raise ConfigError(f"nxdt-to-hf: {ckpt} was trained with model.moe.load_balancing loss_free and its selection "
                          f"bias ({moved[0]}) is not zero: transformers' {model_type} router has no bias and folding "
                          f"it into the gate is not exact for top-k selection; nothing written")
    return {k: t for k, t in tensors.items() if not k.endswith(SCORE_BIAS)}


def with_score_bias(tensors: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 export: a zero `mlp.gate.e_score_correction_bias` for each router trained without one
    (load_balancing aux_loss / none select by the scores alone, as a zero bias does)."""
    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(".mlp.gate.weight"):
            out.setdefault(name[:-len("weight")] + "e_score_correction_bias", torch.zeros(t.shape[0], dtype=torch.float32))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxdt convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-nxdt", help="HF folder (safetensors) → nxdt weights-only checkpoint")
    a.add_argument("--input", required=True, type=Path)
    a.add_argument("--output", required=True, type=Path)
    b = sub.add_parser("nxdt-to-hf", help="nxdt checkpoint → HF folder loadable by transformers")
    b.add_argument("--input", required=True, type=Path, help="a checkpoint, or a run folder (its newest complete one)")
    b.add_argument("--output", required=True, type=Path)
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="store the weights in this dtype (default: as in the checkpoint)")
    b.add_argument("--base", type=Path, default=None, metavar="CKPT",
                   help="LoRA: a weights checkpoint of the base model, for a checkpoint that holds only the "
                        "adapters (save_lora_base: false), e.g. the run's exp_manager.resume_from_checkpoint")
    b.add_argument("--adapter-only", action="store_true",
                   help="LoRA: write only the PEFT adapter folder (OUTPUT/adapter), no merged or base model")
    c = sub.add_parser(NXD_COMMAND, aliases=list(NXD_ALIASES),
                       help="a checkpoint NxDT wrote (NxD's tp/pp rank files, torch.save or xser) → nxdt weights")
    c.add_argument("--input", required=True, type=Path,
                   help="the tag folder (...ckpt), its model/ folder, or the checkpoint dir (newest completed tag)")
    c.add_argument("--output", required=True, type=Path)
    c.add_argument("--config", type=Path, default=None, metavar="NXDT_YAML",
                   help="the YAML the NxDT run trained with (architecture, tp, pp, kv_replicator)")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="overrides of that YAML, e.g. model.model_config=/path/config.json")
    args = parser.parse_args(argv)
    if args.direction in (NXD_COMMAND, *NXD_ALIASES):
        for line in nxd_to_nxdt(args.input, args.output, args.config, args.overrides):
            print(line)
    elif args.direction == "hf-to-nxdt":
        if hf_to_nxdt(args.input, args.output) is not None:
            print(f"model keys of the native model: {args.output / NXDT_MODEL_FILE}")
    else:
        args.input, chosen = resolve_checkpoint(args.input, "--input")  # a run folder: its newest complete one
        if chosen:
            print(f"note: {chosen}")
        nxdt_to_hf(args.input, args.output, parse_size(args.max_shard_size), args.dtype,
                   base=args.base, adapter_only=args.adapter_only)
    print(f"wrote {args.output}")
    return 0
