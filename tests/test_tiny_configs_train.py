"""The tiny configs of the families added for issue 36 (Qwen3, Qwen3-MoE, DeepSeek-V3) train as shipped on
2 CPU ranks with falling loss, and a run stopped at a checkpoint and started again continues bit for bit.

Per config, three runs in one 2-rank launch (conftest.run_pool, in this order): six steps uninterrupted;
three steps that save at their end; the same command line with six steps in that folder, which resumes
from the step-3 checkpoint (exp_manager.resume_if_exists). Only the schedule is shortened (warmup 2 of 6
steps), validation is off and the data loads in the rank (conftest.TINY_OVERRIDES says why); the model, batches, optimizer and parallel layout are the shipped ones
(DeepSeek-V3's loss-free balancing included: its selection bias is state the checkpoint must carry).
"""

from __future__ import annotations

import pytest
from conftest import curve, read_scalars, run_pool

CONFIGS = ("tiny_qwen3_cpu", "tiny_qwen3_moe_cpu", "tiny_deepseek_v3_cpu")
STEPS, SAVED = 6, 3
pytestmark = pytest.mark.slow


def _args(config: str, prefix: str, log_dir, steps: int) -> list[str]:
    return ["--config-name", config, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
            "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "data.num_workers=0",  # a worker forked from a rank with gloo's threads can hang: conftest.TINY_OVERRIDES
            f"model.optim.sched.max_steps={STEPS}", "model.optim.sched.warmup_steps=2",
            f"data.data_prefix=[1.0,{prefix}]", f"exp_manager.explicit_log_dir={log_dir}",
            "exp_manager.create_checkpoint_callback=true",
            f"exp_manager.checkpoint_callback_params.every_n_train_steps={SAVED}",
            "exp_manager.checkpoint_callback_params.save_top_k=-1", "exp_manager.resume_if_exists=true",
            "exp_manager.resume_ignore_no_checkpoint=true"]


@pytest.fixture(scope="module")
def runs(kjv_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_configs")
    jobs = {}
    for config in CONFIGS:
        jobs[f"{config}_whole"] = _args(config, kjv_prefix, root / f"{config}_whole", STEPS)
        jobs[f"{config}_first"] = _args(config, kjv_prefix, root / f"{config}_stopped", SAVED)
        jobs[f"{config}_resumed"] = _args(config, kjv_prefix, root / f"{config}_stopped", STEPS)
    procs = run_pool(jobs, 2, root / "pool")
    return root, procs


@pytest.mark.parametrize("config", CONFIGS)
def test_tiny_config_trains_and_resumes_bit_for_bit(config, runs):
    root, procs = runs
    whole = curve(read_scalars(root / f"{config}_whole"))
    stopped = curve(read_scalars(root / f"{config}_stopped"))
    assert len(whole) == STEPS, whole
    assert whole[-1] < whole[0] - 0.1, f"{config}: loss did not fall: {whole}"
    assert "resum" in procs[f"{config}_resumed"].stdout.lower(), procs[f"{config}_resumed"].stdout[-2000:]
    assert stopped == whole, f"{config}: the resumed run differs\n{whole}\n{stopped}"
