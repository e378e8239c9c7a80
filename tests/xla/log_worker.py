"""Run by tests/xla/test_xla_logging.py in a fresh process: the product training path
(`nxdt.training.trainer.train`, Lightning on one XLA:CPU device) on a tiny Llama, counting torch-xla
graph executions per optimizer step.

usage: log_worker.py MODE LOG_DIR DATA_PREFIX STEPS
  MODE  closures: as shipped (XLA, step scalars read in step closures)
        direct:   XLA with the step-closure logger switched off, i.e. Lightning's self.log on
                  device tensors (the behaviour before step closures: it reads them mid-loop)
        silent:   XLA, per-step scalars dropped (no logging at all): the executions the step itself needs
Prints one line: RESULT {"executions": [per-step graph executions], "compiles": ..., ...}.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(mode: str, log_dir: str, data_prefix: str, steps: int) -> None:
    sys.path.insert(0, os.path.join(HERE, ".."))
    from conftest import TINY_OVERRIDES
    from nxdt.config.env import apply_env
    from nxdt.spec import load_config

    cfg = load_config(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                       f"trainer.max_steps={steps}", "trainer.accelerator=xla",
                       "model.optim.sched.warmup_steps=1", "model.optim.lr=1e-2", "precision.type=fp32",
                       # validation and checkpoints cut graphs of their own: keep them out of the count
                       f"trainer.val_check_interval={steps + 1}", "trainer.limit_val_batches=0",
                       "trainer.num_sanity_val_steps=0", "exp_manager.create_checkpoint_callback=false",
                       "exp_manager.log_gradient_norm=true", f"data.data_prefix=[1.0,{data_prefix}]",
                       f"exp_manager.explicit_log_dir={log_dir}"],
                      world_size=1, check_paths=False, quiet=True)
    apply_env(cfg)  # before torch / torch_xla are imported

    from lightning.pytorch.callbacks import Callback

    import nxdt.training.module as module_mod
    import nxdt.training.trainer as run_mod

    counts: list[int] = []

    class CountExecutions(Callback):
        """Graph executions (torch-xla's ExecuteTime samples) between consecutive batch starts."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            import torch_xla.debug.metrics as met

            data = met.metric_data("ExecuteTime")
            counts.append(data[0] if data else 0)

    build_trainer = run_mod.build_trainer

    def build_trainer_counting(cfg, layout, loggers, callbacks):
        return build_trainer(cfg, layout, loggers, [*callbacks, CountExecutions()])

    run_mod.build_trainer = build_trainer_counting
    if mode == "direct":
        module_mod.step_logger = lambda cfg: None
    elif mode == "silent":
        class Drop:
            def log(self, *args, **kwargs) -> None:
                pass

        module_mod.step_logger = lambda cfg: Drop()
    run_mod.train(cfg)
    import torch_xla.debug.metrics as met

    out = {"mode": mode, "executions": [b - a for a, b in zip(counts, counts[1:])],
           "compiles": (met.metric_data("CompileTime") or [0])[0],
           "transfers_from_device": (met.metric_data("TransferFromDeviceTime") or [0])[0]}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
