"""fms-fsdp's `file_type: hf_parquet`: parquet files of raw text, tokenized when the folder is opened.

    data_path/<dataset>/**/*.parquet   one document per row, its `col_name` column a string

Each row's text goes through the run's tokenizer (`data.tokenizer`) exactly as fms-fsdp's
ParquetHandler calls it: `tokenizer(text)["input_ids"]`, special tokens included (a Llama
tokenizer adds its BOS; nxdt.data.arrow_shards then strips it like any other leading
bos / sep / strip token). Rows are taken in file order, row groups in order.

fms-fsdp tokenizes a document each time its reader reaches it. nxdt tokenizes every row once,
when the dataset is opened: logical shards, resumption on another number of ranks and the
sample-exact checkpointed position (nxdt.data.logical_shards) all need the documents' token
counts. Tokenizing is deterministic, so a resumed run reads bitwise the same samples.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nxdt.config.errors import ConfigError

BATCH_ROWS = 1024  # rows handed to the tokenizer at a time


def is_text_column(path: str, col: str) -> bool:
    """Whether `col` of the parquet file `path` holds strings (raw text)."""
    schema = pq.read_schema(path)
    index = schema.get_field_index(col)
    return index >= 0 and (pa.types.is_string(schema.field(index).type)
                           or pa.types.is_large_string(schema.field(index).type))


def tokenize_text_shard(path: str, col: str, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token array, starts, lengths) of one raw-text parquet file, as
    nxdt.data.arrow_shards.index_shard gives them for token-id files."""
    if tokenizer is None:
        raise ConfigError(f"{path}: a raw-text parquet file (data.file_type) needs the run's tokenizer")
    try:
        schema = pq.read_schema(path)
        index = schema.get_field_index(col)
        if index < 0:
            raise ConfigError(f"{path}: no column '{col}' (data.col_name={col}); its columns: "
                              f"{', '.join(schema.names)}")
        if not is_text_column(path, col):
            raise ConfigError(f"{path}: column '{col}' is {schema.field(index).type}, not raw text; data.file_type "
                              f"hf_parquet reads a string column (data.col_name={col})")
        column = pq.read_table(path, columns=[col]).column(0)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: cannot read it as parquet ({' '.join(str(err).split())})") from None
    if column.null_count:
        raise ConfigError(f"{path}: column '{col}' has {column.null_count} null rows (data.col_name={col})")
    texts = column.to_pylist()
    ids: list[list[int]] = []
    for i in range(0, len(texts), BATCH_ROWS):
        ids += tokenizer(texts[i : i + BATCH_ROWS])["input_ids"]
    lengths = np.asarray([len(d) for d in ids], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(ids) else lengths
    tokens = np.fromiter((t for d in ids for t in d), dtype=np.int64, count=int(lengths.sum()))
    return tokens, starts, lengths
