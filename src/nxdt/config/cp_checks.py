"""Torch-free checks of a context-parallel layout (`distributed_strategy.context_parallel_size`).

nxdt runs context parallelism as causal ring attention on the native Llama
(`nxdt.parallel.context_parallel`); these are the combinations it refuses, one line each.
"""

from __future__ import annotations

from typing import Any

from nxdt.config.compile_settings import wants_compile
from nxdt.config.errors import ConfigError
from nxdt.config.layout import Layout
from nxdt.config.sharding import sharding_mode


def check_context_parallel(cfg: Any, layout: Layout) -> None:
    cp = layout.cp
    key = "distributed_strategy.context_parallel_size"
    data, model, ds = cfg.data, cfg.model, cfg.distributed_strategy
    if model.fusions.ring_attention and cp == 1:
        raise ConfigError("model.fusions.ring_attention: true needs distributed_strategy.context_parallel_size > 1 "
                          "(ring attention is how nxdt runs context parallelism)")
    if cp == 1:
        return
    seq = data.seq_length
    if seq is not None and seq % (2 * cp):
        raise ConfigError(f"data.seq_length ({seq}) must be divisible by 2 x {key} ({2 * cp}): each cp rank "
                          "holds two chunks of every sequence (head-tail load balancing)")
    refused = {
        # both restart positions at each document, which the model turns into document masks
        "data.reset_position_ids / reset_attention_mask (document masks)":
            data.reset_position_ids or data.reset_attention_mask,
        "SFT packing (document masks)": data.packing
        or bool(cfg.model_alignment_strategy is not None and cfg.model_alignment_strategy.sft is not None
                and cfg.model_alignment_strategy.sft.packing),
        "model.attention_dropout > 0": model.attention_dropout > 0,
        "model.sliding_window_size": model.sliding_window_size is not None,
        "model.fusions.torch_compile": wants_compile(cfg),
        "HSDP (sharding_strategy hybrid)": sharding_mode(ds.sharding_strategy).hybrid
        or (ds.hsdp_replicate_size or 1) > 1,
        f"trainer.accelerator {cfg.trainer.accelerator}": cfg.trainer.accelerator
        in ("xla", "neuron", "tpu", "gpu", "cuda", "mps"),  # ring kernels are wired for CPU only
    }
    for what, bad in refused.items():
        if bad:
            raise ConfigError(f"{key} > 1 with {what} is not supported yet (got {key}={cp})")
