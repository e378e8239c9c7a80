"""Evaluate a checkpoint: loss and perplexity on the validation and test splits of the configured data.

Two entries end here: `nxdt evaluate --checkpoint DIR [key=value ...]` (nxdt.tools.evaluate: the
checkpoint's own config.yaml plus overrides) and a training command line with
`trainer.max_epochs=0` (evaluate only: the checkpoint the run would start from, see
`nxdt.checkpoint.resume.evaluation_plan`). Both give `evaluate(cfg, plan)`.

    loss       = sum of the per-token cross entropy / number of loss tokens, over every token
                 the split's evaluated batches hold (all data-parallel ranks' shares)
    perplexity = exp(loss)

It is Lightning's own `trainer.validate` (validation split) and `trainer.test` (test split) on
the training's LightningModule and data module, in any layout training supports: the model is
built and parallelized by `configure_model` as for training, the weights are loaded by
`nxdt.checkpoint` (resharded to this layout; weights only: no optimizer, RNG or data state), and
`validation_step` / `test_step` keep token-weighted sums beside the loss training logs
(`nxdt.training.loss.EvalTally`). How many batches: `trainer.limit_val_batches` /
`limit_test_batches`, as in training (0 turns a split off). A split without data is left out of
the result; no data in either split is an error (one line, exit 2).

The result is written by rank 0 beside the checkpoint, never inside it (a complete checkpoint
is never changed): `<checkpoints dir>/<checkpoint name>.eval.json`. Checkpoint listing
(retention, resume) only looks at directories, so these files are ignored there.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nxdt.checkpoint.resume import ResumePlan, evaluation_plan, load_plan_weights
from nxdt.checkpoint.state import META, layout_of, read_json
from nxdt.config.errors import ConfigError
from nxdt.exp.exp_manager import resolve_dirs
from nxdt.spec import build_spec
from nxdt.training.trainer import build_run_parts, check_run_parts, quiet_lightning

EVAL_SUFFIX = ".eval.json"
# (split name in the result, the Trainer method that runs it)
SPLITS = (("validation", "validate"), ("test", "test"))


def eval_json_path(checkpoint: Path) -> Path:
    """Where the evaluation of `checkpoint` is written: beside it, `<name>.eval.json`."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / f"{checkpoint.name}{EVAL_SUFFIX}"


def check_evaluable(spec) -> None:
    """What evaluate cannot do, refused before anything starts (ConfigError). `spec`: the run spec."""
    cfg, alignment = spec.cfg, spec.alignment
    if alignment.preference is not None:
        raise ConfigError("model_alignment_strategy: evaluate reports the token cross entropy of language-model "
                          "data; DPO / ORPO configs validate on the preference loss instead (train's val_loss)")
    t = cfg.trainer
    if t.limit_val_batches == 0 and t.limit_test_batches == 0:
        raise ConfigError("trainer.limit_val_batches and trainer.limit_test_batches are both 0: nothing to evaluate")


class PlanWeights(Callback):
    """Loads the plan's weights when the first evaluation loop starts: the model has been built and
    parallelized for this layout by then (configure_model), and is kept for the second loop."""

    def __init__(self, plan: ResumePlan) -> None:
        self.plan = plan
        self.loaded = False

    def _load(self, trainer, pl_module) -> None:
        if not self.loaded:
            load_plan_weights(trainer.strategy, self.plan, pl_module.cfg)
            self.loaded = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._load(trainer, pl_module)


def evaluate_only(cfg) -> dict[str, Any]:
    """A training command line with trainer.max_epochs=0: evaluate the checkpoint it would start from."""
    return evaluate(cfg, evaluation_plan(cfg, resolve_dirs(cfg)))


def evaluate(cfg, plan: ResumePlan) -> dict[str, Any]:
    """Run the validation and test loops on the weights of `plan`; write and return the result. An
    entry: the run spec (nxdt.spec.build_spec) is built here, once."""
    spec = build_spec(cfg)
    check_evaluable(spec)
    check_run_parts(spec)
    quiet_lightning()
    # a split without data is reported in the result ("no data"), not as Lightning's warning
    warnings.filterwarnings("ignore", message=r".*Total length of .* across ranks is zero")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer, datamodule, module = build_run_parts(spec, loggers=[], callbacks=[PlanWeights(plan)])
    strategy = trainer.strategy
    # validate, then test, on the same process group, mesh and model (NxdtStrategy; the one-device
    # XLA strategy rebuilds its trivial mesh for the second loop)
    keeps = hasattr(strategy, "release")
    if keeps:
        strategy.keep_alive = True
    splits: dict[str, dict[str, Any]] = {}
    try:
        for split, run in SPLITS:
            module.eval_tally.reset()  # a loop with no batches never reaches on_*_epoch_start
            getattr(trainer, run)(module, datamodule=datamodule, verbose=False)
            loss_sum, tokens, batches = module.eval_tally.totals(module.device_mesh, module.device)
            if batches and tokens:
                loss = loss_sum / tokens
                splits[split] = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
                                 "tokens": int(tokens), "batches": batches}
        world_size = strategy.world_size
        rank0 = strategy.global_rank == 0
        used = layout_of(module)
    finally:
        if keeps:
            strategy.release()
    if not splits:
        raise ConfigError(f"no validation or test data to evaluate: {_no_data_hint(cfg, spec.data_kind)}")
    meta = read_json(plan.path / META) if (plan.path / META).is_file() else {}  # a transformers folder has none
    result = {
        "checkpoint": str(plan.path),
        "step": int(meta.get("step", 0)),
        "consumed_samples": int(meta.get("consumed_samples", 0)),
        "weights_only": plan.weights_only,
        "lora_base": str(plan.base) if plan.base is not None else None,
        "data": spec.data_kind,
        "splits": splits,
        "layout": {"world_size": world_size, **used},
    }
    if rank0:
        out = eval_json_path(plan.path)
        _write_json(out, result)
        print(_table(result, out), flush=True)
    return result


def _no_data_hint(cfg, kind: str) -> str:
    limits = (f"trainer.limit_val_batches={cfg.trainer.limit_val_batches}, "
              f"trainer.limit_test_batches={cfg.trainer.limit_test_batches}")
    if kind in ("megatron", "logical_shards"):
        return f"data.splits_string '{cfg.data.splits_string}' leaves no whole global batch ({limits})"
    if kind in ("hf", "sft", "preference"):
        return (f"data.val_dir={cfg.data.val_dir}, data.test_dir={cfg.data.test_dir} hold no whole global batch "
                f"of {cfg.data.global_batch_size} ({limits})")
    return f"the {kind} data module has no validation or test batches ({limits})"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _table(result: dict[str, Any], out: Path) -> str:
    lay = result["layout"]
    where = " ".join(f"{k}={v}" for k, v in lay.items() if k != "world_size" and (k != "ep" or v != 1))
    lines = [f"evaluated {Path(result['checkpoint']).name} (step {result['step']}) on {lay['world_size']} "
             f"rank{'s' if lay['world_size'] != 1 else ''} ({where})",
             f"{'split':<12}{'loss':>10}{'perplexity':>14}{'tokens':>10}{'batches':>9}"]
    for split, r in result["splits"].items():
        lines.append(f"{split:<12}{r['loss']:>10.4f}{r['perplexity']:>14.3f}{r['tokens']:>10}{r['batches']:>9}")
    for split, _ in SPLITS:
        if split not in result["splits"]:
            lines.append(f"{split:<12}{'(no data)':>10}")
    lines.append(f"written to {out}")
    return "\n".join(lines)
