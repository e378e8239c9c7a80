"""The one module that writes and reads nxdt checkpoints.

A checkpoint is a directory (see docs/checkpoints.md):

    <name>/
      .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): every tensor of the model
                                     and the optimizer, each rank writing its own shards
      meta.json                      rank 0: trainer progress, scheduler, consumed_samples, the model's
                                     tensor names and shapes, layout, versions (JSON)
      rank_<r>.json                  rank r: RNG states, data-loader state, the optimizer's non-tensor
                                     entries (lr, betas, ...) (JSON)
      config.yaml                    the resolved config
      COMPLETE                       written last (JSON), after every rank has written

It is written as `.tmp-<name>` and renamed to `<name>` by rank 0 once complete, so a directory
with the final name is always whole. Loading never unpickles arbitrary objects: JSON for
metadata, DCP's tensor reader (`torch.load(weights_only=True)`) for tensors, and DCP's own
`.metadata` through a restricted unpickler. Only tensors go into DCP, since DCP would store any
other object with pickle.

Saves may run asynchronously (`exp_manager.async_checkpointing`): the tensors are staged to CPU
and written by a background thread while training goes on; at most one save is in flight, and
the marker + rename happen when it has finished (polled after each step, waited for at the end).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from nxdt.config.errors import ConfigError

FORMAT = "nxdt-checkpoint"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
META = "meta.json"
CONFIG = "config.yaml"
TMP_PREFIX = ".tmp-"
# test hook: sleep this many seconds inside the background write of the async save at this step
SLOW_SAVE_ENV = "NXDT_TEST_SLOW_ASYNC_SAVE"  # "<step>:<seconds>"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


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


def _write_json(path: Path, data: Any) -> None:
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


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return to_json(state)


def set_rng_state(state: dict[str, Any]) -> None:
    state = from_json(state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

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


def set_model_and_optimizer_state(model: torch.nn.Module, optimizers: list, state: dict[str, Any]) -> None:
    """Load `state` (keys as made by `model_and_optimizer_state`) into the model and optimizers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    canon = _canonical(model)
    local = {canon(k): k for k in model.state_dict()}
    local.update({canon(k): k for k, _ in model.named_parameters()})
    to_local = lambda fqn: local.get(fqn, fqn)  # noqa: E731
    options = StateDictOptions(flatten_optimizer_state_dict=True)
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
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _zero1_params(model, zero) -> list[tuple[str, torch.nn.Parameter, dict]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p, g) for g in zero.optim.param_groups for p in g["params"]]


def _zero1_state(model, zero) -> dict[str, Any]:
    """This rank's shard of a ZeroRedundancyOptimizer, keyed like a flattened optimizer state dict."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

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


LAYOUT_KEYS = ("dp", "tp", "pp", "vpp", "cp")


def layout_of(module) -> dict[str, int]:
    layout = getattr(module, "layout", None)
    return {k: int(getattr(layout, k)) for k in LAYOUT_KEYS if hasattr(layout, k)} if layout else {}


def _dp_rank(strategy) -> int | None:
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
        from torch.distributed.checkpoint.metadata import StorageMeta

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


# --------------------------------------------------------------------------- the writer
class _SlowWriter(FileSystemWriter):
    """Test hook (SLOW_SAVE_ENV): a writer that sleeps before writing, inside the async save."""

    delay = 0.0

    def write_data(self, plan, planner):
        time.sleep(self.delay)
        return super().write_data(plan, planner)


class Checkpointer:
    """Writes checkpoints (sync or async) and finalizes them: marker, atomic rename, callbacks.

    One per run (held by the strategy). `on_complete(path)` runs on rank 0 after each rename
    (the checkpoint callback prunes old checkpoints there).
    """

    def __init__(self, async_save: bool = False, use_xser: bool = False) -> None:
        self.async_save = async_save
        self.use_xser = use_xser
        self.on_complete = None
        self._pending: tuple[Future, Path, Path, int] | None = None
        self._group = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _process_group(self):
        # A dedicated group: the background thread's collectives must not interleave with the
        # training step's collectives on the default group.
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, strategy, checkpoint: dict[str, Any], path: Path, cfg=None) -> None:
        """Write `checkpoint` (Lightning's dict, model/optimizer tensors collected here) to `path`."""
        path = Path(path)
        rank = strategy.global_rank
        self.wait()  # at most one save in flight
        if path.is_dir() and is_complete(path):
            return  # already saved (e.g. the final save at a step that was just saved)
        tmp = path.parent / f"{TMP_PREFIX}{path.name}"
        if rank == 0:
            if tmp.exists():  # our own leftover from an interrupted attempt at this very step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        strategy.barrier("nxdt-checkpoint-mkdir")

        module = strategy.lightning_module
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        state = model_and_optimizer_state(module.model, strategy.optimizers)
        tensors, scalars = split_tensors(state)
        shapes = all_tensor_shapes(tensors)  # a collective: every rank, before rank 0 writes meta.json
        per_rank = {
            "rank": rank,
            "world_size": strategy.world_size,
            "dp_rank": _dp_rank(strategy),
            "rng": rng_state(),
            "scalars": to_json(scalars, "optimizer state"),
            "trainer": to_json(checkpoint, "trainer state"),
        }
        _write_json(tmp / rank_file(rank), per_rank)
        if rank == 0:
            meta = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "world_size": strategy.world_size,
                "layout": layout_of(module),
                "step": int(checkpoint.get("global_step", 0)),
                "consumed_samples": int(checkpoint.get("consumed_samples", 0)),
                "torch_version": torch.__version__,
                "lightning_version": checkpoint.get("pytorch-lightning_version"),
                "model_source": cfg.get("model_source") if cfg is not None else None,
                "model_shapes": shapes,
            }
            _write_json(tmp / META, meta)
            if cfg is not None:
                from omegaconf import OmegaConf

                OmegaConf.save(cfg, tmp / CONFIG, resolve=True)

        if self.use_xser:
            _xser_save(tensors, tmp, rank)
            self._finalize(strategy, tmp, path, rank, barrier=True)
            return
        import torch.distributed.checkpoint as dcp

        writer_cls, slow = FileSystemWriter, _slow_delay(int(checkpoint.get("global_step", -1)))
        if self.async_save and slow:
            writer_cls = type("SlowWriter", (_SlowWriter,), {"delay": slow})
        writer = writer_cls(str(tmp), sync_files=True)
        if self.async_save:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self._process_group())
            self._pending = (future, tmp, path, rank)
        else:
            dcp.save(tensors, storage_writer=writer, process_group=self._process_group())
            self._finalize(strategy, tmp, path, rank, barrier=False)

    def _finalize(self, strategy, tmp: Path, path: Path, rank: int, barrier: bool) -> None:
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so once rank 0's save returned, all shards and rank files are on disk.
        if barrier:
            strategy.barrier("nxdt-checkpoint-written")
        if rank == 0:
            _write_json(tmp / MARKER, {"format": FORMAT, "version": FORMAT_VERSION, "time": time.time()})
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if self.on_complete is not None:
                self.on_complete(path)

    def poll(self) -> None:
        """Finalize a finished async save (call after each step); raises if it failed."""
        if self._pending is not None and _future(self._pending[0]).done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has finished, then finalize it."""
        if self._pending is None:
            return
        future, tmp, path, rank = self._pending
        self._pending = None
        try:
            _future(future).result()
        except Exception as err:
            raise RuntimeError(f"asynchronous checkpoint save to {path} failed on rank {rank}: {err}") from err
        self._finalize(None, tmp, path, rank, barrier=False)


def _future(response):
    return getattr(response, "upload_completion", response)  # AsyncSaveResponse or Future


def _slow_delay(step: int) -> float:
    spec = os.environ.get(SLOW_SAVE_ENV)
    if not spec:
        return 0.0
    at, seconds = spec.split(":")
    return float(seconds) if int(at) == step else 0.0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- torch-xla (save_xser)
def use_xser(flag: bool, device_type: str) -> bool:
    """torch-xla serialization only when asked for and on an XLA device; DCP everywhere else."""
    return bool(flag) and device_type == "xla"


def _xser_save(tensors: dict[str, torch.Tensor], tmp: Path, rank: int) -> None:
    import torch_xla.utils.serialization as xser  # only on XLA devices

    xser.save(tensors, str(tmp / f"xser_rank_{rank:05d}.pt"), master_only=False)


def _xser_load(tensors: dict[str, torch.Tensor], path: Path, rank: int) -> None:
    import torch_xla.utils.serialization as xser

    loaded = xser.load(str(path / f"xser_rank_{rank:05d}.pt"))
    for k, t in tensors.items():
        t.copy_(loaded[k])


# --------------------------------------------------------------------------- the reader
def validate_checkpoint(path: Path) -> dict[str, Any]:
    """Check a checkpoint directory before loading; returns its meta.json. ConfigError on any problem."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / MARKER).is_file():
        raise ConfigError(
            f"checkpoint {path} is incomplete: file {path / MARKER} is missing (the save did not finish)"
        )
    meta = read_json(path / META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint file {path / META} is not an nxdt checkpoint (key 'format')")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise ConfigError(f"checkpoint file {path / META}: format version {meta['version']} is newer than this nxdt")
    if not any(path.glob("xser_rank_*.pt")):
        check_shards(path, read_dcp_metadata(path))
    return meta


def check_model_matches(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    saved = meta.get("model_shapes", {})
    current = all_tensor_shapes(tensors)
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        key = (missing or extra)[0]
        where = "the model has no" if extra else "the checkpoint has no"
        raise ConfigError(
            f"checkpoint {path / META} is from another model: {where} key '{key.removeprefix('model.')}'"
            f" ({len(missing)} missing, {len(extra)} unexpected keys)"
        )
    for key, shape in current.items():
        if saved[key] != shape:
            raise ConfigError(
                f"checkpoint {path / META}: key '{key.removeprefix('model.')}' has shape {saved[key]} in the "
                f"checkpoint but {shape} in the model built from the config"
            )


def load_checkpoint(strategy, path: Path, cfg=None, weights_only: bool = False) -> dict[str, Any]:
    """Load `path` into the strategy's model (and optimizers unless weights_only).

    Returns Lightning's checkpoint dict (trainer progress, scheduler, callbacks, datamodule
    state, consumed_samples) for Lightning to restore. The RNG states are applied by the caller
    (`pending_rng`) just before the next training step.
    """
    t0 = time.perf_counter()
    path = Path(path)
    meta = validate_checkpoint(path)
    module = strategy.lightning_module
    optimizers = [] if weights_only else strategy.optimizers
    state = model_and_optimizer_state(module.model, optimizers, weights_only=weights_only)
    tensors, scalars = split_tensors(state)
    check_model_matches(path, meta, tensors)

    rank, world = strategy.global_rank, strategy.world_size
    saved_layout, layout = meta.get("layout") or {}, layout_of(module)
    same_world = int(meta.get("world_size", -1)) == world
    # every rank's state belongs to its place in the layout: RNG states only carry over the same
    # layout, data-loader state the same data-parallel size (taken from a rank with our dp rank)
    same_layout = same_world and all(saved_layout.get(k, v) == v for k, v in layout.items())
    same_dp = same_layout or (bool(saved_layout) and saved_layout.get("dp") == layout.get("dp"))
    own: dict[str, Any] = {}
    if not weights_only:
        files = [read_json(path / rank_file(r), "this rank's state") for r in range(int(meta.get("world_size", 1)))]
        if same_layout:
            own = files[rank]
        else:
            dp_rank = _dp_rank(strategy)
            own = next((f for f in files if same_dp and f.get("dp_rank") == dp_rank), files[0])
            same_dp = same_dp and own.get("dp_rank") == dp_rank
        saved_scalars: dict[str, Any] = {}
        for f in files:  # pipeline stages and ZeRO-1 shards hold different keys: merge
            saved_scalars.update(from_json(f.get("scalars", {})))
        for key in scalars:
            if key not in saved_scalars:
                raise ConfigError(f"checkpoint {path}: optimizer key '{key}' not found in {rank_file(0)} "
                                  "(saved with another optimizer?)")
            value = saved_scalars[key]
            state[key] = tuple(value) if isinstance(scalars[key], tuple) else value

    t1 = time.perf_counter()
    if any(path.glob("xser_rank_*.pt")):
        _xser_load(tensors, path, rank)
    else:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load(tensors, storage_reader=SafeReader(str(path)))
        except Exception as err:
            raise ConfigError(f"checkpoint {path}: reading the tensors failed: {_one_line(err)}") from None
    state.update(tensors)
    set_model_and_optimizer_state(module.model, optimizers, state)
    t2 = time.perf_counter()

    trainer_state = from_json(own.get("trainer", {}))
    trainer_state["pending_rng"] = own.get("rng") if same_layout else None
    if not same_layout and not weights_only:
        if same_dp:
            if rank == 0:
                warnings.warn(f"checkpoint saved with layout {_layout_text(saved_layout)}, loading on "
                              f"{_layout_text(layout)}: tensors resharded; per-rank RNG states are not "
                              "restored", stacklevel=2)
        else:
            _drop_data_state(trainer_state, strategy, meta, world)
    if cfg is not None and cfg.exp_manager.get("enable_recovery_time_instrumentation") and rank == 0:
        print(f"checkpoint load {path.name}: check {t1 - t0:.3f}s, tensors {t2 - t1:.3f}s", flush=True)
    return trainer_state


def _drop_data_state(trainer_state: dict[str, Any], strategy, meta: dict[str, Any], world: int) -> None:
    """Per-rank data-loader state belongs to the old data-parallel layout: drop it (consumed_samples stays)."""
    dm = getattr(strategy.lightning_module.trainer, "datamodule", None)
    if dm is not None:
        trainer_state.pop(type(dm).__qualname__, None)
    fit_loop = trainer_state.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    fit_loop.pop("combined_loader", None)
    if strategy.global_rank == 0:
        saved = meta.get("layout") or {}
        now = layout_of(strategy.lightning_module)
        dp = f" (dp={saved['dp']} -> dp={now['dp']})" if "dp" in saved and "dp" in now else ""
        warnings.warn(
            f"checkpoint saved with {meta.get('world_size')} ranks, loading on {world}{dp}: data-loader and RNG "
            "state do not carry over a change of layout; data continues from consumed_samples",
            stacklevel=3,
        )


def _layout_text(layout: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items()) or "?"


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:800]


# --------------------------------------------------------------------------- resuming mid-epoch
def batches_done_in_epoch(trainer_state: dict[str, Any]) -> int:
    """Batches of the current epoch that Lightning counts as done in a restored trainer state."""
    loops = trainer_state.get("loops", {}).get("fit_loop", {})
    progress = loops.get("epoch_loop.batch_progress", {}).get("current", {})
    return int(progress.get("ready", 0) or 0)


class ResumedLoader:
    """The training loader of a resumed run, as Lightning expects a resumable loader to look.

    Our samplers start at consumed_samples and have as many batches as remain, while Lightning
    restores its per-epoch batch count and ends the epoch when that count reaches the loader's
    length. This wrapper reports `skipped + remaining` for the first epoch (then the plain
    length) so the epoch ends at the same batch as in an uninterrupted run and validation
    intervals keep their place. The position itself lives in consumed_samples (and in the
    loader's own state_dict when it has one).
    """

    def __init__(self, loader, skipped: int) -> None:
        self.loader = loader
        self.skipped = int(skipped)

    def __len__(self) -> int:
        return len(self.loader) + self.skipped

    def __iter__(self):
        yield from self.loader
        self.skipped = 0

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def state_dict(self) -> dict[str, Any]:
        inner = getattr(self.loader, "state_dict", None)
        return inner() if callable(inner) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = getattr(self.loader, "load_state_dict", None)
        if callable(inner) and state_dict:
            inner(state_dict)


# --------------------------------------------------------------------------- single-process weights
def save_weights(model_state: dict[str, torch.Tensor], path: Path, extra_meta: dict[str, Any] | None = None) -> None:
    """A weights-only checkpoint (one process, no trainer state), e.g. from `nxdt convert hf-to-nxdt`.

    Load it for training with `exp_manager.resume_from_checkpoint=PATH model.weight_init_only=true`.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model_state.items()}
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": 1, "weights_only": True, "step": 0,
            "consumed_samples": 0, "torch_version": torch.__version__, "model_shapes": tensor_shapes(tensors),
            **(extra_meta or {})}
    _write_json(tmp / META, meta)
    dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), sync_files=True), no_dist=True)
    _write_json(tmp / MARKER, {"format": FORMAT, "version": FORMAT_VERSION, "time": time.time()})
    os.replace(tmp, path)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint as full tensors on CPU (one process), keyed by FQN."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    validate_checkpoint(path)
    metadata = read_dcp_metadata(path)
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            tensors[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        dcp.load(tensors, storage_reader=SafeReader(str(path)), no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path}: reading the tensors failed: {_one_line(err)}") from None
    return {k[len("model."):]: v for k, v in tensors.items()}
