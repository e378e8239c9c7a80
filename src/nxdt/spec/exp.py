"""`exp_manager` settings beyond their types: an evaluate-only run's weights, the samples generated
during training and the preemption signals (names -> numbers, one parser for validation and the
run). Torch-free."""

from __future__ import annotations

import signal
from difflib import get_close_matches
from typing import Any

from nxdt.config.errors import ConfigError


# --------------------------------------------------------------------------- evaluate only
def check_evaluate_only(cfg: Any) -> None:
    """trainer.max_epochs=0 (evaluate only) needs weights to evaluate: a checkpoint to resume."""
    exp = cfg.exp_manager
    if cfg.trainer.max_epochs == 0 and not exp.resume_from_checkpoint and not exp.resume_if_exists:
        # evaluating freshly initialised weights is never what was meant
        raise ConfigError("trainer.max_epochs=0 (evaluate only): no weights to evaluate: set "
                          "exp_manager.resume_from_checkpoint=CHECKPOINT or exp_manager.resume_if_exists=true "
                          "(this run's newest checkpoint)")


def check_exp(cfg: Any) -> None:
    """exp_manager.samples (`check_samples`) and exp_manager.preemption_signals (`parse_signals`)."""
    check_samples(cfg)
    parse_signals(cfg.exp_manager.preemption_signals)


# --------------------------------------------------------------------------- sample checks
SAMPLES_KEY = "exp_manager.samples"


def sampling_problem(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> str | None:
    """The first sampling value out of range, as "<name> must ..., got <value>", else None: the one
    rule for `nxdt generate`'s flags, `exp_manager.samples` and `SamplingParams`."""
    if max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {max_new_tokens}"
    if temperature < 0:
        return f"temperature must be >= 0, got {temperature}"
    if top_k is not None and top_k < 0:
        return f"top_k must be >= 0, got {top_k}"
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}"
    return None


def check_samples(cfg: Any) -> None:
    """Values in range, prompts that are text, and a layout the in-training generation supports:
    every rank runs the same decoding on its part of the model, which a pipeline (stages hold other
    layers and run a fixed schedule) or context parallelism (the sequence is split) cannot."""
    s = cfg.exp_manager.samples
    if s.every_n_train_steps < 0:
        raise ConfigError(f"{SAMPLES_KEY}.every_n_train_steps: must be >= 0, got {s.every_n_train_steps}")
    problem = sampling_problem(s.max_new_tokens, s.temperature, s.top_k, s.top_p)
    if problem:
        name, rule = problem.split(" ", 1)
        raise ConfigError(f"{SAMPLES_KEY}.{name}: {rule}")
    for i, prompt in enumerate(s.prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{SAMPLES_KEY}.prompts[{i}]: must be non-empty text, got {prompt!r}")
    if not s.prompts:
        return
    ds = cfg.distributed_strategy
    for key, value in (("pipeline_model_parallel_size", ds.pipeline_model_parallel_size),
                       ("context_parallel_size", ds.context_parallel_size)):
        if value > 1:
            raise ConfigError(f"{SAMPLES_KEY}.prompts with distributed_strategy.{key}={value} is not supported yet "
                              "(generate from the saved checkpoints with `nxdt generate` instead)")


# --------------------------------------------------------------------------- signals
SIGNALS_KEY = "exp_manager.preemption_signals"
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def parse_signals(names, key: str = SIGNALS_KEY) -> list[signal.Signals]:
    """The signals named in `names` (in order, without repeats); ConfigError naming the key otherwise."""
    known = {s.name: s for s in signal.Signals if not s.name.startswith("CTRL_")}
    found: list[signal.Signals] = []
    for i, name in enumerate(names or []):
        text = str(name).strip().upper()
        full = text if text.startswith("SIG") else "SIG" + text
        if full in UNCATCHABLE:
            raise ConfigError(f"{key}[{i}]: {full} cannot be caught by a process (it ends it at once); "
                              "use SIGTERM or SIGUSR1 (Slurm: --signal=USR1@120)")
        if full not in known:
            close = get_close_matches(full, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}[{i}]: '{name}' is not a signal name{hint} (e.g. SIGTERM, SIGUSR1)")
        if known[full] not in found:
            found.append(known[full])
    return found
