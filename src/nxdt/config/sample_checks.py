"""Checks of `exp_manager.samples` (text generated during training; nxdt.training.samples).

This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from nxdt.config.errors import ConfigError

KEY = "exp_manager.samples"


def samples_enabled(cfg: Any) -> bool:
    return bool(cfg.exp_manager.samples.prompts)


def check_samples(cfg: Any) -> None:
    """Values in range, prompts that are text, and a layout the in-training generation supports:
    every rank runs the same decoding on its part of the model, which a pipeline (stages hold other
    layers and run a fixed schedule) or context parallelism (the sequence is split) cannot."""
    s = cfg.exp_manager.samples
    if s.every_n_train_steps < 0:
        raise ConfigError(f"{KEY}.every_n_train_steps: must be >= 0, got {s.every_n_train_steps}")
    if s.max_new_tokens < 1:
        raise ConfigError(f"{KEY}.max_new_tokens: must be >= 1, got {s.max_new_tokens}")
    if s.temperature < 0:
        raise ConfigError(f"{KEY}.temperature: must be >= 0, got {s.temperature}")
    if s.top_k is not None and s.top_k < 0:
        raise ConfigError(f"{KEY}.top_k: must be >= 0 or null, got {s.top_k}")
    if not 0.0 < s.top_p <= 1.0:
        raise ConfigError(f"{KEY}.top_p: must be in (0, 1], got {s.top_p}")
    for i, prompt in enumerate(s.prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{KEY}.prompts[{i}]: must be non-empty text, got {prompt!r}")
    if not s.prompts:
        return
    ds = cfg.distributed_strategy
    for key, value in (("pipeline_model_parallel_size", ds.pipeline_model_parallel_size),
                       ("context_parallel_size", ds.context_parallel_size)):
        if value > 1:
            raise ConfigError(f"{KEY}.prompts with distributed_strategy.{key}={value} is not supported yet "
                              "(generate from the saved checkpoints with `nxdt generate` instead)")
