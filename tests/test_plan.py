"""`nxdt plan`: exact parameter counts of the shipped configs, the JSON shape, and the memory
estimate against tensor bytes measured in real training steps."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from nxdt.tools.plan import format_plan
from nxdt.tools.plan import main as plan_main
from nxdt.planner.estimate import Bytes, rank_memory

CONF = str(REPO / "conf")

# interface.md §9
EXPECTED = {
    "megatron_llama_7B_config": 6_738_415_616,
    "megatron_llama_70b_config": 68_976_648_192,
    "hf_llama3_8B_config": 8_030_261_248,
    "hf_llama3.1_8B_config": 8_030_261_248,
    "hf_llama3_70B_config": 70_553_706_496,
}


def _plan(capsys, name: str, *overrides: str) -> dict:
    assert plan_main(["--config-path", CONF, "--config-name", name, *overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_counts_match_the_reference(capsys, name):
    p = _plan(capsys, name)
    assert p["parameters"] == EXPECTED[name]
    for key in ("parameters", "parameters_per_rank", "memory_per_rank_bytes", "tokens_per_step", "layout"):
        assert key in p
    assert set(p["memory_per_rank_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert set(p["layout"]) >= {"dp", "tp", "pp", "cp"}
    lay = p["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == p["world_size"]
    if lay["pp"] > 1:  # the stages hold every parameter once
        assert sum(p["parameters_per_stage"]) == p["parameters"]
    assert p["parameters_per_rank"] < p["parameters"]


def test_hf_70b_per_rank_split(capsys):
    """Llama-3-70B at tp 32 x pp 8, mixed precision, ZeRO-1 over dp 2."""
    p = _plan(capsys, "hf_llama3_70B_config")
    assert p["layout"] == {**p["layout"], "dp": 2, "tp": 32, "pp": 8, "cp": 1}
    n = p["parameters_per_rank"]
    mem = p["memory_per_rank_bytes"]
    assert mem["params"] == 2 * n and mem["grads"] == 4 * n  # bf16 weights, fp32 grads
    assert mem["optimizer"] == -(-(12 * n) // 2)  # fp32 master + 2 Adam states, / dp (zero1)
    assert p["tokens_per_step"] == 1024 * 8192


def test_fsdp_flag_shards_over_dp_and_cp(capsys):
    """fms-fsdp's `fsdp: true` means full sharding (not replication), and with context parallel
    FSDP shards over dp × cp: per-rank parameters are the tp shard / (dp × cp)."""
    base = ["trainer.devices=8", "distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.zero1=false"]
    tp_only = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=false",
                    "data.global_batch_size=1024")
    fsdp = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=true")
    assert fsdp["layout"]["dp_replicate"] == 1 and fsdp["layout"]["dp_shard"] == 4
    assert fsdp["parameters_per_rank"] == pytest.approx(tp_only["parameters_per_rank"] / 4, abs=1000)
    cp = _plan(capsys, "megatron_llama_7B_config", *base, "distributed_strategy.fsdp=true",
               "distributed_strategy.context_parallel_size=2")
    assert cp["layout"]["cp"] == 2 and cp["layout"]["dp_shard"] == 2
    assert cp["parameters_per_rank"] == pytest.approx(tp_only["parameters_per_rank"] / 4, abs=1000)


def test_every_shipped_config_plans(capsys):
    for path in sorted((REPO / "conf").glob("*.yaml")):
        p = _plan(capsys, path.stem)
        assert p["parameters"] > 0 and p["memory_per_rank_bytes"]["total"] > 0, path.name


def test_text_output_and_bad_input(capsys):
    assert plan_main(["--config-path", CONF, "--config-name", "hf_llama3_70B_config"]) == 0
    out = capsys.readouterr().out
    assert "70,553,706,496" in out and "memory/rank" in out and "tp=32" in out
    from nxdt.cli import main as cli

    assert cli(["plan", "--config-path", CONF, "--config-name", "tiny_llama_cpu",
                "distributed_strategy.pipeline_model_parallel_size=2", "model.num_layers=1"]) == 2
    assert "model.num_layers (1) is fewer than the 2 pipeline stages" in capsys.readouterr().err


def test_memory_estimate_matches_measured_tensor_bytes(capsys):
    """Three real fp32 AdamW steps of a small model on one process: parameters, gradients and
    optimizer state bytes, plus the activations autograd keeps for one micro-batch (the peak of
    saved tensors), against the plan's estimate (within 15%)."""
    import torch

    from nxdt.spec import load_config
    from nxdt.models import build_model
    from nxdt.training.loss import masked_token_loss

    overrides = ["trainer.devices=1", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176",
                 "model.num_attention_heads=4", "model.num_kv_heads=2", "model.encoder_seq_length=128",
                 "data.micro_batch_size=2", "data.global_batch_size=4"]
    p = _plan(capsys, "tiny_llama_cpu", *overrides)
    cfg = load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides],
                      check_paths=False, quiet=True)
    torch.manual_seed(0)
    model = build_model(cfg, 8192)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = 2, 128
    peak_saved = 0
    for _ in range(3):
        optimizer.zero_grad()
        for _mb in range(2):
            ids = torch.randint(0, 8192, (b, s + 1))
            saved: dict[int, int] = {}

            def pack(t, saved=saved):
                key = t.untyped_storage().data_ptr()
                if key not in params:
                    saved[key] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = masked_token_loss(model(ids[:, :-1]), ids[:, 1:], torch.ones(b, s)) / 2
            peak_saved = max(peak_saved, sum(saved.values()))
            loss.backward()
        optimizer.step()
    measured = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "optimizer": sum(t.numel() * t.element_size() for st in optimizer.state.values()
                         for t in st.values() if torch.is_tensor(t) and t.dim() > 0),
        "activations": peak_saved,
    }
    measured["total"] = sum(measured.values())
    est = p["memory_per_rank_bytes"]
    for key in ("params", "grads", "optimizer"):
        assert est[key] == measured[key], (key, est[key], measured[key])
    gap = abs(est["activations"] - measured["activations"]) / measured["activations"]
    print(f"activations estimated {est['activations']:,} measured {measured['activations']:,} gap {gap:.1%}")
    assert gap < 0.15, (est, measured)
    assert abs(est["total"] - measured["total"]) / measured["total"] < 0.15


# --------------------------------------------------------------------------- mixture of experts


@pytest.mark.parametrize("name", ["megatron_mixtral_8x7b_config", "hf_mixtral_8x7b_config"])
def test_mixtral_total_and_activated_per_token(capsys, name):
    """Mixtral-8x7B: 32 layers of 8 experts x 3 x 4096 x 14336; a token uses 2 of them, and all
    of attention, norms, embeddings, lm_head and the 8 x 4096 routers."""
    p = _plan(capsys, name)
    assert p["parameters"] == 46_702_792_704
    assert p["parameters_activated"] == 12_879_925_248
    experts = 32 * 8 * 3 * 4096 * 14336
    assert p["parameter_breakdown"] == {"dense": 1_604_587_520, "experts": experts, "experts_activated": experts // 4,
                                        "router": 32 * 8 * 4096, "router_noise": 0, "num_experts": 8, "top_k": 2}


def test_llama_moe_activated_is_dense_non_mlp_plus_a_quarter_of_the_mlp_plus_gates(capsys):
    """LLaMA-MoE 4/16 from Llama-2-7B: its non-MLP part (6,738,415,616 less 32 MLPs of
    3 x 4096 x 11008) + 4/16 of those MLPs = 3,492,024,320; + the gates, Linear(4096, 16) without
    bias per layer = 3,494,121,472; + the noisy gate's noise weight, also 16 x 4096 per layer and
    counted with the routers (a token goes through it in training) = 3,496,218,624."""
    p = _plan(capsys, "llama_moe_7B_16select4_config")
    mlp = 32 * 3 * 4096 * 11008
    gates = noise = 32 * 16 * 4096
    b = p["parameter_breakdown"]
    assert b["dense"] == 6_738_415_616 - mlp == 2_409_893_888
    assert b["experts"] == mlp and b["experts_activated"] == mlp // 4 == 1_082_130_432
    assert b["dense"] + b["experts_activated"] == 3_492_024_320
    assert b["router"] == gates + noise and b["router_noise"] == noise == 2_097_152
    assert p["parameters_activated"] - noise == 3_494_121_472
    assert p["parameters_activated"] == 3_496_218_624
    assert p["parameters"] == 6_742_609_920
    assert plan_main(["--config-path", CONF, "--config-name", "llama_moe_7B_16select4_config"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[3:6] == [
        "  activated    3,496,218,624 per token: top-4 of 16 experts",
        "               = dense 2,409,893,888 + experts 1,082,130,432 (4/16 of 4,328,521,728) + routers 4,194,304",
        "               routers = gates 2,097,152 + noise weights 2,097,152 (training only; 3,494,121,472 "
        "activated without them)"]


def test_dense_model_activates_everything_and_prints_it_once(capsys):
    p = _plan(capsys, "megatron_llama_7B_config")
    assert p["parameters_activated"] == p["parameters"] == 6_738_415_616
    assert p["parameter_breakdown"]["experts"] == 0
    assert plan_main(["--config-path", CONF, "--config-name", "megatron_llama_7B_config"]) == 0
    out = capsys.readouterr().out
    assert "activated" not in out and out.count("6,738,415,616") == 1


# tiny_mixtral_cpu (fp32, AdamW: 4 + 4 + 8 bytes per element) on 8 ranks: 4,325,376 expert
# elements (4 layers x 4 experts x 3 x 256 x 352), 4,987,136 others (routers included)
TINY_MOE = ["trainer.devices=8", "data.global_batch_size=32"]
TINY_EXPERTS, TINY_DENSE = 4_325_376, 4_987_136


def test_expert_parallel_divides_the_experts_per_rank(capsys):
    """ep = 2 of dp = 8: each rank holds half the experts and every dense weight. ZeRO-1 splits
    the dense optimizer state over dp = 8; each rank steps its own experts whole (their state is
    not split over the 4 replicas, as zero1_optimizer(rank_local=...) does)."""
    p = _plan(capsys, "tiny_mixtral_cpu", *TINY_MOE, "distributed_strategy.zero1=true",
              "distributed_strategy.expert_model_parallel_size=2")
    assert p["layout"]["ep"] == 2 and p["layout"]["dp"] == 8
    n = TINY_DENSE + TINY_EXPERTS // 2
    assert p["parameters_per_rank"] == n == 7_149_824
    mem = p["memory_per_rank_bytes"]
    assert mem["params"] == mem["grads"] == 4 * n
    assert mem["optimizer"] == 8 * TINY_DENSE // 8 + 8 * TINY_EXPERTS // 2 == 22_288_640
    assert "ep=2" in format_plan(p).splitlines()[1]
    no_ep = _plan(capsys, "tiny_mixtral_cpu", *TINY_MOE, "distributed_strategy.zero1=true")
    assert no_ep["parameters_per_rank"] == TINY_DENSE + TINY_EXPERTS
    assert no_ep["memory_per_rank_bytes"]["optimizer"] == 8 * (TINY_DENSE + TINY_EXPERTS) // 8


def test_fsdp_shards_dense_over_dp_and_experts_over_their_replicas(capsys):
    """FSDP with ep = 2 of dp = 8: dense weights / 8; experts / ep, then / (dp / ep = 4) over
    their replicas (torchtitan's dp_shard_mod_ep): 1/8 of every weight again."""
    p = _plan(capsys, "tiny_mixtral_cpu", *TINY_MOE, "distributed_strategy.fsdp=true",
              "distributed_strategy.expert_model_parallel_size=2")
    assert p["sharding"] == "fsdp"
    n = TINY_DENSE // 8 + TINY_EXPERTS // 2 // 4
    assert p["parameters_per_rank"] == n == 1_164_064
    assert p["memory_per_rank_bytes"]["optimizer"] == 8 * n


def test_rank_memory_formula():
    """bf16 weights, fp32 grads, fp32 master + 2 Adam states (12 bytes) per element; 1,000 dense
    and 640 expert elements on a rank, ZeRO-1 over dp 4."""
    b = Bytes(param=2, grad=4, master=4, state=4, activation=2)
    ep4 = rank_memory(1000, 640, b, 2, zero1=True, dp=4, ep=4)
    assert ep4 == {"params": 3280, "grads": 6560, "optimizer": 12 * 1000 // 4 + 12 * 640}
    ep1 = rank_memory(1000, 640, b, 2, zero1=True, dp=4, ep=1)
    assert ep1["optimizer"] == 12 * 1640 // 4 == 4920
    assert rank_memory(1000, 640, b, 2, zero1=False, dp=4, ep=4)["optimizer"] == 19680


def test_start_summary_shows_activated_parameters(capsys):
    """The run's start summary prints the plan's counts (nxdt.planner.estimate.plan of the run's
    config and vocabulary); a dense model's summary has no activated line."""
    from types import SimpleNamespace

    import torch

    from nxdt.spec import build_spec, load_config
    from nxdt.observability.callbacks import RunSummary

    def summary(name: str) -> list[str]:
        cfg = load_config(["--config-path", CONF, "--config-name", name, "trainer.peak_tflops=1"],
                          check_paths=False, quiet=True)
        module = SimpleNamespace(vocab_size=8192, device=torch.device("cpu"))
        RunSummary(build_spec(cfg, 2), None).on_fit_start(None, module)
        return capsys.readouterr().out.splitlines()

    assert summary("tiny_mixtral_cpu")[2:5] == [
        "  parameters   9,312,512  (9.3 M)  9,312,512 on the fullest rank",
        "  activated    7,149,824 per token: top-2 of 4 experts",
        "               = dense 4,983,040 + experts 2,162,688 (2/4 of 4,325,376) + routers 4,096"]
    dense = summary("tiny_llama_cpu")
    assert dense[2].startswith("  parameters   7,145,728  ") and not any("activated" in line for line in dense)


def test_plan_and_start_summary_print_one_parallel_plan(capsys):
    """`nxdt plan` and a run's start summary print the same layout, stage split and memory figures
    for a tp2 x pp2 x ZeRO-1 (dp 2) layout on 8 ranks, both read from one parallel plan: the plan
    the run makes for its model (nxdt.parallel.plan.make_plan, what parallelize_llama and
    build_pipeline apply) is the planner's, stage for stage and rank for rank."""
    from types import SimpleNamespace

    import torch

    from nxdt.models import build_model
    from nxdt.observability.callbacks import RunSummary
    from nxdt.parallel.plan import make_plan
    from nxdt.planner.estimate import plan
    from nxdt.spec import build_spec, load_config

    overrides = ["trainer.devices=8", "distributed_strategy.tensor_model_parallel_size=2",
                 "distributed_strategy.pipeline_model_parallel_size=2", "distributed_strategy.zero1=true",
                 "model.vocab_size=512", "trainer.peak_tflops=1"]
    assert plan_main(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides]) == 0
    cli = capsys.readouterr().out.splitlines()

    cfg = load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides],
                      world_size=8, check_paths=False, quiet=True)
    spec = build_spec(cfg)
    layout = spec.layout
    # the run: its model (built as configure_model builds it) and the plan it applies
    run_plan = make_plan(build_model(cfg, 512), spec)
    assert run_plan.layout == layout and (layout.dp, layout.tp, layout.pp) == (2, 2, 2)
    module = SimpleNamespace(vocab_size=512, device=torch.device("cpu"), parallel_plan=run_plan)
    RunSummary(spec, None).on_fit_start(None, module)
    summary = capsys.readouterr().out.splitlines()

    # the planner's own plan (a meta-device model) is the run's
    planner_plan = make_plan(build_model(cfg, 512, device="meta"), spec)
    assert planner_plan.stage_starts == run_plan.stage_starts and planner_plan.rank_stages == run_plan.rank_stages
    assert planner_plan.rank_stages == ((0,), (1,))
    for mine, theirs in zip(planner_plan.stages, run_plan.stages):
        assert (mine.layers, mine.checkpoint, mine.data_parallel) == (theirs.layers, theirs.checkpoint,
                                                                      theirs.data_parallel)
        assert {k: type(v) for k, v in mine.tensor_parallel.items()} == {k: type(v) for k, v in
                                                                         theirs.tensor_parallel.items()}
    assert plan(spec, 512, run_plan) == plan(spec, 512)

    def line(lines: list[str], head: str) -> str:
        return next(text for text in lines if text.startswith(f"  {head}"))

    def figures(text: str) -> dict[str, str]:
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    for key in ("world", "dp", "tp", "pp", "cp"):
        assert figures(line(summary, "layout"))[key] == figures(line(cli, "layout"))[key]
    assert line(summary, "stages") == line(cli, "stages") == "  stages       1F1B: 1,606,656, 1,606,912"
    assert line(summary, "memory/rank") == line(cli, "memory/rank") + "  (estimate, fullest rank)"


# --------------------------------------------------------------------------- LoRA


def test_lora_counts_frozen_base_without_grads_or_optimizer_state(capsys):
    """tiny_llama_lora_cpu on one rank: the frozen base holds its weights only; the adapters (rank 8
    on qkv_proj, o_proj, gate_up_proj, down_proj: NxDT's names for q, k, v, o, gate, up and down)
    their weights, gradients and AdamW state."""
    h, f, kv, layers, vocab, r = 256, 704, 4 * 32, 4, 256, 8
    base = layers * (h * (h + 2 * kv) + h * h + h * 2 * f + f * h + 2 * h) + 2 * vocab * h + h
    # A (r x in) + B (out x r) on each of q, k, v, o, gate, up, down
    adapters = layers * r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + f) + (f + h))
    assert (base, adapters) == (3_082_496, 149_504)
    one_rank = ["trainer.devices=1", "model.vocab_size=256", "distributed_strategy.zero1=false"]
    p = _plan(capsys, "tiny_llama_lora_cpu", *one_rank)
    assert (p["parameters"], p["parameters_trainable"], p["parameters_per_rank"]) == (base, adapters, base + adapters)
    mem = p["memory_per_rank_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * (base + adapters), 4 * adapters, 8 * adapters)
    # bf16 weights with fp32 masters: a frozen weight is its fp32 copy + the bf16 one, no master in the optimizer
    p = _plan(capsys, "tiny_llama_lora_cpu", *one_rank, "precision.type=mixed_precision")
    mem = p["memory_per_rank_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == ((2 + 4) * base + 2 * adapters, 4 * adapters,
                                                               (4 + 8) * adapters)
    # the same model without LoRA: every weight trains
    full = _plan(capsys, "tiny_llama_cpu", *one_rank)["memory_per_rank_bytes"]
    assert (full["params"], full["grads"], full["optimizer"]) == (4 * base, 4 * base, 8 * base)
    # modules_to_save trains lm_head in full: its weight gradient adds 2 FLOPs per weight and token
    saved = _plan(capsys, "tiny_llama_lora_cpu", *one_rank, "model_alignment_strategy.peft.modules_to_save=[lm_head]")
    lora_only = _plan(capsys, "tiny_llama_lora_cpu", *one_rank)
    assert saved["flops_per_token"] - lora_only["flops_per_token"] == 2 * vocab * h
    assert saved["parameters_trainable"] == adapters + vocab * h


def test_lora_on_experts_counts_adapters_per_expert_under_ep_and_fsdp(capsys):
    """tiny_mixtral_cpu with rank-4 adapters on the experts only (peft's target_parameters): each of
    the 4 experts of the 4 layers gets A (r x in) + B (out x r) on gate_up_proj [2F, H] and down_proj
    [H, F]; they train (gradients, AdamW state), the base is frozen; under ep2 the expert adapters are
    split with their experts, under FSDP dp2 everything is."""
    h, f, e, layers, r = 256, 352, 4, 4, 4
    base, experts = 5_249_280, layers * e * (2 * f * h + h * f)
    adapters = layers * e * r * ((h + 2 * f) + (f + h))
    assert (experts, adapters) == (4_325_376, 100_352)
    lora = ["model.vocab_size=256", "distributed_strategy.zero1=false", "+model_alignment_strategy.peft.lora_rank=4",
            "+model_alignment_strategy.peft.lora_dropout=0", "+model_alignment_strategy.peft.target_modules=[]",
            "+model_alignment_strategy.peft.target_parameters=[experts.gate_up_proj,experts.down_proj]"]
    p = _plan(capsys, "tiny_mixtral_cpu", "trainer.devices=1", *lora)
    assert (p["parameters"], p["parameters_trainable"], p["parameters_per_rank"]) == (base, adapters, base + adapters)
    mem = p["memory_per_rank_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * (base + adapters), 4 * adapters, 8 * adapters)
    p = _plan(capsys, "tiny_mixtral_cpu", "trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2",
              *lora)
    mem = p["memory_per_rank_bytes"]
    assert p["parameters_per_rank"] == base - experts + (experts + adapters) // 2 == 3_136_768
    assert (mem["grads"], mem["optimizer"]) == (4 * adapters // 2, 8 * adapters // 2)
    p = _plan(capsys, "tiny_mixtral_cpu", "trainer.devices=2", "distributed_strategy.sharding_strategy=FSDP", *lora)
    mem = p["memory_per_rank_bytes"]
    assert p["parameters_per_rank"] == (base + adapters) // 2 and (mem["grads"], mem["optimizer"]) == (
        4 * adapters // 2, 8 * adapters // 2)
    # experts trained in full (modules_to_save) beside q_proj adapters: a token's weight gradients touch
    # its top-2 of the 4 experts, 2 FLOPs per activated weight
    q_only = [*lora[:4], "+model_alignment_strategy.peft.target_modules=[q_proj]"]
    adapters_only = _plan(capsys, "tiny_mixtral_cpu", "trainer.devices=1", *q_only)
    saved = _plan(capsys, "tiny_mixtral_cpu", "trainer.devices=1", *q_only,
                  "+model_alignment_strategy.peft.modules_to_save=[experts]")
    assert saved["parameters_trainable"] - adapters_only["parameters_trainable"] == experts
    assert saved["flops_per_token"] - adapters_only["flops_per_token"] == 2 * experts * 2 // e


def test_8b_sft_lora_per_rank(capsys):
    """hf_llama3_8B_SFT_lora_config (tp 32, autocast: fp32 weights, rank-16 adapters on q/k/v): per
    rank the SFT config's base shard frozen, plus the adapters split as the run splits them (q_proj
    colwise: A whole, B / tp; k/v replicated at 8 kv heads < tp: both whole); gradients and AdamW
    state for the adapters only (before: for all 8.03B weights, 4.98 GiB per rank)."""
    sft = _plan(capsys, "hf_llama3_8B_SFT_config")
    lora = _plan(capsys, "hf_llama3_8B_SFT_lora_config")
    assert lora["layout"]["tp"] == sft["layout"]["tp"] == 32 and lora["precision"] == "autocast"
    r, h, kv, tp, layers = 16, 4096, 8 * 128, 32, 32
    adapters_per_rank = layers * ((r * h + h * r // tp) + 2 * (r * h + kv * r))
    assert adapters_per_rank == 7_405_568
    assert lora["parameters_trainable"] == layers * (3 * r * h + r * (h + 2 * kv)) == 9_437_184
    assert lora["parameters_per_rank"] == sft["parameters_per_rank"] + adapters_per_rank
    mem = lora["memory_per_rank_bytes"]
    assert mem["params"] == 4 * lora["parameters_per_rank"]
    assert (mem["grads"], mem["optimizer"]) == (4 * adapters_per_rank, 8 * adapters_per_rank)
    assert mem["total"] == 2_147_393_536 < 5_345_337_344  # 2.00 GiB per rank, was 4.98 GiB


def test_a_llama31_rope_config_at_its_original_length_builds_without_transformers_warning(tmp_path):
    """NxDT's Llama 3.1 configs (the 405B's) set max_position_embeddings to rope_scaling's
    original_max_position_embeddings (8192), which transformers' rope validation warns about on every
    plan and run: the warning is dropped from nxdt's config build alone; another warning of the
    same logger still comes through."""
    import logging

    import torch

    from nxdt.models.hf import build_hf_model, dropped_log_lines

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 8192,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers")  # the rope module's records reach its handlers
    logger.addHandler(handler)
    level = logger.level  # another module in this worker may have quieted transformers
    logger.setLevel(logging.WARNING)
    try:
        with torch.device("meta"):
            build_hf_model(tmp_path / "config.json")
        with dropped_log_lines("transformers.modeling_rope_utils", "must be less than"):
            logging.getLogger("transformers.modeling_rope_utils").warning("another warning")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["another warning"], seen
