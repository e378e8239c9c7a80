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
import sys
import types

import pytest
import torch
import yaml
from conftest import TINY_OVERRIDES, read_scalars, train_in_process
from transformers import LlamaConfig, LlamaForCausalLM

from nxdt.checkpoint.checkpointer import load_weights
from nxdt.config.errors import ConfigError
from nxdt.tools.convert import main as convert_main
from nxdt.tools.convert import hf_to_nxdt
from nxdt.tools.convert_nxd import nxd_to_nxdt

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


def _shard(sd: dict, tp: int, pp: int, mult: int, trn2: bool, qkv: str = "fused") -> dict[tuple[int, int], dict]:
    """NxD's rank files. qkv: fused (GQAQKVColumnParallelLinear with fuse_qkv: `qkv_proj.weight_qkv`),
    split (without fuse_qkv: `qkv_proj.weight_q/_k/_v`), separate (qkv_linear false: q_proj/k_proj/v_proj)."""
    c = HF
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
            s[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(sd[p + "mlp.gate_proj.weight"]),
                                                          rows(sd[p + "mlp.up_proj.weight"])], dim=0)
            s[p + "mlp.down_proj.weight"] = rows(sd[p + "mlp.down_proj.weight"], 1)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                s[p + n] = sd[p + n].clone()
            s[a + "rotary_emb.inv_freq"] = torch.ones(hd // 2)  # an old persistent buffer: dropped
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


def write_nxd(tag, shards: dict, xser: bool) -> None:
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    for (t, p), sd in shards.items():
        path = tag / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
        torch.save({"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"params": [0]}]},
                   tag / "optim" / path.name)
        if not xser:
            torch.save(sd, path)
            continue
        folder = path.with_name(path.name + ".tensors")  # torch_xla.utils.serialization.save / NxD's _xser_save_data
        folder.mkdir()
        with _torch_xla_reference() as ref:
            refs = {}
            for i, (key, tensor) in enumerate(sd.items()):
                torch.save(tensor, folder / f"tensor_{i}.pt")
                refs[key] = ref(i)
            torch.save(refs, path)
        torch.save({i: {"dtype": tensor.dtype, "shape": tensor.shape, "expert_model_parallel": False}
                    for i, tensor in enumerate(sd.values())}, path.with_name(path.name + ".info.pt"))
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
    assert f"tp {tp} x pp {pp}, {'xser' if xser else 'torch.save'}" in said and "optimizer state not carried" in said
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
