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

A save that fails on any rank fails on every rank (nxdt.checkpoint.save_errors): no `COMPLETE`
marker, its `.tmp-` directory removed, the previous checkpoint still the newest complete one.
What each rank's file restores on load, in the same layout or another: nxdt.checkpoint.rank_state.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from nxdt.config.errors import ConfigError
from nxdt.config.typed import to_yaml
from nxdt.device import load_xser, save_xser
from nxdt.checkpoint.save_errors import CheckpointException, CheckpointSaveError, agree, attempt, describe, writer_class
from nxdt.checkpoint.lora_state import tensors_to_load, tensors_to_save, write_adapter_config
from nxdt.checkpoint.dtype import flags, model_keys_for_export, weights_for_load, weights_for_save
from nxdt.checkpoint.nxd_legacy_optim import check_converted_request
from nxdt.checkpoint.rank_state import own_rank_file, rank_file, restore_optimizer_scalars, resume_trainer_state
from nxdt.checkpoint.state import (
    MARKER,
    META,
    SafeReader,
    dp_rank_of,
    write_json,
    all_tensor_shapes,
    check_shards,
    from_json,
    is_complete,
    layout_of,
    model_and_optimizer_state,
    notice,
    read_dcp_metadata,
    read_json,
    rng_state,
    set_model_and_optimizer_state,
    split_tensors,
    tensor_shapes,
    to_json,
)

FORMAT = "nxdt-checkpoint"
FORMAT_VERSION = 1
CONFIG = "config.yaml"
TMP_PREFIX = ".tmp-"


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
        self._error: str | None = None  # this rank's error from a finished async save, not yet agreed on
        # the async save every rank started and will agree on in wait(): set on every rank alike,
        # whichever step each rank's poll() saw it finish at
        self._to_agree: Path | None = None
        self._group = None
        self._noted: set[str] = set()  # notices already printed (once per run)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    @property
    def failed_here(self) -> bool:
        """An async save failed on this rank (seen by `poll`); `wait` raises it on every rank."""
        return self._error is not None

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
        group = self._process_group()
        # every rank learns of a failure on any rank at each phase (a lone raise would hang the others)
        agree(path, attempt(lambda: _make_tmp(tmp)) if rank == 0 else None, group, rank)

        module = strategy.lightning_module
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        state = model_and_optimizer_state(module.model, strategy.optimizers)
        tensors, scalars = split_tensors(state)
        tensors, lora_meta = tensors_to_save(tensors, cfg)  # LoRA: adapters only, unless save_lora_base
        shapes = all_tensor_shapes(tensors)  # a collective: every rank, before rank 0 writes meta.json
        save_bf16, keep_master = flags(cfg)
        tensors, notes = weights_for_save(tensors, save_bf16, keep_master)
        for note in notes:
            if rank == 0 and note not in self._noted:
                self._noted.add(note)
                notice(note)
        per_rank = {
            "rank": rank,
            "world_size": strategy.world_size,
            "dp_rank": dp_rank_of(strategy),
            "rng": rng_state(),
            "scalars": to_json(scalars, "optimizer state"),
            "trainer": to_json(checkpoint, "trainer state"),
        }

        def write_state() -> None:
            write_json(tmp / rank_file(rank), per_rank)
            if rank == 0:
                self._write_meta(tmp, strategy, checkpoint, cfg, shapes, save_bf16, tensors, lora_meta)

        agree(path, attempt(write_state), group, rank)
        if self.use_xser:
            _xser_save(tensors, tmp, rank)
            self._finalize(strategy, tmp, path, rank, barrier=True)
            return
        writer = writer_class(int(checkpoint.get("global_step", -1)), rank)(str(tmp), sync_files=True)
        if self.async_save:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=group,
                                    planner=_planner(strategy, "save"))
            self._pending, self._to_agree = (future, tmp, path, rank), path
            return
        try:
            dcp.save(tensors, storage_writer=writer, process_group=group, planner=_planner(strategy, "save"))
        except CheckpointException as err:  # DCP raised it on every rank
            _remove_tmp(tmp, rank)
            raise CheckpointSaveError(path, describe(err)) from None
        agree(path, attempt(lambda: self._finalize(strategy, tmp, path, rank, barrier=False)), group, rank)

    @staticmethod
    def _write_meta(tmp, strategy, checkpoint, cfg, shapes, save_bf16, tensors, lora_meta) -> None:
        """Rank 0: meta.json, the adapter config (LoRA) and config.yaml."""
        module = strategy.lightning_module
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "world_size": strategy.world_size,
            "layout": layout_of(module),
            "step": int(checkpoint.get("global_step", 0)),
            "consumed_samples": int(checkpoint.get("consumed_samples", 0)),
            "torch_version": torch.__version__,
            "lightning_version": checkpoint.get("pytorch-lightning_version"),
            "model_source": cfg.model_source if cfg is not None else None,
            "model_shapes": shapes,
            "save_bf16": save_bf16,
            "master_weights": any(k.startswith("master.") for k in tensors),
            "lora": lora_meta,
        }
        write_json(tmp / META, meta)
        if lora_meta is not None:
            write_adapter_config(tmp, cfg, shapes)
            model_bytes = sum(math.prod(shapes[k]) * tensors[k].element_size() for k in shapes
                              if k.startswith("model.") and k in tensors)
            print(f"checkpoint {tmp.name.removeprefix(TMP_PREFIX)}: " + ("LoRA adapters only" if lora_meta["adapter_only"] else
                  "LoRA adapters and base") + f", {model_bytes / 2**20:.2f} MiB of model tensors", flush=True)
        if cfg is not None:  # the resolved YAML: rerunnable with --config-path/--config-name
            (tmp / CONFIG).write_text(to_yaml(cfg), encoding="utf-8")

    def _finalize(self, strategy, tmp: Path, path: Path, rank: int, barrier: bool) -> None:
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so once rank 0's save returned, all shards and rank files are on disk.
        if barrier:
            strategy.barrier("nxdt-checkpoint-written")
        if rank == 0:
            write_json(tmp / MARKER, {"format": FORMAT, "version": FORMAT_VERSION, "time": time.time()})
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if self.on_complete is not None:
                self.on_complete(path)

    def poll(self) -> None:
        """After each step: finalize a finished async save; a failure is kept (`failed_here`) for
        `wait` to raise on every rank (no collective here: ranks may see it finish at different steps)."""
        if self._pending is not None and _future(self._pending[0]).done():
            self._complete()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has finished and finalize it; then, on every rank
        (all ranks call this at the same point), raise CheckpointSaveError if it failed on any."""
        if self._pending is not None:
            self._complete()
        path, self._to_agree = self._to_agree, None
        error, self._error = self._error, None
        if path is not None:
            agree(path, error, self._process_group(), dist.get_rank() if dist.is_initialized() else 0)

    def _complete(self) -> None:
        future, tmp, path, rank = self._pending
        self._pending = None
        try:
            _future(future).result()
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if not isinstance(err, (Exception, CheckpointException)):
                raise
            _remove_tmp(tmp, rank)
            self._error = describe(err)
            return
        self._error = attempt(lambda: self._finalize(None, tmp, path, rank, barrier=False))


def _make_tmp(tmp: Path) -> None:
    if tmp.exists():  # our own leftover from an interrupted attempt at this very step
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _remove_tmp(tmp: Path, rank: int) -> None:
    """Rank 0, after a failed save: free the space a partial write took (never a complete checkpoint)."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _future(response):
    return getattr(response, "upload_completion", response)  # AsyncSaveResponse or Future


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
def _planner(strategy, kind: str):
    """DCP's planner for a save or load: the strategy's where it has one (XLA SPMD: torch-xla's), else DCP's default."""
    own = getattr(strategy, "dcp_planner", None)
    return own(kind) if own is not None else None


def use_xser(flag: bool, device_type: str) -> bool:
    """torch-xla serialization only when asked for and on an XLA device; DCP everywhere else."""
    return bool(flag) and device_type == "xla"


def _xser_save(tensors: dict[str, torch.Tensor], tmp: Path, rank: int) -> None:
    save_xser(tensors, tmp / f"xser_rank_{rank:05d}.pt", master_only=False)


def _xser_load(tensors: dict[str, torch.Tensor], path: Path, rank: int) -> list[str]:
    loaded = load_xser(path / f"xser_rank_{rank:05d}.pt")
    request, notes = weights_for_load(tensors, loaded)  # master weights first, as with DCP
    for k, t in request.items():
        t.copy_(loaded[k])
    return notes


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


def _moe_hint(saved: dict[str, list[int]], current: dict[str, list[int]]) -> str:
    """Why the keys differ when one side is a mixture of experts and the other is not."""
    def experts(shapes):
        return next((shape[0] for key, shape in shapes.items() if key.endswith(".mlp.experts.gate_up_proj")), 0)

    saved_e, current_e = experts(saved), experts(current)
    if saved_e and not current_e:
        return f"; the checkpoint has MoE layers ({saved_e} experts) and the config is dense (model.moe.num_experts=0)"
    if current_e and not saved_e:
        return f"; the checkpoint is dense and the config asks for MoE layers (model.moe.num_experts={current_e})"
    return ""


def check_model_matches(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                        partial: bool = False) -> None:
    """The model's keys and shapes against the checkpoint's (`partial`: a part of the model is
    requested; every requested key must be there, other saved keys are not read)."""
    saved = meta.get("model_shapes", {})
    current = all_tensor_shapes(tensors)
    missing = sorted(set(current) - set(saved))
    extra = [] if partial else sorted(set(saved) - set(current))
    if missing or extra:
        key = (missing or extra)[0]
        where = "the checkpoint has no" if missing else "the model has no"
        raise ConfigError(
            f"checkpoint {path / META} is from another model: {where} key '{key.removeprefix('model.')}'"
            f" ({len(missing)} missing, {len(extra)} unexpected keys){_moe_hint(saved, current)}"
        )
    for key, shape in current.items():
        if saved[key] != shape:
            raise ConfigError(
                f"checkpoint {path / META}: key '{key.removeprefix('model.')}' has shape {saved[key]} in the "
                f"checkpoint but {shape} in the model built from the config"
            )


def load_checkpoint(strategy, path: Path, cfg=None, weights_only: bool = False,
                    frozen_only: bool = False, model_only: bool = False) -> dict[str, Any]:
    """Load `path` into the strategy's model (and optimizers unless weights_only).

    LoRA (nxdt.checkpoint.lora_state): an adapter-only checkpoint loads its keys only; a
    weights-only start leaves the adapters fresh unless `load_lora_from_ckpt`; `frozen_only`
    loads the base under an adapter-only resume (weights only, never the trained keys).
    `model_only` (evaluation): the model's tensors as a full resume loads them (trained adapters
    included), and nothing else: no optimizer, per-rank, RNG or data state, no layout notice.

    Returns Lightning's checkpoint dict (trainer progress, scheduler, callbacks, datamodule
    state, consumed_samples) for Lightning to restore. The RNG states are applied by the caller
    (`pending_rng`) just before the next training step.
    """
    t0 = time.perf_counter()
    path = Path(path)
    meta = validate_checkpoint(path)
    module = strategy.lightning_module
    optimizers = [] if weights_only or model_only else strategy.optimizers
    state = model_and_optimizer_state(module.model, optimizers, weights_only=weights_only or model_only)
    tensors, scalars = split_tensors(state)
    tensors, partial = tensors_to_load(tensors, meta, cfg, path, weights_only=weights_only, frozen_only=frozen_only)
    if partial:
        state = {k: v for k, v in state.items() if not k.startswith("model.") or k in tensors}
    check_model_matches(path, meta, tensors, partial=partial)

    rank, world = strategy.global_rank, strategy.world_size
    saved_layout, layout = meta.get("layout") or {}, layout_of(module)
    same_world = int(meta.get("world_size", -1)) == world
    # every rank's state belongs to its place in the layout: RNG states only carry over the same
    # layout, data-loader state the same data-parallel size (taken from a rank with our dp rank)
    same_layout = same_world and all(saved_layout.get(k, v) == v for k, v in layout.items())
    same_dp = same_layout or (bool(saved_layout) and saved_layout.get("dp") == layout.get("dp"))
    own: dict[str, Any] = {}
    if not weights_only and not model_only:
        files = [read_json(path / rank_file(r), "this rank's state") for r in range(int(meta.get("world_size", 1)))]
        own, same_dp = own_rank_file(files, strategy, same_layout, same_dp)
        restore_optimizer_scalars(state, scalars, files, path, meta)

    t1 = time.perf_counter()
    if any(path.glob("xser_rank_*.pt")):
        notes = _xser_load(tensors, path, rank)
    else:
        # fp32 master weights, where the checkpoint has them, go into the model (checkpoint_dtype)
        saved = read_dcp_metadata(path).state_dict_metadata
        if meta.get("converted_from") == "nxd":
            check_converted_request(tensors, saved, path)
        request, notes = weights_for_load(tensors, saved)
        try:
            dcp.load(request, storage_reader=SafeReader(str(path)), planner=_planner(strategy, "load"))
        except Exception as err:
            raise ConfigError(f"checkpoint {path}: reading the tensors failed: {_one_line(err)}") from None
    for note in notes if rank == 0 else ():
        notice(f"{path.name}: {note}")
    state.update(tensors)
    set_model_and_optimizer_state(module.model, optimizers, state, partial=partial)
    t2 = time.perf_counter()

    trainer_state = from_json(own.get("trainer", {}))
    trainer_state["pending_rng"] = None
    if not weights_only and not model_only:
        resume_trainer_state(trainer_state, strategy, cfg, path, meta, own, same_layout, same_dp)
    if cfg is not None and cfg.exp_manager.enable_recovery_time_instrumentation and rank == 0:
        print(f"checkpoint load {path.name}: check {t1 - t0:.3f}s, tensors {t2 - t1:.3f}s", flush=True)
    return trainer_state


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:800]



# --------------------------------------------------------------------------- single-process weights
def save_weights(model_state: dict[str, torch.Tensor], path: Path, extra_meta: dict[str, Any] | None = None,
                 strategy=None, files: dict[str, str] | None = None,
                 optimizer_state: dict[str, torch.Tensor] | None = None) -> None:
    """A weights-only checkpoint (no trainer state), e.g. from `nxdt convert hf-to-nxdt`, or a LoRA
    run's merged model. One process, or with `strategy` every rank of a run writing its shards
    (the tensors may be DTensors). `files`: text files (name → content) written inside it.
    `optimizer_state`: the optimizer's tensors, flattened (`state.<fqn>.exp_avg`), stored as `optim0.*`.

    Load it for training with `exp_manager.resume_from_checkpoint=PATH model.weight_init_only=true`.
    """
    path = Path(path)
    rank = strategy.global_rank if strategy is not None else 0
    tmp = path.parent / f"{TMP_PREFIX}{path.name}"
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model_state.items()}
    tensors.update({f"optim0.{k}": v.detach().contiguous() for k, v in (optimizer_state or {}).items()})
    shapes = all_tensor_shapes(tensors) if strategy is not None else tensor_shapes(tensors)  # a collective
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if strategy is not None:
        strategy.barrier("nxdt-weights-mkdir")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*save in a single process")
        dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), sync_files=True), no_dist=strategy is None)
    if rank == 0:
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": strategy.world_size if strategy else 1,
                "weights_only": True, "step": 0, "consumed_samples": 0, "torch_version": torch.__version__,
                "model_shapes": shapes, **(extra_meta or {})}
        write_json(tmp / META, meta)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_json(tmp / MARKER, {"format": FORMAT, "version": FORMAT_VERSION, "time": time.time()})
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    if strategy is not None:
        strategy.barrier("nxdt-weights-written")


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint as full tensors on CPU (one process), keyed by FQN: the fp32
    master weights where the checkpoint holds them (`use_master_weights_in_ckpt`), else the weights."""
    path = Path(path)
    validate_checkpoint(path)
    saved = read_dcp_metadata(path).state_dict_metadata
    keys = model_keys_for_export(saved)  # the fp32 master weights where the checkpoint has them
    tensors = {key: torch.empty(tuple(saved[key].size), dtype=saved[key].properties.dtype) for key in keys.values()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*load in a single process")
            dcp.load(tensors, storage_reader=SafeReader(str(path)), no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path}: reading the tensors failed: {_one_line(err)}") from None
    return {fqn: tensors[key] for fqn, key in keys.items()}
