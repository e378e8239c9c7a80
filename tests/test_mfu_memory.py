"""Per-step TFLOP/s and MFU, the device peak, the measured peak memory, and the start summary
printing `nxdt plan`'s figures: the FLOPs formula against a hand count and torch's FLOP counter,
the MFU arithmetic, the peak table and the CPU probe's cache, the CPU peak-memory measurement
against bytes counted by hand. In-process, a few seconds."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from nxdt import hardware
from nxdt.spec import build_spec, load_config
from nxdt.hardware import Peak, device_peak, table_peak
from nxdt.models import build_model
from nxdt.models.flops import flops_per_token, lookup_parameters, mean_keys_per_query, model_shape
from nxdt.models.param_count import parameter_counts
from nxdt.tools.plan import main as plan_main
from nxdt.observability import callbacks
from nxdt.observability.callbacks import MemoryMonitor, RunFigures, RunSummary, ThroughputMonitor
from nxdt.planner.estimate import flops_line, memory_line, plan
from nxdt.observability.memory import CpuStepPeak, live_cpu_storages, peak_of

CONF = str(REPO / "conf")
MiB = 2**20
# 2 layers, hidden 64, 4 heads of 16 (GQA: 2 kv heads), SwiGLU 176, untied lm_head
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "model.encoder_seq_length=32", "trainer.devices=1", "data.micro_batch_size=2",
        "data.global_batch_size=4", "trainer.peak_tflops=50"]
VOCAB = 256


def _cfg(*overrides: str, name: str = "tiny_llama_cpu"):
    return load_config(["--config-path", CONF, "--config-name", name, *overrides], check_paths=False, quiet=True)


# --------------------------------------------------------------------------- FLOPs per token


def test_flops_per_token_is_the_hand_count():
    """6 x the multiplied weights + 12 x layers x heads x head_dim x (s + 1) / 2 keys."""
    p = plan(build_spec(_cfg(*TINY)), VOCAB)
    h, f, d, layers, s = 64, 176, 16, 2, 32
    per_layer = h * 4 * d + 2 * h * 2 * d + 4 * d * h + 3 * h * f + 2 * h  # q, k and v (2 heads), o, MLP, 2 norms
    matmul_params = layers * per_layer + h + h * VOCAB  # + final norm + lm_head; the embedding is a lookup
    assert p["flops_per_token_split"] == {"matmul": 6 * matmul_params, "attention": 12 * layers * 4 * d * (s + 1) // 2}
    assert p["flops_per_token"] == 6 * matmul_params + 12 * layers * 4 * d * (s + 1) // 2 == 678_528
    assert p["model_tflop_per_step"] == pytest.approx(678_528 * 4 * 32 / 1e12)


def test_flops_match_torchs_flop_counter_on_the_native_model():
    """torch.utils.flop_counter on forward + backward (SDPA's math path, so attention is bmm's it
    counts): equal to the formula with full (non-causal) attention, the math path computing the
    masked half too, less 6 x the norm weights, which the formula counts as matmul parameters and
    are elementwise (0.3% here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = _cfg(*TINY)
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    b, s = 2, 32
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, VOCAB, (b, s))).float().sum().backward()
    counts = parameter_counts(model)
    full = flops_per_token(model_shape(model), counts, lookup_parameters(model), s, causal=False)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert norms == 2 * 2 * 64 + 64
    assert counter.get_total_flops() == (full.total - 6 * norms) * b * s == 44_826_624
    causal = flops_per_token(model_shape(model), counts, lookup_parameters(model), s)
    assert causal.matmul == full.matmul and causal.attention * 2 * s == full.attention * (s + 1)


def test_flops_count_activated_experts_tied_embeddings_and_frozen_weights():
    """MoE: top_k of E experts (parameter_counts.activated); a tied lm_head is multiplied, so the
    shared table counts; LoRA's frozen base does no weight-gradient matmul (4 per weight)."""
    moe = plan(build_spec(_cfg(name="tiny_mixtral_cpu")), VOCAB)
    embedding = VOCAB * 256
    assert moe["flops_per_token_split"]["matmul"] == 6 * (moe["parameters_activated"] - embedding)
    assert moe["parameters_activated"] < moe["parameters"]
    tied = build_model(_cfg(*TINY, "model.share_embeddings_and_output_weights=true"), VOCAB, device="meta")
    assert lookup_parameters(tied) == 0
    assert lookup_parameters(build_model(_cfg(*TINY), VOCAB, device="meta")) == 64 * VOCAB
    model = build_model(_cfg(*TINY), VOCAB, device="meta")
    counts, lookup = parameter_counts(model), lookup_parameters(model)
    frozen = flops_per_token(model_shape(model), counts, lookup, 32, frozen=counts.activated - lookup)
    assert frozen.matmul == 4 * (counts.activated - lookup)


def test_keys_per_query_causal_and_sliding_window():
    assert mean_keys_per_query(4) == (1 + 2 + 3 + 4) / 4
    assert mean_keys_per_query(8, window=3) == (1 + 2 + 3 + 3 * 5) / 8
    assert mean_keys_per_query(8, causal=False) == 8
    assert mean_keys_per_query(8, window=3, causal=False) == 3


# --------------------------------------------------------------------------- TFLOP/s and MFU


def test_throughput_monitor_logs_tflops_and_mfu(monkeypatch, capsys):
    """1 GFLOP/token x 1,000 tokens in 0.5 s on 2 devices = 1 TFLOP/s each = 10% of a 10 TFLOP/s
    peak. A measured CPU peak that most steps exceed (0.5 TFLOP/s: MFU 200%) is dropped from the
    cache at the end, so that the next run measures again."""
    forgotten = []
    monkeypatch.setattr(hardware, "forget_cpu_peak", forgotten.append)
    trainer = SimpleNamespace(world_size=2, is_global_zero=True)
    for peak, mfu in ((Peak(10.0, "fake"), 10.0), (Peak(0.5, "probe", measured="fp32"), 200.0)):
        logged = {}
        module = SimpleNamespace(log_step_scalar=lambda name, value, prog_bar=False: logged.update({name: value}))
        monitor = ThroughputMonitor(1000)
        monitor.flops_per_token, monitor.peak = 1e9, peak
        clock = iter([100.0, 100.5])
        monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
        monitor.on_train_batch_start(trainer, module, None, 0)
        monitor.on_train_batch_end(trainer, module, None, None, 0)
        assert logged == pytest.approx({"step_time": 0.5, "throughput": 2000.0, "tflops": 1.0, "mfu": mfu})
        monitor.on_train_end(trainer, module)
    assert forgotten == ["fp32"]
    assert "MFU above 100% on 1 of 1 steps" in capsys.readouterr().out


def test_peak_table_by_device_name_and_precision(monkeypatch):
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756.0
    assert table_peak("NVIDIA H100 NVL", "tf32") == 418.0
    assert table_peak("NVIDIA H200", "fp16") == 989.4
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert table_peak("Tesla T4", "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak("cuda", "bf16") == Peak(989.4, "NVIDIA H100 80GB HBM3, dense bf16")
    assert device_peak("cuda", "fp32").tflops == 66.9  # torch's default: fp32 matmuls off tensor cores
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak("cuda", "fp32").tflops == 494.7  # TF32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert device_peak("cuda", "bf16") is None  # not in the table: no mfu
    monkeypatch.setattr(hardware, "_neuron_name", lambda: "trn2")
    assert device_peak("xla", "bf16", lnc=2).tflops == pytest.approx(166.8)
    monkeypatch.setattr(hardware, "_neuron_name", lambda: "trn1")
    assert device_peak("xla", "fp32").tflops == 23.75


def test_trainer_peak_tflops_overrides_table_and_probe(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_matmul_peak", lambda dtype: pytest.fail("probed despite the override"))
    assert device_peak("cpu", "fp32", override=123.0) == Peak(123.0, "trainer.peak_tflops")
    assert RunFigures(build_spec(_cfg("trainer.peak_tflops=7.5"))).peak(torch.device("cpu")).tflops == 7.5


def test_cpu_probe_is_positive_time_boxed_and_cached(tmp_path, monkeypatch):
    monkeypatch.delenv(hardware.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = hardware.cpu_matmul_peak("fp32")
    assert 1e-4 < first < 100  # between 0.1 GFLOP/s and 100 TFLOP/s
    cache = tmp_path / "nxdt" / "cpu_peak.json"
    key = (f"{hardware.cpu_model()} | {hardware.cpu_capability()} | torch {torch.__version__} | "
           f"{torch.get_num_threads()} threads | fp32")
    assert json.loads(cache.read_text()) == {key: first}
    monkeypatch.setattr(hardware, "probe_matmul_tflops", lambda dtype: pytest.fail("measured again"))
    assert hardware.cpu_matmul_peak("fp32") == first  # read from the file
    hardware.forget_cpu_peak("fp32")
    assert json.loads(cache.read_text()) == {}

    def slow_probe_while_another_rank_stores(dtype):  # a lower figure never replaces a higher one
        cache.write_text(json.dumps({key: 2.0}))
        return 0.5

    monkeypatch.setattr(hardware, "probe_matmul_tflops", slow_probe_while_another_rank_stores)
    assert hardware.cpu_matmul_peak("fp32") == 2.0 and json.loads(cache.read_text()) == {key: 2.0}
    monkeypatch.setenv(hardware.CACHE_ENV, "0")
    assert hardware.cache_path() is None
    monkeypatch.undo()
    start = time.perf_counter()  # fp16 has no fast kernel on many CPUs (4 GFLOP/s on an EPYC): still bounded
    assert hardware.probe_matmul_tflops("fp16", budget_s=0.2) > 0
    assert time.perf_counter() - start < 1.5


def test_a_stored_slow_bf16_figure_is_measured_again_before_the_notice(tmp_path, monkeypatch):
    """A bf16 figure stored while other work loaded the CPU (47 GFLOP/s where it runs 420) must not
    tell the user bf16 is slower: the notice probes again first and keeps the higher figure; a CPU
    that really is slower (AVX2) still gets the line."""
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path / "peak.json"))
    stored = {hardware._cache_key("fp32"): 0.170, hardware._cache_key("bf16"): 0.047}
    (tmp_path / "peak.json").write_text(json.dumps(stored))
    probed = []

    def probe(dtype, budget_s=hardware.PROBE_SECONDS):
        probed.append(dtype)
        return {"fp32": 0.2, "bf16": 0.42}[dtype]

    monkeypatch.setattr(hardware, "probe_matmul_tflops", probe)
    assert hardware.low_precision_notice("cpu", "bf16", "bf16SR") is None
    assert probed == ["bf16"]
    assert json.loads((tmp_path / "peak.json").read_text())[hardware._cache_key("bf16")] == 0.42
    assert hardware.low_precision_notice("cpu", "bf16", "bf16SR") is None and probed == ["bf16"]  # stored now
    monkeypatch.setattr(hardware, "probe_matmul_tflops", lambda dtype, budget_s=0: {"fp32": 0.058, "bf16": 0.0008}[dtype])
    (tmp_path / "peak.json").write_text(json.dumps({hardware._cache_key("fp32"): 0.058,
                                                    hardware._cache_key("bf16"): 0.0008}))
    assert "72.5x slower" in hardware.low_precision_notice("cpu", "bf16", "bf16SR")


# --------------------------------------------------------------------------- one estimator


@pytest.mark.parametrize("name", ["tiny_llama_cpu", "tiny_mixtral_cpu"])
def test_start_summary_prints_the_plans_figures(capsys, name):
    """The same config through `nxdt plan --json` and the run's start summary: the parameters,
    memory and FLOPs lines carry the same numbers."""
    overrides = ["trainer.peak_tflops=50"]
    assert plan_main(["--config-path", CONF, "--config-name", name, *overrides, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    cfg = _cfg(*overrides, name=name)
    module = SimpleNamespace(vocab_size=8192, device=torch.device("cpu"))  # the bundled tokenizer's size
    RunSummary(build_spec(cfg), None).on_fit_start(None, module)
    text = capsys.readouterr().out
    assert cli["vocab_size"] == 8192
    assert f"  parameters   {cli['parameters']:,}  " in text
    assert f"{cli['parameters_per_rank']:,} on the fullest rank" in text
    assert memory_line(cli["memory_per_rank_bytes"]) + "  (estimate, fullest rank)" in text.splitlines()
    assert flops_line(cli) in text.splitlines()
    assert "  peak         50 TFLOP/s per device (trainer.peak_tflops)" in text
    if name == "tiny_mixtral_cpu":
        assert f"  activated    {cli['parameters_activated']:,} per token: top-2 of 4 experts" in text


# --------------------------------------------------------------------------- measured memory


def test_cpu_peak_of_known_allocations():
    """4 MiB live; then 8 and 2 MiB, the 8 freed, 16 MiB: the peak is 4 + 2 + 16 = 22 MiB above
    what was live before."""
    before = sum(live_cpu_storages().values())
    a = torch.empty(4 * MiB, dtype=torch.uint8)
    probe = CpuStepPeak()
    assert probe.begin()
    b, c = torch.empty(8 * MiB, dtype=torch.uint8), torch.empty(2 * MiB, dtype=torch.uint8)
    del b
    d = torch.empty(16 * MiB, dtype=torch.uint8)
    del c, d
    assert probe.end() - before == 22 * MiB
    del a


def test_peak_of_matches_frees_by_address():
    """A free of a window block or of a starting storage lowers the count; one of a block the
    start left out (a gradient) does not."""
    start = {1: 100, 2: 50}
    events = [(0, 2, -50), (1, 9, -70), (2, 3, 30), (3, 4, 40), (4, 3, -30), (5, 5, 60)]
    # 150 -> 100 (storage 2 freed) -> 100 (9 unknown) -> 130 -> 170 -> 140 -> 200
    assert peak_of(start, events) == 200


def _linear_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(256, 1024)  # 1 MiB

    def step():
        optimizer.zero_grad(set_to_none=True)
        y = model(x)  # 1 MiB, referenced until the step returns
        y.square().mean().backward()
        optimizer.step()

    return model, step


def test_cpu_peak_of_a_linear_adamw_step():
    """The peak of a 1024 x 1024 Linear + AdamW step (torch's single-tensor AdamW) is at the
    update's denominator: weight 4 + input 1 + exp_avg 4 + exp_avg_sq 4 (live at the start),
    + output 1 + gradient 4 + sqrt(exp_avg_sq) 4 + its quotient by the bias correction 4 = 26 MiB;
    the previous gradient is freed first. Within 0.01 MiB (the step counter and the loss)."""
    model, step = _linear_adamw()
    step()
    baseline = sum(live_cpu_storages().values()) - 4 * MiB  # less the gradient
    probe = CpuStepPeak()
    for _ in range(2):  # the second measurement sees gradients the profiler knows: same answer
        assert probe.begin(freed_first=[model.weight.grad])
        step()
        assert probe.end() - baseline == pytest.approx(13 * MiB, abs=0.01 * MiB)


def test_memory_monitor_logs_sampled_steps_and_reports(monkeypatch, capsys):
    """Steps 1 and 3 are measured (MEMORY_EVERY = 3 here); memory/peak_gib, the highest so far, is
    logged on every step from the first measurement on (the logged steps need not be the measured
    ones); the end line puts the estimate next to the measured peak."""
    monkeypatch.setattr(callbacks, "MEMORY_EVERY", 3)
    model, step = _linear_adamw()
    logged: dict[int, float] = {}
    steps = iter(range(5))
    current = {"step": -1}
    module = SimpleNamespace(
        device=torch.device("cpu"), vocab_size=None, parameters=model.parameters,
        log_step_scalar=lambda name, value, prog_bar=False: logged.update({current["step"]: value}))
    estimate = {"memory_per_rank_bytes": {"params": 4 * MiB, "grads": 4 * MiB, "optimizer": 8 * MiB,
                                          "activations": 2 * MiB, "total": 18 * MiB}}
    figures = SimpleNamespace(plan=lambda vocab: estimate)
    monitor = MemoryMonitor(_cfg(*TINY), figures)
    trainer = SimpleNamespace(is_global_zero=True)
    monitor.on_fit_start(trainer, module)
    baseline = sum(live_cpu_storages().values())
    for current["step"] in steps:
        monitor.on_train_batch_start(trainer, module, None, 0)
        step()
        monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert sorted(logged) == [1, 2, 3, 4] and monitor.sampled == 2
    assert logged[2] == logged[1] and logged[4] == logged[3] >= logged[1]
    # + the AdamW state (8 MiB) the first step created, + the step's own 13 MiB (the test above)
    assert logged[1] * 1024**3 - baseline == pytest.approx(21 * MiB, abs=0.01 * MiB)
    monitor.on_train_end(trainer, module)
    line = capsys.readouterr().out.strip()
    assert line.startswith("memory/rank  estimate 0.02 GiB (params 0.00, grads 0.00, optimizer 0.01, "
                           "activations 0.00) vs measured peak ")
    assert line.endswith("[live CPU tensor bytes, 2 sampled step(s)]")


# --------------------------------------------------------------------------- what the device runs fast (issue 19)


def _fake_cpu(monkeypatch, fp32: float, bf16: float, flags: set[str]) -> None:
    monkeypatch.setattr(hardware, "cpu_matmul_peak", lambda dtype, remeasure=False: {"fp32": fp32, "bf16": bf16}[dtype])
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC 7R13")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")


def test_a_bf16_preset_on_a_cpu_without_fast_bf16_gets_one_line_with_the_numbers(monkeypatch):
    """An AVX2-only EPYC (fp32 ~58 GFLOP/s, bf16 ~0.8): the measured rates, the slowdown, the preset and
    what to use instead; nothing for fp32, nor where bf16 is the faster (AMX)."""
    _fake_cpu(monkeypatch, 0.058, 0.0008, {"avx2", "fma"})
    assert hardware.low_precision_notice("cpu", "bf16", "mixed_precision") == (
        "notice: precision.type=mixed_precision computes in bf16, which this CPU (AMD EPYC 7R13, AVX2 (no native "
        "bf16)) runs without native kernels: measured matmul bf16 0.8 GFLOP/s vs fp32 58 GFLOP/s, 72.5x slower; "
        "expect the steps to be up to that much slower than with precision.type=fp32 (the run goes on as configured)")
    assert hardware.low_precision_notice("cpu", "fp32", "fp32") is None
    _fake_cpu(monkeypatch, 0.143, 0.574, {"avx512f", "amx_bf16", "avx512_bf16"})
    assert hardware.low_precision_notice("cpu", "bf16", "bf16SR") is None
    assert hardware.machine_line() == ("cpu: AMD EPYC 7R13 | AVX2 + AMX-BF16, AVX512-BF16 | "
                                       f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}"
                                       " | matmul peak fp32 143 GFLOP/s, bf16 574 GFLOP/s")


def test_the_start_summary_says_it_and_both_print_the_step_time_the_peak_allows(monkeypatch, capsys):
    """The run's summary and `nxdt plan` print the peak and the step time at it (the step's model
    FLOPs per device / peak); the run adds the precision notice under the summary."""
    _fake_cpu(monkeypatch, 0.058, 0.0008, {"avx2"})
    cfg = _cfg(*[o for o in TINY if not o.startswith("trainer.peak")], "precision.type=mixed_precision")
    module = SimpleNamespace(vocab_size=VOCAB, device=torch.device("cpu"))
    RunSummary(build_spec(cfg), None).on_fit_start(None, module)
    lines = capsys.readouterr().out.splitlines()
    flop_per_step = plan(build_spec(cfg), VOCAB)["model_tflop_per_step"] * 1e12  # 678,528 x 4 x 32 FLOP
    assert lines[-3] == "  peak         0.8 GFLOP/s per device (measured bf16 matmul on AMD EPYC 7R13, " + \
        f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})"
    assert lines[-2] == (f"  step time    >= {flop_per_step / 0.8e9 * 1e3:.3g} ms at that peak (model FLOPs / peak: "
                         "the bound at 100% MFU)")
    assert lines[-1].startswith("notice: precision.type=mixed_precision computes in bf16") and "72.5x slower" in lines[-1]

    assert plan_main(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *TINY, "model.vocab_size=256",
                      "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["peak_tflops"], p["peak_source"]) == (50, "trainer.peak_tflops")
    assert p["step_time_s"] == pytest.approx(p["model_tflop_per_step"] / 50)
    assert plan_main(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *TINY, "model.vocab_size=256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["  peak         50 TFLOP/s per device (trainer.peak_tflops)",
                        f"  step time    >= {p['step_time_s'] * 1e3:.3g} ms at that peak (model FLOPs / peak: the "
                        "bound at 100% MFU)"]


def test_cpu_training_keeps_the_freed_heap_for_the_next_step(monkeypatch):
    """nxdt.training.trainer.keep_cpu_heap (train() on the CPU; issue 40): once set, a freed 64 MiB
    buffer's pages serve the next one, where glibc's default maps each afresh (a page fault per 4 KiB:
    16,384 a buffer). NXDT_KEEP_CPU_HEAP=0 leaves glibc as it is."""
    import platform
    import resource

    from nxdt.training.trainer import keep_cpu_heap

    monkeypatch.setenv("NXDT_KEEP_CPU_HEAP", "0")
    assert keep_cpu_heap() is False
    monkeypatch.delenv("NXDT_KEEP_CPU_HEAP")
    assert keep_cpu_heap() is (platform.libc_ver()[0] == "glibc")
    if platform.libc_ver()[0] != "glibc":
        return  # nothing set: the allocator's own behaviour stands

    def faults_of_three_buffers() -> int:
        torch.ones(64 * MiB // 4)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            torch.ones(64 * MiB // 4)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_three_buffers()  # the heap grows to the buffer's size once
    assert faults_of_three_buffers() < 3 * 16384 // 4
