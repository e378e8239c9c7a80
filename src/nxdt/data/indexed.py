"""Megatron's memory-mapped indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte for byte.

The format is shared by Megatron-LM, NeMo and GPT-NeoX, so files written here load there and
the other way round (layout of `megatron/core/datasets/indexed_dataset.py`, all little-endian):

`.bin`: the token ids of every sequence, back to back, in the index's dtype.

`.idx`:
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64       sequence count N
    u64       document-index length D (= number of documents + 1)
    int32[N]  sequence lengths (tokens)
    int64[N]  sequence byte offsets into .bin
    int64[D]  document index: sequence index where each document starts, then N (starts with 0)

nxdt writes one sequence per document, so the document index is 0, 1, ..., N.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

from nxdt.config.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_fitting_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's rule: uint16 when the vocabulary is below 65500 tokens, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ConfigError(f"indexed dataset: dtype {np.dtype(dtype)} has no Megatron code") from None


def index_file_path(prefix: str) -> str:
    return f"{prefix}.idx"


def data_file_path(prefix: str) -> str:
    return f"{prefix}.bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Write `PREFIX.bin` / `PREFIX.idx`, one document (= one sequence) at a time.

    Data goes to `PREFIX.bin.tmp` / `PREFIX.idx.tmp`; `finalize()` renames both at the end, so a
    crashed run never leaves a half-written dataset under the final names (`.idx` is renamed last:
    a reader that sees it also sees the complete `.bin`).
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        self._bin_tmp = data_file_path(self.prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._finalized = False

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (no document boundary)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            array = array.reshape(-1)
        if self._info is not None and array.size and (array.min() < self._info.min or array.max() > self._info.max):
            raise ConfigError(
                f"{data_file_path(self.prefix)}: token id out of range for {self.dtype} "
                f"(min {array.min()}, max {array.max()}); use int32 for vocabularies of 65500 or more"
            )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(array.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    @property
    def num_tokens(self) -> int:
        return int(sum(self._sizes))

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._finalized:
            return
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        idx_tmp = index_file_path(self.prefix) + ".tmp"
        with open(idx_tmp, "wb") as stream:
            stream.write(INDEX_HEADER)
            stream.write(struct.pack("<Q", INDEX_VERSION))
            stream.write(struct.pack("<B", self._code))
            stream.write(struct.pack("<Q", len(sizes)))
            stream.write(struct.pack("<Q", len(doc_idx)))
            stream.write(sizes.astype("<i4").tobytes(order="C"))
            stream.write(pointers.astype("<i8").tobytes(order="C"))
            stream.write(doc_idx.astype("<i8").tobytes(order="C"))
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Close and delete the temporary files (the final names are never touched)."""
        self._bin.close()
        for path in (self._bin_tmp, index_file_path(self.prefix) + ".tmp"):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class DocumentAccess:
    """`ds[i]`, `ds[-1]` and `ds[a:b]` over `len(ds)` and `ds.get(i)`: shared by the document sources
    (IndexedDataset here, nxdt.data.arrow_shards.ArrowShardDocuments)."""

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for {len(self)} {self.unit}")
        return self.get(int(idx))


class IndexedDataset(DocumentAccess):
    """Read a Megatron indexed dataset through `np.memmap` (nothing is loaded eagerly).

    `ds[i]` is sequence i as a numpy array; `ds.get(i, offset, length)` a slice of it;
    `ds.sizes` the int32 lengths; `ds.doc_idx` the document index (len = documents + 1).
    Any inconsistency raises `ConfigError` naming the file.
    """

    unit = "sequences"

    def __init__(self, prefix: str, skip_warmup: bool = True):
        self.prefix = str(prefix)
        self.skip_warmup = skip_warmup
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ConfigError(
                    f"{path}: indexed dataset file not found (data prefix '{self.prefix}' needs both .idx and .bin)"
                )
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            head = stream.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise ConfigError(f"{idx_path}: not a Megatron mmap index (bad magic {head[:9]!r}, expected {INDEX_HEADER!r})")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != INDEX_VERSION:
            raise ConfigError(f"{idx_path}: unsupported index version {version} (expected 1)")
        code = head[17]
        if code not in DTYPE_CODES:
            raise ConfigError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_count, self.document_count = struct.unpack("<QQ", head[18:34])
        expected = _HEADER_BYTES + self.sequence_count * (4 + 8) + self.document_count * 8
        if idx_bytes < expected:
            raise ConfigError(
                f"{idx_path}: truncated index ({idx_bytes} bytes, the header announces {expected})"
            )
        self._idx_map = np.memmap(idx_path, mode="r", order="C")
        n, d = self.sequence_count, self.document_count
        self.sizes = np.frombuffer(self._idx_map, dtype="<i4", count=n, offset=_HEADER_BYTES)
        self.pointers = np.frombuffer(self._idx_map, dtype="<i8", count=n, offset=_HEADER_BYTES + 4 * n)
        self.doc_idx = np.frombuffer(self._idx_map, dtype="<i8", count=d, offset=_HEADER_BYTES + 12 * n)

        bin_bytes = os.path.getsize(bin_path)
        expected_bin = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        if bin_bytes != expected_bin:
            raise ConfigError(
                f"{bin_path}: size {bin_bytes} bytes disagrees with {idx_path} "
                f"({int(self.sizes.sum())} tokens x {self.dtype.itemsize} bytes = {expected_bin})"
            )
        if n and (self.pointers[0] != 0 or self.pointers[-1] + int(self.sizes[-1]) * self.dtype.itemsize != bin_bytes):
            raise ConfigError(f"{idx_path}: sequence pointers disagree with the sequence lengths")
        if d and (self.doc_idx[0] != 0 or self.doc_idx[-1] != n or np.any(np.diff(self.doc_idx) < 0)):
            raise ConfigError(f"{idx_path}: document index must rise from 0 to the sequence count {n}")
        # np.memmap of an empty file fails; an empty dataset simply has no data buffer.
        self._bin_map = np.memmap(bin_path, mode="r", order="C") if bin_bytes else np.zeros(0, np.uint8)
        if not skip_warmup and bin_bytes:
            # Touch every page once so the first epoch does not stall on page faults.
            _ = int(np.asarray(self._bin_map[:: 1 << 20]).sum())

    def __getstate__(self):
        # DataLoader workers started with spawn re-open the files instead of copying the maps.
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"], skip_warmup=True)

    @property
    def num_documents(self) -> int:
        return max(int(self.document_count) - 1, 0)

    def __len__(self) -> int:
        return int(self.sequence_count)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `idx` (a read-only view into the file)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {idx} has {size} tokens; asked for {offset}:{offset + length}")
        if length == 0:
            return np.zeros(0, self.dtype)
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype.newbyteorder("<"), count=length, offset=start)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences concatenated)."""
        begin, end = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        parts = [self.get(i) for i in range(begin, end)]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
