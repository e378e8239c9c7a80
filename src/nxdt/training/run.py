"""`nxdt train` / examples/train.py: compose the config, set env vars, then import torch and train.

Order matters: the config is composed and validated, and the Neuron / precision environment
variables it implies are set, before torch (or torch-xla) is imported — they are read at import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def _world_size_from_env() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("GLOBAL_RANK", "0")))


def main(argv: list[str] | None = None) -> int:
    from nxdt.config.env import apply_env
    from nxdt.config.load import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print_help(argv[1] if len(argv) > 1 else None)
        return 0
    cfg = load_config(argv, default_config_dir=REPO_CONF_DIR, world_size=_world_size_from_env())
    inert = apply_env(cfg)
    if inert and _global_rank() == 0:
        print(f"note: Neuron-only keys have no effect on this device: {', '.join(inert)}", file=sys.stderr)
    from nxdt.precision.precision import NumericalInstabilityError

    try:
        if cfg.trainer.max_epochs == 0:  # evaluate only: the checkpoint the run would start from
            from nxdt.training.evaluate import evaluate_only

            evaluate_only(cfg)
        else:
            train(cfg)
    except NumericalInstabilityError as err:  # NaN/inf or fp16 overflow stop: one line, exit 3
        if _global_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


def print_help(section: str | None = None) -> None:
    """Usage plus every config key with its type, default and description (from the schema)."""
    from nxdt.config import describe

    print(__doc__.strip().splitlines()[0])
    print("usage: examples/train.py [--config-path DIR] --config-name NAME [key=value | +key=value | ~key ...]")
    print("       examples/train.py --help [SECTION]   (SECTION: trainer, exp_manager, distributed_strategy, data, model, precision)")
    print(f"shipped configs: {', '.join(sorted(p.stem for p in REPO_CONF_DIR.glob('*.yaml')))}\n")
    print(describe(section))


def build_trainer(cfg, layout, mesh_shape, loggers, callbacks):
    import lightning.pytorch as pl

    from nxdt.training.strategy import NxdtStrategy

    from nxdt.training import xla

    t = cfg.trainer
    on_xla = xla.use_xla(cfg)  # torch-xla: Lightning's XLA accelerator with nxdt's bookkeeping (xla.py)
    return pl.Trainer(
        accelerator=xla.lightning_accelerator(cfg) if on_xla else t.accelerator,
        strategy=xla.build_xla_strategy(mesh_shape) if on_xla else NxdtStrategy(mesh_shape),
        devices=t.devices,
        num_nodes=t.num_nodes,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval,
        # an int val_check_interval counts steps across epochs (NeMo), also after a resume
        check_val_every_n_epoch=None if isinstance(t.val_check_interval, int) else t.check_val_every_n_epoch,
        num_sanity_val_steps=t.num_sanity_val_steps,
        limit_val_batches=t.limit_val_batches,
        limit_test_batches=t.limit_test_batches,
        # one batch = one optimizer step; accumulation happens inside training_step
        accumulate_grad_batches=1,
        # our samplers shard over the mesh's dp axis; Lightning's would shuffle and shard over all ranks
        use_distributed_sampler=False,
        logger=loggers or False,
        callbacks=callbacks,
        # checkpoints are nxdt.checkpoint's NxdtCheckpoint callback, never Lightning's ModelCheckpoint
        enable_checkpointing=False,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,
    )


def quiet_known_warnings() -> None:
    """Silence warnings that are about Lightning's internals or that we handle on purpose."""
    import warnings

    # we reduce val_loss over dp ourselves (all_reduce_mean) before logging it
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*does not have many workers which may be a bottleneck")


def layout_and_mesh(cfg):
    """The run's layout (nxdt.config.layout) and the shape of its DeviceMesh."""
    from nxdt.config.layout import compute_layout
    from nxdt.config.sharding import sharding_mode_of
    from nxdt.parallel.mesh import mesh_shape_from_layout

    layout = compute_layout(cfg, cfg.trainer.devices * cfg.trainer.num_nodes)
    mesh_shape = mesh_shape_from_layout(
        layout, sharding_mode_of(cfg.distributed_strategy),
        cfg.distributed_strategy.hsdp_replicate_size or cfg.trainer.num_nodes  # null: shard within a node
    )
    return layout, mesh_shape


def sample_tokenizer(cfg, datamodule):
    """The tokenizer the data module uses, else the one data.tokenizer names."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is None:
        from nxdt.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(cfg.data.tokenizer)
    return tokenizer


def train(cfg):
    import lightning.pytorch as pl

    from nxdt.checkpoint.resume import setup_checkpointing
    from nxdt.checkpoint.callbacks import NxdtCheckpoint
    from nxdt.data.select import build_datamodule
    from nxdt.exp.exp_manager import resolve_dirs, setup_exp_manager
    from nxdt.training.callbacks import RunSummary, ThroughputMonitor
    from nxdt.training.finetuning import check_lora_targets
    from nxdt.training.module import NxdtLightningModule
    from nxdt.training.progress import StepProgressBar

    quiet_known_warnings()
    layout, mesh_shape = layout_and_mesh(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    dirs = resolve_dirs(cfg)
    resume, callbacks = setup_checkpointing(cfg, dirs)  # may refuse: before anything is written
    loggers = setup_exp_manager(cfg, dirs, _global_rank())
    callbacks += [ThroughputMonitor(layout.tokens_per_step), RunSummary(cfg, layout, str(dirs.log_dir))]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar())
    # checkpointing last (Lightning's order for its own checkpoint callbacks): a step's scalars,
    # throughput included, are all logged before the step's checkpoint is saved
    callbacks.sort(key=lambda callback: isinstance(callback, NxdtCheckpoint))
    trainer = build_trainer(cfg, layout, mesh_shape, loggers, callbacks)
    # custom (data.data_module) > SFT > dummy > data.datasets > HF (train_dir) > Megatron
    datamodule = build_datamodule(cfg, trainer)
    check_lora_targets(cfg, datamodule.vocab_size)  # a bad LoRA target: one line, before any process group
    module = NxdtLightningModule(cfg, layout, vocab_size=datamodule.vocab_size)
    if cfg.exp_manager.samples.prompts:  # text generated during training (nxdt.training.samples)
        from nxdt.training.samples import SampleGenerator

        trainer.callbacks.append(SampleGenerator(cfg, sample_tokenizer(cfg, datamodule), datamodule.vocab_size))
    ckpt_path = resume.full_resume  # weights only: ResumeHelper loads them
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    if trainer.is_global_zero:
        final = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("reduced_train_loss", "val_loss")}
        if final:
            print("final " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items())), flush=True)
        print(f"logs and TensorBoard files: {dirs.log_dir}  (tensorboard --logdir {dirs.log_dir})", flush=True)
    return trainer, module


def entry() -> None:
    """Console entry used by examples/train.py: one clear line and exit 2 on bad input."""
    from nxdt.config.load import main_guard

    sys.exit(main_guard(main)())
