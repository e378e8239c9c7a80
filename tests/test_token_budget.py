"""Token budgets (issue 18): trainer.max_tokens -> max_steps (rounded up, with its notice), the
start summary's batch / tokens-per-batch / max_steps / total-tokens lines and `nxdt plan`'s same
lines, and the one timing line printed once the first steps are timed (step times injected into
ThroughputMonitor with a fake clock and trainer). In-process, a few seconds."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from nxdt.config.errors import ConfigError
from nxdt.spec import build_spec, config_from_dict, load_config
from nxdt.tools.plan import main as plan_main
from nxdt.observability import callbacks
from nxdt.observability.callbacks import RunSummary, ThroughputMonitor
from nxdt.observability.eta import TIMED_STEPS

CONF = str(REPO / "conf")
# 1 device, global batch 4 (2 micro-batches of 2), seq 32: 128 tokens per step
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "model.encoder_seq_length=32", "trainer.devices=1", "data.micro_batch_size=2",
        "data.global_batch_size=4", "trainer.peak_tflops=50", "model.vocab_size=256"]


def _load(*overrides: str, quiet: bool = True):
    return load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *TINY, *overrides],
                       check_paths=False, quiet=quiet)


# --------------------------------------------------------------------------- max_tokens -> max_steps


@pytest.mark.parametrize(("max_tokens", "seq", "gbs"), [(1000, 16, 4), (1024, 16, 4), (1025, 16, 4), (1, 16, 4),
                                                        (10**11, 4096, 1024)])
def test_max_tokens_sets_max_steps_rounded_up(max_tokens, seq, gbs):
    cfg = config_from_dict({"trainer": {"max_tokens": max_tokens}, "data": {"seq_length": seq, "global_batch_size": gbs}})
    assert cfg.trainer.max_steps == math.ceil(max_tokens / (seq * gbs))
    assert {1000: 16, 1024: 16, 1025: 17, 1: 1, 10**11: 23842}[max_tokens] == cfg.trainer.max_steps


def test_max_tokens_notice_names_the_formula_and_the_replaced_max_steps(capsys):
    cfg = _load("trainer.max_tokens=2000", "trainer.max_steps=7", quiet=False)
    assert cfg.trainer.max_steps == 16  # ceil(2000 / 128)
    notices = [line for line in capsys.readouterr().err.splitlines() if "max_tokens" in line]
    # the first (the schema check runs again in validate: a second notice, without the 7, follows)
    assert notices[0] == ("notice: trainer.max_tokens=2000: max_steps 16 (instead of 7) = ceil(max_tokens / "
                          "(global batch 4 x seq_length 32 = 128 tokens/step))")
    _load("trainer.max_tokens=2048", "trainer.max_steps=16", quiet=False)  # already equal: nothing replaced
    assert "max_steps 16 = ceil(" in capsys.readouterr().err


def test_max_steps_minus_1_goes_with_max_tokens_and_is_refused_without(capsys):
    """Lightning's `max_steps=-1` (no step limit) beside a token budget: the budget ends the run;
    alone: one line saying what -1 needs."""
    cfg = _load("trainer.max_tokens=2000", "trainer.max_steps=-1", quiet=False)
    assert cfg.trainer.max_steps == 16
    assert ("notice: trainer.max_tokens=2000: max_steps 16 (max_steps -1: no step limit, the token budget ends "
            "the run) = ceil(") in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^trainer.max_steps: must be >= 1, got -1 \(Lightning's 'no step limit'"):
        _load("trainer.max_steps=-1")


# --------------------------------------------------------------------------- the summary and nxdt plan


def _summary(capsys, cfg) -> list[str]:
    module = SimpleNamespace(vocab_size=256, device=torch.device("cpu"))
    RunSummary(build_spec(cfg), None).on_fit_start(None, module)
    return capsys.readouterr().out.splitlines()


BUDGET_LINES = [
    "  batch        global batch size: 4  micro=2  microbatches/step=2  seq=32",
    "  tokens/step  128  (#tokens/batch: 4 x 32)",
    "  steps        max_steps: 16 (from trainer.max_tokens=2000)  x 128 tokens/step = 2,048 tokens (2.05k)",
]


def test_summary_prints_batch_tokens_per_batch_and_max_steps(capsys):
    lines = _summary(capsys, _load("trainer.max_tokens=2000"))
    at = lines.index(BUDGET_LINES[0])
    assert lines[at:at + 3] == BUDGET_LINES
    assert sum("max_steps" in line for line in lines) == 1  # the old tokens/step line's max_steps= is gone
    # without a budget: max_steps as given, no 'from', a total under 1,000 without a short form
    lines = _summary(capsys, _load("trainer.max_steps=7"))
    assert "  steps        max_steps: 7  x 128 tokens/step = 896 tokens" in lines


def test_summary_says_how_many_torch_threads_it_uses_why_and_how_to_change_it(capsys, monkeypatch):
    """CPU: one line with torch's intra-op threads per rank and where the number comes from; on a
    machine loaded at or above its CPUs, a hint that fewer threads can be faster."""
    lines = [line for line in _summary(capsys, _load("trainer.max_steps=7")) if line.startswith("  threads")]
    n = torch.get_num_threads()
    assert len(lines) == 1 and lines[0].startswith(f"  threads      {n} torch thread"), lines
    assert lines[0].endswith("; set OMP_NUM_THREADS=N to change it"), lines
    monkeypatch.setattr(callbacks.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(callbacks.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(callbacks.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert callbacks.threads_line({}) == ("  threads      2 torch threads per rank, from torch's default: one per CPU "
                                          "this process may use (2); set OMP_NUM_THREADS=N to change it")
    monkeypatch.setattr(callbacks.os, "getloadavg", lambda: (3.4, 3.0, 3.0))
    assert callbacks.threads_line({"OMP_NUM_THREADS": "2"}).splitlines() == [
        "  threads      2 torch threads per rank, from OMP_NUM_THREADS=2; set OMP_NUM_THREADS=N to change it",
        "               the machine is loaded (load average 3.4 on 2 CPUs): fewer threads can be much faster, "
        "e.g. OMP_NUM_THREADS=1"]
    monkeypatch.setattr(callbacks.torch, "get_num_threads", lambda: 1)
    assert callbacks.threads_line({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}) == (
        "  threads      1 torch thread per rank, from OMP_NUM_THREADS=1 (torchrun's 1 per rank unless it is given); "
        "set OMP_NUM_THREADS=N to change it")


@pytest.mark.parametrize("load", [0.0, 99.0], ids=["idle", "loaded"])
def test_summary_says_how_the_cpu_heap_is_kept_and_how_to_change_it(capsys, monkeypatch, load):
    """CPU runs with glibc: a line after the threads line saying whether freed buffers stay in the process
    between steps (training.trainer.keep_cpu_heap) and the NXDT_KEEP_CPU_HEAP switch; none elsewhere."""
    monkeypatch.setattr(callbacks.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(callbacks.os, "getloadavg", lambda: (load, load, load))  # loaded: the threads hint line
    module = SimpleNamespace(vocab_size=256, device=torch.device("cpu"))
    spec = build_spec(_load("trainer.max_steps=7"))
    shown = {}
    for kept in (True, False, None):
        RunSummary(spec, None, cpu_heap_kept=kept).on_fit_start(None, module)
        lines = capsys.readouterr().out.splitlines()
        threads = next(i for i, line in enumerate(lines) if line.startswith("  threads"))
        heap = [i for i, line in enumerate(lines) if line.startswith("  cpu heap")]
        # right after the threads line and its load hint (on a loaded machine: a second, indented line)
        assert all(i in (threads + 1, threads + 2) for i in heap) and len(heap) <= 1, lines
        shown[kept] = lines[heap[0]] if heap else None
    assert shown == {
        True: "  cpu heap     a step's freed buffers stay in the process for the next step (glibc: up to 1 GiB each); "
              "NXDT_KEEP_CPU_HEAP=0 gives them back to the OS",
        False: "  cpu heap     glibc's defaults: buffers over 32 MiB are mapped afresh each step",
        None: None}


def test_plan_prints_the_summarys_lines_and_json_figures(capsys):
    argv = ["--config-path", CONF, "--config-name", "tiny_llama_cpu", *TINY, "trainer.max_tokens=2000"]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    summary = _summary(capsys, _load("trainer.max_tokens=2000"))
    at = text.index(BUDGET_LINES[0])  # the peak and step-time lines follow them
    assert text[at:at + 3] == BUDGET_LINES == [line for line in summary if line in BUDGET_LINES]
    assert plan_main([*argv, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["global_batch_size"], p["seq_length"], p["tokens_per_step"]) == (4, 32, 128)
    assert (p["max_steps"], p["max_tokens"], p["total_tokens"]) == (16, 2000, 16 * 128)


# --------------------------------------------------------------------------- the timing line

NOON = time.mktime((2025, 6, 3, 12, 0, 0, 0, 0, -1))  # local time: the ETA is printed in it


def _fit(monkeypatch, capsys, step_times, max_steps, start_step=0, rank0=True) -> list[str]:
    """Runs ThroughputMonitor's step hooks over `step_times` (s) from `start_step` (a resume when
    > 0), the clock at NOON; the lines printed."""
    clock = iter(t for step in step_times for t in (100.0, 100.0 + step))
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(callbacks.time, "time", lambda: NOON)
    trainer = SimpleNamespace(global_step=start_step, max_steps=max_steps, is_global_zero=rank0, world_size=1)
    module = SimpleNamespace(log_step_scalar=lambda name, value, prog_bar=False: None)
    monitor = ThroughputMonitor(None)
    for _ in step_times:
        monitor.on_train_batch_start(trainer, module, None, 0)
        trainer.global_step += 1  # the optimizer step
        monitor.on_train_batch_end(trainer, module, None, None, 0)
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("timing:")]


WARM_UP, TIMED = 9.0, [0.5, 0.7, 0.6, 0.8, 0.9]  # mean 0.7 s over steps 2-6


def test_timing_line_once_after_the_timed_steps(monkeypatch, capsys):
    assert TIMED_STEPS == len(TIMED)
    lines = _fit(monkeypatch, capsys, [WARM_UP, *TIMED, 0.1, 5.0, 0.3], max_steps=5000)
    left = 5000 - 6
    eta = time.strftime("%H:%M", time.localtime(NOON + 0.7 * left))
    assert eta == "12:58"
    # 0.7 x 4994 = 3495.8 s left; the whole run: 9 + 3.5 spent + 3495.8 = 3508.3 s
    assert lines == [f"timing: 0.7 s/step over steps 2-6 -> 0:58:16 for the {left} steps left, "
                     f"0:58:28 for the whole run (ETA {eta})"]


def test_timing_line_finishing_another_day_and_after_a_resume(monkeypatch, capsys):
    # 0.7 x 199,994 s = 38 h 53 m: the ETA names the day
    lines = _fit(monkeypatch, capsys, [WARM_UP, *TIMED], max_steps=200_000)
    eta = time.strftime("%a %d %b %H:%M", time.localtime(NOON + 0.7 * 199_994))
    assert lines == [f"timing: 0.7 s/step over steps 2-6 -> 38:53:16 for the 199994 steps left, "
                     f"38:53:28 for the whole run (ETA {eta})"]
    # resumed at step 3 (the first fit stopped before printing): timed over steps 5-9
    lines = _fit(monkeypatch, capsys, [WARM_UP, *TIMED, 1.0], max_steps=100, start_step=3)
    assert lines == [f"timing: 0.7 s/step over steps 5-9 -> 0:01:04 for the 91 steps left, "
                     f"0:01:16 for this fit (steps 4-100) (ETA {time.strftime('%H:%M', time.localtime(NOON + 63.7))})"]


@pytest.mark.parametrize(("max_steps", "start_step", "rank0"), [
    (4, 0, True),      # the run ends before the timed steps are done
    (6, 0, True),      # ... or with the last of them: nothing left to estimate
    (5000, 6, True),   # resumed past the timed steps: the first fit printed it
    (5000, 40, True),
    (5000, 0, False),  # not rank 0
])
def test_no_timing_line(monkeypatch, capsys, max_steps, start_step, rank0):
    steps = [WARM_UP, *TIMED, 0.1, 0.2][:max_steps - start_step]
    assert _fit(monkeypatch, capsys, steps, max_steps, start_step, rank0) == []
