"""What a checkpoint holds, and reading it without unpickling: JSON for non-tensor state, RNG
states, the layout-independent model + optimizer state (pipeline stages merged by original
names, ZeRO-1 shards keyed like a plain optimizer), and DCP's `.metadata` through a restricted
unpickler. `nxdt.checkpoint.checkpointer` writes and reads checkpoint directories with these.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from nxdt.config.errors import ConfigError
from nxdt.device import accelerator_rng_state, set_accelerator_rng_state

MARKER = "COMPLETE"  # written last: a directory with it is a whole checkpoint
META = "meta.json"

# --------------------------------------------------------------------------- JSON without pickle
def to_json(obj: Any, where: str = "checkpoint") -> Any:
    """Plain JSON types; tensors and numpy arrays as {"__tensor__": [...], "dtype": ...}."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            values = t.float().tolist()
        else:
            values = t.tolist()
        return {"__tensor__": values, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): to_json(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("lightning"):
        return to_json(vars(obj), where)
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} in a checkpoint (tensors and JSON types only)")


def from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"])).reshape(obj["shape"])
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=obj["dtype"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, key: str = "") -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {path} is missing{f' (needed for {key})' if key else ''}") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint file {path} is unreadable or truncated: {err}") from None


def notice(message: str) -> None:
    """One line for the user (the caller is rank 0): on stdout, and in this rank's log file."""
    print(f"note: {message}", flush=True)
    logging.getLogger("nxdt.checkpoint").info(message)


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    accelerator = accelerator_rng_state()  # "cuda" (or "neuron", ...): the states of all its devices
    if accelerator is not None:
        state[accelerator[0]] = accelerator[1]
    return to_json(state)


def reseed_state(seed: int, step: int) -> dict[str, Any]:
    """What a rank applies instead of saved RNG states it cannot take over (another layout).

    Every rank gets the same seed, as `seed_everything` gives at the start of a run; mixing in the
    step keeps the resumed run from replaying the random numbers of step 0, and makes it
    reproducible (the same checkpoint and layout give the same numbers)."""
    return {"reseed": (int(seed) * 1000003 + int(step)) % (2**32)}


def set_rng_state(state: dict[str, Any]) -> None:
    if "reseed" in state:
        seed = int(state["reseed"])
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also every CUDA device
        return
    state = from_json(state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    for kind in set(state) - {"python", "numpy", "torch"}:
        set_accelerator_rng_state(kind, state[kind])


# --------------------------------------------------------------------------- model + optimizer state
def _inner(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer


def _canonical(model: torch.nn.Module):
    """Maps a parameter name of `model` to its layout-independent name.

    A pipeline rank with several stages (vpp > 1) holds an nn.ModuleList of them, whose names
    are `<k>.model.layers.<i>...`; the stages keep the whole model's names below that prefix,
    which is stripped. Every other layout already uses the whole model's names."""
    if isinstance(model, torch.nn.ModuleList):
        return lambda fqn: fqn.split(".", 1)[1]
    return lambda fqn: fqn


def _rename_optim(osd: dict[str, Any], rename) -> dict[str, Any]:
    """Rename the FQN inside flattened optimizer keys `state.<fqn>.<k>` / `param_groups.<fqn>.<k>`
    (optimizer state keys such as exp_avg, lr, betas have no dots)."""
    out = {}
    for key, value in osd.items():
        kind, rest = key.split(".", 1)
        fqn, k = rest.rsplit(".", 1)
        out[f"{kind}.{rename(fqn)}.{k}"] = value
    return out


def model_and_optimizer_state(model: torch.nn.Module, optimizers: list, weights_only: bool = False) -> dict[str, Any]:
    """The flat state to save or load for the current parallel layout.

    Keys: `model.<fqn>` (tensors: plain, or DTensor when sharded) and `optim<i>.<key>` from the
    flattened optimizer state dict (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`, ...), with
    the whole model's FQNs (pipeline stages merged, see `_canonical`), so the names do not
    depend on how parameters are grouped, sharded or split across pipeline stages: a checkpoint
    saved with one layout loads into another. ZeRO-1 (ZeroRedundancyOptimizer) contributes each
    rank's own shard under the same FQN keys.
    """
    canon = _canonical(model)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict[str, Any] = {f"model.{canon(k)}": v for k, v in get_model_state_dict(model, options=options).items()}
    if weights_only:
        return state
    for i, optimizer in enumerate(optimizers):
        inner = _inner(optimizer)
        if _is_zero1(inner):
            osd = _zero1_state(model, inner)
        else:
            osd = get_optimizer_state_dict(model, inner, options=options)
        state.update({f"optim{i}.{k}": v for k, v in _rename_optim(osd, canon).items()})
    return state


def set_model_and_optimizer_state(model: torch.nn.Module, optimizers: list, state: dict[str, Any],
                                  partial: bool = False) -> None:
    """Load `state` (keys as made by `model_and_optimizer_state`) into the model and optimizers;
    `partial`: the state holds a part of the model's tensors (LoRA adapters, or a base without them)."""
    canon = _canonical(model)
    local = {canon(k): k for k in model.state_dict()}
    local.update({canon(k): k for k, _ in model.named_parameters()})
    to_local = lambda fqn: local.get(fqn, fqn)  # noqa: E731
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=not partial)
    set_model_state_dict(model, {to_local(k[6:]): v for k, v in state.items() if k.startswith("model.")},
                         options=options)
    for i, optimizer in enumerate(optimizers):
        prefix = f"optim{i}."
        osd = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not osd:
            continue
        osd = _rename_optim(osd, to_local)
        inner = _inner(optimizer)
        if _is_zero1(inner):
            _set_zero1_state(model, inner, osd)
        else:
            set_optimizer_state_dict(model, inner, osd, options=options)


def _is_zero1(optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _zero1_params(model, zero) -> list[tuple[str, torch.nn.Parameter, dict]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p, g) for g in zero.optim.param_groups for p in g["params"]]


def _zero1_state(model, zero) -> dict[str, Any]:
    """This rank's shard of a ZeroRedundancyOptimizer, keyed like a flattened optimizer state dict."""
    _init_optim_state(zero.optim)  # a fresh optimizer has no state tensors for DCP to load into
    # the scheduler sets lr on the outer param_groups; ZeRO copies them inward only at step()
    zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)
    out: dict[str, Any] = {}
    for fqn, p, group in _zero1_params(model, zero):
        for k, v in zero.optim.state.get(p, {}).items():
            out[f"state.{fqn}.{k}"] = v
        for k, v in group.items():
            if k != "params":
                out[f"param_groups.{fqn}.{k}"] = v
    return out


def _set_zero1_state(model, zero, osd: dict[str, Any]) -> None:
    for fqn, p, group in _zero1_params(model, zero):
        prefix = f"state.{fqn}."
        zero.optim.state[p] = {k[len(prefix):]: v for k, v in osd.items() if k.startswith(prefix)}
        for k in list(group):
            if k != "params" and f"param_groups.{fqn}.{k}" in osd:
                group[k] = osd[f"param_groups.{fqn}.{k}"]
    # ZeroRedundancyOptimizer copies its own (outer) param_groups onto the inner optimizer's before
    # each step, and the scheduler sets the outer lr: restore the outer groups too (group i of
    # the inner optimizer holds this rank's share of outer group i).
    for outer, inner in zip(zero.param_groups, zero.optim.param_groups):
        if inner["params"]:
            outer.update({k: v for k, v in inner.items() if k != "params"})


def split_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def tensor_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in tensors.items() if k.startswith("model.")}


def all_tensor_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The model's (global) tensor shapes over all ranks: pipeline ranks hold different stages."""
    shapes = tensor_shapes(tensors)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return shapes
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shapes)  # in-memory objects of this run's ranks, not file data
    merged: dict[str, list[int]] = {}
    for part in gathered:
        merged.update(part)
    return merged


LAYOUT_KEYS = ("dp", "tp", "pp", "vpp", "cp", "ep")


def layout_of(module) -> dict[str, int]:
    layout = getattr(module, "layout", None)
    return {k: int(getattr(layout, k)) for k in LAYOUT_KEYS if hasattr(layout, k)} if layout else {}


def dp_rank_of(strategy) -> int | None:
    try:
        return int(strategy.dp_rank)
    except Exception:  # a strategy without a mesh (tests)
        return None


# --------------------------------------------------------------------------- DCP metadata, safely
class _SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` (dataclasses of torch.distributed.checkpoint, torch dtypes,
    torch.Size, builtins) and refuses any other global."""

    _BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice"}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # how a torch.layout pickles
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)  # StorageMeta.checkpoint_id
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} from checkpoint metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read with a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _SafeUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_dcp_metadata(path: Path):
    file = path / ".metadata"
    try:
        return SafeReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {file} is missing (the tensor index of {path})") from None
    except Exception as err:  # truncated / not a DCP metadata file
        raise ConfigError(f"checkpoint file {file} is unreadable or truncated: {err}") from None


def check_shards(path: Path, metadata) -> None:
    """Every tensor's byte range must lie inside its shard file (catches truncated / missing shards)."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            file = path / rel
            sizes[rel] = file.stat().st_size if file.is_file() else -1
        if sizes[rel] < 0:
            raise ConfigError(f"checkpoint file {path / rel} is missing (holds key '{index.fqn}')")
        if info.offset + info.length > sizes[rel]:
            raise ConfigError(
                f"checkpoint file {path / rel} is truncated: key '{index.fqn}' needs bytes "
                f"{info.offset}..{info.offset + info.length}, the file has {sizes[rel]}"
            )


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / META).is_file() and (path / ".metadata").is_file()
