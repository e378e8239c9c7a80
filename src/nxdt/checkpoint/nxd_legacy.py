"""Checkpoints that NxDT (NeuronX Distributed Training) wrote, read with torch alone.

NxDT saved through NxD's trainer (`neuronx_distributed.trainer.checkpoint.save_checkpoint`, called
by NxDT's `NLPCheckpointIO`): one folder per checkpoint ("tag"), one model file per tp/pp rank.

    <checkpoint dir>/<tag>/            e.g. hf_llama3_8B--step=5-consumed_samples=160.0.ckpt
      checkpoint, done                 markers; `done` is written last (NxD lists completed tags by it)
      model/dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt      the rank's state dict (`_ep_rank_WW_` with expert
                                                     parallelism); only dp rank 0 writes model files
      model/<file>.pt.tensors/tensor_<N>.pt          xser (`save_xser: true`): <file>.pt holds the dict
      model/<file>.pt.info.pt                        with torch_xla's TensorReference(tid) in place of
                                                     each tensor, tensor N is its own torch.save file
      optim/dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt      optimizer shards (a dp rank each under ZeRO-1)
      user_content.pt                  the rest of Lightning's checkpoint dict (step, loops, ...)

A pp rank's state dict keeps the original (global) names (NxDPPModel.local_state_dict), so the
stages are a union. The names are transformers' Llama names (NxDT's hf_models/modeling_llama.py)
with NxD's parallel layers in place:

    model.embed_tokens.weight            ParallelEmbedding: vocab rows split over tp (dim 0)
    lm_head.weight                       ColumnParallelLinear: dim 0
    mlp.gate_up_proj.weight              ColumnParallelLinear(stride 2): each rank holds
                                         [gate rows of the rank | up rows of the rank]
    mlp.down_proj.weight, o_proj.weight  RowParallelLinear: dim 1
    self_attn.qkv_proj.weight_qkv        GQAQKVColumnParallelLinear (qkv_linear, fuse_qkv): each rank
                                         holds [q | k | v] of its heads; weight_q/_k/_v unfused
    self_attn.qkv_proj.weight            ColumnParallelLinear(stride 3) of MHA (fuse_qkv): [q | k | v]
    self_attn.q_proj/k_proj/v_proj       ColumnParallelLinear each
    norms                                replicated on every tp rank

K/V replication (`distributed_strategy.kv_replicator`, NxD's kv_size_multiplier, GQAQKV only): the
K/V heads are repeated so that tp ranks outnumber them, on Trn1 as (K0..Kn)(K0..Kn)... (`repeat`),
on Trn2 as (K0,K0..)(K1,K1..) (`repeat_interleave`); which one is read off the weights (the copies
are equal). A rank's query heads attend to its own KV heads (repeat_kv within the rank), so the
query heads (and o_proj's columns) are put back in transformers' order, grouped by the KV head they
use, one copy of each KV head kept. For the layouts NxD's converter writes this is the inverse of
its `convert_full_state_to_tp` (trn1 and trn2 orders); it also covers kv_heads x kv_replicator > tp.

Nothing is unpickled beyond tensors: `torch.load(weights_only=True)`, with torch_xla's
TensorReference mapped to a plain class with a `tid` (the only class allowed).

Followed (read, not imported):
  aws-neuron/neuronx-distributed @ fbac349b (2026-04-09): src/neuronx_distributed/trainer/checkpoint.py
    (_get_path, save_checkpoint, _xser_save_data), trainer/checkpoint_storage.py (done, tags, xser
    detection), scripts/checkpoint_converter.py (merge_tp_checkpoints, convert_full_state_to_tp),
    modules/qkv_linear.py (GQAQKVColumnParallelLinear, kv replication per platform),
    pipeline/model.py (local_state_dict)
  aws-neuron/neuronx-distributed-training @ 9169aa03 (2025-09-22): lightning_modules/nlp_overrides.py
    (NLPCheckpointIO), models/hf_models/modeling_llama.py, examples/checkpoint_converter_scripts/
  pytorch/xla @ 05ad6e46: torch_xla/utils/serialization.py (TensorReference, `<path>.tensors/tensor_<tid>.pt`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nxdt.checkpoint.nxd_legacy_megatron import is_expert, join_expert_ranks, megatron_to_hf_names, merge_experts
from nxdt.config.errors import ConfigError

XSER_REFERENCE = "torch_xla.utils.serialization.TensorReference"
RANK_FILE = re.compile(r"dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt")
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
DROPPED = ("rotary_emb.inv_freq",)  # a buffer older transformers kept in the state dict
KV_TOLERANCE = 1e-3  # relative: copies of a KV head agree (they are updated alike); other heads do not


class XserTensorReference:
    """What torch_xla's xser pickles in place of a tensor: `tid`, its file `tensor_<tid>.pt`."""

    tid: int


@dataclass(frozen=True)
class NxdLayout:
    """The architecture and layout a checkpoint was written with (from the NxDT YAML)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tp: int
    pp: int
    kv_replicator: int = 1
    tie_word_embeddings: bool = False
    style: str = "hf"  # "megatron": NxDT's megatron-style model (nxdt.checkpoint.nxd_legacy_megatron)
    ep: int = 1  # expert_model_parallel_size (MoE)
    gated: bool = True  # megatron: swiglu's [gate | up] dense_h_to_4h; False: gelu's up projection


@dataclass(frozen=True)
class NxdCheckpoint:
    """A tag folder: its model file per (tp, pp) rank (ep rank 0's) and what the reader found out;
    `ep_files`: with expert parallelism, per (tp, pp) rank the file of each ep rank."""

    tag: Path
    files: dict[tuple[int, int], Path]
    tp: int
    pp: int
    xser: bool
    complete: bool
    ep: int = 1
    ep_files: dict[tuple[int, int], list[Path]] | None = None


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]


# --------------------------------------------------------------------------- the folder
def find_tag(path: Path) -> Path:
    """The tag folder of `path`: the tag itself, its model/ folder, or a checkpoint dir (its `newest`
    file's tag, else the completed tag NxD would load: the newest `done`)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"--input {path}: no such folder")
    if path.name == "model" and any(RANK_FILE.fullmatch(p.name) for p in path.iterdir()):
        return path.parent
    if (path / "model").is_dir():
        return path
    newest = path / "newest"
    if newest.is_file() and (path / newest.read_text().strip() / "model").is_dir():
        return path / newest.read_text().strip()
    done = [d for d in path.iterdir() if (d / "model").is_dir() and (d / "done").is_file()]
    if done:
        return max(done, key=lambda d: (d / "done").stat().st_mtime)
    raise ConfigError(f"--input {path}: not an NxDT checkpoint (no model/ folder of "
                      "dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt files here, nor a completed tag folder holding one)")


def scan(path: Path) -> NxdCheckpoint:
    """The model files of the checkpoint at `path`, every (ep x) tp x pp rank present (ConfigError
    naming the first missing one)."""
    tag = find_tag(path)
    found: dict[tuple[int, int, int], Path] = {}
    with_ep = set()
    for file in sorted((tag / "model").iterdir()):
        m = RANK_FILE.fullmatch(file.name)
        if not m:
            continue
        with_ep.add(m.group(2) is not None)
        dp, ep, tp, pp = (int(x) if x is not None else 0 for x in m.groups())
        if dp == 0:
            found[(ep, tp, pp)] = file
    if not found:
        raise ConfigError(f"{tag / 'model'}: no dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt model files")
    if len(with_ep) > 1:
        raise ConfigError(f"{tag / 'model'}: files with and without _ep_rank_ in their names: keep one checkpoint")
    ep, tp, pp = (1 + max(k[i] for k in found) for i in range(3))
    for e in range(ep):
        for t in range(tp):
            for p in range(pp):
                if (e, t, p) not in found:
                    name = f"dp_rank_00{f'_ep_rank_{e:02d}' if True in with_ep else ''}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
                    raise ConfigError(f"{tag / 'model'}: {name} is missing (the other files make "
                                      + (f"ep {ep} x " if True in with_ep else "") + f"tp {tp} x pp {pp})")
    xser = any(f.with_name(f.name + ".tensors").is_dir() for f in found.values())
    ep_files = {(t, p): [found[(e, t, p)] for e in range(ep)] for t in range(tp) for p in range(pp)} if ep > 1 else None
    return NxdCheckpoint(tag=tag, files={(t, p): f for (e, t, p), f in found.items() if e == 0}, tp=tp, pp=pp,
                         xser=xser, complete=(tag / "done").is_file(), ep=ep, ep_files=ep_files)


def read_shard(file: Path, keep=None) -> dict[str, torch.Tensor]:
    """One rank's state dict, torch.save or xser, as CPU tensors; `keep(key)`: only those keys (an
    ep rank's file under xser holds only its expert tensors' files)."""
    try:
        with torch.serialization.safe_globals([(XserTensorReference, XSER_REFERENCE)]):
            data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # an unpickling error names the class it refused
        raise ConfigError(f"{file}: not a state dict of tensors: {_one_line(err)}") from None
    for key in ("state_dict", "model"):  # a dict wrapped once more (NxD's converter: --model_key model)
        if isinstance(data, dict) and len(data) == 1 and isinstance(data.get(key), dict):
            data = data[key]
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: holds a {type(data).__name__}, not a state dict")
    tensors = file.with_name(file.name + ".tensors")
    out = {}
    for key, value in data.items():
        if keep is not None and not keep(str(key)):
            continue
        if isinstance(value, XserTensorReference):
            tensor_file = tensors / f"tensor_{value.tid}.pt"
            if not tensor_file.is_file():
                raise ConfigError(f"{tensor_file} is missing (xser tensor of {key})")
            value = torch.load(tensor_file, map_location="cpu", weights_only=True)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{file}: {key} is a {type(value).__name__}, not a tensor")
        out[str(key)] = value
    return out


# --------------------------------------------------------------------------- merging
def _stages_per_tp_rank(ckpt: NxdCheckpoint) -> list[dict[str, torch.Tensor]]:
    """Each tp rank's state dict, its pp stages merged (they hold different global names)."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(ckpt.tp)]
    owner: dict[str, int] = {}
    for (t, p), file in sorted(ckpt.files.items()):
        shard = read_shard(file)
        if ckpt.ep_files:  # expert parallel: each ep rank's experts joined (dim 0)
            shard = join_expert_ranks([shard] + [read_shard(f, is_expert) for f in ckpt.ep_files[(t, p)][1:]], file)
        for key, value in shard.items():
            if key.endswith(DROPPED):
                continue
            if key in ranks[t]:
                raise ConfigError(f"{ckpt.tag}: {key} is in pp rank {owner[key]} and pp rank {p}")
            ranks[t][key] = value
            owner[key] = p
    for t in range(1, ckpt.tp):
        extra = set(ranks[t]) ^ set(ranks[0])
        if extra:
            raise ConfigError(f"{ckpt.tag}: tp rank {t} and tp rank 0 differ in {sorted(extra)[0]} (not one model)")
    return ranks


def _kv_order(k: torch.Tensor, v: torch.Tensor, kv_heads: int, mult: int, where: str, order: str | None = None) -> str:
    """'repeat' (Trn1: K0..Kn K0..Kn) or 'interleave' (Trn2: K0 K0 .. K1 K1): the replication whose
    copies agree (`order`: the one the weights showed, checked here, e.g. for Adam's moments).
    k, v: (kv_heads x mult, head_dim, hidden)."""
    if mult == 1:
        return "repeat"
    idx = torch.arange(kv_heads * mult)
    scale = max(float(k.abs().max()), float(v.abs().max()), 1e-30)
    spread = {}
    for name, first in (("repeat", idx % kv_heads), ("interleave", idx // mult * mult)):
        if order not in (None, name):
            continue
        spread[name] = max(float((k - k[first]).abs().max()), float((v - v[first]).abs().max())) / scale
    best = min(spread, key=spread.get)
    if spread[best] > KV_TOLERANCE:
        raise ConfigError(f"{where}: the {mult} copies of each of the {kv_heads} K/V heads differ (relative "
                          f"{spread[best]:.2g}): not written with distributed_strategy.kv_replicator={mult}")
    return best


def _attention(parts: dict[str, list[torch.Tensor]], lay: NxdLayout, mult: int, where: str, order: str | None = None):
    """q, k, v, o in transformers' order from each tp rank's [q], [k], [v], [o] (o: RowParallel)."""
    nh, nkv, hd, tp = lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.tp
    rep = nkv * mult
    if nh % tp or rep % tp or (nh // tp) % (rep // tp):
        raise ConfigError(f"{where}: {nh} query and {nkv} x {mult} (kv_replicator) K/V heads do not split "
                          f"over tp {tp}")
    q, k, v = (torch.cat(parts[n], dim=0) for n in "qkv")
    o = torch.cat(parts["o"], dim=1)
    expect = {"q": nh * hd, "k": rep * hd, "v": rep * hd}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != expect[name]:
            raise ConfigError(f"{where}: {name} has {t.shape[0]} rows over the tp ranks, {expect[name]} expected "
                              f"({nh} heads, {nkv} KV heads x kv_replicator {mult}, head_dim {hd})")
    k, v = k.view(rep, hd, -1), v.view(rep, hd, -1)
    order = _kv_order(k, v, nkv, mult, where, order)
    group = [i % nkv if order == "repeat" else i // mult for i in range(rep)]  # replicated head -> KV head
    q_pp, kv_pp = nh // tp, rep // tp
    per_kv = q_pp // kv_pp  # query heads per KV head within a rank (NxD's repeat_kv)
    q_group = [group[(p // q_pp) * kv_pp + (p % q_pp) // per_kv] for p in range(nh)]
    if any(q_group.count(g) != nh // nkv for g in range(nkv)):
        raise ConfigError(f"{where}: the query heads do not share the {nkv} KV heads evenly ({order} layout)")
    perm = sorted(range(nh), key=q_group.__getitem__)  # stable: the order within a group is kept
    first = [group.index(g) for g in range(nkv)]
    q = q.view(nh, hd, -1)[perm].reshape(nh * hd, -1)
    o = o.view(o.shape[0], nh, hd)[:, perm].reshape(o.shape[0], nh * hd)
    return q, k[first].reshape(nkv * hd, -1), v[first].reshape(nkv * hd, -1), o, order


def _split_qkv(ranks: list[dict[str, torch.Tensor]], prefix: str, lay: NxdLayout):
    """Per tp rank q, k, v of one layer from whichever projection NxDT used; the replication
    factor that applies (GQAQKV only)."""
    rep_heads = lay.num_kv_heads * lay.kv_replicator
    gqa_sizes = [lay.num_heads // lay.tp * lay.head_dim, rep_heads // lay.tp * lay.head_dim,
                 rep_heads // lay.tp * lay.head_dim]
    mha_sizes = [lay.num_heads // lay.tp * lay.head_dim] * 3
    for key, sizes, mult in ((f"{prefix}qkv_proj.weight_qkv", gqa_sizes, lay.kv_replicator),
                             (f"{prefix}qkv_proj.weight", mha_sizes, 1)):
        if key in ranks[0]:
            tensors = [r.pop(key) for r in ranks]
            if tensors[0].shape[0] != sum(sizes):
                raise ConfigError(f"{key}: {tensors[0].shape[0]} rows per tp rank, {sum(sizes)} expected "
                                  f"(q {sizes[0]} + k {sizes[1]} + v {sizes[2]}: {lay.num_heads} heads, "
                                  f"{lay.num_kv_heads} K/V heads x kv_replicator {mult}, head_dim {lay.head_dim}, "
                                  f"tp {lay.tp})")
            split = [torch.split(t, sizes, dim=0) for t in tensors]
            return {n: [s[i] for s in split] for i, n in enumerate("qkv")}, mult
    for names, mult in ((("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"), lay.kv_replicator),
                        (("q_proj.weight", "k_proj.weight", "v_proj.weight"), 1)):
        if all(prefix + n in ranks[0] for n in names):
            return {n: [r.pop(prefix + key) for r in ranks] for n, key in zip("qkv", names)}, mult
    raise ConfigError(f"{prefix}: no q/k/v projection (qkv_proj.weight_qkv, qkv_proj.weight_q/k/v, "
                      "qkv_proj.weight or q_proj/k_proj/v_proj)")


def _layer(ranks: list[dict[str, torch.Tensor]], i: int, lay: NxdLayout, orders: set[str],
           order: str | None = None) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    parts, mult = _split_qkv(ranks, p + "self_attn.", lay)
    if p + "self_attn.o_proj.weight" not in ranks[0]:
        raise ConfigError(f"{p}self_attn.o_proj.weight: not in the checkpoint")
    parts["o"] = [r.pop(p + "self_attn.o_proj.weight") for r in ranks]
    q, k, v, o, found = _attention(parts, lay, mult, f"{p}self_attn", order)
    orders.add(found)
    out = {f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
           f"{p}self_attn.v_proj.weight": v, f"{p}self_attn.o_proj.weight": o}
    if p + "mlp.gate_up_proj.weight" in ranks[0]:
        halves = [torch.chunk(r.pop(p + "mlp.gate_up_proj.weight"), 2, dim=0) for r in ranks]
        out[p + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
        out[p + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
    for name, dim in (("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0), ("mlp.down_proj.weight", 1)):
        if p + name in ranks[0]:
            out[p + name] = torch.cat([r.pop(p + name) for r in ranks], dim=dim)
    for name in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "mlp.up_proj.bias"):
        if p + name in ranks[0]:  # megatron GPT's biases of column-split layers (no K/V replication there)
            out[p + name] = torch.cat([r.pop(p + name) for r in ranks], dim=0)
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "input_layernorm.bias",
                 "post_attention_layernorm.bias", "self_attn.o_proj.bias", "mlp.down_proj.bias"):
        if p + name in ranks[0]:  # replicated on every tp rank
            out[p + name] = ranks[0][p + name]
            for r in ranks:
                r.pop(p + name)
    return out


def expected_shapes(lay: NxdLayout) -> dict[str, tuple[int, ...]]:
    """transformers' LlamaForCausalLM tensors for the layout's architecture."""
    h, f, hd = lay.hidden_size, lay.intermediate_size, lay.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (lay.vocab_size, h), "model.norm.weight": (h,)}
    if not lay.tie_word_embeddings:
        out["lm_head.weight"] = (lay.vocab_size, h)
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (lay.num_heads * hd, h),
                    p + "self_attn.k_proj.weight": (lay.num_kv_heads * hd, h),
                    p + "self_attn.v_proj.weight": (lay.num_kv_heads * hd, h),
                    p + "self_attn.o_proj.weight": (h, lay.num_heads * hd),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return out


def merge(ckpt: NxdCheckpoint, lay: NxdLayout, want=None) -> tuple[dict[str, torch.Tensor], str]:
    """The full model under nxdt's names (transformers' Llama / Mixtral), and the KV replication
    order found; `want`: the model's tensor shapes, or a function of the merged tensors giving them
    (default: expected_shapes, a dense Llama)."""
    if (ckpt.tp, ckpt.pp, ckpt.ep) != (lay.tp, lay.pp, lay.ep):
        raise ConfigError(f"{ckpt.tag}: written with tp {ckpt.tp} x pp {ckpt.pp}"
                          + (f" x ep {ckpt.ep}" if max(ckpt.ep, lay.ep) > 1 else "")
                          + f", the config says tp {lay.tp} x pp {lay.pp}"
                          + (f" x ep {lay.ep}" if max(ckpt.ep, lay.ep) > 1 else "")
                          + " (distributed_strategy.tensor/pipeline/expert_model_parallel_size)")
    return merge_ranks(_stages_per_tp_rank(ckpt), lay, ckpt.tag, want=want)


def merge_ranks(ranks: list[dict[str, torch.Tensor]], lay: NxdLayout, tag: Path, order: str | None = None,
                want=None) -> tuple[dict[str, torch.Tensor], str]:
    """Each tp rank's tensors (pp stages merged, NxD's names) as full tensors under nxdt's
    names; `order`: the K/V replication the weights showed (for tensors shaped like them, e.g.
    Adam's moments). Consumes `ranks`."""
    megatron = any(key.startswith("language_model.") for key in ranks[0])
    if megatron != (lay.style == "megatron"):
        raise ConfigError(f"{tag}: {'a megatron-style' if megatron else 'an HF-style'} checkpoint, the config says "
                          f"model_source {'megatron' if lay.style == 'megatron' else 'hf'}")
    if megatron:
        ranks[:] = [megatron_to_hf_names(r, lay.num_heads // lay.tp, lay.num_kv_heads // lay.tp, lay.head_dim,
                                         str(tag), lay.gated) for r in ranks]
    layers = sorted({int(m.group(1)) for key in ranks[0] if (m := LAYER_KEY.fullmatch(key))})
    if layers != list(range(lay.num_layers)):
        raise ConfigError(f"{tag}: layers {layers[0] if layers else '-'}..{layers[-1] if layers else '-'} "
                          f"({len(layers)}) in the checkpoint, the config has {lay.num_layers}")
    out: dict[str, torch.Tensor] = merge_experts(ranks, layers, tag)
    orders: set[str] = set()
    for i in layers:
        out.update(_layer(ranks, i, lay, orders, order))
    for key, dim in (("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
        if key in ranks[0]:
            out[key] = torch.cat([r.pop(key) for r in ranks], dim=dim)
    for key in ("model.norm.weight", "model.norm.bias", "model.embed_positions.weight"):  # replicated
        if key in ranks[0]:
            out[key] = ranks[0][key]
            for r in ranks:
                r.pop(key)
    left = sorted(ranks[0])
    if left:
        raise ConfigError(f"{tag}: {left[0]} is not a tensor of NxDT's Llama ({len(left)} such)")
    want = want(out) if callable(want) else want if want is not None else expected_shapes(lay)
    if lay.tie_word_embeddings and "lm_head.weight" in want and "lm_head.weight" not in out and \
            "model.embed_tokens.weight" in out:  # a tied output layer (nxdt's state dict names both)
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    _check_shapes(tag, out, want)
    return out, "/".join(sorted(orders))


def _check_shapes(tag: Path, got: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    for key, shape in want.items():
        if key not in got:
            raise ConfigError(f"{tag}: no tensor for {key} in any rank file")
        if tuple(got[key].shape) != shape:
            raise ConfigError(f"{tag}: {key} merges to {tuple(got[key].shape)}, the config's model is {shape}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError(f"{tag}: {extra[0]} is not in the config's model (tied embeddings?)")
