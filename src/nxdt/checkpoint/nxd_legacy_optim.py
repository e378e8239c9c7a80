"""Adam's state in a checkpoint NxDT wrote, read with torch alone, and what a resume from it needs.

NxD's `save_checkpoint` writes the optimizer of each rank under `<tag>/optim/`:

    dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt    ZeRO-1 (NeuronZero1Optimizer): one file per dp rank, holding
                                           torch_xla's ZeroRedundancyOptimizer.state_dict():
        param_groups  [{"params": [0, 1, ...], "lr": ..., ...}]   indices numbered over the groups in order
        base_state    {index: {"step": ..., "exp_avg": shard, "exp_avg_sq": shard}}   this dp rank's shard
        shape_info    {index: torch.Size}                          the parameter's shape on its tp/pp rank
        state         {}                                           (the wrapper's own, empty)
      A shard is dim 0 of the parameter padded to a multiple of dp (`_pad_to_world_size`) and
      chunked (`_shard_tensor`); NxD's own converter (optimizer/convert_zero_checkpoints.py) merges
      them by concatenating over dp and cutting at shape_info[i][0], as done here.
    dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt    without ZeRO-1: one file per tp/pp rank, a plain
                                           torch optimizer state dict (`state` in place of base_state)
    xser (`save_xser`): the same with torch_xla's TensorReference in place of each tensor and the
    tensors in `<file>.tensors/tensor_<tid>.pt`.

The index of a parameter is its place in NxDT's optimizer parameter groups, numbered over the
groups in order. Each group lists the rank's parameters in module order, which is the order of its
model file: `local_state_dict()` and the optimizer's walk both go over the same module tree (the
model; under pp a traced stage, whose modules come in first use), own tensors before the
children's. The groups:

  HF-style models (lightning_modules/model/hf_models/base_model.py, utils/model_utils.py
  get_param_groups_by_weight_decay): group 0 the rank's `local_named_parameters()` whose name
  contains none of `no_decay`, group 1 those that contain one; no_decay is ["bias"], plus
  "LayerNorm" and "norm" with model.do_layer_norm_weight_decay.
  Megatron-style (lightning_modules/model/megatron/megatron_gpt_model.py setup_optimizer_param_groups,
  NeMo's nemo/collections/nlp/modules/common/megatron/utils.py): with do_layer_norm_weight_decay
  get_all_params_for_weight_decay_optimization, every parameter in one group; else
  get_params_for_weight_decay_optimization, by module type: the parameters of apex's FusedLayerNorm,
  FastLayerNorm and MixedFusedRMSNorm and those named `bias` in the no-decay group, the rest first.
  NxDT's megatron model normalizes with NxD's RMSNorm / LayerNorm (models/megatron/transformer.py,
  fused_layer_norm.get_layer_norm), none of apex's classes, so only biases move: the Llama /
  Mistral / Mixtral have none (every parameter in group 0, in file order), the GPT's biases (its
  LayerNorms' included) form group 1. NeMo's later variant adds
  an expert group for parameters with `allreduce=False`, an attribute NxD never sets (it marks
  expert_model_parallel): empty, and dropped. MoE layers (NxD's MoE: router.linear_router,
  expert_mlps.mlp_op.gate_up_proj / down_proj) are ordinary parameters of either rule.

With expert parallelism (ep > 1) NxD's ZeRO-1 is NeuronEPZero1Optimizer (trainer.py
initialize_parallel_optimizer): two ZeRO-1 optimizers over NxDT's groups filtered
(recursive_filter: every group kept, in order), one of the parameters that are not
expert-parallel sharded over the dp group, one of the experts (`expert_model_parallel`, NxD's
expert_mlps) sharded over the expert-data-parallel group. Its state_dict, still one file per dp
rank named without the ep rank, holds both: param_groups the first's then the second's (from
`ep_param_group_offset`; the second's indices count from 0 again), base_state and shape_info
the second's keys shifted by `ep_base_state_offset` / `ep_shape_info_offset` (split back here as
its load_state_dict splits them); no sharded_master_weights. An expert's shard is dim 0 (the
rank's experts) over the expert-data-parallel ranks. Which file holds which experts is
parallel_state's rank layout: the default (LOGIC1, ascending ring) reshapes the ranks as
[pp, dp, tp] outside and [pp, edp, ep, tp] inside the experts, so dp rank d is ep rank d % ep
and expert-data-parallel rank d // ep (the experts of ep rank e: the model file `_ep_rank_e`).
Trn2's other layout (LOGIC2: tp 64 at lnc 1, tp 32 at lnc 2 over ≥ 64 ranks) makes rings of the
dp groups but keeps the contiguous expert groups (NxD: "Expert Parallelism is not supported"
there): refused, as is a tp 32 / 64 checkpoint whose YAML does not say which applies, context
parallelism with ep (the files name no cp rank) and per-ep-rank files without ZeRO-1 (NxD's save
writes them from one rank per data-parallel group, ep rank 0's; the others' experts are missing).
The order is checked against shape_info and the groups' sizes, and a checkpoint where it does
not fit is refused rather than guessed.

A converted checkpoint has no Lightning trainer state (NxDT's user_content.pt is an arbitrary
pickle): `converted_trainer_state` makes it at load time from the live trainer for NxDT's step,
with the optimizer's hyperparameters (lr, betas, eps, weight decay) the config's and lr its
schedule's at that step.

Followed (read, not imported):
  aws-neuron/neuronx-distributed @ fbac349b (2026-04-09): trainer/checkpoint.py (_get_path,
    save_checkpoint: `optim/` with `dp` in the name under ZeRO-1, `ep` without; _save),
    optimizer/zero_redundancy_optimizer.py (NeuronZero1Optimizer, NeuronEPZero1Optimizer: state_dict,
    load_state_dict), parallel_layers/parallel_state.py (initialize_model_parallel, ascending_ring_PG_group,
    ascending_descending_ring_PG_group, get_logic_chosen), trainer/trainer.py
    (initialize_parallel_optimizer), utils/model_utils.py (recursive_filter), optimizer/convert_zero_checkpoints.py
    (merge_optim_dp_checkpoints), pipeline/model.py (local_named_parameters, local_state_dict),
    trainer/model.py (NxDModel.named_modules: the local stages'), trainer/trainer.py
    (initialize_optimizer_from_class), modules/moe (model.py, routing.py, experts.py)
  aws-neuron/neuronx-distributed-training @ 9169aa03 (2025-09-22): utils/model_utils.py,
    lightning_modules/model/hf_models/base_model.py and model/megatron/megatron_gpt_model.py
    (setup_optimizer_param_groups, ModelModule.build_model), lightning_modules/model/base.py
    (configure_optimizers), models/megatron/{gpt_model,language_model,transformer}.py (module order),
    lightning_modules/nlp_overrides.py (NLPCheckpointIO.save_checkpoint: optimizer_states[0]),
    requirements.txt (nemo_toolkit 2.1.0)
  NVIDIA/NeMo: nemo/collections/nlp/modules/common/megatron/utils.py (get_params_for_weight_decay_optimization,
    get_all_params_for_weight_decay_optimization; with and without the expert group)
  pytorch/xla @ 41398bff (2026-04-23): torch_xla/distributed/zero_redundancy_optimizer.py
    (_pad_to_world_size, _shard_tensor, state_dict, get_shape_info)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nxdt.checkpoint.nxd_legacy import (
    DROPPED,
    RANK_FILE,
    XSER_REFERENCE,
    NxdCheckpoint,
    NxdLayout,
    XserTensorReference,
    merge_ranks,
)
from nxdt.checkpoint.nxd_legacy_megatron import is_expert
from nxdt.config.errors import ConfigError

MOMENTS = ("exp_avg", "exp_avg_sq")
DCP_OPTIM = re.compile(r"\.metadata|.*\.distcp")  # NxD's use_zero1_dcp: torch DCP under optim/
FULL_FILE = re.compile(r"full_tp_rank_(\d+)_pp_rank_(\d+)\.pt")  # convert_zero_checkpoints --convert_to_full


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]


def _load(file: Path, mmap: bool = False) -> Any:
    """`file` unpickled with tensors and xser's TensorReference only; `mmap`: tensors left on disk
    (the model files, read for their order and shapes), where the file's format allows it."""
    try:
        with torch.serialization.safe_globals([(XserTensorReference, XSER_REFERENCE)]):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # an unpickling error names the class it refused
        if mmap:  # torch.save's legacy (non-zip) format cannot be mapped: read it whole
            return _load(file)
        raise ConfigError(f"{file}: not a state dict of tensors: {_one_line(err)}") from None


def _resolve(obj: Any, file: Path) -> Any:
    """`obj` with every xser TensorReference replaced by its tensor file."""
    if isinstance(obj, XserTensorReference):
        tensor_file = file.with_name(file.name + ".tensors") / f"tensor_{obj.tid}.pt"
        if not tensor_file.is_file():
            raise ConfigError(f"{tensor_file} is missing (xser tensor of {file.name})")
        return _load(tensor_file)
    if isinstance(obj, dict):
        return {k: _resolve(v, file) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(_resolve(v, file) for v in obj)
    return obj


# --------------------------------------------------------------------------- the files
def optim_files(ckpt: NxdCheckpoint) -> dict[tuple[int, int], list[Path]] | None:
    """Per (tp, pp) rank its optimizer files by dp rank; None when the checkpoint has none."""
    folder = ckpt.tag / "optim"
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if any(DCP_OPTIM.fullmatch(n) for n in names):
        raise ConfigError(f"{folder}: optimizer state in torch DCP (NxD's use_zero1_dcp); only NxD's "
                          "dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files are read (convert without it: remove optim/ "
                          "for a weights-only conversion)")
    found: dict[tuple[int, int], dict[int, Path]] = {}
    full = [m for n in names if (m := FULL_FILE.fullmatch(n))]
    for m in full:  # NxD's converter joined the dp shards: one ZeRO-1 state of dp 1 per tp/pp rank
        found.setdefault((int(m.group(1)), int(m.group(2))), {})[0] = folder / m.group(0)
    for name in names:
        m = RANK_FILE.fullmatch(name)
        if m and full:
            raise ConfigError(f"{folder}: both {full[0].group(0)} (joined over dp) and {name} (a dp rank's): "
                              "keep one kind")
        if m and m.group(2) is not None:
            raise ConfigError(f"{folder}: {name}: optimizer files per ep rank (NxD without ZeRO-1 under expert "
                              "parallelism) are not read: NxD's save writes them from one rank per data-parallel "
                              "group, leaving the other ep ranks' experts out (remove optim/ for a weights-only "
                              "conversion)")
        if m:
            dp, _, tp, pp = (int(x) if x is not None else 0 for x in m.groups())
            found.setdefault((tp, pp), {})[dp] = folder / name
    if not found:
        return None
    extra = sorted(set(found) - {(t, p) for t in range(ckpt.tp) for p in range(ckpt.pp)})
    if extra:
        raise ConfigError(f"{folder}: files of tp rank {extra[0][0]}, pp rank {extra[0][1]}; the model files make "
                          f"tp {ckpt.tp} x pp {ckpt.pp}")
    dp_size = 1 + max(dp for ranks in found.values() for dp in ranks)
    out = {}
    for t in range(ckpt.tp):
        for p in range(ckpt.pp):
            ranks = found.get((t, p), {})
            for dp in range(dp_size):
                if dp not in ranks:
                    missing = f"full_tp_rank_{t:02d}" if full else f"dp_rank_{dp:02d}_tp_rank_{t:02d}"
                    raise ConfigError(f"{folder}: {missing}_pp_rank_{p:02d}.pt is missing "
                                      f"(the other files make dp {dp_size} x tp {ckpt.tp} x pp {ckpt.pp})")
            out[(t, p)] = [ranks[dp] for dp in range(dp_size)]
    return out


def _read_optim(file: Path) -> dict[str, Any]:
    data = _resolve(_load(file), file)
    if not isinstance(data, dict) or not isinstance(data.get("param_groups"), list):
        raise ConfigError(f"{file}: not an optimizer state dict (no param_groups)")
    if "base_state" in data and not isinstance(data.get("shape_info"), dict):
        raise ConfigError(f"{file}: a ZeRO-1 state (base_state) without shape_info")
    if not isinstance(data.get("base_state", data.get("state")), dict):
        raise ConfigError(f"{file}: no optimizer state (neither base_state nor state)")
    return data


def _moments(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), torch.Tensor) for k in MOMENTS):
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ConfigError(f"{where}: holds {keys}, not Adam's exp_avg and exp_avg_sq (only Adam(W) state is carried)")
    return entry


def merge_dp(files: list[Path], parts: list[dict[str, Any]] | None = None
             ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]], dict[int, tuple]]:
    """One tp/pp rank's state: per parameter index its full exp_avg, exp_avg_sq and step, the
    param groups, and each index's shape (ZeRO-1: from shape_info; else the moments'); `parts`:
    the files' state dicts already read (split_ep_state's halves)."""
    parts = parts if parts is not None else [_read_optim(f) for f in files]
    groups = parts[0]["param_groups"]
    if "base_state" not in parts[0]:
        if len(files) > 1:
            raise ConfigError(f"{files[1]}: a dp rank's optimizer file without ZeRO-1's base_state")
        state = {i: _moments(v, f"{files[0]}: state[{i}]") for i, v in parts[0]["state"].items()}
        return state, groups, {i: tuple(v["exp_avg"].shape) for i, v in state.items()}
    shapes = {i: tuple(s) for i, s in parts[0]["shape_info"].items()}
    state: dict[int, dict[str, Any]] = {}
    for i, shape in shapes.items():
        entries = []
        for f, part in zip(files, parts):
            if i not in part.get("base_state", {}):
                raise ConfigError(f"{f}: base_state has no entry {i} (shape_info lists it)")
            entries.append(_moments(part["base_state"][i], f"{f}: base_state[{i}]"))
        merged = {"step": entries[0].get("step")}
        for key in MOMENTS:
            merged[key] = _join([e[key] for e in entries], shape, f"{files[0].parent}: base_state[{i}].{key}")
        if all(i in part.get("sharded_master_weights", {}) for part in parts):  # save_master_weights
            merged["master"] = _join([part["sharded_master_weights"][i] for part in parts], shape,
                                     f"{files[0].parent}: sharded_master_weights[{i}]")
        state[i] = merged
    return state, groups, shapes


def _join(shards: list[torch.Tensor], shape: tuple, where: str) -> torch.Tensor:
    """The dp shards of one parameter joined on dim 0 and the padding cut (convert_zero_checkpoints._merge)."""
    if any(not isinstance(t, torch.Tensor) for t in shards):
        raise ConfigError(f"{where}: not a tensor on every dp rank")
    full = torch.cat([t.reshape(-1, *t.shape[1:]) for t in shards])
    full = full[: shape[0]] if shape else full[:1].reshape(())
    if tuple(full.shape) != shape:
        raise ConfigError(f"{where} over the {len(shards)} dp ranks is {tuple(full.shape)} after unpadding, "
                          f"shape_info says {shape}")
    return full


# --------------------------------------------------------------------------- parameter order
def no_decay_rule(style: str, do_layer_norm_weight_decay: bool):
    """NxDT's no-decay test of a parameter name (its second group), per model source."""
    if style == "megatron":  # NeMo's rule by module type: biases (NxDT's norms are not apex's)
        return lambda name: not do_layer_norm_weight_decay and name.rsplit(".", 1)[-1].endswith("bias")
    no_decay = ["bias", "LayerNorm", "norm"] if do_layer_norm_weight_decay else ["bias"]
    return lambda name: any(nd in name for nd in no_decay)


def model_file_params(file: Path) -> list[tuple[str, tuple]]:
    """The rank's model tensors (name, shape) in the file's order, buffers left out."""
    data = _load(file, mmap=True)
    for key in ("state_dict", "model"):
        if isinstance(data, dict) and len(data) == 1 and isinstance(data.get(key), dict):
            data = data[key]
    info = file.with_name(file.name + ".info.pt")
    shapes = _load(info) if info.is_file() else {}
    out = []
    for key, value in data.items():
        if str(key).endswith(DROPPED):
            continue
        if isinstance(value, XserTensorReference):
            shape = shapes.get(value.tid, {}).get("shape") if isinstance(shapes, dict) else None
            if shape is None:
                shape = _resolve(value, file).shape
        elif isinstance(value, torch.Tensor):
            shape = value.shape
        else:
            raise ConfigError(f"{file}: {key} is a {type(value).__name__}, not a tensor")
        out.append((str(key), tuple(shape)))
    return out


def param_names(model_file: Path, groups: list[dict[str, Any]], shapes: dict[int, tuple],
                no_decay, where: Path, keep=None) -> dict[int, str]:
    """Optimizer index → parameter name on one tp/pp rank (NxDT's grouping; `no_decay(name)`: in
    the second group), checked against the groups' sizes and every index's shape; `keep(name)`:
    the parameters this optimizer holds (NeuronEPZero1Optimizer's two: experts or the others)."""
    params = [(n, s) for n, s in model_file_params(model_file) if keep is None or keep(n)]
    ordered = [n for n, _ in params if not no_decay(n)] + [n for n, _ in params if no_decay(n)]
    shape_of = dict(params)
    indices = [i for g in groups for i in g.get("params", [])]
    nonempty = [len(g.get("params", [])) for g in groups]
    if indices != list(range(len(indices))) or len(indices) != len(ordered):
        raise ConfigError(f"{where}: {len(indices)} parameters in {len(groups)} groups ({nonempty}), the model file "
                          f"{model_file.name} has {len(ordered)}: not the parameter order NxDT's optimizer "
                          "used (model.do_layer_norm_weight_decay as the run had it?)")
    names = dict(zip(indices, ordered))
    for i, name in names.items():
        if i in shapes and tuple(shapes[i]) != shape_of[name]:
            raise ConfigError(f"{where}: parameter {i} has shape {tuple(shapes[i])}, the model file's parameter "
                              f"{i} in NxDT's group order ({name}) is {shape_of[name]} (model.do_layer_norm_weight_decay "
                              "as the run had it?)")
    return names


# --------------------------------------------------------------------------- merging
@dataclass
class NxdOptimizer:
    """Adam's state of an NxDT checkpoint under transformers' names."""

    state: dict[str, torch.Tensor]  # nxdt's flattened optimizer tensors: state.<name>.exp_avg/exp_avg_sq/step
    step: float  # Adam's step (one for every parameter)
    dp: int  # the dp ranks it was sharded over (1: not ZeRO-1)
    masters: dict[str, torch.Tensor]  # ZeRO-1's fp32 master weights (save_master_weights), else {}


def merge_optimizer(ckpt: NxdCheckpoint, files: dict[tuple[int, int], list[Path]], lay: NxdLayout,
                    do_layer_norm_weight_decay: bool, kv_order: str | None, want=None) -> NxdOptimizer:
    """The optimizer files of every tp/pp rank merged (kv_order: the K/V replication the weights
    showed; `want`: the model's shapes, as nxd_legacy.merge takes them)."""
    no_decay = no_decay_rule(lay.style, do_layer_norm_weight_decay)
    per_rank = {key: [{} for _ in range(ckpt.tp)] for key in (*MOMENTS, "master")}
    steps: dict[float, str] = {}
    for (t, p), dp_files in sorted(files.items()):
        if ckpt.ep > 1:
            by_name = ep_rank_state(ckpt.files[(t, p)], dp_files, no_decay, ckpt.ep)
        else:
            state, groups, shapes = merge_dp(dp_files)
            by_name = _by_name(param_names(ckpt.files[(t, p)], groups, shapes, no_decay, dp_files[0]), state,
                               dp_files[0])
        for name, entry in by_name.items():
            step = entry["step"]
            steps.setdefault(float(step) if step is not None else -1.0, f"{dp_files[0].name}: {name}")
            for key in (*MOMENTS, "master"):
                if key in entry:
                    per_rank[key][t][name] = entry[key]
    if len(steps) != 1 or -1.0 in steps:
        said = ", ".join(f"{v:g} at {w}" for v, w in sorted(steps.items())[:2])
        raise ConfigError(f"{ckpt.tag / 'optim'}: Adam's step is {said}: not one step for every parameter "
                          "(-1: none saved)")
    out: dict[str, torch.Tensor] = {}
    step = next(iter(steps))
    with_masters = all(len(per_rank["master"][t]) == len(per_rank["exp_avg"][t]) for t in range(ckpt.tp))
    for key in MOMENTS:
        full, _ = merge_ranks(per_rank[key], lay, ckpt.tag / "optim", order=kv_order or None, want=want)
        for name, tensor in full.items():
            out[f"state.{name}.{key}"] = tensor.float().contiguous()
    for name in {k.split(".", 1)[1].rsplit(".", 1)[0] for k in out}:
        out[f"state.{name}.step"] = torch.tensor(step, dtype=torch.float32)
    masters: dict[str, torch.Tensor] = {}
    if with_masters:  # every parameter's (merge_ranks consumes what it merges: counted before)
        masters, _ = merge_ranks(per_rank["master"], lay, ckpt.tag / "optim", order=kv_order or None, want=want)
    return NxdOptimizer(out, step, len(next(iter(files.values()))), {k: v.float() for k, v in masters.items()})


def _by_name(names: dict[int, str], state: dict[int, dict[str, Any]], where: Path) -> dict[str, dict[str, Any]]:
    for i, name in names.items():
        if i not in state:
            raise ConfigError(f"{where}: no Adam state for parameter {i} ({name})")
    return {name: state[i] for i, name in names.items()}


# --------------------------------------------------------------------------- expert parallelism
EP_KEYS = ("ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset")


def split_ep_state(data: dict[str, Any], file: Path, ep: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """NeuronEPZero1Optimizer.state_dict() → the ZeRO-1 state of the parameters that are not
    expert-parallel and that of the experts, as its load_state_dict splits it."""
    missing = [k for k in EP_KEYS if not isinstance(data.get(k), int)]
    if missing or "base_state" not in data:
        raise ConfigError(f"{file}: no {missing[0] if missing else 'base_state'}: not the state of NxD's "
                          f"NeuronEPZero1Optimizer, which ZeRO-1 with ep {ep} writes")

    def split(key: str, offset: int) -> tuple[dict, dict]:
        low = {k: v for k, v in data[key].items() if k < offset}
        return low, {k - offset: v for k, v in data[key].items() if k >= offset}
    base, ep_base = split("base_state", data["ep_base_state_offset"])
    shapes, ep_shapes = split("shape_info", data["ep_shape_info_offset"])
    g = data["ep_param_group_offset"]
    return ({"param_groups": data["param_groups"][:g], "base_state": base, "shape_info": shapes},
            {"param_groups": data["param_groups"][g:], "base_state": ep_base, "shape_info": ep_shapes})


def ep_rank_state(model_file: Path, dp_files: list[Path], no_decay, ep: int) -> dict[str, dict[str, Any]]:
    """One tp/pp rank's Adam state by parameter name under ZeRO-1 with expert parallelism: the
    others' merged over every dp rank, each ep rank's experts over its expert-data-parallel ranks
    (dp rank d: ep rank d % ep, edp rank d // ep) and the ep ranks joined on dim 0 (the experts)."""
    if len(dp_files) % ep:
        raise ConfigError(f"{dp_files[0].parent}: {len(dp_files)} dp ranks' optimizer files do not split over ep {ep} "
                          "(NxD's expert-data-parallel degree is dp / ep)")
    parts = [split_ep_state(_read_optim(f), f, ep) for f in dp_files]
    state, groups, shapes = merge_dp(dp_files, [a for a, _ in parts])
    out = _by_name(param_names(model_file, groups, shapes, no_decay, dp_files[0], lambda n: not is_expert(n)),
                   state, dp_files[0])
    experts = []
    for e in range(ep):
        ranks = range(e, len(dp_files), ep)  # dp rank d: ep rank d % ep, edp rank d // ep
        files = [dp_files[d] for d in ranks]
        state, groups, shapes = merge_dp(files, [parts[d][1] for d in ranks])
        experts.append(_by_name(param_names(model_file, groups, shapes, no_decay, files[0], is_expert), state, files[0]))
    for name in experts[0]:
        steps = {float(x[name]["step"]) if x[name].get("step") is not None else -1.0 for x in experts}
        if len(steps) > 1:
            raise ConfigError(f"{dp_files[0].parent}: Adam's step of {name} differs between the ep ranks ({sorted(steps)})")
        out[name] = {"step": experts[0][name]["step"],
                     **{key: torch.cat([x[name][key] for x in experts]) for key in MOMENTS}}
    return out


def check_ep_layout(ep: int, tp: int, world: int, lnc: int | None, cp: int, where: Path) -> None:
    """ConfigError unless NxD's default rank layout (parallel_state LOGIC1) wrote the ep > 1 state."""
    if cp > 1:
        raise ConfigError(f"{where}: context_parallel_size {cp} with ep {ep}: the optimizer files name no cp rank; not read")
    logic2 = {64: "lnc 1 on Trn2", 32: "lnc 2 on Trn2 over 64 or more ranks"}.get(tp)
    if logic2 is None or (tp == 32 and (world < 64 or lnc == 1)) or (tp == 64 and lnc == 2):
        return
    if (tp, lnc) in ((32, 2),):
        raise ConfigError(f"{where}: tp 32 at lnc 2 over {world} ranks: NxD's Trn2 ring layout (LOGIC2), whose "
                          f"expert groups mix tp ranks (NxD: expert parallelism not supported there); not read")
    raise ConfigError(f"{where}: tp {tp} with ep {ep}: NxD lays the ranks out as rings (LOGIC2) with {logic2}, "
                      "which the checkpoint does not record: "
                      + ("give trainer.lnc (1 or 2)" if tp == 32 else "the instance type (Trn1 or Trn2) is unknown")
                      + "; the optimizer state is not read (remove optim/ for a weights-only conversion)")


def check_masters(masters: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], where: Path) -> None:
    """The master weights agree with the model files' weights to their dtype's rounding (stochastic
    rounding included: one unit in the last place); a mismatch means another parameter order."""
    for name, master in masters.items():
        weight = weights[name]
        ulp = torch.finfo(weight.dtype).eps * master.abs() + torch.finfo(weight.dtype).tiny
        worst = float(((master - weight.float()).abs() - ulp).max()) if master.numel() else 0.0
        if worst > 0:
            raise ConfigError(f"{where}: the fp32 master weights of {name} differ from the model file's beyond "
                              f"{weight.dtype} rounding: not the parameter order of the model files")


# --------------------------------------------------------------------------- the resume
def check_converted_request(tensors: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """The optimizer of this run keeps no state beyond what the converted checkpoint holds."""
    missing = sorted(k for k in tensors if k.startswith("optim") and k not in saved)
    if missing:
        raise ConfigError(f"checkpoint {path} (converted from NxDT) holds Adam's exp_avg, exp_avg_sq and step; "
                          f"this config's optimizer also keeps '{missing[0].rsplit('.', 1)[1]}' ({len(missing)} "
                          "tensors): resume with model.optim.name adamw (without amsgrad), or start from the "
                          "weights with model.weight_init_only=true")


def _progress(fit: dict[str, Any], key: str, **values: int) -> None:
    for part in ("total", "current"):
        fit[key][part].update(values)


def converted_trainer_state(strategy, meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """Lightning's trainer state at NxDT's step S for a checkpoint converted from NxDT, made from
    the live trainer as nxdt's own save at step S holds it (saved at the end of batch S: batch S
    started, S - 1 completed; S optimizer steps, manual optimization), the schedulers set to step S
    and each parameter group's lr to its schedule's value there."""
    import lightning  # reason: the version Lightning's checkpoint migration reads; only a resume needs it

    trainer = strategy.lightning_module.trainer
    step = int(meta.get("step", 0))
    fit = trainer.fit_loop.state_dict()
    _progress(fit, "epoch_loop.batch_progress", ready=step, started=step, processed=step, completed=max(step - 1, 0))
    _progress(fit, "epoch_loop.manual_optimization.optim_step_progress", ready=step, completed=step)
    _progress(fit, "epoch_progress", ready=1, started=1)
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = max(step - 1, 0)
    schedulers = []
    for config in trainer.lr_scheduler_configs:
        sched = config.scheduler
        lr_at = getattr(sched, "lr_at", None)
        if lr_at is None:
            raise ConfigError(f"checkpoint {path}: converted from NxDT at step {step}: the scheduler "
                              f"{type(sched).__name__} cannot be set to that step (nxdt's schedules of model.optim.sched can)")
        lrs = [lr_at(step, base) for base in sched.base_lrs]
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"] = lr
        state = {**sched.state_dict(), "last_epoch": step, "_step_count": step + 1, "_last_lr": lrs}
        if "_is_initial" in state:
            state["_is_initial"] = False
        schedulers.append(state)
    # "callbacks": no callback state to restore, but present: Lightning calls the callbacks'
    # on_load_checkpoint only then, and ResumeHelper's prints the "resuming from" line there
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": lightning.__version__,
            "loops": {"fit_loop": fit}, "lr_schedulers": schedulers, "callbacks": {},
            "consumed_samples": int(meta.get("consumed_samples", 0))}
