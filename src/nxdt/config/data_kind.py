"""Which data module a config gets (nxdt.data.select builds it; validation checks against it).

The order is documented in `nxdt.data.select`. This module imports only nxdt.config.
"""

from __future__ import annotations

from nxdt.config.alignment import alignment_of
from nxdt.config.errors import ConfigError


def datamodule_kind(cfg) -> str:
    """'custom' | 'sft' | 'preference' | 'dummy' | 'logical_shards' | 'hf' | 'megatron' for `cfg` (see the
    module doc)."""
    data = cfg.data
    alignment = alignment_of(cfg)
    if data.data_module is not None:
        return "custom"
    if alignment.sft is not None:
        return "sft"
    if alignment.preference is not None:
        return "preference"
    if data.use_dummy_dataset:
        return "dummy"
    if data.datasets is not None:
        return "logical_shards"
    if data.dynamic_data_selection != "none" and data.data_prefix and not (
            data.train_dir is not None and (cfg.model_source == "hf" or data.use_sft_style_data_module)):
        return "logical_shards"  # a Megatron blend whose weights change: read as logical-shard streams
    has_prefix = bool(data.data_prefix)
    if data.train_dir is not None and (
            cfg.model_source == "hf" or data.use_sft_style_data_module or not has_prefix):
        return "hf"
    if has_prefix:
        return "megatron"
    raise ConfigError("data: no data source; set data.data_prefix (Megatron), data.train_dir (HF datasets), "
                      "data.datasets, data.use_dummy_dataset, model_alignment_strategy.sft or data.data_module")
