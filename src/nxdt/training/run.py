"""`nxdt train` / examples/train.py: compose the config, set env vars, then import torch and train.

Order matters: the config is composed and validated, and the Neuron / precision environment
variables it implies are set, before torch (or torch-xla) is imported — they are read at import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nxdt.config.load import global_rank as _global_rank

REPO_CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def _world_size_from_env() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def main(argv: list[str] | None = None) -> int:
    """The training entry: Hydra's command line (nxdt.config.command_line), then one run, a sweep
    (-m), or a printed config (--cfg, --info)."""
    from nxdt.config.command_line import HYDRA_HELP, expand_sweeps, parse_command_line, sweep_keys
    from nxdt.config.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print_help(argv[1] if len(argv) > 1 else None)
        return 0
    cl = parse_command_line(argv)
    if cl.hydra_help:
        print(HYDRA_HELP)
        return 0
    if not cl.multirun and (swept := sweep_keys(cl.overrides)):
        raise ConfigError(f"'{swept[0]}' is a sweep: add -m (--multirun) to run every value, or quote the "
                          "value if the comma is part of it")
    jobs = expand_sweeps(cl.overrides) if cl.multirun else [cl.overrides]
    if cl.show_cfg or cl.info:
        return show_config(cl, jobs)
    if not cl.multirun:
        return run_job(cl, cl.overrides, log_dir=cl.hydra.get("hydra.run.dir"))
    return run_sweep(cl, jobs)


def _dir_override(log_dir) -> list[str]:
    """An explicit_log_dir override for a path, quoted (paths may hold '=', ',' or spaces)."""
    from nxdt.config.load import quote_value

    return [] if log_dir is None else [f"exp_manager.explicit_log_dir={quote_value(str(log_dir))}"]


def load_job(cl, overrides: list[str], log_dir=None, quiet: bool = False):
    """The typed config of one job and what Hydra records of it (nxdt.config.load.compose)."""
    from nxdt.config.load import load_config

    record: dict = {}
    cfg = load_config(cl.compose_argv([*overrides, *_dir_override(log_dir)]), default_config_dir=REPO_CONF_DIR,
                      world_size=_world_size_from_env(), record=record, quiet=quiet)
    return cfg, record


def run_job(cl, overrides: list[str], log_dir=None, job_num: int = 0, loaded=None) -> int:
    """One training (or evaluate-only) run of the command line `cl` with these overrides."""
    from nxdt.config.env import apply_env

    cfg, record = loaded or load_job(cl, overrides, log_dir)
    apply_env(cfg)  # the Neuron-only keys it finds inert are in load_config's notice (nxdt.config.inert)
    from nxdt.checkpoint.save_errors import CheckpointSaveError
    from nxdt.precision.precision import NumericalInstabilityError
    from nxdt.training.launcher_watchdog import watch_launcher

    watch_launcher()  # a rank whose launcher is gone (kill -9 of torchrun) exits instead of living on
    try:
        if cfg.trainer.max_epochs == 0:  # evaluate only: the checkpoint the run would start from
            from nxdt.training.evaluate import evaluate_only

            evaluate_only(cfg)
        else:
            train(cfg, hydra_job=(cl, record, job_num, overrides))
    except (NumericalInstabilityError, CheckpointSaveError) as err:
        # one line: a NaN/inf or fp16 overflow stop (exit 3), a save that failed on some rank (exit 1)
        if _global_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 3 if isinstance(err, NumericalInstabilityError) else 1
    return 0


def _sweep_root(cl, first_job: list[str]) -> Path:
    """Where a sweep's job dirs go: hydra.sweep.dir, else the log dir the first job would use."""
    from nxdt.exp.exp_manager import resolve_dirs

    if "hydra.sweep.dir" in cl.hydra:
        return Path(cl.hydra["hydra.sweep.dir"]).absolute()
    cfg, _ = load_job(cl, first_job, quiet=True)
    return resolve_dirs(cfg).log_dir


def _job_subdir(cl, job_num: int, overrides: list[str]) -> str:
    from nxdt.config.command_line import override_dirname

    subdir = cl.hydra.get("hydra.sweep.subdir", "${hydra.job.num}")
    return subdir.replace("${hydra.job.num}", str(job_num)).replace(
        "${hydra.job.override_dirname}", override_dirname(overrides))


def run_sweep(cl, jobs: list[list[str]]) -> int:
    """-m: every job's config is validated first (a bad value in the last job stops the sweep
    before the first one trains), then the jobs run one after another in this process."""
    from nxdt.config.errors import ConfigError

    world = _world_size_from_env()
    if world is not None and world > 1:
        raise ConfigError("-m (--multirun) sweeps run single-process jobs one after another; under torchrun "
                          "launch one run per sweep point instead")
    root = _sweep_root(cl, jobs[0])

    def label(job: list[str]) -> str:  # the swept values of a job (the other overrides are common)
        return " ".join(o for o in job if o not in cl.overrides) or "(no overrides)"

    loaded = []
    for num, job in enumerate(jobs):
        log_dir = root / _job_subdir(cl, num, job)
        try:
            loaded.append((job, log_dir, load_job(cl, job, log_dir, quiet=num > 0)))
        except ConfigError as err:
            raise ConfigError(f"sweep job #{num} ({label(job)}): {err}") from None
    print(f"[sweep] {len(jobs)} jobs under {root}", flush=True)
    for num, (job, log_dir, job_loaded) in enumerate(loaded):
        print(f"[sweep] job #{num}: {label(job)} -> {log_dir}", flush=True)
        code = run_job(cl, job, log_dir, job_num=num, loaded=job_loaded)
        if code:
            print(f"[sweep] job #{num} failed (exit {code}); the remaining jobs did not run", file=sys.stderr)
            return code
    return 0


def show_config(cl, jobs: list[list[str]]) -> int:
    """--cfg job|hydra|all [--resolve] [--package KEY] and --info: print, train nothing."""
    from omegaconf import OmegaConf

    from nxdt.config.command_line import format_info, hydra_section, print_cfg
    from nxdt.config.load import compose
    from nxdt.exp.exp_manager import resolve_dirs

    record: dict = {}
    log_dir = cl.hydra.get("hydra.run.dir")
    cfg = compose(cl.compose_argv([*jobs[0], *_dir_override(log_dir)]), default_config_dir=REPO_CONF_DIR,
                  record=record)
    log_dir = resolve_dirs(cfg).log_dir
    hydra = hydra_section(cl, log_dir, record["config_dir"], record["config_name"], 0, jobs[0])
    if cl.info:
        print(format_info(cl, record["config_dir"], record["config_name"], record["defaults"], log_dir, jobs))
        return 0
    job = OmegaConf.to_container(cfg, resolve=True) if cl.resolve else record["composed"]
    print_cfg(cl, job, hydra)
    return 0


def print_help(section: str | None = None) -> None:
    """Usage plus every config key with its type, default and description (from the schema)."""
    from nxdt.config import describe

    keys = describe(section)  # first: an unknown section is one error line (exit 2), not a half-printed help
    print(__doc__.strip().splitlines()[0])
    print("usage: examples/train.py [--config-path DIR] --config-name NAME [key=value | +key=value | ~key ...]")
    print("       examples/train.py --help [SECTION]   (SECTION: trainer, exp_manager, distributed_strategy, data, model, precision)")
    print("       Hydra: --cfg job|hydra|all [--resolve] [-p KEY], --info, -m a=1,2 (sweep), hydra.run.dir=DIR "
          "(examples/train.py --hydra-help)")
    print(f"shipped configs: {', '.join(sorted(p.stem for p in REPO_CONF_DIR.glob('*.yaml')))}\n")
    print(keys)


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


def quiet_lightning() -> None:
    """Lightning's start banners (devices, 'Initializing distributed', adverts) and end notes go to
    the rank log file only, not the console: nxdt's start summary says what they said. Warnings
    that are about Lightning's internals, or that nxdt handles on purpose, are silenced."""
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
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


def train(cfg, hydra_job=None):
    """Train one config. `hydra_job`: (command line, compose record, job number, overrides) from
    main(), written to <log_dir>/.hydra/ as Hydra does."""
    import lightning.pytorch as pl

    from nxdt.checkpoint.resume import setup_checkpointing
    from nxdt.exp.exp_manager import build_loggers, resolve_dirs
    from nxdt.training.user_callbacks import extra_callbacks

    quiet_lightning()
    layout, mesh_shape = layout_and_mesh(cfg)
    check_compile_backend(cfg)  # before anything is written or any process group starts
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    dirs = resolve_dirs(cfg)
    resume, callbacks = setup_checkpointing(cfg, dirs)  # may refuse: before anything is written
    # the profiler first (its step boundary and trace writing stay out of the step times measured
    # after it); the user's trainer.callbacks after nxdt's own. Both may refuse, before anything is written
    profiler, user_callbacks = extra_callbacks(cfg, dirs.log_dir, layout.world_size, _global_rank())
    callbacks = profiler + callbacks
    loggers = build_loggers(cfg, dirs)  # a missing package or a bad logger argument: refused, nothing written
    lock = take_run_lock(cfg, dirs.log_dir)  # one writer per log dir; before anything is written
    try:
        return _train(cfg, hydra_job, layout, mesh_shape, dirs, resume, callbacks, user_callbacks, loggers, lock)
    finally:
        if lock is not None:
            lock.release()


def check_compile_backend(cfg) -> None:
    """model.fusions.torch_compile where torch cannot compile for the run's device: one line (exit 2)."""
    from nxdt.config.compile_settings import wants_compile
    from nxdt.config.errors import ConfigError
    from nxdt.training import xla

    if not wants_compile(cfg) or xla.use_xla(cfg):
        return
    from nxdt.hardware import local_device_type
    from nxdt.parallel.parallelize import compile_backend_missing

    device = local_device_type(cfg.trainer.accelerator)
    why = compile_backend_missing(device) if device else None
    if why:
        raise ConfigError(f"model.fusions.torch_compile: {why}; install it, or set model.fusions.torch_compile=false "
                          "(and model.use_torch_compile=false)")


def take_run_lock(cfg, log_dir):
    """Rank 0 takes <log_dir>/nxdt.lock (the other ranks only check it); None when exp_manager.run_lock=false
    or on other ranks. ConfigError: another live run holds it, it cannot be parsed, or the dir is not writable."""
    from nxdt.exp.run_lock import RunLock, check_run_lock

    exp = cfg.exp_manager
    if not exp.run_lock:
        return None
    if _global_rank() != 0:
        check_run_lock(log_dir, exp.run_lock_lease)
        return None
    return RunLock.acquire(log_dir, exp.run_lock_lease, notice=lambda line: print(line, flush=True))


def _train(cfg, hydra_job, layout, mesh_shape, dirs, resume, callbacks, user_callbacks, loggers, lock):
    """train() once the log dir is ours: the loggers, callbacks, trainer, data and model; then fit."""
    from nxdt.checkpoint.callbacks import NxdtCheckpoint
    from nxdt.data.select import build_datamodule
    from nxdt.exp.exp_manager import setup_exp_manager
    from nxdt.config.compile_settings import wants_compile
    from nxdt.training.callbacks import CompileTimer, MemoryMonitor, RunFigures, RunSummary, ThroughputMonitor
    from nxdt.training.fault_tolerance import FaultTolerance, requeue_slurm_job
    from nxdt.training.finetuning import check_lora_targets
    from nxdt.training.module import NxdtLightningModule
    from nxdt.training.progress import StepProgressBar
    from nxdt.training.xla import use_xla

    setup_exp_manager(cfg, dirs, _global_rank(), loggers)
    if hydra_job is not None and _global_rank() == 0:
        write_hydra_job(dirs.log_dir, *hydra_job)
    figures = RunFigures(cfg)  # nxdt plan's figures and the device's peak, once, at fit start
    # memory first: a sampled step's scan and profiler start are not in the step time
    callbacks += [MemoryMonitor(cfg, figures), ThroughputMonitor(layout.tokens_per_step, figures),
                  RunSummary(cfg, layout, str(dirs.log_dir), figures)]
    if cfg.data.dynamic_data_selection != "none":  # held-out losses move the blend's weights
        from nxdt.training.dynamic_selection import DynamicDataSelection

        callbacks.append(DynamicDataSelection())
    if cfg.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar())
    if wants_compile(cfg) and not use_xla(cfg):  # the compile time, once, after the first step
        callbacks.append(CompileTimer())
    callbacks += user_callbacks  # before the checkpoint callback (sorted last below)
    # checkpointing last (Lightning's order for its own checkpoint callbacks): a step's scalars,
    # throughput included, are all logged before the step's checkpoint is saved
    callbacks.sort(key=lambda callback: isinstance(callback, NxdtCheckpoint))
    # after the step's own save: a preemption save then finds the step saved, or saves it
    fault_tolerance = FaultTolerance(cfg)
    callbacks.append(fault_tolerance)
    trainer = build_trainer(cfg, layout, mesh_shape, loggers, callbacks)
    # custom (data.data_module) > SFT > dummy > data.datasets > HF (train_dir) > Megatron
    datamodule = build_datamodule(cfg, trainer)
    check_lora_targets(cfg, datamodule.vocab_size)  # a bad LoRA target: one line, before any process group
    module = NxdtLightningModule(cfg, layout, vocab_size=datamodule.vocab_size)
    if cfg.exp_manager.samples.prompts:  # text generated during training (nxdt.training.samples)
        from nxdt.training.samples import SampleGenerator

        trainer.callbacks.append(SampleGenerator(cfg, sample_tokenizer(cfg, datamodule), datamodule.vocab_size))
    ckpt_path = resume.full_resume  # weights only: ResumeHelper loads them
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
    if trainer.is_global_zero:
        final = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("reduced_train_loss", "val_loss")}
        if final:
            print("final " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items())), flush=True)
        print_next_steps(cfg, dirs, hydra_job, preempted=fault_tolerance.preempted_at is not None)
    return trainer, module


def print_next_steps(cfg, dirs, hydra_job, preempted: bool = False) -> None:
    """Rank 0, at the end: the checkpoint and the commands that resume, sample, evaluate and report."""
    from nxdt.checkpoint.retention import complete_checkpoints
    from nxdt.training.next_steps import format_next_steps

    found = complete_checkpoints(dirs.checkpoint_dir, warn=False) if cfg.exp_manager.create_checkpoint_callback else []
    cl = hydra_job[0] if hydra_job is not None else None
    argv = cl.argv if cl is not None and not cl.multirun else None
    checkpoint = found[-1][1] if found and argv is not None else None
    print(f"logs         {dirs.log_dir}", flush=True)
    print(format_next_steps(checkpoint, dirs.log_dir, argv or [], cfg.trainer.max_steps, preempted=preempted),
          flush=True)


def write_hydra_job(log_dir, cl, record: dict, job_num: int, overrides: list[str]) -> None:
    from nxdt.config.command_line import hydra_section, write_hydra_record

    hydra = hydra_section(cl, log_dir, record.get("config_dir"), record.get("config_name"), job_num, overrides)
    write_hydra_record(log_dir, record.get("composed", {}), hydra, overrides)


def entry() -> None:
    """Console entry used by examples/train.py: one clear line and exit 2 on bad input."""
    from nxdt.config.load import main_guard

    sys.exit(main_guard(main)())
