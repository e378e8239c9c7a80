"""fms-fsdp's pre-tokenized arrow shard folders, read as documents the way `IndexedDataset` is.

    data_path/<dataset>/**/*.arrow    Arrow IPC files: every record batch is one document, its
                                      `col_name` column ("tokens") the document's token ids
    data_path/<dataset>/**/*.parquet  one document per row, `col_name` a list of integer ids

An `.arrow` file may also be an IPC *stream* (what `datasets.save_to_disk` writes), and any file
whose column is a list<int> has one document per row. Files are taken in the order of their
relative paths (fms-fsdp's order), documents in file order.

With `data.file_type: hf_parquet` the .parquet files' `col_name` column is raw text, tokenized
with the run's tokenizer when the folder is opened (nxdt.data.parquet_text); `auto` reads .arrow
files' `tokens` column as token ids and the .parquet files' `col_name` as text (fms-fsdp's
AutoHandler).

Every document is read as the virtual document [bos] + tokens + [sep] (fms-fsdp's
`bos_token` / `sep_token`): a leading or trailing token already equal to bos or sep, or to one
of `data.strip_tokens` (and bol / eol, as fms-fsdp's droplist), is dropped first, as fms-fsdp's
ArrowHandler does, so neither is doubled. `sizes` count those added tokens,
so `ShardedStreams`, `GPTDataset` and the Megatron split logic work on this class unchanged.

Nothing is loaded into Python lists: uncompressed IPC files are memory-mapped and each document
is a numpy view into the map (its element offset is found once, from the Arrow buffer addresses);
parquet files and compressed IPC batches cannot be mapped, so their token column is decoded once
into one numpy array. Per-document offsets are kept in numpy arrays, so `get` is one searchsorted.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nxdt.config.errors import ConfigError
from nxdt.spec.paths import SHARD_SUFFIXES
from nxdt.data.indexed import DocumentAccess
from nxdt.data.parquet_text import tokenize_text_shard


FILE_TYPES = {"arrow": SHARD_SUFFIXES, "hf_parquet": (".parquet",), "auto": SHARD_SUFFIXES}
"""data.file_type -> the files it reads (fms-fsdp's handlers; arrow here also takes list<int> parquet)."""


def shard_files(folder: str, file_type: str = "arrow") -> list[str]:
    """Relative paths of every shard file of `file_type` under `folder`, recursively, sorted."""
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names if n.endswith(FILE_TYPES[file_type])]
    return sorted(found)


def is_text_file(rel: str, file_type: str) -> bool:
    """Whether data.file_type reads this file as raw text (hf_parquet; auto: its .parquet files)."""
    return file_type in ("hf_parquet", "auto") and rel.endswith(".parquet")


def _is_int_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)


def _column_chunks(path: str, col: str):
    """(keepalive buffer or None, [(values array, int64 offsets of its documents)]) of one shard file.

    An integer column: each record batch is one document. A list<int> column: each row is one."""
    keep = None
    try:
        if path.endswith(".parquet"):
            schema = pq.read_schema(path)
            _check_column(schema, col, path)
            chunks = pq.read_table(path, columns=[col]).column(0).chunks
        else:
            keep = pa.memory_map(path, "r").read_buffer()  # zero-copy: the whole file as one map
            try:
                reader = pa.ipc.open_file(keep)
                schema = reader.schema
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: an IPC stream (datasets.save_to_disk)
                reader = pa.ipc.open_stream(keep)
                schema = reader.schema
                batches = iter(reader)
            index = _check_column(schema, col, path)
            chunks = [batch.column(index) for batch in batches]
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: cannot read it as an Arrow IPC file or stream or as parquet ({err})") from err
    kind = schema.field(col).type
    out = []
    for chunk in chunks:
        if chunk.null_count or (_is_int_list(kind) and chunk.values.null_count):
            raise ConfigError(f"{path}: column '{col}' has null token ids (data.col_name={col})")
        if _is_int_list(kind):
            out.append((chunk.values, chunk.offsets.to_numpy().astype(np.int64)))
        else:
            out.append((chunk, np.array([0, len(chunk)], dtype=np.int64)))
    return keep, out


def _check_column(schema: pa.Schema, col: str, path: str) -> int:
    index = schema.get_field_index(col)
    if index < 0:
        raise ConfigError(f"{path}: no column '{col}' (data.col_name={col}); its columns: {', '.join(schema.names)}")
    kind = schema.field(index).type
    if path.endswith(".parquet") and not _is_int_list(kind):
        raise ConfigError(f"{path}: column '{col}' is {kind}; a parquet shard needs one document per row, "
                          f"a list of integer token ids (data.col_name={col})")
    if not (pa.types.is_integer(kind) or _is_int_list(kind)):
        raise ConfigError(f"{path}: column '{col}' is {kind}, not integer token ids (data.col_name={col})")
    return index


def _mapped_start(values: pa.Array, base: pa.Buffer, itemsize: int) -> int | None:
    """Element offset of `values` in the memory map `base`, or None when it is not a view of it
    (a compressed batch is decompressed into memory)."""
    if len(values) == 0:
        return 0
    data = values.buffers()[1]
    if data is None:
        return None
    delta = data.address - base.address
    if delta < 0 or delta + data.size > base.size or delta % itemsize:
        return None
    return delta // itemsize + values.offset


def index_shard(path: str, col: str):
    """(token array, starts, lengths) of the documents of one shard file: document i is
    `tokens[starts[i] : starts[i] + lengths[i]]`. `tokens` is a view of the memory map when
    every document lies in it, else the column decoded once into memory."""
    keep, chunks = _column_chunks(path, col)
    if not chunks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    dtype = np.dtype(chunks[0][0].type.to_pandas_dtype())
    starts, lengths = [], []
    mapped = [_mapped_start(v, keep, dtype.itemsize) if keep is not None else None for v, _ in chunks]
    if all(m is not None for m in mapped):
        tokens = np.frombuffer(keep, dtype=dtype.newbyteorder("<"), count=keep.size // dtype.itemsize)
        for m, (_, offsets) in zip(mapped, chunks):
            starts.append(m + offsets[:-1])
            lengths.append(np.diff(offsets))
    else:  # decode once: one numpy array of every chunk's values
        parts, pos = [], 0
        for values, offsets in chunks:
            parts.append(values.to_numpy(zero_copy_only=False))
            starts.append(pos + offsets[:-1])
            lengths.append(np.diff(offsets))
            pos += len(values)
        tokens = np.concatenate(parts).astype(dtype, copy=False)
    return tokens, np.concatenate(starts), np.concatenate(lengths)


def _strip(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, drop: list[int]):
    """fms-fsdp's rule: drop a first token in `drop`, then a last one (bos / sep already in the data)."""
    if not drop or not len(tokens):
        return starts, lengths
    for end in (False, True):
        nonempty = lengths > 0
        at = np.where(nonempty, starts + (lengths - 1 if end else 0), 0)
        hit = nonempty & np.isin(tokens[at], drop)
        lengths = lengths - hit
        if not end:
            starts = starts + hit
    return starts, lengths


class ArrowShardDocuments(DocumentAccess):
    """The documents of a folder of arrow / parquet shards, with `IndexedDataset`'s interface.

    `ds.get(i, offset, length)` is tokens offset:offset+length of [bos] + document i + [sep];
    `ds.sizes` the lengths of those (bos and sep included); `len(ds)` the number of documents.
    """

    unit = "documents"

    def __init__(self, folder: str, col_name: str = "tokens", sep_token: int | None = None,
                 bos_token: int | None = None, strip_tokens=(), file_type: str = "arrow", tokenizer=None,
                 _texts: dict | None = None):
        self.prefix = os.path.normpath(str(folder))
        self.col_name, self.sep_token, self.bos_token = str(col_name), sep_token, bos_token
        self.strip_tokens, self.file_type, self.tokenizer = [int(t) for t in strip_tokens], str(file_type), tokenizer
        self.files = shard_files(self.prefix, self.file_type)
        # auto: col_name names the text column; the .arrow files' ids are in 'tokens' (fms-fsdp's AutoHandler)
        self.token_column = "tokens" if self.file_type == "auto" else self.col_name
        if not self.files:
            kinds = " or ".join(FILE_TYPES[self.file_type])
            raise ConfigError(f"data.datasets: {self.prefix} has no {kinds} shards"
                              + (f" (data.file_type={self.file_type})" if self.file_type != "arrow" else ""))
        # fms-fsdp's droplist: strip_tokens + bos + eos (+ bol + eol, which the caller puts in strip_tokens)
        drop = sorted({t for t in (bos_token, sep_token, *self.strip_tokens) if t is not None})
        self._texts = dict(_texts or {})  # rel -> (tokens, starts, lengths) of the raw-text files
        self._tokens, starts, lengths, counts = [], [], [], [0]
        for rel in self.files:
            if is_text_file(rel, self.file_type):
                if rel not in self._texts:
                    self._texts[rel] = tokenize_text_shard(self.shard_path(rel), self.col_name, tokenizer)
                tokens, s, n = self._texts[rel]
            else:
                tokens, s, n = index_shard(self.shard_path(rel), self.token_column)
            s, n = _strip(tokens, s, n, drop)
            self._tokens.append(tokens)
            starts.append(s)
            lengths.append(n)
            counts.append(counts[-1] + len(n))
        self._starts = np.concatenate(starts).astype(np.int64)
        self._lengths = np.concatenate(lengths).astype(np.int64)
        self._bounds = np.asarray(counts, dtype=np.int64)  # documents of file f: bounds[f]:bounds[f+1]
        if not len(self._lengths):
            raise ConfigError(f"data.datasets: {self.prefix} holds no documents (its {len(self.files)} "
                              f"shard files have no record batches or rows)")
        self._head = int(bos_token is not None)
        self.sizes = self._lengths + self._head + int(sep_token is not None)
        self.doc_idx = np.arange(len(self.sizes) + 1, dtype=np.int64)
        # one dtype for every document: the files' column types and bos / sep (an unsigned 64-bit
        # column would promote to float: int64 then)
        kinds = [t.dtype for t in self._tokens if t.size] + [np.min_scalar_type(t) for t in drop]
        dtype = np.result_type(*kinds) if kinds else np.dtype(np.int64)
        self.dtype = np.dtype(dtype) if np.issubdtype(dtype, np.integer) else np.dtype(np.int64)

    def shard_path(self, rel: str) -> str:
        return os.path.join(self.prefix, rel)

    # -- pickling: DataLoader workers started with spawn re-open (and re-index) the files

    def __getstate__(self):  # raw text travels tokenized: a worker needs no tokenizer
        return {"folder": self.prefix, "col_name": self.col_name, "sep": self.sep_token, "bos": self.bos_token,
                "strip": self.strip_tokens, "file_type": self.file_type, "texts": self._texts}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["col_name"], state["sep"], state["bos"], state["strip"],
                      state["file_type"], _texts=state["texts"])

    # -- the IndexedDataset interface

    @property
    def num_documents(self) -> int:
        return len(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of [bos] + document `idx` + [sep]."""
        size = int(self.sizes[idx])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"document {idx} has {size} tokens; asked for {offset}:{offset + length}")
        f = int(np.searchsorted(self._bounds, idx, side="right")) - 1
        start, n, head = int(self._starts[idx]), int(self._lengths[idx]), self._head
        lo, hi = min(max(offset - head, 0), n), min(max(offset + length - head, 0), n)
        core = self._tokens[f][start + lo : start + hi]
        with_bos = head and offset == 0 and length > 0
        with_sep = self.sep_token is not None and length > 0 and offset + length == size
        if not (with_bos or with_sep):
            return core.astype(self.dtype, copy=False)
        parts = ([[self.bos_token]] if with_bos else []) + [core] + ([[self.sep_token]] if with_sep else [])
        return np.concatenate([np.asarray(p, dtype=self.dtype) for p in parts])

    def document(self, doc: int) -> np.ndarray:
        return self.get(doc)

    # -- for the index-mapping cache and the vocabulary check

    def cache_stamp(self) -> dict:
        """What the documents depend on: the options and every shard's name, size and mtime."""
        files = []
        for rel in self.files:
            stat = os.stat(self.shard_path(rel))
            files.append([rel, stat.st_size, stat.st_mtime_ns])
        stamp = {"folder": os.path.abspath(self.prefix), "col_name": self.col_name, "sep": self.sep_token,
                 "bos": self.bos_token, "files": files}
        if self.strip_tokens or self.file_type != "arrow":
            stamp.update(strip=self.strip_tokens, file_type=self.file_type)
        if self._texts:  # the documents' lengths depend on the tokenizer
            tok = self.tokenizer
            stamp["tokenizer"] = [str(getattr(tok, "name_or_path", type(tok).__name__)), len(tok) if tok else 0]
        return stamp

    def file_max_token_id(self, rel: str) -> int | None:
        """The largest id in one shard file's token column (pyarrow.compute; None when it holds none)."""
        if rel in self._texts:
            tokens = self._texts[rel][0]
            return int(tokens.max()) if len(tokens) else None
        _, chunks = _column_chunks(self.shard_path(rel), self.token_column)
        found = [pc.max(values).as_py() for values, _ in chunks if len(values)]
        return max(found) if found else None

    def max_token_id(self) -> int | None:
        """The largest id any document yields: every shard's column, and bos / sep."""
        found = [m for m in map(self.file_max_token_id, self.files) if m is not None]
        found += [t for t in (self.bos_token, self.sep_token) if t is not None]
        return max(found) if found else None
