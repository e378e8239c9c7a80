"""Token ids past the tokenizer's vocabulary, found before training instead of inside it.

Data tokenized with another tokenizer (ids up to 102,000 read with a 32,000-token tokenizer) used
to fail only after training started, as `IndexError: index out of range in self` deep in the
embedding. The data module now checks every source it opens: the largest token id of each file
must be below `len(tokenizer)`; otherwise one ConfigError names the file, the id and the tokenizer.

The largest id is found once per file. A Megatron `.bin` whose dtype cannot hold an id as large
as the vocabulary needs no scan (uint16 data under a 65,536+ token tokenizer); otherwise the
memory-mapped `.bin` is scanned in chunks. Arrow / parquet shards use pyarrow.compute per file.
Results are cached in `nxdt_token_ids.json` next to the index mappings (data.index_mapping_dir,
else beside the data), keyed on the file's path, size and mtime; a directory that is not
writable simply has no cache.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import numpy as np

from nxdt.config.errors import ConfigError

CACHE_NAME = "nxdt_token_ids.json"
_CACHE_VERSION = 1
_CHUNK_TOKENS = 1 << 24  # 16M ids per numpy max: bounded memory, few Python iterations


def scan_bin_max(path: str, dtype) -> int | None:
    """The largest id in a Megatron `.bin` (None when it is empty), read through np.memmap in chunks."""
    if os.path.getsize(path) == 0:
        return None
    data = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    return max(int(data[s : s + _CHUNK_TOKENS].max()) for s in range(0, len(data), _CHUNK_TOKENS))


def _load(cache_path: str) -> dict:
    try:
        with open(cache_path) as stream:
            cache = json.load(stream)
        return cache["files"] if cache.get("version") == _CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _save(cache_path: str, files: dict) -> None:
    """Write atomically (ranks may write at once); silently nothing when the directory is not writable."""
    try:
        directory = os.path.dirname(cache_path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=CACHE_NAME + ".", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w") as stream:
            json.dump({"version": _CACHE_VERSION, "files": files}, stream, indent=1, sort_keys=True)
        os.replace(tmp, cache_path)
    except OSError:
        pass


def cached_max(path: str, scan: Callable[[], int | None], cache_dir: str | None, column: str = "") -> int | None:
    """`scan()` for the file `path`, remembered in `cache_dir`/nxdt_token_ids.json under its path,
    size and mtime (and `column` for shards with several token columns)."""
    stat = os.stat(path)
    key = os.path.abspath(path) + (f"#{column}" if column else "")
    stamp = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache_path = os.path.join(cache_dir, CACHE_NAME) if cache_dir else None
    files = _load(cache_path) if cache_path else {}
    entry = files.get(key)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and "max" in entry:
        return entry["max"]
    largest = scan()
    if cache_path:
        files = _load(cache_path)  # another rank may have added files meanwhile
        files[key] = {**stamp, "max": largest}
        _save(cache_path, files)
    return largest


def largest_token_ids(docs, vocab_size: int, cache_dir: str | None) -> list[tuple[str, int]]:
    """(file, largest id) of every file of a document source that needs a look; a Megatron
    IndexedDataset (`.bin`) or ArrowShardDocuments (each shard file)."""
    if hasattr(docs, "file_max_token_id"):  # arrow / parquet shards
        out = []
        for rel in docs.files:
            path = docs.shard_path(rel)
            largest = cached_max(path, lambda rel=rel: docs.file_max_token_id(rel), cache_dir, docs.col_name)
            if largest is not None:
                out.append((path, largest))
        return out
    dtype = np.dtype(docs.dtype)
    if np.issubdtype(dtype, np.integer) and np.iinfo(dtype).max < vocab_size:
        return []  # no id the file can hold reaches the vocabulary
    path = f"{docs.prefix}.bin"
    largest = cached_max(path, lambda: scan_bin_max(path, dtype), cache_dir)
    return [] if largest is None else [(path, largest)]


def tokenizer_label(tok_cfg) -> str:
    """Which tokenizer data.tokenizer names, for the message."""
    library = str(getattr(tok_cfg, "library", "huggingface")).lower()
    if library == "megatron":
        return f"data.tokenizer.vocab_file={tok_cfg.vocab_file}"
    if library == "sentencepiece":
        return f"data.tokenizer.model={tok_cfg.model}"
    if getattr(tok_cfg, "type", None) is None:
        return "data.tokenizer.type=null, the bundled tokenizer"
    return f"data.tokenizer.type={tok_cfg.type}"


def check_vocabulary(docs, vocab_size: int, tok_cfg, cache_dir: str | None) -> None:
    """ConfigError when a file of `docs` holds a token id >= vocab_size (see the module docstring)."""
    label = tokenizer_label(tok_cfg)
    for key in ("bos_token", "sep_token"):
        token = getattr(docs, key, None)
        if token is not None and token >= vocab_size:
            raise ConfigError(f"data.{key}: {token} is not below the tokenizer's vocabulary ({label}: "
                              f"{vocab_size} tokens)")
    for path, largest in largest_token_ids(docs, vocab_size, cache_dir):
        if largest >= vocab_size:
            raise ConfigError(
                f"{path}: token ids reach {largest} but the tokenizer ({label}) has {vocab_size} tokens; "
                "re-tokenize it with this tokenizer (nxdt preprocess) or set data.tokenizer to the one it "
                "was made with")
