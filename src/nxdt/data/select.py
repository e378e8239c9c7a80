"""Which data module a config gets, in this order (the first that applies):

1. `data.data_module: pkg.module.Class`  → the user's LightningDataModule, `Class(cfg, trainer)`
2. `model_alignment_strategy.sft`        → SFTDataModule (jsonl / arrow input-output pairs)
   `model_alignment_strategy.dpo / orpo`  → PreferenceDataModule (jsonl / arrow prompt-chosen-rejected rows)
   `model_alignment_strategy.grpo`        → PromptDataModule (rows with a prompt, or the shipped task)
3. `data.use_dummy_dataset: true`        → DummyDataModule (random tokens, performance runs)
4. `data.datasets`, or dynamic selection → LogicalShardDataModule (fms-fsdp: weights, logical shards;
                                           Megatron prefixes or arrow/parquet shard folders)
5. `data.train_dir` with model_source hf, or use_sft_style_data_module, or no data_prefix
                                         → HFDataModule (pre-tokenized save_to_disk datasets)
6. `data.data_prefix`                    → MegatronDataModule (indexed .bin/.idx, blending, splits)
"""

from __future__ import annotations

from nxdt.config.errors import ConfigError
from nxdt.data.custom import build_custom_datamodule
from nxdt.data.dummy import DummyDataModule
from nxdt.data.hf_module import HFDataModule
from nxdt.data.logical_shards import LogicalShardDataModule
from nxdt.data.megatron_module import MegatronDataModule
from nxdt.data.preference import PreferenceDataModule
from nxdt.data.prompts import PromptDataModule
from nxdt.data.sft import SFTDataModule
from nxdt.spec.data import NO_DATA_SOURCE, datamodule_kind  # noqa: F401  (re-exported: which module a config gets)


def build_datamodule(spec, trainer):
    """The LightningDataModule of the run spec's data kind, built as Cls(spec.cfg, trainer)."""
    cfg, kind = spec.cfg, spec.data_kind  # data.packing without sft is refused by validation (nxdt.spec.data)
    if kind is None:
        raise ConfigError(NO_DATA_SOURCE)
    if kind == "custom":
        return build_custom_datamodule(cfg, trainer)
    if kind == "sft":
        return SFTDataModule(cfg, trainer, alignment=spec.alignment)
    if kind == "preference":
        return PreferenceDataModule(cfg, trainer, alignment=spec.alignment)
    if kind == "prompts":
        return PromptDataModule(cfg, trainer, alignment=spec.alignment)
    if kind == "dummy":
        return DummyDataModule(cfg, trainer)
    if kind == "logical_shards":
        return LogicalShardDataModule(cfg, trainer)
    if kind == "hf":
        return HFDataModule(cfg, trainer)
    return MegatronDataModule(cfg, trainer)
