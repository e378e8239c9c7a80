"""End to end: examples/train.py trains, logs, and data parallelism matches one process.

One single-process run and one 2-rank torchrun run of the same config (same init, same global
batches) are shared by several tests. The 2-rank run is a true command-line launch (torchrun
examples/train.py); the single-process run and the two runs that follow from it share one launch
(conftest.run_pool, through the entry examples/train.py calls): a launch is mostly imports.
"""

from __future__ import annotations

import math

import pytest
from conftest import TINY_OVERRIDES, read_scalars, run_cli, run_pool
from conftest import curve as _curve

STEPS = 6


def _train_args(prefix: str, log_dir, devices: int, extra: list[str] = ()) -> list[str]:
    return [
        "--config-name", "tiny_llama_cpu",
        *TINY_OVERRIDES,
        f"trainer.devices={devices}",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "model.optim.lr=1e-2",
        "model.optim.sched.warmup_steps=2",
        f"data.data_prefix=[1.0,{prefix}]",
        f"exp_manager.explicit_log_dir={log_dir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process(kjv_prefix, tmp_path_factory):
    """One single-process launch (conftest.run_pool), in order: the single run, a rerun from its saved
    config.yaml and an HF-model run."""
    root = tmp_path_factory.mktemp("one_process")
    args = _train_args(kjv_prefix, root / "hf", devices=1, extra=[
        "model_source=hf", "model.model_config=${nxdt_conf:model_configs/tiny_llama/config.json}",
    ])
    argv = {"single": _train_args(kjv_prefix, root / "single", devices=1),
            "rerun": ["--config-path", str(root / "single"), "--config-name", "config",
                      f"exp_manager.explicit_log_dir={root / 'rerun'}"],
            "hf": [a for a in args if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=4"]}
    procs = run_pool(argv, 1, root / "pool")
    return {name: (proc, read_scalars(root / name), root / name) for name, proc in procs.items()}


@pytest.fixture(scope="module")
def single_run(one_process):
    return one_process["single"]


@pytest.fixture(scope="module")
def dp2_run(kjv_prefix, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("dp2")
    proc = run_cli(_train_args(kjv_prefix, log_dir, devices=2), nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, read_scalars(log_dir), log_dir


def test_single_process_trains_and_logs_every_metric(single_run):
    proc, scalars, log_dir = single_run
    for tag in ("reduced_train_loss", "lr", "gradient_norm", "parameter_norm", "consumed_samples",
                "throughput", "step_time", "val_loss"):
        assert tag in scalars, f"{tag} missing from TensorBoard; have {sorted(scalars)}"
    losses = _curve(scalars)
    assert len(losses) == STEPS
    # random init over an 8192-token vocab starts near ln(8192) and must fall within a few steps
    assert abs(losses[0] - math.log(8192)) < 0.5
    assert losses[-1] < losses[0] - 0.5
    # each step consumes one global batch of 8 samples
    assert _curve(scalars, "consumed_samples") == [8.0 * (i + 1) for i in range(STEPS)]
    # validation ran at steps 3 and 6 (val_check_interval=3)
    assert len(scalars["val_loss"]) == 2
    assert (log_dir / "config.yaml").is_file()
    # the start summary is printed
    assert "parameters" in proc.stdout and "tokens/step  256" in proc.stdout


def test_lr_follows_the_configured_schedule(single_run):
    """CosineAnnealing(warmup 2, max_steps 6, min_lr 1e-4, lr 1e-2): NeMo's formula by hand."""
    _, scalars, _ = single_run
    lr, min_lr, warmup, max_steps = 1e-2, 1e-4, 2, STEPS
    expected = []
    for step in range(STEPS):
        if step < warmup:
            expected.append(lr * (step + 1) / (warmup + 1))
        else:
            progress = (step - warmup) / (max_steps - warmup)
            expected.append(min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress)))
    assert _curve(scalars, "lr") == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_data_parallel_matches_single_process(single_run, dp2_run):
    """dp=2 (2 ranks × 2 micro-batches of 2) sees the same global batches as 1 rank × 4 micro-batches."""
    single = _curve(single_run[1])
    dp2 = _curve(dp2_run[1])
    assert len(dp2) == STEPS
    assert max(abs(a - b) for a, b in zip(single, dp2)) < 1e-5, (single, dp2)
    assert _curve(single_run[1], "gradient_norm") == pytest.approx(_curve(dp2_run[1], "gradient_norm"), abs=1e-5)
    assert _curve(single_run[1], "val_loss") == pytest.approx(_curve(dp2_run[1], "val_loss"), abs=1e-5)
    assert "dp=2" in dp2_run[0].stdout


@pytest.fixture(scope="module")
def more_runs(one_process):
    """A rerun from the single run's saved config.yaml and an HF-model run (in the single run's launch)."""
    return {name: one_process[name][:2] for name in ("rerun", "hf")}


def test_rerun_from_the_saved_config_reproduces_the_run(single_run, more_runs):
    """The log dir's config.yaml (the typed config written back as resolved YAML) is a config a
    user can rerun as is: the same losses come out."""
    _, scalars, log_dir = single_run
    saved = (log_dir / "config.yaml").read_text()
    assert "custom:" not in saved and "data_prefix:" in saved  # data.custom is not a YAML key
    assert _curve(more_runs["rerun"][1]) == _curve(scalars)


def test_hf_model_source_trains(more_runs):
    """model_source: hf builds transformers' LlamaForCausalLM from a local config.json and trains it."""
    proc, scalars = more_runs["hf"]
    assert "model_source=hf" in proc.stdout
    losses = _curve(scalars)
    assert len(losses) == 4 and losses[-1] < losses[0]
