"""One training run once its config is loaded and its env vars are set: the run spec (built once,
here, and passed down), the mesh shape, the log dir and its lock, the loggers and the ordered callback list, the Trainer, the data module
and the LightningModule; then `trainer.fit`. The command line around it (Hydra's flags, sweeps,
the closing commands) is nxdt.tools.train; evaluation reuses `build_trainer` (nxdt.training.evaluate).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl

from nxdt.checkpoint.callbacks import check_checkpoint_params
from nxdt.checkpoint.resume import check_weight_init, setup_checkpointing
from nxdt.config.errors import ConfigError
from nxdt.config.load import global_rank as _global_rank
from nxdt.data.custom import custom_datamodule_class
from nxdt.data.select import build_datamodule
from nxdt.data.tokenizers import build_tokenizer
from nxdt.exp.exp_manager import build_loggers, resolve_dirs, setup_exp_manager
from nxdt.exp.loggers import check_loggers
from nxdt.device import check_neuron, use_xla, uses_native_neuron
from nxdt.exp.run_lock import RunLock, check_run_lock
from nxdt.hardware import local_device_type
from nxdt.observability.callbacks import CompileTimer, MemoryMonitor, RunFigures, RunSummary, ThroughputMonitor
from nxdt.observability.profiler import check_profiler
from nxdt.observability.progress import ProgressLines, StepProgressBar, shows_bar
from nxdt.observability.samples import SampleGenerator
from nxdt.observability.user_callbacks import extra_callbacks
from nxdt.optim.optimizers import resolve_optimizer
from nxdt.parallel.parallelize import compile_backend_missing
from nxdt.planner.estimate import model_vocabulary, planned_vocab
from nxdt.spec import build_spec
from nxdt.training import xla
from nxdt.training.dynamic_selection import DynamicDataSelection
from nxdt.training.fault_tolerance import FaultTolerance, requeue_slurm_job
from nxdt.rl.module import check_grpo_inputs
from nxdt.training.finetuning import check_lora_targets
from nxdt.training.module import NxdtLightningModule
from nxdt.training.strategy import NeuronAccelerator, NxdtStrategy, native_neuron_strategy


@dataclass
class TrainOutcome:
    """What a finished (or preempted) fit leaves for the entry to report."""

    trainer: Any
    module: Any
    dirs: Any
    """The run's exp_manager dirs (log dir, checkpoint dir)."""
    preempted: bool
    """A preemption signal stopped the run (it saved first)."""


def build_trainer(cfg, layout, loggers, callbacks):
    """Lightning's Trainer for nxdt: its strategy builds the DeviceMesh of `layout`; one batch is one
    optimizer step; nxdt's samplers, checkpoint callback and progress bar instead of Lightning's."""
    t = cfg.trainer
    if use_xla(cfg):  # torch-xla: Lightning's XLA accelerator with nxdt's bookkeeping (xla.py)
        accelerator, strategy = xla.lightning_accelerator(cfg), xla.build_xla_strategy(layout)
    elif uses_native_neuron(cfg):  # TorchNeuron's native device: trainer.accelerator neuron / auto (nxdt.device)
        accelerator, strategy = NeuronAccelerator(), native_neuron_strategy(layout)
    else:
        accelerator, strategy = t.accelerator, NxdtStrategy(layout)
    # several XLA devices are one SPMD process (nxdt.parallel.xla_spmd): Lightning sees one device
    devices, num_nodes = (1, 1) if use_xla(cfg) else (t.devices, t.num_nodes)
    return pl.Trainer(
        accelerator=accelerator,
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
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
        enable_progress_bar=shows_bar(cfg),  # no bar in a file: ProgressLines (nxdt.observability.progress)
        enable_model_summary=False,
    )


def quiet_lightning() -> None:
    """Lightning's start banners (devices, 'Initializing distributed', adverts) and end notes go to
    the rank log file only, not the console: nxdt's start summary says what they said. Warnings
    that are about Lightning's internals, or that nxdt handles on purpose, are silenced."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    # we reduce val_loss over dp ourselves (all_reduce_mean) before logging it
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*does not have many workers which may be a bottleneck")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
CPU_HEAP_BYTES = 1 << 30


def keep_cpu_heap(limit: int = CPU_HEAP_BYTES) -> bool:
    """CPU training with glibc: buffers up to `limit` bytes come from the heap, and freed heap memory
    is kept for the next step (up to 2 x `limit` of it) instead of going back to the OS. By default
    glibc maps every buffer over 32 MiB (a step's logits and their gradients) afresh and trims the
    heap as soon as 2 x its last such buffer is free, so each step touches its activations' pages
    anew: a page fault per 4 KiB, which on the reference shape cost 10% of the step (fp32) and 30%
    under bf16 autocast (docs/performance.md, issue 40). PyTorch's CPU allocator caches nothing
    itself; its tuning guide's remedy is another malloc (LD_PRELOAD), this is glibc's own setting.
    The process's resident memory then stays near the step's peak between steps instead of falling
    back, and its peak grows a little (torchtitan's debugmodel shape: 1.40-1.47 GB against 1.31 GB).
    NXDT_KEEP_CPU_HEAP=0 leaves glibc as it was. True when set."""
    if os.environ.get("NXDT_KEEP_CPU_HEAP", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt
    return bool(libc.mallopt(M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * limit))


def sample_tokenizer(cfg, datamodule):
    """The tokenizer the data module uses, else the one data.tokenizer names."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg.data.tokenizer)
    return tokenizer


def train(cfg, record_job: Callable[[Path], None] | None = None) -> TrainOutcome:
    """Train one config. `record_job(log_dir)`: called on rank 0 once the log dir is this run's (the
    entry writes Hydra's `.hydra/` record there). Everything that may refuse (checkpoint keys and the
    resume, the profiler and user callbacks, the loggers, the run lock) runs before anything is written."""
    quiet_lightning()
    spec = build_spec(cfg)  # the run spec, once: everything below reads it
    check_run(spec)  # before anything is written or any process group starts (nxdt plan runs it too)
    heap_kept = None  # keep_cpu_heap's outcome where it applies, for the start summary
    if local_device_type(cfg.trainer.accelerator) == "cpu" and not use_xla(cfg) and platform.libc_ver()[0] == "glibc":
        heap_kept = keep_cpu_heap()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    dirs = resolve_dirs(cfg)
    resume, resume_helper, checkpointing = setup_checkpointing(cfg, dirs)
    profiler, user_callbacks = extra_callbacks(cfg, dirs.log_dir, spec.layout.world_size, _global_rank())
    loggers = build_loggers(cfg, dirs)  # a missing package or a bad logger argument: refused, nothing written
    lock = take_run_lock(cfg, dirs.log_dir)  # one writer per log dir
    try:
        setup_exp_manager(cfg, dirs, _global_rank(), loggers)
        if record_job is not None and _global_rank() == 0:
            record_job(dirs.log_dir)
        fault_tolerance = FaultTolerance(cfg)
        figures = RunFigures(spec)  # nxdt plan's figures and the device's peak, once, at fit start
        callbacks = [
            *profiler,  # first: its step boundary and trace writing stay out of the step times measured after it
            resume_helper,
            MemoryMonitor(cfg, figures),  # before throughput: a sampled step's scan is not in the step time
            ThroughputMonitor(spec.layout.tokens_per_step, figures),
            RunSummary(spec, str(dirs.log_dir), figures, heap_kept),
            *([DynamicDataSelection()] if cfg.data.dynamic_data_selection != "none" else []),  # moves the blend
            StepProgressBar() if shows_bar(cfg) else ProgressLines(),  # a bar on a terminal, lines in a file
            *([CompileTimer()] if spec.compile and not use_xla(cfg) else []),  # once, after the first step
            *user_callbacks,  # the user's trainer.callbacks after nxdt's own
            # checkpointing after every callback that logs (Lightning's order for its own checkpoint
            # callbacks): a step's scalars, throughput included, are logged before its checkpoint is saved
            *([checkpointing] if checkpointing is not None else []),
            fault_tolerance,  # after the step's own save: a preemption save then finds the step saved, or saves it
        ]
        trainer, datamodule, module = build_run_parts(spec, loggers, callbacks)
        if cfg.exp_manager.samples.prompts:  # text generated during training (nxdt.observability.samples)
            trainer.callbacks.append(SampleGenerator(cfg, sample_tokenizer(cfg, datamodule), datamodule.vocab_size))
        return _fit(trainer, datamodule, module, resume, fault_tolerance, dirs, lock)
    finally:
        if lock is not None:
            lock.release()


def build_run_parts(spec, loggers: list, callbacks: list):
    """The Trainer, the data module and the LightningModule of a run or an evaluation, in the order
    they need each other: the data module asks the Trainer's strategy for the dp layout, the module
    takes the data's vocabulary. Their pre-flight checks are `check_run_parts` (the caller's)."""
    trainer = build_trainer(spec.cfg, spec.layout, loggers, callbacks)
    # custom (data.data_module) > SFT > dummy > data.datasets > HF (train_dir) > Megatron
    datamodule = build_datamodule(spec, trainer)
    return trainer, datamodule, NxdtLightningModule(spec, vocab_size=model_vocabulary(spec.cfg, datamodule.vocab_size))


def check_run_parts(spec) -> None:
    """What building the run's parts (`build_run_parts`) would refuse, checked before anything is
    written: a custom data module's class, the LoRA targets (on a meta-device model; the vocabulary
    does not change the names, so the plan's, nxdt.planner.estimate.planned_vocab, will do)."""
    cfg = spec.cfg
    if spec.data_kind == "custom":
        custom_datamodule_class(cfg.data.data_module)
    if spec.alignment.peft is not None:
        check_lora_targets(spec, planned_vocab(cfg)[0])
    check_grpo_inputs(spec)  # GRPO: the reward functions import, the prompt rows have a prompt


def check_run(spec) -> None:
    """The checks a run makes before anything is written that read no file; `nxdt plan` runs the same
    (nxdt.tools.plan). The files' own checks are nxdt.spec.paths."""
    cfg = spec.cfg
    exp = cfg.exp_manager
    check_neuron(cfg.trainer.accelerator)  # neither TorchNeuron nor torch-xla: one line
    check_compile_backend(spec)
    check_checkpoint_params(exp.checkpoint_callback_params)
    check_weight_init(cfg)
    if exp.profiler.enabled:
        check_profiler(exp.profiler, spec.layout.world_size)
    check_loggers(exp)
    resolve_optimizer(cfg.model.optim)  # configure_optimizers builds it after the process group starts
    check_run_parts(spec)


def check_compile_backend(spec) -> None:
    """model.fusions.torch_compile where torch cannot compile for the run's device: one line (exit 2)."""
    cfg = spec.cfg
    if not spec.compile or use_xla(cfg):
        return

    device = local_device_type(cfg.trainer.accelerator)
    why = compile_backend_missing(device) if device else None
    if why:
        raise ConfigError(f"model.fusions.torch_compile: {why}; install it, or set model.fusions.torch_compile=false "
                          "(and model.use_torch_compile=false)")


def take_run_lock(cfg, log_dir):
    """Rank 0 takes <log_dir>/nxdt.lock (the other ranks only check it); None when exp_manager.run_lock=false
    or on other ranks. ConfigError: another live run holds it, it cannot be parsed, or the dir is not writable."""
    exp = cfg.exp_manager
    if not exp.run_lock:
        return None
    if _global_rank() != 0:
        check_run_lock(log_dir, exp.run_lock_lease)
        return None
    return RunLock.acquire(log_dir, exp.run_lock_lease, notice=lambda line: print(line, flush=True))


def _fit(trainer, datamodule, module, resume, fault_tolerance: FaultTolerance, dirs, lock) -> TrainOutcome:
    """trainer.fit from the checkpoint the run resumes (weights only: ResumeHelper loads them), with
    the preemption signal handlers installed; a preempted run releases its lock and requeues."""
    ckpt_path = resume.full_resume
    fault_tolerance.install()  # a preemption signal during fit's setup (model build, checkpoint load) counts too
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    finally:
        fault_tolerance.restore()  # the signal handlers from before the run
    if fault_tolerance.preempted_at is not None:
        if lock is not None:
            lock.release()  # before the requeue: the job's next instance may start as soon as this one ends
        if trainer.is_global_zero and fault_tolerance.requeue:
            requeue_slurm_job()
    return TrainOutcome(trainer, module, dirs, preempted=fault_tolerance.preempted_at is not None)
