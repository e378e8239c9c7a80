"""`nxdt train` / examples/train.py: Hydra's command line, one run or a sweep, `--cfg` / `--info`, the
`.hydra/` record and the closing commands. The run itself is nxdt.training.trainer.

Order matters: the config is composed and validated, and the Neuron / precision environment
variables it implies are set, before torch (or torch-xla) is imported — they are read at import.
So this module imports nothing that imports torch; the run's modules are imported in `run_job`
and `train`, after `apply_env`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from nxdt.config import describe
from nxdt.config.env import apply_env
from nxdt.config.errors import ConfigError
from nxdt.config.load import compose, main_guard, quote_value
from nxdt.config.resolvers import asset_path
from nxdt.config.load import global_rank as _global_rank
from nxdt.exp.exp_manager import resolve_dirs
from nxdt.spec import load_config
from nxdt.tools.command_line import (
    HYDRA_HELP,
    expand_sweeps,
    format_info,
    hydra_section,
    override_dirname,
    parse_command_line,
    print_cfg,
    sweep_keys,
    write_hydra_record,
)
from nxdt.tools.launch import is_launch, launch
from nxdt.tools.next_steps import BUNDLED_PROMPT, closing_options, format_next_steps

REPO_CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def _world_size_from_env() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def main(argv: list[str] | None = None) -> int:
    """The training entry: Hydra's command line (nxdt.tools.command_line), then one run, a sweep
    (-m), or a printed config (--cfg, --info)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print_help(argv[1] if len(argv) > 1 else None)
        return 0
    if is_launch(argv) and _world_size_from_env() is None:  # torchrun's options first: validate, then launch
        return launch(argv, validate_launch)
    cl = parse_command_line(argv)
    if cl.hydra_help:
        print(HYDRA_HELP)
        return 0
    check_sweep(cl)
    jobs = expand_sweeps(cl.overrides) if cl.multirun else [cl.overrides]
    if cl.show_cfg or cl.info:
        return show_config(cl, jobs)
    if not cl.multirun:
        return run_job(cl, cl.overrides, log_dir=cl.hydra.get("hydra.run.dir"))
    return run_sweep(cl, jobs)


def check_sweep(cl) -> None:
    if not cl.multirun and (swept := sweep_keys(cl.overrides)):
        raise ConfigError(f"'{swept[0]}' is a sweep: add -m (--multirun) to run every value, or quote the "
                          "value if the comma is part of it")


def validate_launch(argv: list[str], world_size: int | None) -> None:
    """The launcher's check (nxdt.tools.launch) of the workers' command line, for the launch's world size."""
    cl = parse_command_line(argv)
    if cl.multirun or cl.show_cfg or cl.info or cl.hydra_help:
        raise ConfigError("-m, --cfg, --info and --hydra-help are for one process: drop torchrun's options "
                          "(--nproc-per-node ...) to use them")
    check_sweep(cl)
    load_config(cl.compose_argv([*cl.overrides, *_dir_override(cl.hydra.get("hydra.run.dir"))]),
                default_config_dir=REPO_CONF_DIR, world_size=world_size, quiet=True)


def _dir_override(log_dir) -> list[str]:
    """An explicit_log_dir override for a path, quoted (paths may hold '=', ',' or spaces)."""
    return [] if log_dir is None else [f"exp_manager.explicit_log_dir={quote_value(str(log_dir))}"]


def load_job(cl, overrides: list[str], log_dir=None, quiet: bool = False):
    """The typed config of one job and what Hydra records of it (nxdt.config.load.compose)."""
    record: dict = {}
    cfg = load_config(cl.compose_argv([*overrides, *_dir_override(log_dir)]), default_config_dir=REPO_CONF_DIR,
                      world_size=_world_size_from_env(), record=record, quiet=quiet)
    return cfg, record


_frozen = False


@contextlib.contextmanager
def startup_imports():
    """The run's modules imported with Python's cyclic garbage collector paused, then frozen, once
    per process. Importing torch, Lightning (and through it torchmetrics, transformers, scipy) makes
    some 500,000 objects that are never garbage; the collector's full passes during the imports
    scanned all of them again and again (0.6-0.7 s), and every full pass of the run after it too
    (0.27 s each). `gc.freeze()` moves them out of its sight for good: a tiny one-process run of
    6 steps took 5.5 s, 3.55 s with this (CPU time alike). Once per process: a sweep's later jobs
    import nothing new, and what they leave behind is collected as before."""
    global _frozen
    if _frozen:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        _frozen = True
        if enabled:
            gc.enable()


def train(cfg, **kwargs):
    """nxdt.training.trainer.train (imported here: torch only after `apply_env`)."""
    from nxdt.training.trainer import train as train_run  # torch only after apply_env (env vars first)

    return train_run(cfg, **kwargs)


def run_job(cl, overrides: list[str], log_dir=None, job_num: int = 0, loaded=None) -> int:
    """One training (or evaluate-only) run of the command line `cl` with these overrides."""
    cfg, record = loaded or load_job(cl, overrides, log_dir)
    apply_env(cfg)  # the Neuron-only keys it finds inert are in load_config's notice (nxdt.config.inert)
    with startup_imports():  # torch is imported from here on (the env vars are set)
        from nxdt.checkpoint.retention import complete_checkpoints
        from nxdt.checkpoint.save_errors import CheckpointSaveError
        from nxdt.precision.precision import NumericalInstabilityError
        from nxdt.training.evaluate import evaluate_only
        from nxdt.training.launcher_watchdog import watch_launcher

    watch_launcher()  # a rank whose launcher is gone (kill -9 of torchrun) exits instead of living on
    try:
        if cfg.trainer.max_epochs == 0:  # evaluate only: the checkpoint the run would start from
            evaluate_only(cfg)
            return 0
        outcome = train(cfg, record_job=lambda log_dir: write_hydra_job(log_dir, cl, record, job_num, overrides))
    except KeyboardInterrupt:  # Ctrl-C before the training steps (during them it saves: fault_tolerance)
        if _global_rank() == 0:
            print("interrupted (Ctrl-C) outside the training steps: stopped at once, nothing was saved",
                  file=sys.stderr, flush=True)
        return 130
    except (NumericalInstabilityError, CheckpointSaveError) as err:
        # one line: a NaN/inf or fp16 overflow stop (exit 3), a save that failed on some rank (exit 1)
        if _global_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 3 if isinstance(err, NumericalInstabilityError) else 1
    if outcome is not None and outcome.trainer.is_global_zero:
        final = {k: float(v) for k, v in outcome.trainer.callback_metrics.items()
                 if k in ("reduced_train_loss", "val_loss")}
        if final:
            print("final " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items())), flush=True)
        checkpoints = (complete_checkpoints(outcome.dirs.checkpoint_dir, warn=False)
                       if cfg.exp_manager.create_checkpoint_callback else [])
        print_next_steps(cfg, outcome.dirs, cl, checkpoints, preempted=outcome.preempted)
    return 0


def _sweep_root(cl, first_job: list[str]) -> Path:
    """Where a sweep's job dirs go: hydra.sweep.dir, else the log dir the first job would use."""
    if "hydra.sweep.dir" in cl.hydra:
        return Path(cl.hydra["hydra.sweep.dir"]).absolute()
    cfg, _ = load_job(cl, first_job, quiet=True)
    return resolve_dirs(cfg).log_dir


def _job_subdir(cl, job_num: int, overrides: list[str]) -> str:
    """A sweep job's folder under the sweep's: hydra.sweep.subdir (default: the job's number)."""
    subdir = cl.hydra.get("hydra.sweep.subdir", "${hydra.job.num}")
    return subdir.replace("${hydra.job.num}", str(job_num)).replace(
        "${hydra.job.override_dirname}", override_dirname(overrides))


def run_sweep(cl, jobs: list[list[str]]) -> int:
    """-m: every job's config is validated first (a bad value in the last job stops the sweep
    before the first one trains), then the jobs run one after another in this process."""
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
    keys = describe(section)  # first: an unknown section is one error line (exit 2), not a half-printed help
    print(__doc__.strip().splitlines()[0])
    print("usage: examples/train.py [--config-path DIR] --config-name NAME [key=value | +key=value | ~key ...]")
    print("       examples/train.py --help [SECTION]   (SECTION: trainer, exp_manager, distributed_strategy, data, model, precision)")
    print("       Hydra: --cfg job|hydra|all [--resolve] [-p KEY], --info, -m a=1,2 (sweep), hydra.run.dir=DIR "
          "(examples/train.py --hydra-help)")
    print(f"shipped configs: {', '.join(sorted(p.stem for p in REPO_CONF_DIR.glob('*.yaml')))}\n")
    print(keys)


def print_next_steps(cfg, dirs, cl, found: list, preempted: bool = False) -> None:
    """Rank 0, at the end: the checkpoint (the newest of `found`) and the commands that resume,
    sample, evaluate and report."""
    argv = cl.argv if cl is not None and not cl.multirun else None
    checkpoint = found[-1][1] if found and argv is not None else None
    print(f"logs         {dirs.log_dir}", flush=True)
    tok = cfg.data.tokenizer  # the bundled KJV tokenizer (null or ${nxdt_asset:tokenizer}): the bundled corpus
    bundled = tok.library == "huggingface" and (tok.type is None or Path(tok.type) == Path(asset_path("tokenizer")))
    print(format_next_steps(checkpoint, dirs.log_dir, argv or [], cfg.trainer.max_steps, preempted=preempted,
                            prompt=BUNDLED_PROMPT if bundled else "PROMPT", **closing_options(cfg, checkpoint)),
          flush=True)


def write_hydra_job(log_dir, cl, record: dict, job_num: int, overrides: list[str]) -> None:
    hydra = hydra_section(cl, log_dir, record.get("config_dir"), record.get("config_name"), job_num, overrides)
    write_hydra_record(log_dir, record.get("composed", {}), hydra, overrides)


def entry() -> None:
    """Console entry used by examples/train.py: one clear line and exit 2 on bad input."""
    sys.exit(main_guard(main)())
