"""`nxdt convert nxd-to-nxdt`: checkpoints in NxD's trainer layout (what NxDT wrote) become nxdt checkpoints.

The NxD-layout checkpoints are written here with plain torch, the way NxD writes them
(neuronx_distributed.trainer.checkpoint + scripts/checkpoint_converter.convert_full_state_to_tp,
the sharding NxD's own converter does): one file per tp/pp rank under model/, global layer names per
pp stage, the fused [q|k|v] of GQAQKVColumnParallelLinear per tp rank with the K/V heads repeated
kv_replicator times (Trn1's `repeat` with its query-head shuffle, or Trn2's `repeat_interleave`),
[gate|up] per rank, and xser files (torch_xla's TensorReference + `<file>.tensors/tensor_N.pt`).
The converted weights give the logits transformers gives for the same weights from safetensors.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process
from torch.distributed.checkpoint import load as dcp_load
from transformers import LlamaConfig, LlamaForCausalLM

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.checkpoint.nxd_legacy import LAYER_KEY as LAYER
from nxdt.checkpoint.nxd_legacy_optim import check_ep_layout
from nxdt.checkpoint.state import SafeReader, read_dcp_metadata
from nxdt.config.errors import ConfigError
from nxdt.config.load import main_guard
from nxdt.models.builder import build_model, logits_of
from nxdt.tools.convert import main as convert_main
from nxdt.tools.convert import hf_to_nxdt
from nxdt.tools.convert_nxd import nxd_to_nxdt, read_yaml

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
      "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8192,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
      "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


# --------------------------------------------------------------------------- NxD's layout, written here
def _q_order(q: torch.Tensor, heads: int, kv: int, tp: int, mult: int, hd: int, trn2: bool) -> list[torch.Tensor]:
    """Per tp rank, the query rows (or o_proj columns, transposed) NxD's converter gives it."""
    w = q.reshape(heads, hd, -1)
    if trn2:  # blocked replication: heads in order
        return list(w.reshape(tp, -1, w.shape[-1]))
    if kv * mult != tp:  # beyond what the converter writes: each rank's query slots take, in order, the next
        # heads of the KV head NxD's runtime pairs them with (rank r holds replicated KV heads r*kv_pp.., Trn1's repeat)
        q_pp, kv_pp = heads // tp, kv * mult // tp
        pools = [list(range(g * heads // kv, (g + 1) * heads // kv)) for g in range(kv)]
        order = [pools[(r * kv_pp + j // (q_pp // kv_pp)) % kv].pop(0) for r in range(tp) for j in range(q_pp)]
        return list(w[order].reshape(tp, -1, w.shape[-1]))
    w = w.reshape(-1, heads // (kv * mult), hd, w.shape[-1])  # trn1: convert_full_state_to_tp's shuffle
    idx = torch.arange(0, kv) * tp // kv
    splits = torch.cat([w[idx + i] for i in range(tp // kv)], dim=0)
    return [splits[r].reshape(-1, w.shape[-1]) for r in range(tp)]


def _shard(sd: dict, tp: int, pp: int, mult: int, trn2: bool, qkv: str = "fused", c: dict = HF
           ) -> dict[tuple[int, int], dict]:
    """NxD's rank files. qkv: fused (GQAQKVColumnParallelLinear with fuse_qkv: `qkv_proj.weight_qkv`),
    split (without fuse_qkv: `qkv_proj.weight_q/_k/_v`), separate (qkv_linear false: q_proj/k_proj/v_proj).
    `c`: the config.json (a Mixtral's MoE layers are left to _moe_shard)."""
    heads, kv, layers = c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    hd = c["hidden_size"] // heads
    per_stage = layers // pp
    out = {(t, p): {} for t in range(tp) for p in range(pp)}
    for t in range(tp):
        def rows(x, dim=0):
            return torch.chunk(x, tp, dim=dim)[t].clone()
        out[(t, 0)]["model.embed_tokens.weight"] = rows(sd["model.embed_tokens.weight"])
        out[(t, pp - 1)]["model.norm.weight"] = sd["model.norm.weight"].clone()
        out[(t, pp - 1)]["lm_head.weight"] = rows(sd["lm_head.weight"])
        for i in range(layers):
            s, p = out[(t, i // per_stage)], f"model.layers.{i}."
            a = p + "self_attn."
            repeat = (lambda x: torch.repeat_interleave(x.reshape(kv, hd, -1), mult, 0).reshape(kv * mult * hd, -1)) \
                if trn2 else (lambda x: x.repeat(mult, 1))
            q = (_q_order(sd[a + "q_proj.weight"], heads, kv, tp, mult, hd, trn2)[t] if mult > 1
                 else rows(sd[a + "q_proj.weight"]))
            o = (_q_order(sd[a + "o_proj.weight"].T, heads, kv, tp, mult, hd, trn2)[t].T if mult > 1
                 else rows(sd[a + "o_proj.weight"], 1))
            k, v = rows(repeat(sd[a + "k_proj.weight"])), rows(repeat(sd[a + "v_proj.weight"]))
            if qkv == "fused":
                s[a + "qkv_proj.weight_qkv"] = torch.cat([q, k, v], dim=0).contiguous()
            else:
                names = ("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v") if qkv == "split" else (
                    "q_proj.weight", "k_proj.weight", "v_proj.weight")
                s.update({a + n: w.contiguous() for n, w in zip(names, (q, k, v))})
            s[a + "o_proj.weight"] = o.contiguous()
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                s[p + n] = sd[p + n].clone()
            s[a + "rotary_emb.inv_freq"] = torch.ones(hd // 2)  # an old persistent buffer: dropped
            if p + "mlp.gate_proj.weight" in sd:  # (a Mixtral's MoE layers: _moe_shard)
                s[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(sd[p + "mlp.gate_proj.weight"]),
                                                              rows(sd[p + "mlp.up_proj.weight"])], dim=0)
                s[p + "mlp.down_proj.weight"] = rows(sd[p + "mlp.down_proj.weight"], 1)
    return out


def _attention(ranks: list[tuple[torch.Tensor, ...]], x: torch.Tensor, hd: int) -> torch.Tensor:
    """Causal attention as NxD computes it (no RoPE: it rotates every head alike): each tp rank its
    query heads over its own K/V heads (repeat_kv within the rank), o_proj's partial sums added."""
    out = 0
    for q, k, v, o in ranks:
        heads = [(x @ w.T).unflatten(-1, (-1, hd)).transpose(1, 2) for w in (q, k, v)]
        group = heads[0].shape[1] // heads[1].shape[1]
        a = torch.nn.functional.scaled_dot_product_attention(
            heads[0], heads[1].repeat_interleave(group, 1), heads[2].repeat_interleave(group, 1), is_causal=True)
        out = out + a.transpose(1, 2).flatten(2) @ o.T
    return out


@pytest.mark.parametrize(("tp", "mult", "trn2"), [(2, 1, False), (4, 2, False), (4, 2, True), (2, 2, False)])
def test_written_shards_compute_transformers_attention(hf_model, tp, mult, trn2):
    """The NxD layouts the tests write are NxD models of the same weights: per-rank attention (NxD's
    runtime) equals transformers' grouped-query attention within 1e-6. (2, 2): 2 KV heads x 2 copies
    over tp 2, a layout NxD runs but its converter cannot write."""
    _, sd = hf_model
    heads, kv, hd = HF["num_attention_heads"], HF["num_key_value_heads"], HF["hidden_size"] // HF["num_attention_heads"]
    rep_pp = kv * mult // tp
    sizes = [heads // tp * hd, rep_pp * hd, rep_pp * hd]
    a = "model.layers.0.self_attn."
    shards = _shard(sd, tp, 1, mult, trn2)
    ranks = [(*torch.split(shards[(t, 0)][a + "qkv_proj.weight_qkv"], sizes), shards[(t, 0)][a + "o_proj.weight"])
             for t in range(tp)]
    x = torch.randn(2, 12, HF["hidden_size"])
    expect = _attention([tuple(sd[a + n + "_proj.weight"] for n in "qkvo")], x, hd)
    assert (_attention(ranks, x, hd) - expect).abs().max().item() <= 1e-6
    assert expect.abs().max().item() > 1e-2


@contextlib.contextmanager
def _torch_xla_reference():
    """torch_xla.utils.serialization.TensorReference as pickle finds it, for the time of a save."""
    names = ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    mods = {n: types.ModuleType(n) for n in names}

    class TensorReference:  # torch_xla's: `def __init__(self, tid): self.tid = tid`
        def __init__(self, tid):
            self.tid = tid

    TensorReference.__module__, TensorReference.__qualname__ = names[-1], "TensorReference"
    mods[names[-1]].TensorReference = TensorReference
    sys.modules.update(mods)
    try:
        yield TensorReference
    finally:
        for n in names:
            del sys.modules[n]


def _xser_save(obj, path) -> None:
    """torch_xla.utils.serialization.save (_rewrite_data): each tensor of a nested structure, in
    traversal order, as `<path>.tensors/tensor_<tid>.pt`, a TensorReference(tid) in its place."""
    folder = path.with_name(path.name + ".tensors")
    folder.mkdir()
    tids = iter(range(10**6))
    with _torch_xla_reference() as ref:
        def rewrite(o):
            if isinstance(o, torch.Tensor):
                tid = next(tids)
                torch.save(o, folder / f"tensor_{tid}.pt")
                return ref(tid)
            if isinstance(o, dict):
                return {k: rewrite(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
                return type(o)(rewrite(v) for v in o)
            return o
        torch.save(rewrite(obj), path)


def write_nxd(tag, shards: dict, xser: bool, optim: dict | None = None) -> None:
    """NxD's tag folder; `optim`: per (tp, pp) rank the optimizer state dict of each dp rank
    (dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt under optim/, trainer/checkpoint.py _get_path with dp)."""
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    for (t, p), per_dp in (optim or {}).items():
        for dp, state in enumerate(per_dp):
            path = tag / "optim" / f"dp_rank_{dp:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
            _xser_save(state, path) if xser else torch.save(state, path)
    for rank, sd in shards.items():  # (tp, pp), or (ep, tp, pp) with expert parallelism
        e, (t, p) = (rank[0], rank[1:]) if len(rank) == 3 else (None, rank)
        path = tag / "model" / f"dp_rank_00{'' if e is None else f'_ep_rank_{e:02d}'}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
        if not xser:
            torch.save(sd, path)
            continue
        folder = path.with_name(path.name + ".tensors")  # torch_xla.utils.serialization.save / NxD's _xser_save_data
        folder.mkdir()
        with _torch_xla_reference() as ref:
            refs = {}
            for i, (key, tensor) in enumerate(sd.items()):
                if not e or "expert_mlps" in key:  # NxD: tensors not expert-parallel are ep rank 0's files only
                    torch.save(tensor, folder / f"tensor_{i}.pt")
                refs[key] = ref(i)
            torch.save(refs, path)
        torch.save({i: {"dtype": tensor.dtype, "shape": tensor.shape, "expert_model_parallel": "expert_mlps" in key}
                    for i, (key, tensor) in enumerate(sd.items())}, path.with_name(path.name + ".info.pt"))
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random tiny Llama saved as safetensors, and the config.json an NxDT YAML names."""
    root = tmp_path_factory.mktemp("nxd")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms away from 1, so a misplaced one shows
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf", safe_serialization=True)
    return root, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _yaml(root, tp: int, pp: int, mult: int | None):
    path = root / f"nxdt_tp{tp}_pp{pp}_kv{mult}.yaml"
    ds = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    if mult:
        ds["kv_replicator"] = mult
    path.write_text(yaml.safe_dump({
        "name": "hf_llama", "model_source": "hf", "trainer": {"devices": tp * pp, "num_nodes": 1, "max_steps": 1},
        "distributed_strategy": ds,
        "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 32},
        "model": {"model_config": str(root / "hf" / "config.json"), "encoder_seq_length": 32,
                  "qkv_linear": True, "fuse_qkv": True}}))
    return path


def _logits(weights: dict, ids: torch.Tensor) -> torch.Tensor:
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"})).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(("tp", "pp", "mult", "trn2", "xser", "qkv"), [
    (2, 2, None, False, False, "fused"),  # tp 2 = kv heads: no replication, 4 query heads per KV head per rank
    (2, 2, None, False, True, "fused"),
    (4, 2, 2, False, True, "fused"),      # tp 4 > 2 KV heads: Trn1's repeat and query shuffle, 2 query heads a rank
    (4, 1, 2, True, False, "fused"),      # Trn2's repeat_interleave
    (4, 2, 2, False, False, "split"),
    (2, 1, None, False, True, "separate"),
    (2, 1, 2, False, False, "fused"),     # 2 KV heads x 2 copies over tp 2: 2 KV heads a rank (NxD's runtime order)
])
def test_nxd_layout_gives_transformers_logits(hf_model, tmp_path, capsys, tp, pp, mult, trn2, xser, qkv):
    root, sd = hf_model
    tag = tmp_path / "checkpoints" / "hf_llama--step=5-consumed_samples=40.0.ckpt"
    write_nxd(tag, _shard(sd, tp, pp, mult or 1, trn2, qkv), xser)
    out = tmp_path / "nxdt"
    # the input as NxD's checkpoint dir (newest `done` tag), the tag, or its model/ folder; the YAML's
    # model.model_config overridden on the command line as NxDT's shipped YAMLs need it
    given = [tag.parent, tag / "model", tag][(tp + pp + int(xser)) % 3]
    config = _yaml(root, tp, pp, mult)
    config.write_text(config.read_text().replace(str(root / "hf" / "config.json"), "/home/ubuntu/config.json"))
    assert convert_main(["nxd-to-nxdt", "--input", str(given), "--output", str(out), "--config", str(config),
                         f"model.model_config={root / 'hf' / 'config.json'}"]) == 0
    said = capsys.readouterr().out
    assert f"tp {tp} x pp {pp}, {'xser' if xser else 'torch.save'}" in said and "the output is weights-only" in said
    assert "NxDT's step 5, consumed_samples 40" in said
    weights = load_weights(out)
    assert set(weights) == set(sd)
    reference = LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    ids = torch.arange(48).reshape(2, 24) * 131 % HF["vocab_size"]
    with torch.no_grad():
        expect = reference(input_ids=ids).logits
    got = _logits(weights, ids)
    assert (got - expect).abs().max().item() <= 1e-6
    assert expect.abs().max().item() > 0.05  # logits of substance


def test_bad_inputs_are_one_line(hf_model, tmp_path):
    """A missing rank file or xser tensor, a YAML of another layout, K/V copies that are not copies,
    no checkpoint at all, no --config: a ConfigError of one line that names it."""
    root, sd = hf_model
    tag, xtag, ktag = tmp_path / "plain" / "tag", tmp_path / "xser" / "tag", tmp_path / "kv" / "tag"
    write_nxd(tag, _shard(sd, 2, 2, 1, False), xser=False)
    write_nxd(xtag, _shard(sd, 2, 2, 1, False), xser=True)
    (xtag / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt.tensors" / "tensor_2.pt").unlink()
    shards = _shard(sd, 4, 1, 2, False)
    shards[(3, 0)]["model.layers.1.self_attn.qkv_proj.weight_qkv"][-3:] += 1.0  # one V copy differs
    write_nxd(ktag, shards, xser=False)
    (tmp_path / "empty").mkdir()
    cases = {
        "written with tp 2 x pp 2, the config says tp 4 x pp 2": (tag, _yaml(root, 4, 2, 2)),
        "model.layers.0.self_attn.qkv_proj.weight_qkv: 48 rows per tp rank, 64 expected": (tag, _yaml(root, 2, 2, 2)),
        "model.layers.1.self_attn: the 2 copies of each of the 2 K/V heads differ": (ktag, _yaml(root, 4, 1, 2)),
        "tensor_2.pt is missing": (xtag, _yaml(root, 2, 2, None)),
        "not an NxDT checkpoint": (tmp_path / "empty", _yaml(root, 2, 2, None)),
        "--config NXDT_YAML: needed": (tag, None),
    }
    (tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").rename(tag / "aside.pt")
    with pytest.raises(ConfigError) as err:
        nxd_to_nxdt(tag, tmp_path / "out", _yaml(root, 2, 2, None))
    assert "dp_rank_00_tp_rank_01_pp_rank_00.pt is missing" in str(err.value)
    (tag / "aside.pt").rename(tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    for i, (says, (src, config)) in enumerate(cases.items()):
        with pytest.raises(ConfigError) as err:
            nxd_to_nxdt(src, tmp_path / f"out{i}", config)
        assert says in str(err.value) and "\n" not in str(err.value), (says, str(err.value))


def test_converted_checkpoint_resumes_training(hf_model, tmp_path, kjv_prefix):
    """`exp_manager.resume_from_checkpoint=CKPT model.weight_init_only=true` trains from the converted
    NxD checkpoint (tp 4 x pp 2, kv_replicator 2, xser), in one process: the losses of its first two
    steps are those of a run started from the same weights imported from safetensors (`hf-to-nxdt`),
    and not those of a run from nxdt's own initialization."""
    root, sd = hf_model
    tag = tmp_path / "tag"
    write_nxd(tag, _shard(sd, 4, 2, 2, False), xser=True)
    nxd_to_nxdt(tag, tmp_path / "from_nxd", _yaml(root, 4, 2, 2))
    hf_to_nxdt(root / "hf", tmp_path / "from_hf")
    losses = {}
    for name in ("from_nxd", "from_hf", "scratch"):
        start = [] if name == "scratch" else [f"exp_manager.resume_from_checkpoint={tmp_path / name}",
                                              "model.weight_init_only=true"]
        run = train_in_process(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                                "trainer.max_steps=2", "model_source=hf",
                                f"model.model_config={root / 'hf' / 'config.json'}",
                                f"data.data_prefix=[1.0,{kjv_prefix}]",
                                f"exp_manager.explicit_log_dir={tmp_path / name}_run", *start])
        assert run.rc == 0, run.err[-3000:]
        losses[name] = [v for _, v in sorted(read_scalars(tmp_path / f"{name}_run")["reduced_train_loss"].items())]
    assert len(losses["from_nxd"]) == 2
    assert losses["from_nxd"] == pytest.approx(losses["from_hf"], abs=1e-6)
    assert abs(losses["from_nxd"][0] - losses["scratch"][0]) > 1e-4, losses


# --------------------------------------------------------------------------- Adam's state (optim/)
SUBLAYER = ("self_attn.qkv_proj", "self_attn.o_proj", "self_attn.rotary_emb", "mlp.gate_up_proj", "mlp.down_proj",
            "mlp.moe.router", "mlp.moe.expert_mlps", "input_layernorm", "post_attention_layernorm")


def _nxd_order(shard: dict) -> dict:
    """A rank's tensors in the order NxD's model lists them (local_state_dict = the order of
    local_named_parameters: embed_tokens, each layer's self_attn, mlp, input_layernorm,
    post_attention_layernorm, then norm, lm_head; NxDT's hf_models/modeling_llama.py)."""
    def place(key):
        m = LAYER.fullmatch(key)
        if m:
            return 1, int(m.group(1)), next(i for i, s in enumerate(SUBLAYER) if m.group(2).startswith(s))
        return {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}[key], 0, 0
    return dict(sorted(shard.items(), key=lambda kv: place(kv[0])))


def _zero1(weights: dict, moments: dict, step: float, dp: int, no_decay: list[str], masters: dict | None = None) -> list[dict]:
    """Each dp rank's torch_xla ZeroRedundancyOptimizer.state_dict() (pytorch/xla @ 41398bff,
    zero_redundancy_optimizer.py: state_dict, get_shape_info, _pad_to_world_size, _shard_tensor) of
    one tp/pp rank, the parameters numbered over NxDT's groups (neuronx-distributed-training @
    9169aa03, utils/model_utils.py get_param_groups_by_weight_decay: names without no_decay first);
    `masters`: save_master_weights' `sharded_master_weights` {index: this rank's shard}."""
    names = [n for n in weights if not n.endswith("inv_freq")]
    order = [n for n in names if not any(d in n for d in no_decay)] + [n for n in names if any(d in n for d in no_decay)]
    n0 = sum(not any(d in n for d in no_decay) for n in names)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None}
    groups = [{"weight_decay": 0.01, **hyper, "params": list(range(n0))},
              {"weight_decay": 0.0, **hyper, "params": list(range(n0, len(order)))}]

    def shard(t, r):
        if t.size(0) % dp:
            t = torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, dp - t.size(0) % dp])
        return t.chunk(dp)[r].clone()
    out = [{"state": {}, "param_groups": groups, "shape_info": {i: weights[n].shape for i, n in enumerate(order)},
            "base_state": {i: {"step": torch.tensor(step), **{k: shard(moments[k][n], r) for k in moments}}
                           for i, n in enumerate(order)}} for r in range(dp)]
    for r, state in enumerate(out if masters else ()):
        state["sharded_master_weights"] = {i: shard(masters[n], r) for i, n in enumerate(order)}
    return out


def _nxdt_state(checkpoint) -> tuple[dict, dict]:
    """An nxdt checkpoint's model weights and Adam tensors (`state.<fqn>.<key>`), full, on CPU."""
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    optim = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
             if k.startswith("optim0.state.")}
    dcp_load(optim, storage_reader=SafeReader(str(checkpoint)), no_dist=True)
    return load_weights(checkpoint), {k.removeprefix("optim0."): v for k, v in optim.items()}


def _nxd_with_optimizer(tag, weights: dict, optim: dict, dp: int, xser: bool, layout=(2, 2, 1, False),
                        plain: bool = False, bf16_masters: bool = False) -> None:
    """NxD's checkpoint of nxdt's `weights` and Adam state: layout (tp, pp, kv_replicator, trn2),
    ZeRO-1 over dp `dp`; `plain`: without ZeRO-1 (one torch optimizer state dict per tp/pp rank,
    trainer/checkpoint.py save_checkpoint's path without `dp`); `bf16_masters`: bf16 model files,
    the fp32 weights as ZeRO-1's master weights."""
    moments = {k: {n: optim[f"state.{n}.{k}"] for n in weights} for k in ("exp_avg", "exp_avg_sq")}
    shards = {key: _nxd_order(sd) for key, sd in _shard(weights, *layout).items()}
    masters = dict(shards) if bf16_masters else {}
    if bf16_masters:
        shards = {key: {n: t.bfloat16() for n, t in sd.items()} for key, sd in shards.items()}
    per_rank = {k: _shard(v, *layout) for k, v in moments.items()}  # replicated K/V heads: equal moments
    step = float(next(v for k, v in optim.items() if k.endswith(".step")))
    no_decay = ["bias", "LayerNorm", "norm"]  # NxDT's with model.do_layer_norm_weight_decay: true
    states = {key: _zero1(sd, {k: per_rank[k][key] for k in moments}, step, dp, no_decay, masters.get(key))
              for key, sd in shards.items()}
    if plain:
        states = {key: [{"state": s[0]["base_state"], "param_groups": s[0]["param_groups"]}] for key, s in states.items()}
    write_nxd(tag, shards, xser, states)


def _reference_run(tmp_path: Path, run: list[str]) -> tuple[dict, dict, dict]:
    """nxdt's own run to step 4, checkpointed every 2 steps: its step-2 weights and optimizer state and
    its losses by step."""
    ref = train_in_process([*run, f"exp_manager.explicit_log_dir={tmp_path / 'ref'}",
                            "exp_manager.create_checkpoint_callback=true",
                            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
                            "exp_manager.checkpoint_callback_params.save_top_k=-1"])
    assert ref.rc == 0, ref.err[-3000:]
    weights, optim = _nxdt_state(next((tmp_path / "ref" / "checkpoints").glob("*step=2-*")))
    return weights, optim, read_scalars(tmp_path / "ref")["reduced_train_loss"]


def _resumed_losses(tmp_path: Path, run: list[str], name: str, checkpoint: Path) -> dict:
    """`run` resumed from a converted `checkpoint`: it says so as a native resume does, and logs steps 3
    and 4 (the steps left); their losses."""
    resumed = train_in_process([*run, f"exp_manager.explicit_log_dir={tmp_path / name}_run",
                                f"exp_manager.resume_from_checkpoint={checkpoint}"])
    assert resumed.rc == 0, resumed.err[-3000:]
    assert f"resuming from {checkpoint} (step 2, consumed_samples 16)" in resumed.out, resumed.out[-2000:]
    losses = read_scalars(tmp_path / f"{name}_run")["reduced_train_loss"]
    assert sorted(losses) == [3, 4], losses
    return losses


def _assert_the_moments_carry_step_4(got: dict, want: dict) -> None:
    """The converted run ('conv') continues the reference within 1e-6; with Adam's moments zeroed
    ('conv0') step 3's loss is the same and step 4's (which Adam's state shapes) misses by > 1e-4."""
    for step in (3, 4):
        assert abs(got["conv"][step] - want[step]) <= 1e-6, (step, got, want)
    assert abs(got["conv0"][3] - want[3]) <= 1e-6 and abs(got["conv0"][4] - want[4]) > 1e-4, (got, want)


def test_nxd_optimizer_state_resumes_the_run(hf_model, tmp_path, kjv_prefix, capsys):
    """NxDT's ZeRO-1 Adam shards (dp 3: dims of 64 rows pad to 66 and split 22/22/20) of a tp 2 x
    pp 2 run, xser, made from nxdt's own step-2 checkpoint of the same tiny Llama: converted, the
    moments are nxdt's bit for bit, and a resume from it logs the losses of the uninterrupted run
    at steps 3 and 4 (step 4's depends on Adam's state and the lr at step 3) within 1e-6, where
    the same checkpoint with the moments zeroed (torch.save this time) misses step 4's by > 1e-4."""
    root, _ = hf_model
    run = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=4",
           "model_source=hf", f"model.model_config={root / 'hf' / 'config.json'}", "model.do_layer_norm_weight_decay=true",
           "model.optim.sched.warmup_steps=2", f"data.data_prefix=[1.0,{kjv_prefix}]"]
    weights, optim, want = _reference_run(tmp_path, run)
    tag = tmp_path / "nxd" / "hf_llama--step=2-consumed_samples=16.0.ckpt"
    _nxd_with_optimizer(tag, weights, optim, dp=3, xser=True)
    config = _yaml(root, 2, 2, None)
    config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    assert convert_main(["nxd-to-nxdt", "--input", str(tag), "--output", str(tmp_path / "conv"),
                         "--config", str(config)]) == 0
    said = capsys.readouterr().out
    assert "(ZeRO-1 shards over dp 3); resumes at step 2, consumed_samples 16" in said, said
    got_weights, got_optim = _nxdt_state(tmp_path / "conv")
    assert set(got_optim) == set(optim) and set(got_weights) == set(weights)
    for key, tensor in optim.items():
        assert torch.equal(got_optim[key], tensor), key
    assert float(optim["state.model.norm.weight.exp_avg_sq"].abs().max()) > 0  # moments of substance

    # the same checkpoint with Adam's moments zeroed: step 3's loss is the same, step 4's is not
    zeroed = {k: torch.zeros_like(v) if "exp_avg" in k else v for k, v in optim.items()}
    _nxd_with_optimizer(tmp_path / "nxd0" / tag.name, weights, zeroed, dp=3, xser=False)
    nxd_to_nxdt(tmp_path / "nxd0" / tag.name, tmp_path / "conv0", config)
    got = {}
    for name in ("conv", "conv0"):
        got[name] = _resumed_losses(tmp_path, run, name, tmp_path / name)
    _assert_the_moments_carry_step_4(got, want)
    # an optimizer keeping more than Adam's moments (amsgrad's max_exp_avg_sq): one line, exit 2
    amsgrad = train_in_process([*run, f"exp_manager.explicit_log_dir={tmp_path / 'amsgrad_run'}",
                                f"exp_manager.resume_from_checkpoint={tmp_path / 'conv'}", "+model.optim.amsgrad=true"])
    assert amsgrad.rc == 2 and "also keeps 'max_exp_avg_sq' (21 tensors)" in amsgrad.err, amsgrad.err[-2000:]


def test_malformed_optimizer_shard_is_refused(hf_model, tmp_path, capsys):
    """A ZeRO-1 shard whose exp_avg lost rows, a dp rank's file missing, a plain optimizer whose
    parameters do not match the model file's: one line naming it, exit 2, nothing written."""
    root, sd = hf_model
    optim = {f"state.{n}.{k}": torch.randn_like(t) for n, t in sd.items() for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(3.0) for n in sd})
    config = _yaml(root, 2, 2, None)
    config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    cases = {}
    tag = tmp_path / "short" / "tag"
    _nxd_with_optimizer(tag, sd, optim, dp=2, xser=False)
    bad = tag / "optim" / "dp_rank_01_tp_rank_01_pp_rank_00.pt"
    state = torch.load(bad, weights_only=True)
    state["base_state"][0]["exp_avg"] = state["base_state"][0]["exp_avg"][:-3]
    torch.save(state, bad)
    cases["base_state[0].exp_avg over the 2 dp ranks is (4093, 64) after unpadding, shape_info says (4096, 64)"] = tag
    tag = tmp_path / "missing" / "tag"
    _nxd_with_optimizer(tag, sd, optim, dp=2, xser=False)
    (tag / "optim" / "dp_rank_01_tp_rank_00_pp_rank_01.pt").unlink()
    cases["dp_rank_01_tp_rank_00_pp_rank_01.pt is missing (the other files make dp 2 x tp 2 x pp 2)"] = tag
    tag = tmp_path / "plain" / "tag"
    _nxd_with_optimizer(tag, sd, optim, dp=1, xser=False)
    plain = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = torch.load(plain, weights_only=True)
    torch.save({"state": state["base_state"], "param_groups": state["param_groups"][:1]}, plain)
    cases["parameters in 1 groups"] = tag
    for i, (says, src) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        with pytest.raises(SystemExit) as exit_:
            main_guard(convert_main)(["nxd-to-nxdt", "--input", str(src), "--output", str(out), "--config", str(config)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, (says, err)
        assert not out.exists() and not (tmp_path / f".tmp-out{i}").exists()


@pytest.mark.parametrize(("layout", "dp", "plain", "masters"), [
    ((4, 2, 2, False), 2, False, True), ((4, 1, 2, True), 3, False, False), ((2, 2, 1, False), 1, True, False)])
def test_optimizer_state_of_each_layout(hf_model, tmp_path, capsys, layout, dp, plain, masters):
    """Adam's moments through K/V replication (Trn1's repeat with its query shuffle, Trn2's
    repeat_interleave; the copies' order is the weights') and without ZeRO-1: the converted
    moments are the full ones, bit for bit. With ZeRO-1's fp32 master weights beside bf16 model
    files the weights are the masters, bit for bit; masters of another order are refused."""
    root, sd = hf_model
    torch.manual_seed(1)
    optim = {f"state.{n}.{k}": torch.randn_like(t).abs() for n, t in sd.items() for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(7.0) for n in sd})
    tag = tmp_path / "nxd" / "hf_llama--step=7-consumed_samples=56.0.ckpt"
    _nxd_with_optimizer(tag, sd, optim, dp=dp, xser=False, layout=layout, plain=plain, bf16_masters=masters)
    config = _yaml(root, layout[0], layout[1], layout[2] if layout[2] > 1 else None)
    config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    lines = nxd_to_nxdt(tag, tmp_path / "conv", config)
    assert any("step 7 " + ("(one file per tp/pp rank)" if plain else f"(ZeRO-1 shards over dp {dp})") in line
               for line in lines), lines
    _, got = _nxdt_state(tmp_path / "conv")
    assert set(got) == set(optim)
    for key, tensor in optim.items():
        assert torch.equal(got[key], tensor), key
    weights = load_weights(tmp_path / "conv")
    assert all(torch.equal(weights[n], t) for n, t in sd.items())  # with masters: not the bf16 files' values
    assert not torch.equal(sd["lm_head.weight"].bfloat16().float(), sd["lm_head.weight"])
    if masters:  # one rank's master shards swapped between two parameters of the same shape
        bad = tag / "optim" / "dp_rank_01_tp_rank_00_pp_rank_01.pt"
        state = torch.load(bad, weights_only=True)
        sharded = state["sharded_master_weights"]
        a, b = [i for i, s in state["shape_info"].items() if tuple(s) == (64,)][:2]
        sharded[a], sharded[b] = sharded[b], sharded[a]
        torch.save(state, bad)
        with pytest.raises(ConfigError) as err:
            nxd_to_nxdt(tag, tmp_path / "conv_bad", config)
        assert "differ from the model file's beyond torch.bfloat16 rounding" in str(err.value)


def test_optimizer_joined_by_nxds_converter(hf_model, tmp_path):
    """optim/full_tp_rank_YY_pp_rank_ZZ.pt, the ZeRO-1 state NxD's convert_zero_checkpoints.py
    --convert_to_full writes (base_state joined over dp, shape_info kept): read as dp 1."""
    root, sd = hf_model
    optim = {f"state.{n}.{k}": torch.randn_like(t) for n, t in sd.items() for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(4.0) for n in sd})
    tag = tmp_path / "nxd" / "tag"
    _nxd_with_optimizer(tag, sd, optim, dp=1, xser=False)
    for f in sorted((tag / "optim").iterdir()):
        f.rename(f.with_name(f.name.replace("dp_rank_00_", "full_")))
    config = _yaml(root, 2, 2, None)
    config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    nxd_to_nxdt(tag, tmp_path / "conv", config)
    _, got = _nxdt_state(tmp_path / "conv")
    assert set(got) == set(optim) and all(torch.equal(got[k], v) for k, v in optim.items())
    (tag / "optim" / "full_tp_rank_01_pp_rank_01.pt").unlink()
    with pytest.raises(ConfigError) as err:
        nxd_to_nxdt(tag, tmp_path / "conv2", config)
    assert "full_tp_rank_01_pp_rank_01.pt is missing" in str(err.value)


# --------------------------------------------------------------------------- megatron-style and MoE checkpoints
MEGATRON = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 8, "num_kv_heads": 4,
            "encoder_seq_length": 32, "max_position_embeddings": 32, "normalization": "rmsnorm", "activation": "swiglu",
            "has_bias": False, "position_embedding_type": "rope", "share_embeddings_and_output_weights": False}
MIXTRAL = {**{k: v for k, v in HF.items() if k not in ("mlp_bias",)}, "architectures": ["MixtralForCausalLM"],
           "model_type": "mixtral", "intermediate_size": 96, "vocab_size": 1024, "num_local_experts": 4,
           "num_experts_per_tok": 2, "router_jitter_noise": 0.0, "sliding_window": None}
MOE = {"num_experts": 4, "top_k": 2}
GPT = {"normalization": "layernorm", "activation": "gelu", "has_bias": True, "position_embedding_type": "learned_absolute",
       "share_embeddings_and_output_weights": True}  # megatron_gpt_config's model
GATE_UP, DOWN = "mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight", "mlp.moe.expert_mlps.mlp_op.down_proj.weight"


def _moe_yaml(root, source: str, tp: int, pp: int, ep: int, model: dict):
    path = root / f"{source}_tp{tp}_pp{pp}_ep{ep}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "name": f"{source}_moe", "model_source": source, "trainer": {"devices": tp * pp, "num_nodes": 1, "max_steps": 1},
        "distributed_strategy": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                 "expert_model_parallel_size": ep},
        "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 32},
        "model": {"encoder_seq_length": 32, **model}}))
    return path


def cfg_model(config) -> dict:
    return yaml.safe_load(config.read_text())["model"]


def _moe_shard(sd: dict, shards: dict, tp: int, pp: int, ep: int, layers: int, prefix) -> dict:
    """NxD's MoE layer (router replicated; the experts' [E/ep, H, 2I/tp] gate_up with [gate | up] per tp
    rank on dim 2, the [E/ep, I/tp, H] down_proj) added to each (tp, pp) rank's tensors, the ranks
    then per (ep, tp, pp): each ep rank its experts, the rest as ep rank 0's."""
    for i in range(layers):
        p = f"model.layers.{i}."
        if p + "mlp.gate.weight" not in sd:
            continue
        w13 = sd[p + "mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, H, 2I]: NxD's input-major weights
        gate, up = w13.chunk(2, dim=2)
        down = sd[p + "mlp.experts.down_proj"].transpose(1, 2)  # [E, I, H]
        for t in range(tp):
            s = shards[(t, i * pp // layers)]
            s[prefix(i) + "mlp.moe.router.linear_router.weight"] = sd[p + "mlp.gate.weight"].clone()
            s[prefix(i) + GATE_UP] = torch.cat([gate.chunk(tp, 2)[t], up.chunk(tp, 2)[t]], dim=2).contiguous()
            s[prefix(i) + DOWN] = down.chunk(tp, 1)[t].contiguous()
    if ep == 1:
        return shards
    return {(e, t, p): {k: v.chunk(ep)[e].clone() if "expert_mlps" in k else v for k, v in sd_.items()}
            for (t, p), sd_ in shards.items() for e in range(ep)}


def _megatron_shard(sd: dict, tp: int, pp: int, c: dict) -> dict:
    """NxDT's megatron GPT model's rank files (models/megatron: language_model., the fused
    query_key_value of MHA as [np, 3 * hn] per rank, GQA's query and key_value as [nk, 2 * hn],
    dense_h_to_4h as [gate | up] per rank (swiglu) or the up projection (gelu), biases alike, the
    RowParallel layers' biases, the norms and learned positions replicated, a tied output_layer
    the embedding's tensor); MoE layers by _moe_shard."""
    heads, kv, layers, hd = c["num_attention_heads"], c["num_kv_heads"], c["num_layers"], c["hidden_size"] // c["num_attention_heads"]
    out = {(t, p): {} for t in range(tp) for p in range(pp)}
    for t in range(tp):
        def rows(x, dim=0):
            return torch.chunk(x, tp, dim=dim)[t].clone()
        out[(t, 0)]["language_model.embedding.word_embeddings.weight"] = rows(sd["model.embed_tokens.weight"])
        if "model.embed_positions.weight" in sd:
            out[(t, 0)]["language_model.embedding.position_embeddings.weight"] = sd["model.embed_positions.weight"].clone()
        for kind in ("weight", "bias"):
            if f"model.norm.{kind}" in sd:
                out[(t, pp - 1)][f"language_model.encoder.final_layernorm.{kind}"] = sd[f"model.norm.{kind}"].clone()
        # tied (GPTModel: output_layer.weight = word_embeddings_weight()): one tensor under both names
        out[(t, pp - 1)]["language_model.output_layer.weight"] = (
            out[(t, 0)]["language_model.embedding.word_embeddings.weight"]
            if c.get("share_embeddings_and_output_weights") else rows(sd["lm_head.weight"]))
        for i in range(layers):
            s, p, m = out[(t, i * pp // layers)], f"model.layers.{i}.", f"language_model.encoder.layers.{i}."
            for kind in ("weight", "bias"):
                if p + f"self_attn.q_proj.{kind}" not in sd:
                    continue
                tail = sd[p + f"self_attn.q_proj.{kind}"].shape[1:]
                q, k, v = (rows(sd[p + f"self_attn.{n}_proj.{kind}"]).view(-1, hd, *tail) for n in "qkv")
                if kv == heads:
                    s[m + f"self_attention.query_key_value.{kind}"] = torch.stack([q, k, v], 1).reshape(-1, *tail)
                else:
                    s[m + f"self_attention.query.{kind}"] = q.reshape(-1, *tail)
                    s[m + f"self_attention.key_value.{kind}"] = torch.stack([k, v], 1).reshape(-1, *tail)
            s[m + "self_attention.dense.weight"] = rows(sd[p + "self_attn.o_proj.weight"], 1)
            s[m + "self_attention.core_attention.rotary_emb.inv_freq"] = torch.ones(hd // 2)
            for n in ("input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
                      "post_attention_layernorm.bias"):
                if p + n in sd:
                    s[m + n] = sd[p + n].clone()
            if p + "self_attn.o_proj.bias" in sd:
                s[m + "self_attention.dense.bias"] = sd[p + "self_attn.o_proj.bias"].clone()
            if p + "mlp.gate_proj.weight" in sd:
                s[m + "mlp.dense_h_to_4h.weight"] = torch.cat([rows(sd[p + "mlp.gate_proj.weight"]),
                                                               rows(sd[p + "mlp.up_proj.weight"])])
            elif p + "mlp.up_proj.weight" in sd:  # gelu
                s[m + "mlp.dense_h_to_4h.weight"] = rows(sd[p + "mlp.up_proj.weight"])
                s[m + "mlp.dense_h_to_4h.bias"] = rows(sd[p + "mlp.up_proj.bias"])
            if p + "mlp.down_proj.weight" in sd:
                s[m + "mlp.dense_4h_to_h.weight"] = rows(sd[p + "mlp.down_proj.weight"], 1)
            if p + "mlp.down_proj.bias" in sd:
                s[m + "mlp.dense_4h_to_h.bias"] = sd[p + "mlp.down_proj.bias"].clone()
    return out


def _random(model: torch.nn.Module) -> dict:
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}


def _model_case(tmp_path, source: str, tp: int, pp: int, ep: int, kv: int, moe: bool):
    """The YAML of a megatron Llama / Mixtral or an HF Mixtral, its config, nxdt's model of it with
    random weights, and those weights."""
    if source in ("megatron", "gpt"):
        config = _moe_yaml(tmp_path, "megatron", tp, pp, ep, {**MEGATRON, "num_kv_heads": kv, "vocab_size": 1000,
                                                              **({"moe": MOE} if moe else {}),
                                                              **(GPT if source == "gpt" else {})})
    else:
        (tmp_path / "mixtral").mkdir()
        (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL))
        config = _moe_yaml(tmp_path, source, tp, pp, ep, {"model_config": str(tmp_path / "mixtral"),
                                                          "qkv_linear": True, "fuse_qkv": True, "moe": MOE})
    cfg = read_yaml(config)
    model = build_model(cfg, vocab_size=1000).eval()
    return config, cfg, model, _random(model)


def _nxd_shards(source: str, sd: dict, tp: int, pp: int, ep: int, kv: int, c: dict = MEGATRON) -> dict:
    """NxDT's rank files of nxdt's tensors `sd` (the weights, or Adam's moments alike)."""
    if source in ("megatron", "gpt"):
        shards = _megatron_shard(sd, tp, pp, {**c, "num_kv_heads": kv, **(GPT if source == "gpt" else {})})
        prefix = "language_model.encoder.layers.{}.".format
    else:
        shards = _shard(sd, tp, pp, 1, False, "fused", MIXTRAL)
        prefix = "model.layers.{}.".format
    return _moe_shard(sd, shards, tp, pp, ep, c["num_layers"], prefix)


@pytest.mark.parametrize(("source", "tp", "pp", "ep", "kv", "xser"), [
    ("megatron", 2, 2, 1, 4, False),  # GQA: 2 KV heads a rank, [k0 v0 k1 v1] rows
    ("megatron", 2, 1, 1, 8, True),   # MHA: query_key_value head by head
    ("megatron", 2, 2, 2, 4, True),   # megatron Mixtral: experts over ep 2 (xser: ep rank 1 holds only its experts)
    ("hf", 2, 2, 2, 2, True),         # NxDT's HF Mixtral: fused GQA qkv_proj and NxD's MoE
    ("hf", 2, 1, 1, 2, False),
    ("gpt", 2, 1, 1, 8, False),       # megatron GPT: layernorm, gelu, biases, learned positions, tied output
])
def test_megatron_and_moe_checkpoints_give_nxdt_logits(tmp_path, capsys, source, tp, pp, ep, kv, xser):
    """NxDT's megatron-style Llama / Mixtral and its HF Mixtral, written in NxD's layout (tp 2, pp 2,
    GQA, ep 2): converted, nxdt's model of the config loads them and its logits are those of the
    same weights loaded directly, within 1e-6; the MHA megatron shards compute the model's own
    attention per rank (the forward's [np, 3 * hn] view), within 1e-6 relative."""
    moe = ep > 1 or source == "hf"
    config, cfg, model, sd = _model_case(tmp_path, source, tp, pp, ep, kv, moe)
    shards = _nxd_shards(source, sd, tp, pp, ep, kv)
    tag = tmp_path / "ckpt" / f"{source}--step=3-consumed_samples=24.0.ckpt"
    write_nxd(tag, shards, xser)
    lines = nxd_to_nxdt(tag.parent, tmp_path / "conv", config)
    assert f"tp {tp} x pp {pp}" + (f" x ep {ep}" if ep > 1 else "") in lines[0], lines
    assert any("the output is weights-only" in line for line in lines), lines
    assert ("2 MoE layers" in lines[0]) == moe and ("megatron-style" in lines[0]) == (source != "hf"), lines
    weights = load_weights(tmp_path / "conv")
    assert set(weights) == set(sd), set(weights) ^ set(sd)
    fresh = build_model(cfg, vocab_size=1000).eval()
    fresh.load_state_dict(weights, strict=False)
    ids = torch.arange(48).reshape(2, 24) * 37 % 1000
    with torch.no_grad():
        expect, got = (logits_of(m(ids)) for m in (model, fresh))
    assert (got - expect).abs().max().item() <= 1e-6
    assert expect.abs().max().item() > 0.05
    if ep > 1:  # another layout's or another source's YAML, a megatron GPT: one line each
        other = {"megatron": {**MEGATRON, "vocab_size": 1000, "num_kv_heads": kv, "moe": MOE}}
        cases = {"written with tp 2 x pp 2 x ep 2, the config says tp 2 x pp 2 x ep 1":
                 _moe_yaml(tmp_path / "bad0", source, tp, pp, 1, cfg_model(config)),
                 ("a megatron-style checkpoint, the config says model_source hf" if source == "megatron" else
                  "an HF-style checkpoint, the config says model_source megatron"):
                 _moe_yaml(tmp_path / "bad1", "hf" if source == "megatron" else "megatron", tp, pp, ep,
                           {"model_config": str(tmp_path / "mixtral"), "moe": MOE} if source == "megatron"
                           else other["megatron"]),
                 "model.transformer_block_type 'post_ln'":
                 _moe_yaml(tmp_path / "bad2", "megatron", tp, pp, ep, {**other["megatron"], "transformer_block_type": "post_ln"}),
                 "model.has_bias true with model.activation swiglu":
                 _moe_yaml(tmp_path / "bad3", "megatron", tp, pp, ep, {**other["megatron"], "has_bias": True})}
        if source == "megatron":
            (tmp_path / "mixtral").mkdir()
            (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL))
        for i, (says, yaml_file) in enumerate(cases.items()):
            with pytest.raises(ConfigError) as err:
                nxd_to_nxdt(tag, tmp_path / f"out{i}", yaml_file)
            assert says in str(err.value) and "\n" not in str(err.value), (says, str(err.value))
    if source == "megatron" and kv == 8:  # the MHA rank files, read as NxDT's forward reads them
        hd, a = 8, "language_model.encoder.layers.0.self_attention."
        ranks = [(*shards[(t, 0)][a + "query_key_value.weight"].view(4, 3, hd, 64).unbind(1),
                  shards[(t, 0)][a + "dense.weight"]) for t in range(tp)]
        x = torch.randn(2, 12, 64)
        want = _attention([tuple(sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkvo")], x, hd)
        assert (_attention([(q.reshape(-1, 64), k.reshape(-1, 64), v.reshape(-1, 64), o) for q, k, v, o in ranks],
                           x, hd) - want).abs().max().item() <= 1e-6 * want.abs().max().item()  # summation order


# --------------------------------------------------------------------------- Adam's state of megatron-style and MoE
MEGATRON_SUBLAYER = ("input_layernorm", "self_attention.query_key_value", "self_attention.query",
                     "self_attention.key_value", "self_attention.core_attention", "self_attention.dense",
                     "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h", "mlp.moe.router",
                     "mlp.moe.expert_mlps")


def _megatron_order(shard: dict, traced: bool) -> dict:
    """A rank's tensors in the order NxDT's megatron GPT model holds its modules (neuronx-distributed-
    training @ 9169aa03, models/megatron: GPTModel.language_model = embedding.word_embeddings,
    encoder.layers (ParallelTransformerLayer_: input_layernorm, self_attention (query_key_value, or
    query and key_value; core_attention; dense), post_attention_layernorm, mlp (dense_h_to_4h,
    dense_4h_to_h; NeuronSwitchMLP: NxD's MoE(router, expert_mlps))), encoder.final_layernorm,
    output_layer), the order of both its local_state_dict and the optimizer's module walk. `traced`:
    a pipeline stage, whose torch.fx module copies its modules in first use: key_value before query
    (ParallelAttention.forward computes K/V first)."""
    sub = list(MEGATRON_SUBLAYER)
    if traced:
        sub[2], sub[3] = sub[3], sub[2]

    def place(key):
        m = re.fullmatch(r"language_model\.encoder\.layers\.(\d+)\.(.+)", key)
        if m:
            return 1, int(m.group(1)), next(i for i, s in enumerate(sub) if m.group(2).startswith(s))
        return {"language_model.embedding.word_embeddings.weight": 0, "language_model.embedding.position_embeddings.weight": 0,
                "language_model.encoder.final_layernorm.weight": 2, "language_model.encoder.final_layernorm.bias": 2,
                "language_model.output_layer.weight": 3}[key], 0, 0
    return dict(sorted(shard.items(), key=lambda kv: place(kv[0])))


@pytest.mark.parametrize(("source", "tp", "pp", "dp", "kv", "moe", "xser"), [
    ("megatron", 2, 2, 2, 4, False, True),  # GQA megatron Llama, the stages' traced order
    ("megatron", 2, 1, 3, 8, True, False),  # MHA megatron Mixtral, ZeRO-1 shards padded (4 experts over dp 3)
    ("hf", 2, 2, 2, 2, True, False),        # NxDT's HF Mixtral, norms in the no-decay group
    ("gpt", 2, 1, 2, 8, False, False),      # megatron GPT: the biases (NxD's LayerNorm's too) in the no-decay group
])
def test_megatron_and_moe_optimizer_state(tmp_path, source, tp, pp, dp, kv, moe, xser):
    """Adam's ZeRO-1 shards of NxDT's megatron Llama / Mixtral / GPT and HF Mixtral (without expert
    parallelism), numbered as NxDT's optimizer numbers them: the megatron model's groups are NeMo's
    get_params_for_weight_decay_optimization (NVIDIA/NeMo, nemo/collections/nlp/modules/common/
    megatron/utils.py): no-decay only for apex's norm classes and biases, and NxDT's megatron Llama
    has NxD's RMSNorm and no biases, so one group in module order (the GPT: its biases, NxD
    LayerNorm's included, second); the HF model's by name
    (do_layer_norm_weight_decay: norms second). Converted, each moment equals the one written, by
    name, bit for bit; parameters numbered in another order are refused."""
    config, cfg, model, sd = _model_case(tmp_path, source, tp, pp, 1, kv, moe)
    if source == "hf":
        config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    torch.manual_seed(5)
    optim = {f"state.{n}.{k}": torch.randn_like(t).abs() for n, t in sd.items() for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(9.0) for n in sd})
    if source == "gpt":  # tied: one parameter, listed twice (NeMo's module walk) with the same moments
        optim.update({f"state.lm_head.weight.{k}": optim[f"state.model.embed_tokens.weight.{k}"]
                      for k in ("exp_avg", "exp_avg_sq")})
    order = (lambda shard, p: _nxd_order(shard)) if source == "hf" else (lambda shard, p: _megatron_order(shard, pp > 1))
    shards = {rank: order(shard, rank[1]) for rank, shard in _nxd_shards(source, sd, tp, pp, 1, kv).items()}
    moments = {k: _nxd_shards(source, {n: optim[f"state.{n}.{k}"] for n in sd}, tp, pp, 1, kv)
               for k in ("exp_avg", "exp_avg_sq")}
    no_decay = {"megatron": [], "gpt": ["bias"], "hf": ["bias", "LayerNorm", "norm"]}[source]
    states = {rank: _zero1(shard, {k: moments[k][rank] for k in moments}, 9.0, dp, no_decay)
              for rank, shard in shards.items()}
    for state in (s for per_dp in states.values() for s in per_dp if source != "hf"):
        state["param_groups"] = [g for g in state["param_groups"] if g["params"]]  # NeMo drops empty groups
    tag = tmp_path / "ckpt" / f"{source}--step=9-consumed_samples=72.0.ckpt"
    write_nxd(tag, shards, xser, states)
    lines = nxd_to_nxdt(tag, tmp_path / "conv", config)
    assert any(f"of {len(sd)} parameters, step 9 (ZeRO-1 shards over dp {dp}); resumes at step 9, "
               "consumed_samples 72" in line for line in lines), lines
    _, got = _nxdt_state(tmp_path / "conv")
    assert set(got) == set(optim), set(got) ^ set(optim)
    for key, tensor in optim.items():
        assert torch.equal(got[key], tensor), key
    # the model file in another order than the optimizer's numbering: refused, not guessed
    first = tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    if xser:
        return
    torch.save(dict(reversed(torch.load(first, weights_only=True).items())), first)
    with pytest.raises(ConfigError) as err:
        nxd_to_nxdt(tag, tmp_path / "conv_bad", config)
    assert "in NxDT's group order" in str(err.value) and "\n" not in str(err.value), str(err.value)


def _ep_zero1(plain: dict, experts: dict) -> dict:
    """NeuronEPZero1Optimizer.state_dict() (aws-neuron/neuronx-distributed @ fbac349b, optimizer/
    zero_redundancy_optimizer.py) of one dp rank from its two ZeRO-1 states: param_groups joined
    (the experts' indices from 0 again), the experts' base_state / shape_info keys shifted past the
    others' (_get_offset: max key + 1; 1 for the wrapper's empty `state`)."""
    n = max(plain["base_state"]) + 1
    return {"ep_param_id_offset": 1, "ep_param_group_offset": len(plain["param_groups"]), "ep_base_state_offset": n,
            "ep_shape_info_offset": n, "param_groups": plain["param_groups"] + experts["param_groups"], "state": {},
            "base_state": {**plain["base_state"], **{n + k: v for k, v in experts["base_state"].items()}},
            "shape_info": {**plain["shape_info"], **{n + k: v for k, v in experts["shape_info"].items()}}}


def _ep_states(shards: dict, moments: dict, step: float, dp: int, ep: int, no_decay: list[str], drop_empty: bool) -> dict:
    """Per (tp, pp) rank each dp rank's NeuronEPZero1Optimizer state: dp rank d holds the non-expert
    parameters' ZeRO-1 shard d of dp and ep rank d % ep's experts' shard d // ep of dp / ep
    (`shards`, `moments[k]`: per (ep, tp, pp) rank); `drop_empty`: NeMo's groups (megatron-style)."""
    def half(rank, experts: bool, ranks: int, r: int) -> dict:
        names = [n for n in shards[rank] if ("expert_mlps" in n) == experts]
        state = _zero1({n: shards[rank][n] for n in names}, {k: moments[k][rank] for k in moments}, step, ranks,
                       no_decay)[r]
        if drop_empty:
            state["param_groups"] = [g for g in state["param_groups"] if g["params"]]
        return state
    return {(t, p): [_ep_zero1(half((0, t, p), False, dp, d), half((d % ep, t, p), True, dp // ep, d // ep))
                     for d in range(dp)] for (_, t, p) in shards if _ == 0}


@pytest.mark.parametrize(("source", "tp", "pp", "dp", "kv", "xser"), [
    ("hf", 2, 1, 4, 2, False),       # NxDT's HF Mixtral, tp 2 x dp 4 x ep 2: the experts over 2 edp ranks
    ("megatron", 2, 2, 2, 4, True),  # megatron Mixtral, tp 2 x pp 2 x dp 2 x ep 2 (edp 1), xser
])
def test_expert_parallel_optimizer_state(tmp_path, source, tp, pp, dp, kv, xser):
    """Adam's state of an ep 2 MoE run as NxD writes it: ZeRO-1 is NeuronEPZero1Optimizer (trainer.py
    initialize_parallel_optimizer), one file per dp rank (`dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt`, no ep
    rank: checkpoint.py _get_path with dp), holding the non-expert parameters' ZeRO-1 state over dp and
    its ep rank's experts' over the expert-data-parallel ranks; dp rank d is ep rank d % ep, edp
    rank d // ep (parallel_state.py initialize_model_parallel / ascending_ring_PG_group: ranks as
    [pp, dp, tp] and [pp, edp, ep, tp]). Converted, every moment equals the one written, by name,
    bit for bit; dp not a multiple of ep and NxD's Trn2 ring layout are refused in one line."""
    ep = 2
    config, cfg, model, sd = _model_case(tmp_path, source, tp, pp, ep, kv, True)
    if source == "hf":
        config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    torch.manual_seed(6)
    optim = {f"state.{n}.{k}": torch.randn_like(t).abs() for n, t in sd.items() for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(11.0) for n in sd})
    order = (lambda shard, p: _nxd_order(shard)) if source == "hf" else (lambda shard, p: _megatron_order(shard, pp > 1))
    shards = {rank: order(shard, rank[2]) for rank, shard in _nxd_shards(source, sd, tp, pp, ep, kv).items()}
    moments = {k: _nxd_shards(source, {n: optim[f"state.{n}.{k}"] for n in sd}, tp, pp, ep, kv)
               for k in ("exp_avg", "exp_avg_sq")}
    no_decay = {"megatron": [], "hf": ["bias", "LayerNorm", "norm"]}[source]
    states = _ep_states(shards, moments, 11.0, dp, ep, no_decay, source != "hf")
    tag = tmp_path / "ckpt" / f"{source}--step=11-consumed_samples=88.0.ckpt"
    write_nxd(tag, shards, xser, states)
    lines = nxd_to_nxdt(tag, tmp_path / "conv", config)
    assert any(f"of {len(sd)} parameters, step 11 (ZeRO-1 shards over dp {dp}, the experts' over ep 2 x "
               f"expert-data-parallel {dp // ep}); resumes at step 11" in line for line in lines), lines
    _, got = _nxdt_state(tmp_path / "conv")
    assert set(got) == set(optim), set(got) ^ set(optim)
    for key, tensor in optim.items():
        assert torch.equal(got[key], tensor), key
    if source != "hf":
        return
    # a dp rank's file missing: named
    (tag / "optim" / "dp_rank_03_tp_rank_00_pp_rank_00.pt").unlink()
    with pytest.raises(ConfigError) as err:
        nxd_to_nxdt(tag, tmp_path / "conv_bad", config)
    assert "dp_rank_03_tp_rank_00_pp_rank_00.pt is missing" in str(err.value), str(err.value)
    for args, says in (((2, 64, 128, 1, 1), "the instance type (Trn1 or Trn2) is unknown"),
                       ((2, 32, 128, None, 1), "give trainer.lnc (1 or 2)"),
                       ((2, 32, 64, 2, 1), "NxD's Trn2 ring layout (LOGIC2)"),
                       ((2, 8, 64, None, 2), "context_parallel_size 2 with ep 2")):
        with pytest.raises(ConfigError) as err:
            check_ep_layout(*args, tag)
        assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    check_ep_layout(2, 32, 32, None, 1, tag)  # tp 32 over 32 ranks: the default layout whatever the lnc
    check_ep_layout(2, 64, 128, 2, 1, tag)


def _megatron_nxd_with_optimizer(tag, weights: dict, optim: dict, c: dict, tp: int, pp: int, dp: int) -> None:
    """NxDT's megatron-style checkpoint (torch.save) of nxdt's `weights` and Adam state `optim`: the
    rank files in a traced stage's module order, ZeRO-1 over dp `dp`, one parameter group (NeMo's
    rule for a model with NxD's RMSNorm and no biases; empty groups dropped)."""
    kv = c["num_kv_heads"]
    shards = {rank: _megatron_order(s, pp > 1) for rank, s in _nxd_shards("megatron", weights, tp, pp, 1, kv, c).items()}
    moments = {k: _nxd_shards("megatron", {n: optim[f"state.{n}.{k}"] for n in weights}, tp, pp, 1, kv, c)
               for k in ("exp_avg", "exp_avg_sq")}
    step = float(next(v for k, v in optim.items() if k.endswith(".step")))
    states = {rank: _zero1(shard, {k: moments[k][rank] for k in moments}, step, dp, []) for rank, shard in shards.items()}
    for state in (s for per_dp in states.values() for s in per_dp):
        state["param_groups"] = [g for g in state["param_groups"] if g["params"]]
    write_nxd(tag, shards, False, states)


def test_megatron_optimizer_state_resumes_the_run(tmp_path, kjv_prefix):
    """nxdt's own megatron-style run (tiny_llama_cpu) at step 2, written as NxDT's megatron Llama
    would have saved it (tp 2 x pp 2, ZeRO-1 over dp 2): converted with the run's YAML, a resume
    prints the "resuming from" line a native resume prints and logs the uninterrupted run's losses
    at steps 3 and 4 within 1e-6; the same checkpoint with Adam's moments zeroed misses step 4's."""
    run = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=4",
           "model.optim.sched.warmup_steps=2", f"data.data_prefix=[1.0,{kjv_prefix}]"]
    weights, optim, want = _reference_run(tmp_path, run)
    c = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2}
    got = {}
    for name, moments in (("conv", optim), ("conv0", {k: torch.zeros_like(v) if "exp_avg" in k else v
                                                      for k, v in optim.items()})):
        tag = tmp_path / name / "megatron_llama--step=2-consumed_samples=16.0.ckpt"
        _megatron_nxd_with_optimizer(tag, weights, moments, c, tp=2, pp=2, dp=2)
        assert convert_main(["nxd-to-nxdt", "--input", str(tag), "--output", str(tmp_path / f"{name}_ckpt"),
                             "--config", str(REPO / "conf" / "tiny_llama_cpu.yaml"), *TINY_OVERRIDES,
                             "distributed_strategy.tensor_model_parallel_size=2",
                             "distributed_strategy.pipeline_model_parallel_size=2"]) == 0
        got[name] = _resumed_losses(tmp_path, run, name, tmp_path / f"{name}_ckpt")
    _, converted = _nxdt_state(tmp_path / "conv_ckpt")
    assert set(converted) == set(optim) and all(torch.equal(converted[k], v) for k, v in optim.items())
    _assert_the_moments_carry_step_4(got, want)


def test_expert_parallel_optimizer_state_resumes_the_run(tmp_path, kjv_prefix):
    """nxdt's own megatron Mixtral run (tiny_llama_cpu with 4 experts, top 2) at step 2, written as
    NxDT would have saved it at tp 2 x pp 2 x dp 2 x ep 2 (NeuronEPZero1Optimizer): converted, a
    resume logs the uninterrupted run's losses at steps 3 and 4 within 1e-6; with the experts'
    moments zeroed, step 4's is missed."""
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2"]
    run = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, *moe, "trainer.devices=1", "trainer.max_steps=4",
           "model.optim.sched.warmup_steps=2", f"data.data_prefix=[1.0,{kjv_prefix}]"]
    weights, optim, want = _reference_run(tmp_path, run)
    c = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2}
    shards = {r: _megatron_order(s, True) for r, s in _nxd_shards("megatron", weights, 2, 2, 2, 2, c).items()}
    step = float(next(v for k, v in optim.items() if k.endswith(".step")))
    got = {}
    for name, zero in (("conv", False), ("conv0", True)):
        moments = {k: _nxd_shards("megatron", {n: optim[f"state.{n}.{k}"] * (0 if zero and ".experts." in n else 1)
                                               for n in weights}, 2, 2, 2, 2, c) for k in ("exp_avg", "exp_avg_sq")}
        tag = tmp_path / name / "megatron_mixtral--step=2-consumed_samples=16.0.ckpt"
        write_nxd(tag, shards, False, _ep_states(shards, moments, step, 2, 2, [], True))
        assert convert_main(["nxd-to-nxdt", "--input", str(tag), "--output", str(tmp_path / f"{name}_ckpt"),
                             "--config", str(REPO / "conf" / "tiny_llama_cpu.yaml"), *TINY_OVERRIDES, *moe,
                             "distributed_strategy.tensor_model_parallel_size=2",
                             "distributed_strategy.pipeline_model_parallel_size=2",
                             "distributed_strategy.expert_model_parallel_size=2"]) == 0
        got[name] = _resumed_losses(tmp_path, run, name, tmp_path / f"{name}_ckpt")
    _assert_the_moments_carry_step_4(got, want)
