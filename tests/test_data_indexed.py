"""Megatron indexed dataset format, the preprocess tool and the bundled tokenizer."""

from __future__ import annotations

import gzip
import json
import os
import struct

import numpy as np
import pytest

from nxdt.config.errors import ConfigError
from nxdt.config.schema import TokenizerConfig
from nxdt.data.assets import bundled_corpus_path, bundled_tokenizer_dir
from nxdt.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype
from nxdt.data.tokenizers import build_tokenizer, eod_id
from nxdt.tools import preprocess

DOCS = [[5, 6, 7], [1], [], [40000, 2, 3, 4, 9], [65535, 0]]


def write_reference(prefix: str, docs, dtype, code: int, magic: bytes = b"MMIDIDX\x00\x00") -> None:
    """An independent writer, from the format description only (not nxdt's builder)."""
    itemsize = np.dtype(dtype).itemsize
    with open(prefix + ".bin", "wb") as f:
        for doc in docs:
            f.write(np.asarray(doc, dtype=dtype).tobytes())
    sizes = [len(d) for d in docs]
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * itemsize
    doc_index = list(range(len(docs) + 1))
    with open(prefix + ".idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_reader_reads_reference_files(tmp_path, dtype, code):
    prefix = str(tmp_path / "ref")
    write_reference(prefix, DOCS, dtype, code)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(DOCS) and ds.num_documents == len(DOCS)
    assert ds.sizes.tolist() == [len(d) for d in DOCS]
    assert ds.doc_idx.tolist() == list(range(len(DOCS) + 1))
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == doc
        assert ds.document(i).tolist() == doc
    assert ds[-1].tolist() == DOCS[-1]
    assert ds.get(3, offset=1, length=3).tolist() == [2, 3, 4]
    with pytest.raises(IndexError):
        ds[len(DOCS)]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_builder_roundtrip_and_bytes_match_reference(tmp_path, dtype, code):
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "sub" / "ours")
    write_reference(ref, DOCS, dtype, code)
    builder = IndexedDatasetBuilder(ours, dtype=dtype)
    for doc in DOCS:
        builder.add_document(doc)
    assert not os.path.exists(ours + ".idx") and not os.path.exists(ours + ".bin")  # only temp names so far
    builder.finalize()
    for ext in (".bin", ".idx"):
        with open(ref + ext, "rb") as a, open(ours + ext, "rb") as b:
            assert a.read() == b.read(), ext
    assert not [p for p in os.listdir(tmp_path / "sub") if p.endswith(".tmp")]
    ds = IndexedDataset(ours)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS


def test_builder_aborts_on_error_and_checks_range(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([1, 2])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    b = IndexedDatasetBuilder(prefix, np.uint16)
    with pytest.raises(ConfigError, match="out of range"):
        b.add_document([70000])
    b.abort()
    assert best_fitting_dtype(8192) is np.uint16 and best_fitting_dtype(65500) is np.int32


def _corrupt(tmp_path, how: str) -> tuple[str, str]:
    prefix = str(tmp_path / "bad")
    write_reference(prefix, DOCS, np.uint16, 8, magic=b"NOTMAGIC!" if how == "magic" else b"MMIDIDX\x00\x00")
    if how == "missing_idx":
        os.remove(prefix + ".idx")
        return prefix, prefix + ".idx"
    if how == "missing_bin":
        os.remove(prefix + ".bin")
        return prefix, prefix + ".bin"
    if how == "dtype":
        with open(prefix + ".idx", "r+b") as f:
            f.seek(17)
            f.write(bytes([9]))
        return prefix, prefix + ".idx"
    if how == "bin_size":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\x00\x00")
        return prefix, prefix + ".bin"
    if how == "truncated":
        with open(prefix + ".idx", "r+b") as f:
            f.truncate(40)
        return prefix, prefix + ".idx"
    return prefix, prefix + ".idx"


@pytest.mark.parametrize("how,message", [
    ("missing_idx", "not found"), ("missing_bin", "not found"), ("magic", "bad magic"),
    ("dtype", "unknown dtype code 9"), ("bin_size", "disagrees"), ("truncated", "truncated"),
])
def test_bad_files_raise_config_error_naming_the_file(tmp_path, how, message):
    prefix, path = _corrupt(tmp_path, how)
    with pytest.raises(ConfigError, match=message) as info:
        IndexedDataset(prefix)
    assert path in str(info.value)


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TokenizerConfig(library="huggingface", type=str(bundled_tokenizer_dir())))


def test_bundled_tokenizer_loads_offline_and_roundtrips(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()), local_files_only=True)
    assert len(tok) == 8192
    assert [tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token] == ["<s>", "</s>", "<pad>", "<unk>"]
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    text = "In the beginning God created the heaven and the earth.\n\tÜnïcode ✓ 😀  spaces"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert 1 not in ids and 0 not in ids  # no special tokens added implicitly
    assert len(tok("And God said, Let there be light")["input_ids"]) <= 10  # trained merges at work
    assert eod_id(tok) == 1


def test_build_tokenizer_errors(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="data.tokenizer.type") as info:
        build_tokenizer(TokenizerConfig(library="huggingface", type=missing))
    assert missing in str(info.value)
    with pytest.raises(ConfigError, match="data.tokenizer.vocab_file"):
        build_tokenizer(TokenizerConfig(library="megatron", type="GPT2BPETokenizer", vocab_file=missing, merge_file=missing))
    with pytest.raises(ConfigError, match="data.tokenizer.model"):
        build_tokenizer(TokenizerConfig(library="sentencepiece", model=missing))
    with pytest.raises(ConfigError, match="data.tokenizer.library"):
        build_tokenizer(TokenizerConfig(library="bogus"))


def test_megatron_gpt2_bpe_from_vocab_and_merges(tmp_path):
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "Ġa": 5}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ a\n")
    tok = build_tokenizer(TokenizerConfig(library="megatron", type="GPT2BPETokenizer",
                           vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt")))
    assert tok("ab a", add_special_tokens=False)["input_ids"] == [3, 5]
    assert eod_id(tok) == 0


# ----------------------------------------------------------------------------- preprocess

ROWS = [
    {"text": "In the beginning God created the heaven and the earth.", "title": "a"},
    {"text": "And the earth was without form, and void.", "title": "b"},
    {"text": "", "title": "empty"},
    {"text": "Jesus wept.", "title": "c"},
]


def _write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _expected(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] + [1] for t in texts if t]


@pytest.mark.parametrize("gz", [False, True])
def test_preprocess_jsonl_tokens_match_tokenizer(tmp_path, tokenizer, gz):
    src = tmp_path / ("in.jsonl.gz" if gz else "in.jsonl")
    _write_jsonl(src, ROWS, gz)
    prefix = str(tmp_path / "out" / "ds")
    argv = ["--input", str(src), "--tokenizer", str(bundled_tokenizer_dir()), "--output-prefix", prefix, "--quiet"]
    assert preprocess.main(argv) == 0
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == _expected(tokenizer, [r["text"] for r in ROWS])
    with pytest.raises(ConfigError, match="--overwrite") as info:
        preprocess.main(argv)
    assert prefix + ".bin" in str(info.value)
    assert preprocess.main(argv + ["--overwrite", "--json-keys", "title", "--no-append-eod"]) == 0
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tokenizer(r["title"], add_special_tokens=False)["input_ids"] for r in ROWS
    ]


def test_preprocess_workers_keep_order(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [{"text": f"Verse {i}: and it was so, {i * 7} times."} for i in range(300)]
    _write_jsonl(src, rows)
    outs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        assert preprocess.main(["--input", str(src), "--output-prefix", prefix, "--workers", str(workers), "--quiet"]) == 0
        outs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx")])
    assert outs[0] == outs[1]


def test_preprocess_json_list_and_text(tmp_path, tokenizer):
    (tmp_path / "in.json").write_text(json.dumps(ROWS))
    prefix = str(tmp_path / "j")
    assert preprocess.main(["--input", str(tmp_path / "in.json"), "--output-prefix", prefix, "--quiet"]) == 0
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == _expected(tokenizer, [r["text"] for r in ROWS])

    (tmp_path / "in.txt").write_text("First paragraph\nstill first.\n\n\nSecond one.\n\n")
    prefix = str(tmp_path / "t")
    assert preprocess.main(["--input", str(tmp_path / "in.txt"), "--output-prefix", prefix, "--quiet"]) == 0
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == _expected(
        tokenizer, ["First paragraph\nstill first.", "Second one."]
    )
    prefix = str(tmp_path / "f")
    argv = ["--input", str(tmp_path / "in.txt"), "--output-prefix", prefix, "--quiet", "--text-mode", "file"]
    assert preprocess.main(argv) == 0
    assert len(IndexedDataset(prefix)) == 1


def test_preprocess_bad_input(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "ok"}, {"txt": "no key"}])
    with pytest.raises(ConfigError, match="missing json key 'text'") as info:
        preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--quiet"])
    assert f"{src}:2" in str(info.value)
    assert not any(p.startswith("o.") for p in os.listdir(tmp_path))  # nothing left behind
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty input") as info:
        preprocess.main(["--input", str(empty), "--output-prefix", str(tmp_path / "o"), "--quiet"])
    assert str(empty) in str(info.value)
    with pytest.raises(ConfigError, match="not found"):
        preprocess.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")])


def test_cli_dispatch_reports_config_error(tmp_path, capsys):
    from nxdt.cli import main as cli_main

    assert cli_main(["preprocess", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bundled_assets_exist():
    assert bundled_corpus_path().is_file()
    assert (bundled_tokenizer_dir() / "tokenizer.json").is_file()
    assert (bundled_tokenizer_dir() / "tokenizer_config.json").is_file()
