"""What a `--checkpoint PATH` names: a checkpoint, a run folder, or a transformers model folder.

    resolve_checkpoint(Path("nxdt_experiments/tiny_llama"))
    -> (Path(".../2026-11-27_10-00-00/checkpoints/tiny_llama--step=100-..."), "checkpoint ... (the newest ...)")

A folder that is not itself a checkpoint is searched for the newest complete one: a run's log dir
(`<run>/checkpoints/*`), its `checkpoints/` folder, or an experiment folder holding several runs
(`<exp>/*/checkpoints/*`). Within a run the newest is the highest step (then the latest save);
across runs, the latest save. Incomplete ones (no COMPLETE marker: a save that did not finish) are
skipped and counted. `nxdt generate`, `nxdt evaluate` and `nxdt convert nxdt-to-hf` call it before
anything else, so the checkpoint used is named in one line. A transformers folder is read here
too (`read_hf_folder`: config.json and the safetensors tensors; nothing is unpickled), for
`nxdt convert`, `nxdt generate` and `nxdt evaluate`, and loaded as a run's starting weights
(`exp_manager.resume_from_checkpoint=HF_DIR model.weight_init_only=true`: `load_hf_folder`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from nxdt.checkpoint.checkpointer import load_checkpoint, validate_checkpoint
from nxdt.checkpoint.retention import complete_checkpoints, list_checkpoints
from nxdt.checkpoint.state import MARKER, META, model_and_optimizer_state, set_model_and_optimizer_state, split_tensors
from nxdt.config.errors import ConfigError
from nxdt.models.lora import is_lora_key

INDEX = "model.safetensors.index.json"
HF_WEIGHTS = ("model.safetensors", INDEX)


def is_checkpoint_dir(path: Path) -> bool:
    """A directory that is itself a checkpoint, whole or not (its meta, marker or DCP metadata is there)."""
    return any((path / name).exists() for name in (META, MARKER, ".metadata"))


def is_hf_folder(path: Path) -> bool:
    """A transformers model folder: config.json and safetensors weights, and no nxdt checkpoint files."""
    path = Path(path)
    return (path.is_dir() and (path / "config.json").is_file() and any((path / w).is_file() for w in HF_WEIGHTS)
            and not is_checkpoint_dir(path))


def _checkpoint_dirs(folder: Path) -> list[Path]:
    """The folders under `folder` that hold checkpoints: its checkpoints/, itself, or its runs' checkpoints/."""
    if (folder / "checkpoints").is_dir():
        return [folder / "checkpoints"]
    if any(is_checkpoint_dir(p) for p in list_checkpoints(folder)):
        return [folder]
    return sorted(p / "checkpoints" for p in folder.iterdir() if (p / "checkpoints").is_dir())


def resolve_checkpoint(path: Path, flag: str = "--checkpoint") -> tuple[Path, str | None]:
    """(the checkpoint to use, a note naming it when `path` was a folder of checkpoints). A path that
    is a checkpoint (whole or not), a transformers folder or missing is returned as it is: the
    caller's checks say what is wrong with it. ConfigError when a folder holds no complete checkpoint."""
    path = Path(path).expanduser()
    if not path.is_dir() or is_checkpoint_dir(path) or is_hf_folder(path):
        return path, None
    folders = _checkpoint_dirs(path)
    candidates = [p for folder in folders for p in list_checkpoints(folder) if is_checkpoint_dir(p)]
    if not candidates:
        raise ConfigError(f"{flag} {path}: not a checkpoint (no {META}) and no checkpoints in it (a run folder "
                          "holds checkpoints/; a transformers folder, config.json and model.safetensors)")
    complete = [found for folder in folders if (found := complete_checkpoints(folder, warn=False))]
    newest = [found[-1][1] for found in complete]
    skipped = len(candidates) - sum(len(found) for found in complete)
    if not newest:
        raise ConfigError(f"{flag} {path}: no complete checkpoint in it ({skipped} incomplete: saves that did not "
                          f"finish have no {MARKER} file)")
    chosen = max(newest, key=lambda p: (p / MARKER).stat().st_mtime)
    note = (f"checkpoint {chosen} (the newest complete one in {path}"
            + (f"; {skipped} incomplete skipped" if skipped else "") + ")")
    return chosen, note


# --------------------------------------------------------------------------- a transformers folder
def read_hf_weights(folder: Path) -> dict[str, Any]:
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


def check_start_weights(path: Path, weights_only: bool) -> None:
    """`exp_manager.resume_from_checkpoint` is a whole checkpoint, or a transformers folder read as the
    starting weights (model.weight_init_only: a folder has no optimizer or trainer state)."""
    if not is_hf_folder(path):
        validate_checkpoint(path)
    elif not weights_only:
        raise ConfigError(f"exp_manager.resume_from_checkpoint: {path} is a transformers model folder (weights "
                          "only, no optimizer or trainer state): add model.weight_init_only=true")


def hf_tensor_names(folder: Path) -> set[str]:
    """The tensor names of a transformers folder's safetensors files (headers only)."""
    index = folder / INDEX
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def load_hf_folder(strategy, path: Path) -> None:
    """The model's weights from a transformers folder, each rank reading its shards of every tensor
    (DCP's HuggingFaceStorageReader: tensor, pipeline and FSDP layouts alike). nxdt's models use
    transformers' names; LoRA adapters stay fresh; a tied output layer comes with the embedding."""
    model = strategy.lightning_module.model
    tensors, _ = split_tensors(model_and_optimizer_state(model, [], weights_only=True))
    names = hf_tensor_names(path)
    request, missing = {}, []
    for key, tensor in tensors.items():
        fqn = key.removeprefix("model.")
        name = fqn.replace(".base_layer.", ".")
        if name in names:
            request[name] = tensor
        elif not is_lora_key(fqn) and not (name == "lm_head.weight" and "model.embed_tokens.weight" in names):
            missing.append(name)
    same = (f"the config must build the folder's model: model_source hf with model.model_config={path}, "
            "model.num_layers and model.hidden_size null or the folder's")
    if missing:
        raise ConfigError(f"exp_manager.resume_from_checkpoint: {path} lacks {len(missing)} of the model's tensors "
                          f"(e.g. {missing[0]}): not the model this config builds ({same}; GPT-NeoX folders into "
                          "the native model: nxdt convert hf-to-nxdt first)")
    try:
        dcp.load(request, storage_reader=HuggingFaceStorageReader(str(path)))
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"exp_manager.resume_from_checkpoint: reading {path} failed: {first} (another model than "
                          f"this config's? {same})") from None
    loaded = {f"model.{fqn}": request[fqn.replace('.base_layer.', '.')] for fqn in
              (k.removeprefix("model.") for k in tensors) if fqn.replace(".base_layer.", ".") in request}
    set_model_and_optimizer_state(model, [], loaded, partial=len(loaded) < len(tensors))
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def load_start_weights(strategy, path: Path, cfg) -> None:
    """A weights-only start (model.weight_init_only) from a checkpoint or a transformers folder."""
    if is_hf_folder(path):
        load_hf_folder(strategy, path)
    else:
        load_checkpoint(strategy, path, cfg, weights_only=True)
