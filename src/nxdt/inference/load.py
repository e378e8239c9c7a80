"""A checkpoint of any training layout as a model ready to generate, with its tokenizer.

    loaded = load_for_inference(Path("nxdt_experiments/tiny_llama/.../checkpoints/<name>"))
    loaded.model, loaded.tokenizer, loaded.context_length

The checkpoint is nxdt's (DCP shards written by any tp/pp/dp/fsdp/ep layout); its config.yaml says
which model to build and which tokenizer the run used. A transformers model folder (config.json,
safetensors, tokenizer files) and a weights-only checkpoint of `nxdt convert hf-to-nxdt` (its
config.json kept in meta.json, its tokenizer/ folder) load too: the model is the config.json's. One process reads every tensor whole
(`load_weights`, which also prefers fp32 master weights). LoRA adapters are folded into the base
weights (W + B A * alpha / r); an adapter-only checkpoint takes its base from `base` or, by default,
from the run's `exp_manager.resume_from_checkpoint` (the model it was fine-tuned from).

With a tensor-parallel mesh (`tp_mesh`, one process per rank under torchrun) the model is built on
the meta device, sharded with the training's own tensor-parallel plan (without sequence
parallelism: decoding runs one token at a time), and each rank reads only its shards from the
checkpoint: a model that does not fit one process is generated from without ever being whole.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch import nn
from torch.distributed.tensor import distribute_tensor

from nxdt.checkpoint.checkpointer import check_model_matches, load_weights, validate_checkpoint
from nxdt.checkpoint.dtype import weights_for_load
from nxdt.checkpoint.locate import is_hf_folder, read_hf_folder
from nxdt.checkpoint.lora_merge import with_base
from nxdt.checkpoint.state import SafeReader, read_dcp_metadata
from nxdt.config.errors import ConfigError
from nxdt.config.load import load_saved_config
from nxdt.config.schema import TokenizerConfig
from nxdt.device import accelerator_type, process_group_backend, set_device
from nxdt.data.tokenizers import build_tokenizer
from nxdt.spec import config_from_dict
from nxdt.models.builder import build_model, init_model_weights, padded_vocab_size
from nxdt.models.lora import is_lora_key, merged_state_dict
from nxdt.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class InferenceModel:
    model: nn.Module
    tokenizer: Any
    cfg: Any
    """The run's typed config (from the checkpoint's config.yaml)."""
    context_length: int
    """The longest sequence the model was built for (prompt + new tokens)."""
    vocab_size: int
    """The tokenizer's size: ids at or above it (vocabulary padding) are never sampled."""
    checkpoint: Path
    notes: list[str]


def tensor_parallel_group():
    """(rank, tp mesh) under torchrun, else (0, None): generation and the harness split the model over
    every rank of the launch (tensor parallel), each rank running every request on its shards."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, None
    kind = accelerator_type() or "cpu"
    if kind != "cpu":
        set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(kind))
    return dist.get_rank(), init_device_mesh(kind, (world,), mesh_dim_names=("tp",))


def read_run_config(path: Path, meta: dict[str, Any] | None = None):
    """The run's config.yaml; for weights without one (a transformers folder, an `nxdt convert
    hf-to-nxdt` checkpoint) a config that builds the model its config.json (or nxdt_model) describes."""
    config = path / "config.yaml"
    if config.is_file():
        return load_saved_config(config)
    meta = meta or {}
    tokenizer = next((str(d) for d in (path / "tokenizer", path) if (d / "tokenizer.json").is_file()
                      or (d / "tokenizer.model").is_file()), None)
    data = {"tokenizer": {"library": "huggingface", "type": tokenizer}}
    if meta.get("nxdt_model"):  # a GPT-NeoX folder converted to the native model
        return config_from_dict({**meta["nxdt_model"], "data": data})
    if is_hf_folder(path):
        model_config = str(path)
    elif meta.get("hf_config"):
        folder = Path(tempfile.mkdtemp(prefix="nxdt-hf-config-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        (folder / "config.json").write_text(json.dumps(meta["hf_config"]))
        model_config = str(folder)
    else:
        raise ConfigError(f"checkpoint {path} has no config.yaml and no transformers config.json: nothing says "
                          "which model it holds (a run's checkpoint has config.yaml; a transformers folder, config.json)")
    return config_from_dict({"model_source": "hf", "model": {"model_config": model_config}, "data": data})


def tokenizer_for(path: Path, cfg, tokenizer_dir: Path | None):
    """--tokenizer DIR, else the checkpoint's own tokenizer/ folder, else the run's data.tokenizer."""
    if tokenizer_dir is None and (path / "tokenizer").is_dir():
        tokenizer_dir = path / "tokenizer"
    tok_cfg = cfg.data.tokenizer
    if tokenizer_dir is None and tok_cfg.type is None and not (path / "config.yaml").is_file():
        raise ConfigError(f"{path} holds no tokenizer (tokenizer.json or tokenizer.model): give one with "
                          "--tokenizer DIR")
    if tokenizer_dir is not None:
        if not Path(tokenizer_dir).is_dir():
            raise ConfigError(f"--tokenizer {tokenizer_dir}: not a directory")
        tok_cfg = TokenizerConfig(library="huggingface", type=str(tokenizer_dir))
    try:
        return build_tokenizer(tok_cfg)
    except ConfigError as err:
        where = path / "config.yaml" if (path / "config.yaml").is_file() else path
        raise ConfigError(f"{err} (the tokenizer of {where}; give another with --tokenizer DIR)") from None


def _single_process(cfg) -> Any:
    """The run's config as a one-process model: no tensor/pipeline/expert split, no LoRA modules
    (adapters are merged into the weights before loading)."""
    ds = dataclasses.replace(cfg.distributed_strategy, tensor_model_parallel_size=1,
                             pipeline_model_parallel_size=1)
    return dataclasses.replace(cfg, distributed_strategy=ds)


def merged_tensors(path: Path, tensors: dict[str, torch.Tensor], cfg, meta: dict[str, Any],
                   base: Path | None, notes: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with LoRA adapters folded in (a plain checkpoint: unchanged)."""
    if not any(is_lora_key(k) for k in tensors):
        return tensors
    lora = meta.get("lora") or {}
    if lora.get("adapter_only"):
        flag = "--base"
        if base is None and cfg.exp_manager.resume_from_checkpoint:
            base, flag = Path(cfg.exp_manager.resume_from_checkpoint), "exp_manager.resume_from_checkpoint"
        if base is None:
            raise ConfigError(f"checkpoint {path} holds LoRA adapters only (save_lora_base: false): give the "
                              "base model's checkpoint with --base CKPT")
        if flag != "--base" and not base.is_dir():
            raise ConfigError(f"checkpoint {path} holds LoRA adapters only and its base ({flag}: {base}) is not "
                              "there: give it with --base CKPT")
        tensors = with_base(tensors, base, flag)
        notes.append(f"LoRA base weights from {base}")
    rank, alpha = lora.get("lora_rank"), lora.get("lora_alpha")
    if rank is None:
        peft = cfg.model_alignment_strategy.peft if cfg.model_alignment_strategy is not None else None
        if peft is None:
            raise ConfigError(f"checkpoint {path} holds LoRA adapters but no lora_rank / lora_alpha")
        rank, alpha = peft.lora_rank, peft.lora_alpha
    try:
        merged = merged_state_dict(tensors, (int(rank), float(alpha)))
    except ValueError as err:
        raise ConfigError(f"checkpoint {path}: {err}") from None
    notes.append(f"LoRA adapters merged (rank {rank}, alpha {alpha})")
    return merged


def check_vocab(path: Path, cfg, tokenizer, rows: int) -> int:
    """The tokenizer's size, after checking it belongs to a model with `rows` embedding rows."""
    size = len(tokenizer)
    if cfg.model_source == "megatron":
        m = cfg.model
        expected = padded_vocab_size(size, m.make_vocab_size_divisible_by,
                                     cfg.distributed_strategy.tensor_model_parallel_size)
    else:
        expected = rows if size <= rows else size
    if size > rows or expected != rows:
        raise ConfigError(f"the tokenizer ({size} tokens) does not match the model of {path} ({rows} embedding "
                          "rows): it is not the tokenizer the run trained with (give that one with --tokenizer DIR)")
    return size


def load_for_inference(path: Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       tokenizer_dir: Path | None = None, base: Path | None = None,
                       tp_mesh=None) -> InferenceModel:
    """See the module docstring. ConfigError (one line) for a checkpoint that is missing, incomplete,
    not nxdt's, of another model than its config, or whose tokenizer does not fit."""
    path = Path(path)
    hf_folder = is_hf_folder(path)
    meta = {} if hf_folder else validate_checkpoint(path)
    cfg = read_run_config(path, meta)
    tokenizer = tokenizer_for(path, cfg, tokenizer_dir)
    notes: list[str] = []
    one = _single_process(cfg)
    saved = {k.removeprefix("model."): s for k, s in (meta.get("model_shapes") or {}).items()}
    lora = any(is_lora_key(k) for k in saved)
    tensors = None
    if hf_folder:  # safetensors, read whole (a rank keeps its shards of them)
        tensors = read_hf_folder(path)[1]
        saved = {k: list(t.shape) for k, t in tensors.items()}
    elif lora or tp_mesh is None or tp_mesh.size() == 1:  # whole tensors (LoRA: folded in whole, then sharded)
        tensors = merged_tensors(path, load_weights(path), cfg, meta, base, notes)
        saved = {k: list(t.shape) for k, t in tensors.items()}
    embed = next((s for k, s in saved.items() if k.endswith(("embed_tokens.weight", "embed_in.weight"))), None)
    if embed is None:
        raise ConfigError(f"checkpoint {path} has no embedding (a pipeline stage's partial save?)")
    rows = int(embed[0])
    vocab_size = check_vocab(path, cfg, tokenizer, rows)
    if tp_mesh is not None and tp_mesh.size() > 1:
        model = _load_tensor_parallel(path, one, rows, meta, tp_mesh, device, tensors)
    else:
        model = build_model(one, vocab_size=rows, device="meta")
        init_model_weights(model, "cpu")  # also computes non-persistent buffers (transformers' rotary inv_freq)
        _load_full(path, model, tensors)
    model.to(device=device, dtype=dtype).eval()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return InferenceModel(model, tokenizer, cfg, context_length(model), vocab_size, path, notes)


def _load_full(path: Path, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    wanted = {f"model.{k}": v for k, v in own.items()}
    have = {f"model.{k}": v for k, v in tensors.items()}
    check_model_matches(path, {"model_shapes": {k: list(v.shape) for k, v in have.items()}}, wanted)
    with torch.no_grad():
        for key, t in own.items():
            t.copy_(tensors[key])
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _load_tensor_parallel(path: Path, cfg, rows: int, meta: dict[str, Any], tp_mesh, device,
                          tensors: dict[str, torch.Tensor] | None) -> nn.Module:
    """The model sharded over `tp_mesh`; each rank reads its shards from the checkpoint, or takes them
    from the whole `tensors` when given (LoRA, folded in already)."""
    tp = tp_mesh.size()
    ds = dataclasses.replace(cfg.distributed_strategy, tensor_model_parallel_size=tp)
    model = build_model(dataclasses.replace(cfg, distributed_strategy=ds), vocab_size=rows, device="meta")
    try:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)
    except ValueError as err:
        raise ConfigError(f"tensor parallel over {tp} ranks: {err}") from None
    with warnings.catch_warnings():  # random init of values the checkpoint overwrites next
        warnings.filterwarnings("ignore", message="DTensor random operators")
        init_model_weights(model, device)
    own = model.state_dict()
    wanted = {f"model.{k}": v for k, v in own.items()}
    if tensors is not None:
        check_model_matches(path, {"model_shapes": {f"model.{k}": list(v.shape) for k, v in tensors.items()}}, wanted)
        with torch.no_grad():
            for key, t in own.items():
                full = tensors[key].to(device=device, dtype=t.dtype)
                t.copy_(distribute_tensor(full, t.device_mesh, t.placements) if hasattr(t, "device_mesh") else full)
    else:
        check_model_matches(path, meta, wanted)
        request, _ = weights_for_load(wanted, read_dcp_metadata(path).state_dict_metadata)
        try:
            dcp.load(request, storage_reader=SafeReader(str(path)))
        except Exception as err:
            raise ConfigError(f"checkpoint {path}: reading the tensors failed: {str(err).splitlines()[0]}") from None
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def context_length(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    if args is not None:
        return int(args.max_position_embeddings)
    return int(model.config.max_position_embeddings)
