"""`HFDataModule`: pre-tokenized HF datasets on disk (`datasets.save_to_disk`) → global-step batches.

Keys: `data.train_dir` (required), `data.val_dir`, `data.test_dir` (each a `save_to_disk`
directory of a Dataset, or of a DatasetDict whose `train` / `validation` / `test` split is
taken), `data.dev_choose_samples` (keep the first N rows of each), `data.seq_length`,
`data.tokenizer` (for the pad id and the vocabulary size).

Rows hold `input_ids` (a list of token ids), optionally `labels` (transformers' convention:
equal to input_ids, -100 = ignore; the shift is done here) and `attention_mask` (0 = padding).
A row of seq_length + 1 tokens gives seq_length inputs and their next tokens as labels; a row of
seq_length tokens (NxDT's format) trains on the first seq_length - 1 next tokens, the last
position is masked; shorter rows are padded (masked), longer rows truncated.

Training runs `trainer.max_steps × global_batch_size` samples, going round the dataset as many
times as needed (in order). A resumed run starts at the LightningModule's `consumed_samples`
(NxDT restarts HF data at sample 0). Validation and test go once through their dataset in whole
global batches (Lightning's limit_val_batches / limit_test_batches cap them).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from nxdt.config.errors import ConfigError
from nxdt.data.common import NxdtDataModuleBase
from nxdt.data.tokenizers import build_tokenizer

SPLIT_KEYS = {"train": "train_dir", "validation": "val_dir", "test": "test_dir"}


def load_hf_dataset(path: str, key: str, split: str):
    """`datasets.load_from_disk(path)` as one Dataset; every failure is a ConfigError naming the path."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise ConfigError(f"data.{key}: {path}: not a directory (expected a datasets.save_to_disk directory)")
    import datasets  # about 1 s to import: only for save_to_disk input, not in every run (nxdt.data.select)

    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"data.{key}: {path}: not a datasets.save_to_disk directory ({first})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        pick = split if split in ds else ("validation" if split == "validation" and "valid" in ds else None)
        if pick is None and len(names) == 1:
            pick = names[0]
        if pick is None:
            raise ConfigError(f"data.{key}: {path}: a DatasetDict without a '{split}' split (has {names})")
        ds = ds[pick]
    return ds


def choose_samples(ds, n: int | None):
    """The first n rows (dev_choose_samples); all when n is None."""
    if n is None:
        return ds
    if n < 1:
        raise ConfigError(f"data.dev_choose_samples: must be >= 1, got {n}")
    return ds.select(range(min(int(n), len(ds))))


class TokenBlocks(torch.utils.data.Dataset):
    """HF rows of token ids → fixed-length `input_ids`, `labels`, `loss_mask`, `position_ids`."""

    def __init__(self, ds, seq_length: int, pad_id: int, where: str):
        if "input_ids" not in ds.column_names:
            raise ConfigError(f"{where}: no 'input_ids' column (columns: {ds.column_names}); save pre-tokenized rows")
        if len(ds) == 0:
            raise ConfigError(f"{where}: the dataset has no rows")
        keep = [c for c in ("input_ids", "labels", "attention_mask") if c in ds.column_names]
        self.ds = ds.select_columns(keep).with_format("numpy")
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        row = self.ds[int(idx)]
        S = self.seq_length
        ids = np.asarray(row["input_ids"], dtype=np.int64).reshape(-1)
        # targets[i] is what input i should predict, valid[i] whether it counts
        target_src = np.asarray(row["labels"], dtype=np.int64).reshape(-1) if "labels" in row else ids
        valid_src = np.ones(len(ids), dtype=bool)
        if "attention_mask" in row:
            valid_src &= np.asarray(row["attention_mask"]).reshape(-1).astype(bool)
        valid_src &= target_src != -100
        n = min(len(ids), S + 1)
        tokens = np.full(S, self.pad_id, dtype=np.int64)
        labels = np.full(S, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(S, dtype=np.float32)
        m = min(n, S)
        tokens[:m] = ids[:m]
        if n > 1:
            labels[: n - 1] = np.where(target_src[1:n] == -100, self.pad_id, target_src[1:n])
            loss_mask[: n - 1] = valid_src[1:n] & valid_src[: n - 1]
        return {
            "input_ids": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.arange(S, dtype=torch.int64),
        }


class HFDataModule(NxdtDataModuleBase):
    """Pre-tokenized HF datasets from disk; see the module docstring."""

    def __init__(self, cfg, trainer=None):
        super().__init__(cfg, trainer)
        data = cfg.data
        if data.train_dir is None:
            raise ConfigError("data.train_dir: required for the HF data module (a datasets.save_to_disk directory)")
        self.tokenizer = build_tokenizer(data.tokenizer)
        self.vocab_size = len(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.datasets: dict[str, torch.utils.data.Dataset | None] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        data = self.cfg.data
        for split, key in SPLIT_KEYS.items():
            path = getattr(data, key)
            if path is None:
                self.datasets[split] = None
                continue
            ds = choose_samples(load_hf_dataset(path, key, split), data.dev_choose_samples)
            self.datasets[split] = TokenBlocks(ds, self.seq_length, self.pad_id, f"data.{key}: {path}")
