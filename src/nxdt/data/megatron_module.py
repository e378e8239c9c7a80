"""`MegatronDataModule`: Megatron indexed datasets → per-dp-rank global-step batches.

Built as `MegatronDataModule(cfg, trainer)` (trainer may be None: dp rank 0 of 1, nothing
consumed). The tokenizer is built in `__init__` so the model can be sized from `vocab_size`
before `setup()`. Each batch is one global step's share for this data-parallel rank:
`input_ids`, `labels`, `position_ids` LongTensor[B, S] and `loss_mask` FloatTensor[B, S] with
B = global_batch_size // dp_size; the LightningModule cuts it into micro-batches.

Sample counts (Megatron/NeMo):
    train      = trainer.max_steps × global_batch_size
    validation = (max_steps // val_check_interval + 1) × limit_val_batches × global_batch_size
    test       = limit_test_batches × global_batch_size
A float limit (a fraction, ≤ 1.0) counts as one batch; 0 turns the split off.

Index mappings are cached as .npy in `data.index_mapping_dir`, or next to the data when it is
null (no cache when that directory is not writable).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from nxdt.config.errors import ConfigError
from nxdt.data.gpt_dataset import (
    SPLIT_NAMES,
    BlendedDataset,
    GPTDataset,
    blended_samples_per_dataset,
    get_train_valid_test_split_,
    parse_data_prefix,
)
from nxdt.data.indexed import IndexedDataset
from nxdt.data.samplers import MegatronPretrainingBatchSampler, MegatronPretrainingRandomBatchSampler
from nxdt.data.tokenizers import build_tokenizer, eod_id

# data.* keys this module reads, with the defaults used when a key is absent.
DATA_DEFAULTS: dict[str, Any] = {
    "data_prefix": None,
    "seq_length": None,
    "micro_batch_size": 1,
    "global_batch_size": 1,
    "splits_string": "980,10,10",
    "index_mapping_dir": None,
    "data_impl": "mmap",
    "num_workers": 1,
    "dataloader_type": "single",
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "eod_mask_loss": False,
    "validation_drop_last": True,
    "skip_warmup": True,
    "no_seqlen_plus_one_input_tokens": False,
}


def _get(node: Any, key: str, default=None):
    if node is None:
        return default
    value = node.get(key, default) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, key, default)
    return default if value is None else value


def _batches(limit, key: str) -> int:
    """A Lightning limit_*_batches as a number of batches: int as is, a fraction → 1, 0 → 0."""
    if isinstance(limit, bool):
        raise ConfigError(f"{key}: expected a number, got {limit}")
    if isinstance(limit, float):
        if limit < 0:
            raise ConfigError(f"{key}: must be >= 0, got {limit}")
        if limit <= 1.0:
            return 0 if limit == 0 else 1
        return int(limit)
    return max(int(limit), 0)


class MegatronDataModule(pl.LightningDataModule):
    """Megatron GPT data (`model_source: megatron`), see the module docstring."""

    def __init__(self, cfg, trainer=None):
        super().__init__()
        self.cfg = cfg
        self.trainer = trainer
        data = cfg.data
        self.data_cfg = {key: _get(data, key, default) for key, default in DATA_DEFAULTS.items()}
        if self.data_cfg["seq_length"] is None:
            raise ConfigError("data.seq_length: required (tokens per training sample)")
        self.seq_length = int(self.data_cfg["seq_length"])
        self.micro_batch_size = int(self.data_cfg["micro_batch_size"])
        self.global_batch_size = int(self.data_cfg["global_batch_size"])
        if str(self.data_cfg["data_impl"]) != "mmap":
            raise ConfigError(f"data.data_impl: only 'mmap' is supported, got '{self.data_cfg['data_impl']}'")
        if self.data_cfg["dataloader_type"] not in ("single", "cyclic"):
            raise ConfigError(
                f"data.dataloader_type: expected single or cyclic, got '{self.data_cfg['dataloader_type']}'"
            )
        self.tokenizer = build_tokenizer(_get(data, "tokenizer"))
        self.vocab_size = len(self.tokenizer)
        self.eod_id = eod_id(self.tokenizer)
        self.datasets: dict[str, torch.utils.data.Dataset | None] = {}
        if self.data_cfg["reset_attention_mask"]:
            warnings.warn(
                "data.reset_attention_mask: not applied; the model attends causally across document "
                "boundaries (use reset_position_ids / eod_mask_loss)",
                stacklevel=2,
            )

    # -- layout

    def _strategy_attr(self, name: str, default: int) -> int:
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        return int(getattr(strategy, name, default)) if strategy is not None else default

    @property
    def dp_rank(self) -> int:
        return self._strategy_attr("dp_rank", 0)

    @property
    def dp_size(self) -> int:
        return self._strategy_attr("dp_size", 1)

    def _consumed_samples(self) -> int:
        if self.trainer is None:
            return 0
        try:
            module = self.trainer.lightning_module
        except (AttributeError, RuntimeError):
            return 0
        return int(getattr(module, "consumed_samples", 0) or 0)

    # -- sample counts

    def num_samples(self) -> dict[str, int]:
        tr = self.cfg.trainer
        gbs = self.global_batch_size
        max_steps = int(_get(tr, "max_steps", -1))
        if max_steps <= 0:
            raise ConfigError(f"trainer.max_steps: must be > 0 for Megatron data (got {max_steps})")
        vci = _get(tr, "val_check_interval", 1.0)
        if isinstance(vci, float) and vci <= 1.0:
            vci = max(1, int(vci * max_steps))
        vci = max(1, int(vci))
        val_batches = _batches(_get(tr, "limit_val_batches", 1.0), "trainer.limit_val_batches")
        test_batches = _batches(_get(tr, "limit_test_batches", 1.0), "trainer.limit_test_batches")
        return {
            "train": max_steps * gbs,
            "validation": (max_steps // vci + 1) * val_batches * gbs,
            "test": test_batches * gbs,
        }

    # -- datasets

    def _gpt(self, indexed: IndexedDataset, doc_ids: np.ndarray, n: int, split: str) -> GPTDataset:
        d = self.data_cfg
        # index_mapping_dir null: cache next to the data (skipped if that directory is read-only).
        cache_dir = d["index_mapping_dir"] or os.path.dirname(os.path.abspath(indexed.prefix))
        return GPTDataset(
            indexed, doc_ids, n, self.seq_length, int(_get(self.cfg, "seed", 1234)),
            eod_id=self.eod_id, name=split, eod_mask_loss=bool(d["eod_mask_loss"]),
            reset_position_ids=bool(d["reset_position_ids"]),
            add_extra_token=not bool(d["no_seqlen_plus_one_input_tokens"]),
            index_mapping_dir=cache_dir,
        )

    def _blend(self, parts: list[tuple[IndexedDataset, np.ndarray]], weights: list[float], n: int, split: str):
        if len(parts) == 1:
            return self._gpt(parts[0][0], parts[0][1], n, split)
        per_dataset = blended_samples_per_dataset(weights, n)
        datasets = [self._gpt(ix, docs, m, split) for (ix, docs), m in zip(parts, per_dataset)]
        return BlendedDataset(datasets, weights, n)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        blend = parse_data_prefix(self.data_cfg["data_prefix"])
        counts = self.num_samples()
        skip_warmup = bool(self.data_cfg["skip_warmup"])
        opened: dict[str, IndexedDataset] = {}

        def open_prefix(prefix: str) -> IndexedDataset:
            if prefix not in opened:
                opened[prefix] = IndexedDataset(prefix, skip_warmup=skip_warmup)
            return opened[prefix]

        for k, split in enumerate(SPLIT_NAMES):
            n = counts[split]
            if blend.blend is not None:
                pairs = blend.blend
                parts = []
                for _, prefix in pairs:
                    ix = open_prefix(prefix)
                    bounds = get_train_valid_test_split_(self.data_cfg["splits_string"], len(ix))
                    parts.append((ix, np.arange(bounds[k], bounds[k + 1], dtype=np.int64)))
            else:
                pairs = blend.split_blends.get(split, [])
                parts = [(open_prefix(p), np.arange(len(open_prefix(p)), dtype=np.int64)) for _, p in pairs]
            keep = [(w, part) for (w, _), part in zip(pairs, parts) if len(part[1]) > 0 and w > 0]
            if n <= 0 or not keep:
                if split == "train":
                    raise ConfigError(
                        "data.splits_string: the train split has no documents "
                        f"('{self.data_cfg['splits_string']}' over data.data_prefix)"
                    )
                self.datasets[split] = None
                continue
            self.datasets[split] = self._blend([p for _, p in keep], [w for w, _ in keep], n, split)

    # -- loaders

    def _loader(self, dataset, consumed: int, drop_last: bool, cyclic: bool):
        dp_size = self.dp_size
        if self.global_batch_size % dp_size:
            raise ConfigError(
                f"data.global_batch_size: {self.global_batch_size} is not divisible by the data-parallel size {dp_size}"
            )
        local = self.global_batch_size // dp_size
        common = dict(
            total_samples=len(dataset), consumed_samples=consumed, local_batch_size=local,
            global_batch_size=self.global_batch_size, dp_rank=self.dp_rank, dp_size=dp_size, drop_last=drop_last,
        )
        if cyclic:
            sampler = MegatronPretrainingRandomBatchSampler(**common, seed=int(_get(self.cfg, "seed", 1234)))
        else:
            sampler = MegatronPretrainingBatchSampler(**common)
        workers = int(self.data_cfg["num_workers"])
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
        )

    def train_dataloader(self):
        self.setup("fit")
        cyclic = self.data_cfg["dataloader_type"] == "cyclic"
        return self._loader(self.datasets["train"], self._consumed_samples(), True, cyclic)

    def val_dataloader(self):
        self.setup("validate")
        ds = self.datasets.get("validation")
        if ds is None:
            return []
        return self._loader(ds, 0, bool(self.data_cfg["validation_drop_last"]), False)

    def test_dataloader(self):
        self.setup("test")
        ds = self.datasets.get("test")
        if ds is None:
            return []
        return self._loader(ds, 0, bool(self.data_cfg["validation_drop_last"]), False)
