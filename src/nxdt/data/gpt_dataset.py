"""Megatron GPT samples over indexed datasets: splits, sample index mapping and blending.

How a GPTDataset turns documents into samples (Megatron's scheme):

1. `doc_idx`: the split's documents, shuffled once per epoch with `seed` and concatenated, for as
   many epochs as it takes to cover `num_samples` (every document appears once per epoch).
2. This is one token stream. Sample j is stream[j*S : j*S + S + 1] (S = seq_length): S+1 tokens
   that span document boundaries, so consecutive samples share one token (the last label of
   sample j is the first input of sample j+1). `sample_idx[j] = (position in doc_idx, offset)`
   of stream position j*S, computed with cumsum + searchsorted.
3. `shuffle_idx`: a seeded permutation of all built samples; item i is sample shuffle_idx[i].

Items are dicts of tensors: `input_ids` (the first S tokens), `labels` (the next S),
`loss_mask` (0.0 on inputs equal to eod when eod_mask_loss), `position_ids` (0..S-1, restarting
after every eod when reset_position_ids).

The three arrays can be cached as .npy files in `index_mapping_dir` (name keyed by a hash of
everything they depend on; written to a temporary name and renamed, so ranks building the same
files at once never read a partial one).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from nxdt.spec.data import SPLIT_NAMES  # noqa: F401 - the split order, re-exported
from nxdt.config.errors import ConfigError
from nxdt.data.indexed import IndexedDataset

_MAPPING_VERSION = 1


# ----------------------------------------------------------------------------- splits


def parse_splits_string(splits_string: str | None) -> list[float]:
    """'980,10,10' (or '98/1/1', or '1') → three normalised fractions for train/validation/test."""
    text = "1" if splits_string is None else str(splits_string)
    sep = "," if "," in text else "/" if "/" in text else None
    try:
        splits = [float(s) for s in (text.split(sep) if sep else [text])]
    except ValueError:
        raise ConfigError(f"data.splits_string: '{text}' is not a list of numbers like '980,10,10'") from None
    splits = (splits + [0.0, 0.0, 0.0])[:3]
    if any(s < 0 for s in splits) or sum(splits) <= 0:
        raise ConfigError(f"data.splits_string: '{text}' needs non-negative parts with a positive sum")
    total = sum(splits)
    return [s / total for s in splits]


def get_train_valid_test_split_(splits_string: str | None, size: int) -> list[int]:
    """Megatron's document ranges: boundaries [0, a, b, size]; split k is documents [bk, bk+1)."""
    splits = parse_splits_string(splits_string)
    index = [0]
    for split in splits:
        index.append(index[-1] + int(round(split * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    assert len(index) == 4 and index[-1] == size
    return index


# ----------------------------------------------------------------------------- GPT dataset


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _atomic_save(path: str, array: np.ndarray) -> None:
    """np.save under a unique temporary name, then rename: readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as stream:
            np.save(stream, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def build_document_index(doc_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState | None) -> np.ndarray:
    """The split's documents once per epoch, each epoch shuffled on its own (int32 when it fits)."""
    dtype = np.int32 if (len(doc_ids) == 0 or doc_ids.max() < 2**31 - 1) else np.int64
    epochs = []
    for _ in range(num_epochs):
        epoch = np.array(doc_ids, dtype=dtype)
        if rng is not None:
            rng.shuffle(epoch)
        epochs.append(epoch)
    return np.concatenate(epochs) if epochs else np.zeros(0, dtype)


def build_sample_index(lengths: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] of (position in doc_idx, token offset) for stream positions j*seq_length.

    `lengths` are the token counts of the documents in doc_idx order. A position that falls on a
    document's end belongs to the next non-empty document at offset 0.
    """
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # Without the extra token the final boundary can sit exactly on the stream's end: keep it in
    # the last document (offset == its length).
    doc_pos = np.minimum(np.searchsorted(ends, starts, side="right"), len(lengths) - 1)
    offsets = starts - (ends[doc_pos] - lengths[doc_pos])
    return np.stack([doc_pos, offsets], axis=1).astype(np.int64)


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length causal-LM samples over the documents `doc_ids` of an IndexedDataset.

    `len(ds) == num_samples`; samples beyond one epoch wrap into further (reshuffled) epochs.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: Sequence[int] | np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        *,
        eod_id: int | None = None,
        name: str = "train",
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        add_extra_token: bool = True,
        shuffle: bool = True,
        index_mapping_dir: str | None = None,
    ):
        if seq_length < 1:
            raise ConfigError(f"data.seq_length: must be positive, got {seq_length}")
        if (eod_mask_loss or reset_position_ids) and eod_id is None:
            raise ValueError("eod_mask_loss / reset_position_ids need eod_id")
        self.indexed = indexed
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod_id = eod_id
        self.name = name
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.extra = 1 if add_extra_token else 0
        self.shuffle = shuffle
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._index_mapping(index_mapping_dir)

    # -- index mapping

    def _num_epochs(self, tokens_per_epoch: int) -> int:
        """Fewest epochs whose token stream yields num_samples samples."""
        need = self.num_samples * self.seq_length + self.extra
        return max(1, -(-need // tokens_per_epoch))

    def _cache_key(self) -> str:
        stamp = getattr(self.indexed, "cache_stamp", None)
        if callable(stamp):  # a folder of arrow shards (nxdt.data.arrow_shards): its files and options
            source = {"shards": stamp()}
        else:
            idx_path = os.path.abspath(self.indexed.prefix + ".idx")
            stat = os.stat(idx_path)
            source = {"idx": idx_path, "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns}
        desc = {
            "version": _MAPPING_VERSION, **source,
            "docs": hashlib.sha1(self.doc_ids.tobytes()).hexdigest(), "num_samples": self.num_samples,
            "seq_length": self.seq_length, "seed": self.seed, "extra": self.extra, "shuffle": self.shuffle,
        }
        return hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    def _index_mapping(self, cache_dir: str | None):
        if self.num_samples <= 0:
            return np.zeros(0, np.int32), np.zeros((1, 2), np.int64), np.zeros(0, np.int64)
        # Checked on every rank before any collective, so no rank waits for one that failed.
        if not len(self.doc_ids) or not int(np.asarray(self.indexed.sizes, dtype=np.int64)[self.doc_ids].sum()):
            raise ConfigError(
                f"{self.indexed.prefix}: the {self.name} split has no tokens "
                f"({len(self.doc_ids)} documents) but {self.num_samples} samples are needed; check data.splits_string"
            )
        paths = None
        if cache_dir:
            base = os.path.join(cache_dir, f"{os.path.basename(self.indexed.prefix)}_{self.name}_{self._cache_key()}")
            paths = [f"{base}_{part}_idx.npy" for part in ("doc", "sample", "shuffle")]
            if _distributed():
                # Global rank 0 builds and writes the cache while the others wait, then they load it.
                built = self._build_and_cache(cache_dir, paths) if dist.get_rank() == 0 else None
                dist.barrier()
                if built is not None:
                    return built
            if all(os.path.isfile(p) for p in paths):
                return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        return self._build_and_cache(cache_dir, paths)

    def _build_and_cache(self, cache_dir: str | None, paths: list[str] | None):
        if paths is not None and all(os.path.isfile(p) for p in paths):
            return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)

        sizes = np.asarray(self.indexed.sizes, dtype=np.int64)
        tokens_per_epoch = int(sizes[self.doc_ids].sum()) if len(self.doc_ids) else 0
        num_epochs = self._num_epochs(tokens_per_epoch)
        rng = np.random.RandomState(self.seed) if self.shuffle else None
        doc_idx = build_document_index(self.doc_ids, num_epochs, rng)
        total = (num_epochs * tokens_per_epoch - self.extra) // self.seq_length
        sample_idx = build_sample_index(sizes[doc_idx], self.seq_length, total)
        shuffle_idx = rng.permutation(total).astype(np.int64) if rng is not None else np.arange(total, dtype=np.int64)
        if paths is not None:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                for path, array in zip(paths, (doc_idx, sample_idx, shuffle_idx)):
                    _atomic_save(path, array)
            except OSError as err:  # a read-only data directory: work without the cache
                warnings.warn(f"index mapping cache not written to {cache_dir}: {err}", stacklevel=2)
        return doc_idx, sample_idx, shuffle_idx

    # -- samples

    @property
    def num_built_samples(self) -> int:
        """Samples in the token stream (>= len(self)); `raw_sample(j)` is valid below this."""
        return len(self.sample_idx) - 1

    def raw_sample(self, j: int) -> np.ndarray:
        """Unshuffled sample j: stream tokens [j*S, j*S + S + extra) as int64."""
        (first, first_off), (last, last_off) = self.sample_idx[j], self.sample_idx[j + 1]
        first, first_off, last, last_off = int(first), int(first_off), int(last), int(last_off)
        end = last_off + self.extra
        if first == last:
            return self.indexed.get(int(self.doc_idx[first]), first_off, end - first_off).astype(np.int64)
        parts = [self.indexed.get(int(self.doc_idx[first]), first_off)]
        for pos in range(first + 1, last):
            parts.append(self.indexed.get(int(self.doc_idx[pos])))
        if end:
            parts.append(self.indexed.get(int(self.doc_idx[last]), 0, end))
        return np.concatenate(parts).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"{self.name} sample {idx} out of range ({self.num_samples})")
        return self.make_item(self.raw_sample(int(self.shuffle_idx[idx])))

    def make_item(self, text: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids / labels / loss_mask / position_ids from S + extra tokens."""
        S = self.seq_length
        loss_mask = np.ones(S, dtype=np.float32)
        if self.extra:
            tokens, labels = text[:-1], text[1:]
        else:
            # seq_length tokens only: the last position has no next token and is not trained on.
            tokens = text
            labels = np.empty_like(text)
            labels[:-1] = text[1:]
            labels[-1] = self.eod_id if self.eod_id is not None else 0
            loss_mask[-1] = 0.0
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_id] = 0.0
        position_ids = np.arange(S, dtype=np.int64)
        if self.reset_position_ids:
            # Positions restart at 0 on the token after each eod (Megatron's reset_position_ids).
            seg_start = np.zeros(S, dtype=np.int64)
            after_eod = np.nonzero(tokens[:-1] == self.eod_id)[0] + 1
            seg_start[after_eod] = after_eod
            position_ids = position_ids - np.maximum.accumulate(seg_start)
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
            "labels": torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
        }


# ----------------------------------------------------------------------------- blending


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(f"data.data_prefix: blend weights {list(weights)} must be non-negative with a positive sum")
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's deterministic blend (helpers.cpp `build_blending_indices`).

    For sample i, with x = max(i, 1): pick the dataset with the largest `w_d * x - taken_d`
    (normalised weights, first index wins ties); `dataset_sample_index[i]` is taken_d before the
    pick. Note Megatron's x is max(i, 1), not i + 1: samples 0 and 1 both use x = 1.
    """
    w = [float(v) for v in normalize_weights(weights)]
    taken = [0] * len(w)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        x = float(max(i, 1))
        best, best_err = 0, w[0] * x - taken[0]
        for d in range(1, len(w)):
            err = w[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


def blended_samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples to build per dataset for a blend of num_samples (Megatron's 0.5% margin)."""
    return [int(math.ceil(w * num_samples * 1.005)) for w in normalize_weights(weights)]


class BlendedDataset(torch.utils.data.Dataset):
    """num_samples items drawn from `datasets` in Megatron's deterministic weighted order."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, count) in enumerate(zip(self.datasets, counts)):
            if count > len(ds):
                raise ValueError(f"blend needs {count} samples from dataset {d}, which has {len(ds)}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
