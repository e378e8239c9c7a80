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

import numpy as np
import torch

from nxdt.spec.data import SPLIT_NAMES, DataBlend, data_blend
from nxdt.config.errors import ConfigError
from nxdt.spec.paths import dataset_path, is_shard_folder
from nxdt.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    blended_samples_per_dataset,
    get_train_valid_test_split_,
)
from nxdt.data.common import NxdtDataModuleBase
from nxdt.data.indexed import IndexedDataset
from nxdt.data.tokenizers import build_tokenizer, eod_id
from nxdt.data.vocab_check import check_vocabulary

class MegatronDataModule(NxdtDataModuleBase):
    """Megatron GPT data (`model_source: megatron`), see the module docstring."""

    def __init__(self, cfg, trainer=None):
        super().__init__(cfg, trainer)
        # data.data_impl (only mmap) and data.dataloader_type (single | cyclic) are schema Literals
        self.data = data = cfg.data
        self.tokenizer = build_tokenizer(data.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.eod_id = eod_id(self.tokenizer)
        self.datasets: dict[str, torch.utils.data.Dataset | None] = {}
        # The batch carries document boundaries only through position_ids, and the model blocks
        # attention wherever positions restart: the two Megatron switches act together here.
        self.reset_documents = data.reset_position_ids or data.reset_attention_mask

    # -- datasets

    def _gpt(self, indexed: IndexedDataset, doc_ids: np.ndarray, n: int, split: str) -> GPTDataset:
        d = self.data
        # index_mapping_dir null: cache next to the data (skipped if that directory is read-only).
        cache_dir = d.index_mapping_dir or os.path.dirname(os.path.abspath(indexed.prefix))
        return GPTDataset(
            indexed, doc_ids, n, self.seq_length, self.seed,
            eod_id=self.eod_id, name=split, eod_mask_loss=d.eod_mask_loss,
            reset_position_ids=self.reset_documents,
            add_extra_token=not d.no_seqlen_plus_one_input_tokens,
            index_mapping_dir=cache_dir,
        )

    def _blend(self, parts: list[tuple[IndexedDataset, np.ndarray]], weights: list[float], n: int, split: str):
        if len(parts) == 1:
            return self._gpt(parts[0][0], parts[0][1], n, split)
        per_dataset = blended_samples_per_dataset(weights, n)
        datasets = [self._gpt(ix, docs, m, split) for (ix, docs), m in zip(parts, per_dataset)]
        return BlendedDataset(datasets, weights, n)

    def _open(self, prefix: str) -> IndexedDataset:
        """The documents of one data entry: a folder of arrow / parquet shards (fms-fsdp, relative
        to data.data_path for data.datasets) or a Megatron prefix; its token ids checked once
        against the tokenizer's vocabulary (nxdt.data.vocab_check)."""
        if not hasattr(self, "_opened"):
            self._opened: dict[str, IndexedDataset] = {}
        if prefix not in self._opened:
            d = self.data
            # fms-fsdp: data.datasets entries under data.data_path
            path = dataset_path(prefix, d.data_path if d.datasets is not None else None)
            if is_shard_folder(path):
                # pyarrow (about 0.3 s to import) only for shard folders, not in every Megatron run
                from nxdt.data.arrow_shards import ArrowShardDocuments

                sep = d.sep_token if d.sep_token is not None else self.eod_id
                strip = [*d.strip_tokens, *(t for t in (d.bol_token, d.eol_token) if t is not None)]
                docs = ArrowShardDocuments(path, d.col_name, sep_token=sep, bos_token=d.bos_token, strip_tokens=strip,
                                           file_type=d.file_type, tokenizer=self.tokenizer)
            else:
                docs = IndexedDataset(path, skip_warmup=d.skip_warmup)
            # the cache sits where the index mappings go (see _gpt)
            cache_dir = d.index_mapping_dir or os.path.dirname(os.path.abspath(docs.prefix))
            check_vocabulary(docs, len(self.tokenizer), d.tokenizer, cache_dir)
            self._opened[prefix] = docs
        return self._opened[prefix]

    def data_blend(self) -> DataBlend:
        """The parsed data.data_prefix (nxdt.spec.data, the parser validation uses)."""
        return data_blend(self.data)

    def split_parts(self, k: int) -> list[tuple[float, tuple[IndexedDataset, np.ndarray]]]:
        """(weight, (indexed dataset, document ids)) of split k (0 train, 1 validation, 2 test)."""
        blend = self.data_blend()
        pairs = blend.pairs(SPLIT_NAMES[k])
        if blend.blend is not None:  # one blend, each dataset cut into splits by splits_string
            parts = []
            for _, prefix in pairs:
                ix = self._open(prefix)
                bounds = get_train_valid_test_split_(self.data.splits_string, len(ix))
                parts.append((ix, np.arange(bounds[k], bounds[k + 1], dtype=np.int64)))
        else:  # a blend per split: whole datasets
            parts = [(self._open(p), np.arange(len(self._open(p)), dtype=np.int64)) for _, p in pairs]
        return [(w, part) for (w, _), part in zip(pairs, parts) if len(part[1]) > 0 and w > 0]

    def build_split(self, k: int, n: int):
        """The dataset of split k with n samples, or None when the split is empty or off."""
        split = SPLIT_NAMES[k]
        keep = self.split_parts(k)
        if n <= 0 or not keep:
            if split == "train":
                raise ConfigError(
                    "data.splits_string: the train split has no documents "
                    f"('{self.data.splits_string}' over data.data_prefix)"
                )
            return None
        return self._blend([p for _, p in keep], [w for w, _ in keep], n, split)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        counts = self.num_samples()
        for k, split in enumerate(SPLIT_NAMES):
            self.datasets[split] = self.build_split(k, counts[split])

    # -- loaders

    def train_dataloader(self):
        self.setup("fit")
        cyclic = self.data.dataloader_type == "cyclic"
        return self._loader(self.datasets["train"], self._consumed_samples(), True, cyclic)

    def _eval(self, split: str):
        self.setup("validate" if split == "validation" else "test")
        ds = self.datasets.get(split)
        if ds is None:
            return []
        return self._loader(ds, 0, self.data.validation_drop_last, False)

    def val_dataloader(self):
        return self._eval("validation")

    def test_dataloader(self):
        return self._eval("test")
