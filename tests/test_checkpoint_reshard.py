"""Resharding: a checkpoint saved with one parallel layout continues in another.

Every run has the same model, init, data and global batch (8 samples), so every layout's
per-step `reduced_train_loss` equals the one uninterrupted reference run within 1e-5
(tests/test_parallel_layouts.py). The model has one K/V head for four query heads, so every
tp2 layout replicates the K/V projections (tp > num_kv_heads). The runs form chains: each
resume run loads a checkpoint of the previous one and writes its own checkpoints (every step)
for the next; these runs cover these changes:

    reference  pp2 x vpp2, from scratch, 6 steps
    ├─ @1 → pp2 x vpp2      plain resume, same layout
    │   └─ @2 → pp2         vpp2 → vpp1 (stages regrouped; same world size: RNG re-seeded)
    ├─ @1 → HSDP 2x2        4 ranks, dp 1 → 4 (replicate 2 x shard 2); saves bf16 + fp32 masters
    │   └─ @2 → pp2 x ZeRO-1 dp2       4 ranks: pp, dp and sharding change at once; loads the masters
    │       └─ @3 → pp1     pp2 + ZeRO-1 dp2 → one process
    └─ @1 → zero1 dp2       dp1 → dp2 (data-loader state dropped, continues from consumed_samples)
        ├─ @2 → fsdp dp2    zero1 dp2 → fsdp dp2
        ├─ @2 → zero1 dp2   plain ZeRO-1 resume
        └─ @2 → tp2         tp1 dp2 → tp2 dp1 (K/V replicated)
            └─ @3 → tp1     tp2 (K/V replicated) → tp1, one process; keeps the best
                            checkpoint by reduced_train_loss (mode max) and the newest
    neox_tp2_sp   GPT-NeoX blocks (2 layers), tp2 + sequence parallel, from scratch (its own reference)
    └─ @3 → pp2             tp-sharded weights and biases into two stages, then
        └─ @4 → pp1         one process
    moe_ep2    MoE (4 experts), expert parallel ep2 dp2, from scratch (its own reference)
    ├─ @2 → ep1             the experts whole on both ranks, then
    │   └─ @4 → ep2         sharded again
    └─ @2 → dense config    refused: one line naming a key, exit 2
    nxd        a checkpoint NxDT wrote (NxD's layout: HF-style Llama, tp 2 x pp 2, ZeRO-1 Adam shards over
    │          dp 2; tests/test_convert_nxd.py), converted by `nxdt convert nxd-to-nxdt` at step 2
    ├─ @2 → zero1 dp2       2 ranks, then
    └─ @2 → one process     the same steps 3 and 4 within 1e-5 (not the reference's: another model)

Runs of one world size share one launch (conftest.run_pool: imports paid once), so the
runs take three launches: the 2-rank runs, then the 4-rank runs, then the single-process ones.
Each resumed run's losses (steps after the checkpoint, to step 6) are compared with the
reference's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_OVERRIDES, read_scalars, run_pool, tensor_bytes
from test_convert_nxd import HF, _nxd_with_optimizer, _yaml
from test_parallel_layouts import NEOX
from transformers import LlamaConfig, LlamaForCausalLM

from nxdt.tools.convert_nxd import nxd_to_nxdt

STEPS = 6
TOL = 1e-5
PP2 = ["distributed_strategy.pipeline_model_parallel_size=2"]
VPP2 = [*PP2, "distributed_strategy.virtual_pipeline_model_parallel_size=2"]
HSDP = ["distributed_strategy.sharding_strategy=HSDP", "distributed_strategy.hsdp_replicate_size=2",
        "exp_manager.save_bf16=true", "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=true"]
PP2_ZERO1 = [*PP2, "distributed_strategy.zero1=true"]
TP2 = ["distributed_strategy.tensor_model_parallel_size=2"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.output_router_logits=true",
       "model.moe.router_aux_loss_coef=0.1", "model.moe.capacity_factor=1.5"]
EP2 = ["distributed_strategy.expert_model_parallel_size=2"]
NXD = ["model_source=hf", "model.model_config=NXD_CONFIG", "model.num_layers=2", "trainer.max_steps=4"]
NEOX2 = [*NEOX, "model.num_layers=2"]  # multi-head attention (num_kv_heads = heads), two layers
# keeps the checkpoint with the highest loss (mode max, so that an older checkpoint outranks newer
# ones) and the newest
TOP1_BY_LOSS = ["exp_manager.checkpoint_callback_params.monitor=reduced_train_loss",
                "exp_manager.checkpoint_callback_params.mode=max",
                "exp_manager.checkpoint_callback_params.save_top_k=1",
                "exp_manager.checkpoint_callback_params.save_last=true",
                "exp_manager.checkpoint_callback_params.filename='tiny_llama--{step}-{reduced_train_loss:.4f}'"]
pytestmark = pytest.mark.slow


def _args(prefix: str, log_dir: Path, devices: int, extra=()) -> list[str]:
    overrides = [
        *TINY_OVERRIDES,
        "model.num_layers=4",  # pp2 x vpp2: four stages of one layer
        "model.num_kv_heads=1",  # tp2 > num_kv_heads: K/V projections replicated
        f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
        "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=2",
        "model.optim.sched.max_steps=8",  # the learning-rate schedule of an eight-step run
        f"data.data_prefix=[1.0,{prefix}]",
        f"exp_manager.explicit_log_dir={log_dir}",
        "exp_manager.create_checkpoint_callback=true",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=1",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
        *extra,
    ]
    last = {o.split("=", 1)[0]: o for o in overrides}  # a later override of a key replaces the earlier one
    return ["--config-name", "tiny_llama_cpu", *last.values()]


def _ckpt(log_dir: Path, step: int) -> Path:
    return Path(log_dir) / "checkpoints" / f"tiny_llama--step={step}-consumed_samples={8.0 * step}"


class Run:
    def __init__(self, log_dir: Path, proc) -> None:
        self.log_dir = log_dir
        self.proc = proc
        self.losses = read_scalars(log_dir).get("reduced_train_loss", {})
        log = Path(log_dir) / "nxdt_log_globalrank-0_localrank-0.txt"
        self.log = (log.read_text() if log.is_file() else "") + proc.stdout + proc.stderr
        self.stdout = proc.stdout

    def ckpt(self, step: int) -> Path:
        return _ckpt(self.log_dir, step)


def _assert_continues(reference: Run, run: Run, from_step: int, label: str) -> None:
    assert sorted(run.losses) == list(range(from_step + 1, STEPS + 1)), (label, run.losses)
    gap = max(abs(run.losses[s] - reference.losses[s]) for s in run.losses)
    assert gap < TOL, f"{label}: max loss gap {gap:.2e}\n{reference.losses}\n{run.losses}"
    print(f"{label}: steps {from_step + 1}..{STEPS}, max loss gap {gap:.2e}")


# ----------------------------------------------------------------------------- the runs (chained)
# name: (ranks, overrides, resumes from (run, step) or None). Runs of one world size share a launch
# (conftest.run_pool), in this order: every run's source is in an earlier launch or earlier in its own.
RUNS = {
    "reference": (2, VPP2, None),
    "vpp_resumed": (2, VPP2, ("reference", 1)),
    "pp2": (2, PP2, ("vpp_resumed", 2)),
    "zero1": (2, ["distributed_strategy.zero1=true"], ("reference", 1)),
    "fsdp_from_zero1": (2, ["distributed_strategy.sharding_strategy=FSDP"], ("zero1", 2)),
    "zero1_from_zero1": (2, ["distributed_strategy.zero1=true"], ("zero1", 2)),
    "tp2": (2, TP2, ("zero1", 2)),
    "hsdp": (4, HSDP, ("reference", 1)),
    "pp2_zero1": (4, PP2_ZERO1, ("hsdp", 2)),
    "pp1": (1, [], ("pp2_zero1", 3)),
    "tp1": (1, TOP1_BY_LOSS, ("tp2", 3)),
    # MoE: expert parallel ep2 → ep1 (same 2 ranks, experts whole on each) → ep2 again
    "moe_ep2": (2, [*MOE, *EP2], None),
    "moe_ep1": (2, MOE, ("moe_ep2", 2)),
    "moe_ep2_again": (2, [*MOE, *EP2], ("moe_ep1", 4)),
    # GPT-NeoX: tp2 + sp → pp2 → one process
    "neox_tp2_sp": (2, [*NEOX2, *TP2, "distributed_strategy.sequence_parallel=true"], None),
    "neox_pp2": (2, [*NEOX2, *PP2], ("neox_tp2_sp", 3)),
    "neox_pp1": (1, NEOX2, ("neox_pp2", 4)),
    # bad input: an MoE checkpoint into the dense config, one line and exit 2
    "dense_from_moe": (1, [], ("moe_ep2", 2)),
    # NxDT's checkpoint, converted (`_nxd_converted`): resumed on 2 ranks and in one process
    "nxd_zero1_dp2": (2, [*NXD, "distributed_strategy.zero1=true"], ("nxd", 2)),
    "nxd_one_process": (1, NXD, ("nxd", 2)),
}
EXPECTED_RC = {"dense_from_moe": 2}


@pytest.fixture(scope="module")
def runs(kjv_prefix, tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("reshard")
    nxd = _nxd_converted(root / "nxd")

    def source(resume):
        return nxd if resume[0] == "nxd" else _ckpt(root / resume[0], resume[1])
    out: dict[str, Run] = {}
    for nproc in (2, 4, 1):
        argvs = {}
        for name, (ranks, extra, resume) in RUNS.items():
            if ranks == nproc:
                extra = [e.replace("NXD_CONFIG", str(root / "nxd" / "hf" / "config.json")) for e in extra]
                if resume is not None:
                    # quoted: the checkpoint's name contains '=' (step=..., consumed_samples=...)
                    extra = [*extra, f"exp_manager.resume_from_checkpoint='{source(resume)}'"]
                argvs[name] = _args(kjv_prefix, root / name, nproc, extra)
        for name, proc in run_pool(argvs, nproc, root / f"pool{nproc}", EXPECTED_RC, freeze=True).items():
            out[name] = Run(root / name, proc)
            if RUNS[name][2] is not None and name not in EXPECTED_RC and RUNS[name][2][0] != "nxd":
                assert f"resuming from {source(RUNS[name][2])} (step {RUNS[name][2][1]}" in proc.stdout, name
    return out


def _nxd_converted(root: Path) -> Path:
    """A random tiny Llama with random Adam moments at step 2, written as NxDT writes it (NxD's
    layout: tp 2 x pp 2, ZeRO-1 shards over dp 2; tests/test_convert_nxd.py) and converted in-process."""
    torch.manual_seed(5)
    weights = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"})).state_dict()
    optim = {f"state.{n}.{k}": torch.randn_like(t).abs() * 1e-4 for n, t in weights.items()
             for k in ("exp_avg", "exp_avg_sq")}
    optim.update({f"state.{n}.step": torch.tensor(2.0) for n in weights})
    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text(json.dumps(HF))
    tag = root / "hf_llama--step=2-consumed_samples=16.0.ckpt"
    _nxd_with_optimizer(tag, weights, optim, dp=2, xser=False)
    config = _yaml(root, 2, 2, None)
    config.write_text(config.read_text().replace("qkv_linear: true", "qkv_linear: true\n  do_layer_norm_weight_decay: true"))
    nxd_to_nxdt(tag, root / "converted", config)
    return root / "converted"


@pytest.fixture(scope="module")
def reference(runs) -> Run:
    return runs["reference"]


# ----------------------------------------------------------------------------- the cases
def test_pipeline_checkpoint_names_the_whole_model(reference):
    """A pp2 x vpp2 checkpoint uses the whole model's names (no `<k>.` stage prefix) and lists
    every tensor, though each rank holds only its own stages."""
    meta = json.loads((reference.ckpt(1) / "meta.json").read_text())
    shapes = meta["model_shapes"]
    assert meta["layout"] == {"dp": 1, "tp": 1, "pp": 2, "vpp": 2, "cp": 1, "ep": 1}
    assert "model.model.embed_tokens.weight" in shapes and "model.lm_head.weight" in shapes
    assert {k.split(".")[3] for k in shapes if k.startswith("model.model.layers.")} == {"0", "1", "2", "3"}
    assert not any(k.startswith("model.0.") or k.startswith("model.1.") for k in shapes)
    scalars = {}
    for rank in (0, 1):
        scalars.update(json.loads((reference.ckpt(1) / f"rank_{rank:05d}.json").read_text())["scalars"])
    assert "optim0.param_groups.model.layers.3.mlp.up_proj.weight.lr" in scalars


def test_pp2_vpp2_resume_same_layout(reference, runs):
    vpp_resumed = runs["vpp_resumed"]
    _assert_continues(reference, vpp_resumed, 1, "pp2 x vpp2 -> pp2 x vpp2")
    assert "resharded" not in vpp_resumed.log and "consumed_samples" not in _warnings(vpp_resumed)


def test_pp2_vpp2_to_pp2(reference, runs):
    pp2 = runs["pp2"]
    _assert_continues(reference, pp2, 2, "pp2 x vpp2 -> pp2")
    # same world size, another layout: one line; every rank re-seeded alike, data-loader state kept
    assert _notes(pp2, "tensors resharded") == [
        "note: checkpoint saved on 2 ranks (dp=1 tp=1 pp=2 vpp=2 cp=1), loading on 2 (dp=1 tp=1 pp=2 vpp=1 cp=1): "
        "tensors resharded; per-rank RNG states are not restored (every rank re-seeded from seed 1234 and step 2); "
        "data-loader state kept (same dp size)"]


def test_pp2_vpp2_to_hsdp_with_bf16_and_master_weights(reference, runs):
    hsdp = runs["hsdp"]
    _assert_continues(reference, hsdp, 1, "pp2 x vpp2 dp1 -> HSDP 2x2")
    notes = _notes(hsdp, "tensors resharded")
    assert len(notes) == 1 and "(dp=1 -> dp=4): data continues from consumed_samples" in notes[0], notes
    # save_bf16 + use_master_weights_in_ckpt: model tensors in half the bytes, the fp32 masters beside them
    ref, saved = tensor_bytes(reference.ckpt(2)), tensor_bytes(hsdp.ckpt(2))
    meta = json.loads((hsdp.ckpt(2) / "meta.json").read_text())
    n = sum(math.prod(shape) for shape in meta["model_shapes"].values())  # 1,225,280 parameters
    assert (saved["model."], saved["master."], ref["model."], ref["master."]) == (2 * n, 4 * n, 4 * n, 0), (ref, saved)
    assert saved["optim0."] == ref["optim0."]  # optimizer state keeps fp32
    assert meta["layout"]["dp"] == 4 and meta["save_bf16"] and meta["master_weights"]
    print(f"HSDP checkpoint: model tensors {saved['model.']:,} B (bf16) vs {ref['model.']:,} B (fp32)")


def test_hsdp_to_pp2_zero1(reference, runs):
    """pp, dp and sharding change at once; the fp32 master weights go into the model."""
    pp2_zero1 = runs["pp2_zero1"]
    _assert_continues(reference, pp2_zero1, 2, "HSDP 2x2 -> pp2 x zero1 dp2")
    assert "(dp=4 -> dp=2)" in _notes(pp2_zero1, "tensors resharded")[0]
    assert "not an exact resume" not in pp2_zero1.log


def test_pp2_zero1_to_pp1(reference, runs):
    pp1 = runs["pp1"]
    _assert_continues(reference, pp1, 3, "pp2 x zero1 dp2 -> pp1 dp1")
    assert "(dp=2 -> dp=1)" in _notes(pp1, "tensors resharded")[0]


def test_tp1_to_tp2(reference, runs):
    tp2 = runs["tp2"]
    _assert_continues(reference, tp2, 2, "zero1 tp1 dp2 -> tp2 dp1 (K/V replicated)")
    assert "(dp=2 -> dp=1)" in _notes(tp2, "tensors resharded")[0]
    # replicated K/V projections keep the model's names and shapes: one head of 16 for 4 query heads
    shapes = json.loads((tp2.ckpt(3) / "meta.json").read_text())["model_shapes"]
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == [16, 64]
    assert shapes["model.model.layers.0.self_attn.q_proj.weight"] == [64, 64]


def test_tp2_to_tp1(reference, runs):
    tp1 = runs["tp1"]
    _assert_continues(reference, tp1, 3, "tp2 (K/V replicated) -> tp1")


def test_top_k_by_monitored_metric(runs):
    """monitor reduced_train_loss, mode max, save_top_k 1, save_last: the run saved steps 4, 5, 6;
    checkpoint s is scored with the loss of training step s (TensorBoard step s too) and named
    with it; the highest-scoring one survives, and the newest (6) whatever its score."""
    tp1 = runs["tp1"]
    loss = {s: tp1.losses[s] for s in (4, 5, 6)}
    best = max(loss, key=lambda s: (loss[s], s))
    keep = sorted({6, best})
    assert best == 4 and keep == [4, 6], loss  # the loss falls: step 5 is neither best nor newest
    ckpts = Path(tp1.log_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        [f"tiny_llama--step={s}-reduced_train_loss={loss[s]:.4f}" for s in keep] + ["last"]), loss
    assert (ckpts / "last").resolve().name.startswith("tiny_llama--step=6-")
    for s in keep:
        score = json.loads((ckpts / f"tiny_llama--step={s}-reduced_train_loss={loss[s]:.4f}" / "monitor.json").read_text())
        assert score["monitor"] == "reduced_train_loss" and math.isclose(score["value"], loss[s], rel_tol=1e-6)
    print(f"top-1 by reduced_train_loss (max) of steps 4-6 {loss}: kept {keep}")


def test_dp1_to_zero1_dp2_drops_data_state_in_one_line(reference, runs):
    zero1 = runs["zero1"]
    _assert_continues(reference, zero1, 1, "pp2 x vpp2 dp1 -> zero1 dp2")
    lines = [line for line in zero1.stdout.splitlines() if "data continues from consumed_samples" in line]
    assert len(lines) == 1 and "(dp=1 -> dp=2)" in lines[0], lines


def test_zero1_dp2_to_fsdp_dp2(reference, runs):
    fsdp_from_zero1 = runs["fsdp_from_zero1"]
    _assert_continues(reference, fsdp_from_zero1, 2, "zero1 dp2 -> fsdp dp2")


def test_zero1_dp2_resume(reference, runs):
    zero1_from_zero1 = runs["zero1_from_zero1"]
    _assert_continues(reference, zero1_from_zero1, 2, "zero1 dp2 -> zero1 dp2")
    assert "resharded" not in zero1_from_zero1.log


def test_moe_ep2_to_ep1_and_back(runs):
    """Expert-sharded weights and optimizer state reshard between ep sizes: the losses continue the
    uninterrupted ep2 run's within 1e-5, and each change says so in one line."""
    ep2, ep1, again = runs["moe_ep2"], runs["moe_ep1"], runs["moe_ep2_again"]
    _assert_continues(ep2, ep1, 2, "MoE ep2 -> ep1")
    _assert_continues(ep2, again, 4, "MoE ep1 -> ep2")
    assert "(dp=2 tp=1 pp=1 vpp=1 cp=1 ep=2), loading on 2 (dp=2 tp=1 pp=1 vpp=1 cp=1)" in _notes(ep1, "resharded")[0]
    assert "loading on 2 (dp=2 tp=1 pp=1 vpp=1 cp=1 ep=2)" in _notes(again, "resharded")[0]
    shapes = json.loads((ep2.ckpt(2) / "meta.json").read_text())["model_shapes"]
    assert shapes["model.model.layers.0.mlp.experts.gate_up_proj"] == [4, 352, 64]  # whole, not a shard


def test_neox_tp2_sp_to_pp2_to_one_process(runs):
    """GPT-NeoX blocks: a tp2 + sp checkpoint (column-sharded biases, two norms per block) continues
    in two pipeline stages, and their checkpoint in one process, on the uninterrupted curve."""
    ref, pp2, pp1 = runs["neox_tp2_sp"], runs["neox_pp2"], runs["neox_pp1"]
    _assert_continues(ref, pp2, 3, "NeoX tp2 + sp -> pp2")
    _assert_continues(ref, pp1, 4, "NeoX pp2 -> pp1")
    assert "loading on 2 (dp=1 tp=1 pp=2 vpp=1 cp=1)" in _notes(pp2, "tensors resharded")[0]
    assert "saved on 2 ranks (dp=1 tp=1 pp=2 vpp=1 cp=1)" in _notes(pp1, "tensors resharded")[0]
    # whole tensors under the model's names, whichever layout wrote them
    for run, step in ((ref, 3), (pp2, 4)):
        shapes = json.loads((run.ckpt(step) / "meta.json").read_text())["model_shapes"]
        block = {k.split("layers.0.")[1]: v for k, v in shapes.items() if k.startswith("model.model.layers.0.")}
        assert block["mlp.up_proj.bias"] == [176] and block["self_attn.k_proj.weight"] == [64, 64], block
        assert block["input_layernorm.bias"] == block["post_attention_layernorm.weight"] == [64], block
        assert len(block) == 16 and "mlp.gate_proj.weight" not in block, sorted(block)  # 6 linears + 2 norms


def test_converted_nxd_checkpoint_resumes_on_two_ranks(runs):
    """NxDT's checkpoint converted by `nxdt convert nxd-to-nxdt` (Adam's state included) resumes on
    2 ranks (ZeRO-1 dp 2) with the losses of a one-process resume of it within 1e-5: step 3 (the
    converted weights) and step 4 (the converted moments and lr too)."""
    two, one = runs["nxd_zero1_dp2"], runs["nxd_one_process"]
    assert sorted(two.losses) == sorted(one.losses) == [3, 4], (two.losses, one.losses)
    gap = max(abs(two.losses[s] - one.losses[s]) for s in (3, 4))
    assert gap < TOL, (two.losses, one.losses)
    assert abs(one.losses[4] - one.losses[3]) > 1e-4  # a step that moved the model
    print(f"converted NxDT checkpoint: zero1 dp2 vs one process, steps 3..4, max loss gap {gap:.2e}")


def test_moe_checkpoint_into_dense_config_is_refused(runs):
    proc = runs["dense_from_moe"].proc
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "the checkpoint has no key 'model.layers.0.mlp.down_proj.weight' (12 missing, 12 unexpected" in errors[0], errors
    assert "the checkpoint has MoE layers (4 experts) and the config is dense" in errors[0], errors
    assert not (runs["dense_from_moe"].log_dir / "checkpoints").exists()


def _notes(run: Run, text: str) -> list[str]:
    return [line for line in run.stdout.splitlines() if line.startswith("note:") and text in line]


def _warnings(run: Run) -> str:
    return "\n".join(line for line in run.log.splitlines() if "Warning" in line)
