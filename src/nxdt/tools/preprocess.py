"""`nxdt preprocess`: tokenize documents into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

    nxdt preprocess --input corpus.jsonl.gz --tokenizer TOKENIZER_DIR --output-prefix data/corpus

Inputs (chosen by file name; several --input files are concatenated in order):
  *.jsonl, *.jsonl.gz    one JSON object per line; the text is under --json-keys (default `text`)
  *.json, *.json.gz      a JSON list of objects; a file not starting with `[` is read as jsonl
                         (Megatron's preprocess_data.py calls its loose-json input .json)
  anything else          plain text: one document per blank-line-separated paragraph, or one
                         document per file with --text-mode file

Every document becomes one sequence: the tokenizer's ids (no special tokens added) followed by
the end-of-document id (the tokenizer's eos) unless --no-append-eod. Documents whose text is empty
are skipped and counted. Token ids are stored as uint16 when the vocabulary has fewer than 65500
tokens, else int32. With several --json-keys, each key goes to its own PREFIX_<key>.bin/.idx.
Existing output is never overwritten without --overwrite. --workers N tokenizes in N processes
(document order is kept).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from nxdt.config.errors import ConfigError
from nxdt.config.schema import TokenizerConfig
from nxdt.data.assets import bundled_tokenizer_dir
from nxdt.data.indexed import IndexedDatasetBuilder, best_fitting_dtype, data_file_path, index_file_path
from nxdt.data.jsonl import iter_jsonl
from nxdt.data.tokenizers import build_tokenizer, eod_id

_CHUNK_DOCS = 64  # documents per tokenizer call / per worker task


def _open_text(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        return opener(path, "rt", encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--input: file not found: {path}") from None


def _input_kind(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    return "text"


def _row_texts(row, keys: list[str], where: str) -> list[str]:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    texts = []
    for key in keys:
        if key not in row:
            raise ConfigError(f"{where}: missing json key '{key}' (--json-keys {' '.join(keys)})")
        value = row[key]
        if not isinstance(value, str):
            raise ConfigError(f"{where}: json key '{key}' is {type(value).__name__}, expected a string")
        texts.append(value)
    return texts


def iter_documents(path: str, keys: list[str], text_mode: str = "paragraph") -> Iterator[list[str]]:
    """Yield one list of texts (one per json key) per document of `path`, in file order."""
    kind = _input_kind(path)
    with _open_text(path) as stream:
        if kind in ("json", "jsonl"):
            first = ""
            if kind == "json":
                first = stream.read(1)
                while first and first.isspace():
                    first = stream.read(1)
            if first == "[":
                try:
                    rows = json.loads("[" + stream.read())
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
                for i, row in enumerate(rows):
                    yield _row_texts(row, keys, f"{path}: item {i}")
                return
            # the character read to tell a list from jsonl belongs to the first line
            lines = (first + line if i == 0 else line for i, line in enumerate(stream))
            for lineno, row in iter_jsonl(lines, path):
                yield _row_texts(row, keys, f"{path}:{lineno}")
            return
        if text_mode == "file":
            yield [stream.read()] * len(keys)
            return
        paragraph: list[str] = []
        for line in stream:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield ["".join(paragraph).rstrip("\n")] * len(keys)
                paragraph = []
        if paragraph:
            yield ["".join(paragraph).rstrip("\n")] * len(keys)


def _chunks(docs: Iterator[list[str]], size: int) -> Iterator[list[list[str]]]:
    chunk: list[list[str]] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# Per-process state for the worker pool (set by _init_worker).
_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, eod: int | None) -> None:
    _WORKER["tok"] = build_tokenizer(TokenizerConfig(library="huggingface", type=tokenizer_dir))
    _WORKER["eod"] = eod


def _encode_chunk(chunk: list[list[str]]) -> list[list[list[int]]]:
    """Per document, per key: the token ids (+ eod). Empty texts give an empty list."""
    tok, eod = _WORKER["tok"], _WORKER["eod"]
    out = [[None] * len(chunk[0]) for _ in chunk]
    for k in range(len(chunk[0])):
        texts = [doc[k] for doc in chunk]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        for d, (text, doc_ids) in enumerate(zip(texts, ids)):
            if not text.strip():
                out[d][k] = []
            else:
                out[d][k] = list(doc_ids) + ([eod] if eod is not None else [])
    return out


def _output_prefixes(prefix: str, keys: list[str]) -> list[str]:
    return [prefix] if len(keys) == 1 else [f"{prefix}_{key}" for key in keys]


def _progress(quiet: bool):
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,} docs"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TextColumn("{task.fields[rate]:,.0f} tokens/s"),
        TimeElapsedColumn(),
        disable=quiet,
        transient=False,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nxdt preprocess",
        description="Tokenize jsonl/json/text into Megatron indexed dataset files (.bin/.idx).",
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="input file(s), read in order")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the bundled KJV BPE)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON field(s) holding the text")
    parser.add_argument(
        "--append-eod", action=argparse.BooleanOptionalAction, default=True, help="append the eos id per document"
    )
    parser.add_argument("--text-mode", choices=("paragraph", "file"), default="paragraph",
                        help="plain text: one document per blank-line-separated paragraph, or per file")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (order is kept)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            raise ConfigError(f"--input: file not found: {path}")
    if args.workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {args.workers}")
    prefixes = _output_prefixes(args.output_prefix, args.json_keys)
    if not args.overwrite:
        for prefix in prefixes:
            for path in (data_file_path(prefix), index_file_path(prefix)):
                if os.path.exists(path):
                    raise ConfigError(f"{path}: output exists; pass --overwrite to replace it")

    tokenizer_dir = str(args.tokenizer or bundled_tokenizer_dir())
    tokenizer = build_tokenizer(TokenizerConfig(library="huggingface", type=tokenizer_dir), flag="--tokenizer")
    eod = eod_id(tokenizer, flag="--tokenizer") if args.append_eod else None
    dtype = best_fitting_dtype(len(tokenizer))

    builders = [IndexedDatasetBuilder(prefix, dtype=dtype) for prefix in prefixes]
    docs_written = skipped = tokens = 0
    try:
        with _progress(args.quiet) as progress:
            task = progress.add_task("tokenizing", total=None, tokens=0, rate=0.0)
            start = time.perf_counter()
            for path in args.input:
                documents = 0
                chunks = _chunks(iter_documents(path, args.json_keys, args.text_mode), _CHUNK_DOCS)
                if args.workers == 1:
                    _init_worker(tokenizer_dir, eod)
                    encoded = map(_encode_chunk, chunks)
                    pool = None
                else:
                    # spawn, not fork: this process has threads by now (the progress
                    # display's refresher, torch's or tokenizers' pools when called
                    # in-process), and a child forked while one of them holds a lock
                    # waits on it forever (seen as a hung pool in CI).
                    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                    pool = multiprocessing.get_context("spawn").Pool(
                        args.workers, initializer=_init_worker, initargs=(tokenizer_dir, eod)
                    )
                    encoded = pool.imap(_encode_chunk, chunks, chunksize=4)
                try:
                    for chunk in encoded:
                        for doc in chunk:
                            documents += 1
                            if all(len(ids) == 0 for ids in doc):
                                skipped += 1
                                continue
                            for builder, ids in zip(builders, doc):
                                builder.add_document(np.asarray(ids, dtype=np.int64))
                                tokens += len(ids)
                            docs_written += 1
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        progress.update(task, completed=docs_written, tokens=tokens, rate=tokens / elapsed)
                finally:
                    if pool is not None:
                        pool.terminate()
                        pool.join()
                if documents == 0:
                    raise ConfigError(f"{path}: no documents found (empty input)")
        if docs_written == 0:
            raise ConfigError(f"{', '.join(args.input)}: every document is empty; nothing to write")
        for builder in builders:
            builder.finalize()
    except BaseException:
        for builder in builders:
            builder.abort()
        raise

    elapsed = time.perf_counter() - start
    if not args.quiet:
        print(
            f"wrote {', '.join(p + '.{bin,idx}' for p in prefixes)}: {docs_written:,} documents, "
            f"{tokens:,} tokens ({np.dtype(dtype).name}), {skipped} empty skipped, "
            f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
