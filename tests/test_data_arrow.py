"""fms-fsdp arrow / parquet shard folders as documents (nxdt.data.arrow_shards) and the check of
token ids against the tokenizer's vocabulary (nxdt.data.vocab_check). Fixtures are written with
pyarrow directly, as fms-fsdp's tooling writes them."""

from __future__ import annotations

import logging
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_modules import base_cfg, fake_trainer

from nxdt.config.errors import ConfigError
from nxdt.data.arrow_shards import ArrowShardDocuments
from nxdt.data.assets import bundled_tokenizer_dir
from nxdt.data.select import build_datamodule
from nxdt.spec import build_spec

S = 16  # seq_length of base_cfg (tests/test_data_modules.py)
SEP, BOS = 1, 2  # SEP: the bundled tokenizer's eos (data.sep_token null), BOS: any other id
VOCAB = 8192  # len() of the bundled tokenizer the configs default to


def _docs(first: int, count: int, seed: int) -> list[list[int]]:
    """`count` documents of consecutive ids from `first` on (so a sample shows where it was cut from)."""
    rng = np.random.RandomState(seed)
    out, nxt = [], first
    for _ in range(count):
        n = int(rng.randint(3, 30))
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def write_fms_folder(folder, docs: list[list[int]], kind=pa.uint32(), files=2, **options) -> None:
    """fms-fsdp's layout: `files` Arrow IPC files (the later ones in a sub-folder), one record batch per document."""
    schema = pa.schema([pa.field("tokens", kind)])
    per = -(-len(docs) // files)
    for f in range(files):
        path = folder / ("" if f == 0 else f"sub{f}") / f"shard_{f}.arrow"
        path.parent.mkdir(parents=True, exist_ok=True)
        with pa.ipc.new_file(str(path), schema, **options) as writer:
            for doc in docs[f * per : (f + 1) * per]:
                writer.write(pa.record_batch([pa.array(doc, kind)], schema=schema))


def virtual(doc: list[int], bos=BOS, sep=SEP) -> list[int]:
    """fms-fsdp's document: an existing leading / trailing bos or sep dropped, then [bos] + doc + [sep]."""
    drop = {t for t in (bos, sep) if t is not None}
    if doc and doc[0] in drop:
        doc = doc[1:]
    if doc and doc[-1] in drop:
        doc = doc[:-1]
    return ([bos] if bos is not None else []) + doc + ([sep] if sep is not None else [])


# ----------------------------------------------------------------------------- the documents


def test_fms_folder_documents_are_bos_doc_sep(tmp_path):
    docs = _docs(100, 9, 0)
    docs[1] = [BOS] + docs[1] + [SEP]  # already framed: not doubled
    docs[4] = [SEP] + docs[4]  # fms-fsdp drops either token at either end
    docs[6] = [SEP]  # nothing left but the added tokens
    write_fms_folder(tmp_path / "ds", docs)
    (tmp_path / "ds" / "notes.txt").write_text("not a shard")
    ix = ArrowShardDocuments(str(tmp_path / "ds") + "/", "tokens", sep_token=SEP, bos_token=BOS)
    assert ix.prefix == str(tmp_path / "ds") and ix.files == ["shard_0.arrow", "sub1/shard_1.arrow"]
    want = [virtual(d) for d in docs]
    assert len(ix) == ix.num_documents == 9 and ix.doc_idx.tolist() == list(range(10))
    assert ix.sizes.tolist() == [len(w) for w in want]
    assert want[1] == [BOS] + docs[1][1:-1] + [SEP] and want[6] == [BOS, SEP]
    assert [ix.get(i).tolist() for i in range(9)] == want
    assert ix.document(4).tolist() == want[4] and ix[-1].tolist() == want[8]
    for i, w in enumerate(want):  # every window: the bos only, the sep only, both, the middle
        for offset in range(len(w)):
            for length in {0, min(1, len(w) - offset), min(2, len(w) - offset), len(w) - offset}:
                assert ix.get(i, offset, length).tolist() == w[offset : offset + length], (i, offset, length)
    assert ix.dtype == np.uint32 and ix.get(2, 1, 3).dtype == np.uint32
    assert not ix.get(2, 1, 3).flags.writeable  # a view into the memory-mapped file, not a copy
    with pytest.raises(IndexError):
        ix.get(0, 2, len(want[0]))
    assert ix.max_token_id() == max(max(d) for d in docs)
    # DataLoader workers (spawn) get a re-opened copy
    again = pickle.loads(pickle.dumps(ix))
    assert again.sizes.tolist() == ix.sizes.tolist() and again.get(5).tolist() == want[5]
    # no bos: [doc] + [sep], and only the sep is stripped
    plain = ArrowShardDocuments(str(tmp_path / "ds"), sep_token=SEP)
    assert [plain.get(i).tolist() for i in range(9)] == [virtual(d, bos=None) for d in docs]
    assert plain.get(1).tolist()[0] == BOS  # a leading BOS is data when bos_token is null


def test_stream_parquet_and_compressed_shards(tmp_path):
    """datasets.save_to_disk's IPC stream and parquet: one document per row of a list<int> column;
    a compressed IPC file is decoded (cannot be mapped) but reads the same."""
    docs = _docs(10, 12, 1)
    folder = tmp_path / "mixed"
    folder.mkdir()
    listed = pa.list_(pa.int32())
    schema = pa.schema([pa.field("ids", listed), pa.field("text", pa.string())])
    with pa.ipc.new_stream(str(folder / "a_stream.arrow"), schema) as writer:  # rows 0-5, two batches
        for rows in (docs[0:4], docs[4:6]):
            writer.write(pa.record_batch([pa.array(rows, listed), pa.array(["x"] * len(rows))], schema=schema))
    pq.write_table(pa.table({"ids": pa.array(docs[6:10], listed)}), str(folder / "b.parquet"), row_group_size=3)
    flat = pa.schema([pa.field("ids", pa.int64())])
    with pa.ipc.new_file(str(folder / "c.arrow"), flat, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        for doc in docs[10:]:
            w.write(pa.record_batch([pa.array(doc, pa.int64())], schema=flat))
    ix = ArrowShardDocuments(str(folder), "ids", sep_token=SEP, bos_token=None)
    assert ix.files == ["a_stream.arrow", "b.parquet", "c.arrow"]
    assert [ix.get(i).tolist() for i in range(len(ix))] == [d + [SEP] for d in docs]
    assert ix.sizes.tolist() == [len(d) + 1 for d in docs] and ix.dtype == np.int64
    assert ix.get(7, 2, 3).tolist() == docs[7][2:5]
    assert [ix.file_max_token_id(f) for f in ix.files] == [docs[5][-1], docs[9][-1], docs[11][-1]]


def test_bad_shards_are_one_line(tmp_path):
    def refuse(folder, match, col="tokens"):
        with pytest.raises(ConfigError, match=match) as info:
            ArrowShardDocuments(str(folder), col, sep_token=SEP)
        assert "\n" not in str(info.value)

    (tmp_path / "empty" / "deep").mkdir(parents=True)
    (tmp_path / "empty" / "deep" / "x.json").write_text("{}")
    refuse(tmp_path / "empty", rf"^data.datasets: {tmp_path / 'empty'} has no .arrow or .parquet shards$")
    write_fms_folder(tmp_path / "ok", [[5, 6, 7]], files=1)
    refuse(tmp_path / "ok", rf"^{tmp_path / 'ok' / 'shard_0.arrow'}: no column 'input_ids' "
                            r"\(data.col_name=input_ids\); its columns: tokens$", col="input_ids")
    write_fms_folder(tmp_path / "floats", [[0.5, 1.5]], kind=pa.float32(), files=1)
    refuse(tmp_path / "floats", rf"^{tmp_path / 'floats' / 'shard_0.arrow'}: column 'tokens' is float, "
                                r"not integer token ids \(data.col_name=tokens\)$")
    pq.write_table(pa.table({"tokens": pa.array([1, 2, 3])}), str(tmp_path / "ok" / "flat.parquet"))
    refuse(tmp_path / "ok", r"flat.parquet: column 'tokens' is int64; a parquet shard needs one document per row")
    (tmp_path / "none").mkdir()
    pa.ipc.new_file(str(tmp_path / "none" / "s.arrow"), pa.schema([pa.field("tokens", pa.int32())])).close()
    refuse(tmp_path / "none", rf"^data.datasets: {tmp_path / 'none'} holds no documents")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "s.arrow").write_bytes(b"not arrow at all")
    refuse(tmp_path / "junk", rf"^{tmp_path / 'junk' / 's.arrow'}: cannot read it as an Arrow IPC file")


# ----------------------------------------------------------------------------- logical shards over arrow


def test_logical_shards_over_arrow_resume_from_two_ranks_on_one(tmp_path):
    """As test_logical_shards_resume_from_two_ranks_on_one (test_data_modules.py), on arrow documents:
    2 ranks read 3 steps, 1 rank resumes, every sample of the epoch is read exactly once."""
    from nxdt.data.logical_shards import LogicalShardSampler, ShardedStreams, merge_tables

    write_fms_folder(tmp_path / "a", _docs(100, 40, 1))
    write_fms_folder(tmp_path / "b", _docs(4000, 24, 2))
    opened = [ArrowShardDocuments(str(tmp_path / n), sep_token=SEP, bos_token=BOS) for n in "ab"]
    parts = [(ix, np.arange(len(ix))) for ix in opened]
    streams = ShardedStreams(parts, logical_shards=4, seq_length=8, seed=3)
    # a shard's stream is its [bos] + doc + [sep] documents back to back
    order, _ = streams._epoch(1, 2, 0)
    stream = np.concatenate([opened[1].get(int(d)) for d in order]).tolist()
    assert streams.tokens(1, 2, 1).tolist() == stream[8:17]
    weights, gbs = [3.0, 1.0], 4
    epoch = {(d, k, j) for d in range(2) for k in range(4) for j in range(int(streams.samples_per_epoch[d, k]))}

    seen, reports = [], []
    table0 = np.zeros((2, 4), dtype=np.int64)
    for rank in (0, 1):
        sampler = LogicalShardSampler(streams, table0, weights, gbs // 2, rank, 2, num_batches=10)
        batches = list(sampler)  # prefetched 10 ...
        seen += [key for batch in batches[:3] for key in batch]  # ... trained 3
        reports.append((rank, 2, sampler.consumed_after(3)))
    state = merge_tables(reports, 4)
    assert state.sum() == 3 * gbs
    steps_left = int(4 * streams.samples_per_epoch[1].sum()) // gbs + 8
    for batch in LogicalShardSampler(streams, state, weights, gbs, 0, 1, num_batches=steps_left):
        seen += list(batch)
    first_epoch = [key for key in seen if key[2] < streams.samples_per_epoch[key[0], key[1]]]
    assert len(first_epoch) == len(set(first_epoch)) and len(set(seen)) == len(seen)
    assert set(first_epoch) == epoch, f"skipped: {sorted(epoch - set(first_epoch))[:5]}"


def _runs_are_documents(row: list[int], low: int, high: int) -> bool:
    """Between bos/sep tokens a sample holds consecutive ids of one dataset's range [low, high)."""
    run = []
    for t in row + [SEP]:
        if t in (SEP, BOS):
            if any(b != a + 1 for a, b in zip(run, run[1:])) or any(not low <= x < high for x in run):
                return False
            run = []
        else:
            run.append(t)
    return True


def test_datamodule_reads_arrow_folders_under_data_path(tmp_path, monkeypatch):
    from nxdt.spec.paths import check_files

    root = tmp_path / "data"
    write_fms_folder(root / "a", _docs(100, 30, 3))
    write_fms_folder(root / "b", _docs(4000, 30, 4), files=3)
    cfg = base_cfg(datasets=["a", "b"], weights=[1, 1], data_path=str(root), logical_shards=2,
                   bos_token=BOS, splits_string="80,10,10", index_mapping_dir=str(tmp_path / "maps"))
    monkeypatch.chdir(tmp_path)
    check_files(cfg)  # the pre-run path check takes shard folders under data.data_path
    dm = build_datamodule(build_spec(cfg), fake_trainer())
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and batches[0]["input_ids"].shape == (4, S)
    ranges = {0: (100, 4000), 1: (4000, VOCAB)}
    for batch in batches:
        for inputs, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            row = inputs + labels[-1:]
            assert inputs[1:] == labels[:-1]
            ds = 0 if any(100 <= t < 4000 for t in row) else 1
            assert _runs_are_documents(row, *ranges[ds]), row
    # both datasets, 1:1 (weights [1, 1]: the rows of a batch alternate)
    assert dm.streams.names == ["a", "b"] and dm.streams.parts[1][0].prefix == str(root / "b")
    from_b = [max(r) >= 4000 for b in batches for r in b["input_ids"].tolist()]
    assert from_b == [False, True] * 8
    # validation: GPTDataset over the arrow documents, its index mappings cached by the shard files
    val = list(dm.val_dataloader())
    assert len(val) == 3 and all(_runs_are_documents(r, 100, VOCAB) for b in val for r in b["input_ids"].tolist())
    assert len(list((tmp_path / "maps").glob("a_validation_*_doc_idx.npy"))) == 1
    # a folder without shards: one line before the run and from the data module
    (root / "c").mkdir()
    cfg.data.datasets = ["a", "c"]
    with pytest.raises(ConfigError, match=rf"^data.datasets\[1\]: {root / 'c'} has no .arrow or .parquet shards$"):
        check_files(cfg)
    with pytest.raises(ConfigError, match=rf"^data.datasets: {root / 'c'} has no .arrow or .parquet shards$"):
        build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader()
    cfg.data.datasets = ["a", "missing"]
    with pytest.raises(ConfigError, match=rf"^data.datasets\[1\]: not found: {root / 'missing'} \(a folder of"):
        check_files(cfg)
    # a Megatron PREFIX.bin/.idx beside a folder PREFIX is read as the Megatron data
    (root / "m").mkdir()
    _megatron(root / "m", [list(range(5, 40))] * 40)
    cfg.data.datasets = ["a", "m"]
    check_files(cfg)
    assert type(build_datamodule(build_spec(cfg), fake_trainer())._open("m")).__name__ == "IndexedDataset"


# ----------------------------------------------------------------------------- the vocabulary


def _megatron(prefix, docs, dtype=np.uint16) -> str:
    from nxdt.data.indexed import IndexedDatasetBuilder

    with IndexedDatasetBuilder(str(prefix), dtype=dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return str(prefix)


def test_vocabulary_check_names_the_file_and_caches_the_scan(tmp_path, monkeypatch):
    import nxdt.data.vocab_check as vocab_check

    maps = tmp_path / "maps"
    bad = _megatron(tmp_path / "bad", [list(range(5, 60)), [7, 9000, 8]] * 20)
    cfg = base_cfg(data_prefix=[bad], index_mapping_dir=str(maps))
    with pytest.raises(ConfigError) as info:
        build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader()
    assert str(info.value) == (
        f"{bad}.bin: token ids reach 9000 but the tokenizer (data.tokenizer.type=null, the bundled tokenizer) "
        f"has {VOCAB} tokens; re-tokenize it with this tokenizer (nxdt preprocess) or set data.tokenizer to "
        "the one it was made with")
    good = _megatron(tmp_path / "good", [list(range(5, 60)), [7, VOCAB - 1, 8]] * 20)
    cfg.data.data_prefix = [good]
    assert len(list(build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader())) == 4
    cache = (maps / vocab_check.CACHE_NAME).read_text()
    assert f"{good}.bin" in cache and f"{bad}.bin" in cache

    # the second open reads the cache: no scan
    def no_scan(*args):
        raise AssertionError("rescanned")

    monkeypatch.setattr(vocab_check, "scan_bin_max", no_scan)
    build_datamodule(build_spec(cfg), fake_trainer()).setup("fit")
    # ... until the file changes (size / mtime)
    os.utime(f"{good}.bin", ns=(1, 1))
    with pytest.raises(AssertionError, match="rescanned"):
        build_datamodule(build_spec(cfg), fake_trainer()).setup("fit")
    # a uint8 file cannot hold an id of 8192: never scanned
    cfg.data.data_prefix = [_megatron(tmp_path / "small", [list(range(5, 250))] * 20, dtype=np.uint8)]
    build_datamodule(build_spec(cfg), fake_trainer()).setup("fit")
    monkeypatch.undo()
    # no cache where it cannot be written: the check still runs
    (tmp_path / "afile").write_text("x")
    from nxdt.data.indexed import IndexedDataset

    with pytest.raises(ConfigError, match="token ids reach 9000"):
        vocab_check.check_vocabulary(IndexedDataset(bad), VOCAB, cfg.data.tokenizer, str(tmp_path / "afile" / "d"))


def test_vocabulary_check_on_arrow_shards(tmp_path):
    write_fms_folder(tmp_path / "ds", [[5, 6], [7, 8], [9, 8200], [3, 4]])
    cfg = base_cfg(datasets=["ds"], data_path=str(tmp_path), logical_shards=1)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'ds' / 'sub1' / 'shard_1.arrow'}: token ids reach 8200 "
                                          rf"but the tokenizer \(data.tokenizer.type=null, the bundled tokenizer\) "
                                          rf"has {VOCAB} tokens; re-tokenize"):
        build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader()
    write_fms_folder(tmp_path / "ok", [[5, 6, 7, 8, 9, 10]] * 10)
    cfg.data.datasets, cfg.data.bos_token = ["ok"], VOCAB
    with pytest.raises(ConfigError, match=rf"^data.bos_token: {VOCAB} is not below the tokenizer's vocabulary"):
        build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader()
    cfg.data.bos_token, cfg.data.eol_token = None, VOCAB + 1
    with pytest.raises(ConfigError, match=rf"^data.eol_token: {VOCAB + 1} is not below the tokenizer's vocabulary "
                                          rf"\(data.tokenizer.type=null, the bundled tokenizer: {VOCAB} tokens\)$"):
        build_datamodule(build_spec(cfg), fake_trainer()).train_dataloader()


def test_data_with_ids_past_the_vocabulary_stops_the_run_before_training(tmp_path, capsys):
    """Through the training entry (in-process): Megatron data made with a bigger tokenizer (ids up to
    8,999; the bundled tokenizer has 8,192) is one line naming the file, the largest id and the
    vocabulary, exit 2, before the summary and the first step (it used to be an IndexError deep in
    the embedding once training had started)."""
    from conftest import TINY_OVERRIDES

    from nxdt.config.load import main_guard
    from nxdt.data.indexed import IndexedDatasetBuilder
    from nxdt.exp.exp_manager import close_rank_log_file
    from nxdt.tools.train import main

    prefix = tmp_path / "big_vocab"
    with IndexedDatasetBuilder(str(prefix), dtype=np.uint16) as builder:
        for d in range(40):
            builder.add_document(np.arange(40) + 100 * d + (9000 - 3940 if d == 39 else 0))
    environ = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as stop:
            main_guard(main)(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                              f"data.data_prefix=[1.0,{prefix}]", f"exp_manager.explicit_log_dir={tmp_path / 'log'}"])
    finally:
        os.environ.clear()
        os.environ.update(environ)
        close_rank_log_file()  # the run's log file (and the warnings routed to it) end here
        logging.captureWarnings(False)
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in out.err, out.err[-2000:]
    assert f"{prefix}.bin" in errors[0] and "token ids reach 8999" in errors[0] and "has 8192 tokens" in errors[0]
    assert "nxdt run" not in out.out and "reduced_train_loss" not in out.out  # no summary, no step


# ----------------------------------------------------------------------------- fms-fsdp's strip / bol / eol


def fms_buffer_lines(docs: list[list[int]], length: int, bol, eol, count: int) -> list[list[int]]:
    """fms-fsdp 5a296af's BufferDataset._get_buffer (pack_hard=True), copied: `count` lines of `length`
    tokens packed from the document stream `docs`, each started by bol and ended by eol."""
    it, buffer, lines = iter(docs), [], []
    for _ in range(count):
        new = []
        while len(buffer) + len(new) < length:
            buffer += new
            new = next(it)
        if bol is not None and (len(buffer) == 0 or buffer[0] != bol):
            buffer = [bol] + buffer
        if len(buffer) >= length:
            out = buffer[:length]
            buffer = buffer[length:]
            if eol is not None and out[-1] != eol:
                buffer = [out[-1]] + buffer
                out[-1] = eol
            buffer = buffer + new
        else:
            buffer = buffer + new
            out = buffer[:length]
            buffer = buffer[length:]
            if eol is not None and out[-1] != eol:
                buffer = [out[-1]] + buffer
                out[-1] = eol
        lines.append(out)
    return lines


def test_strip_tokens_and_fms_lines_with_bol_and_eol(tmp_path):
    """strip_tokens (and bol / eol, fms-fsdp's droplist) leave a document's ends; a sample with
    data.bol_token / data.eol_token is fms-fsdp's packed line, token for token."""
    from nxdt.data.logical_shards import ShardedStreams

    STRIP, BOL, EOL = 5, 6, 7
    docs = _docs(100, 60, 5)
    docs[0] = [STRIP] + docs[0] + [EOL]
    docs[3] = [BOL] + docs[3] + [STRIP]
    docs[4] = docs[4][:2] + [STRIP] + docs[4][2:]  # inside a document: kept
    write_fms_folder(tmp_path / "ds", docs)
    ix = ArrowShardDocuments(str(tmp_path / "ds"), sep_token=SEP, bos_token=BOS, strip_tokens=[STRIP, BOL, EOL])
    want = [[BOS] + d + [SEP] for d in _docs(100, 60, 5)]  # the added tokens are gone again
    want[4] = [BOS] + docs[4] + [SEP]
    assert [ix.get(i).tolist() for i in range(len(ix))] == want
    assert pickle.loads(pickle.dumps(ix)).get(3).tolist() == want[3]
    parts = [(ix, np.arange(len(ix)))]
    for bol, eol in ((BOL, EOL), (BOL, None), (None, EOL)):
        streams = ShardedStreams(parts, logical_shards=2, seq_length=8, seed=3, bol=bol, eol=eol)
        order, _ = streams._epoch(0, 1, 0)
        n = int(streams.samples_per_epoch[0, 1])
        stream = sum((ix.get(int(d)).tolist() for d in order), [])
        assert n == len(stream) // (9 - (bol is not None) - (eol is not None))
        lines = fms_buffer_lines([ix.get(int(d)).tolist() for d in order], 9, bol, eol, n)
        assert [streams.tokens(0, 1, j).tolist() for j in range(n)] == lines, (bol, eol)
    plain = ShardedStreams(parts, logical_shards=2, seq_length=8, seed=3)  # Megatron's overlapping samples
    assert plain.tokens(0, 1, 1).tolist()[0] == plain.tokens(0, 1, 0).tolist()[-1]


# ----------------------------------------------------------------------------- raw-text parquet


def _texts(n: int, seed: int) -> list[str]:
    words = "in the beginning God created heaven and earth light darkness waters deep spirit".split()
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(words, rng.randint(3, 40))) + "." for _ in range(n)]


def _write_text_parquet(folder, texts: list[str], files: int = 2, col: str = "text") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(texts) // files)
    for f in range(files):
        pq.write_table(pa.table({col: texts[f * per : (f + 1) * per], "id": list(range(len(texts[f * per:][:per])))}),
                       str(folder / f"part-{f:05d}.parquet"), row_group_size=7)


def test_hf_parquet_text_is_tokenized_in_file_order(tmp_path):
    from nxdt.data.tokenizers import build_tokenizer

    tok = build_tokenizer(None)
    texts = _texts(30, 0)
    _write_text_parquet(tmp_path / "raw", texts)
    ix = ArrowShardDocuments(str(tmp_path / "raw"), "text", sep_token=SEP, bos_token=BOS, file_type="hf_parquet",
                             tokenizer=tok)
    want = [virtual(tok(t)["input_ids"]) for t in texts]  # fms-fsdp's ParquetHandler: tokenizer(text)
    assert ix.files == ["part-00000.parquet", "part-00001.parquet"] and len(ix) == 30
    assert [ix.get(i).tolist() for i in range(30)] == want and ix.sizes.tolist() == [len(w) for w in want]
    assert ix.max_token_id() == max(max(w) for w in want)
    again = pickle.loads(pickle.dumps(ix))  # a spawned worker: the tokens travel, no tokenizer needed
    assert again.tokenizer is None and [again.get(i).tolist() for i in range(30)] == want
    assert ix.cache_stamp()["tokenizer"][1] == VOCAB
    # auto: .arrow token ids and .parquet text (fms-fsdp's AutoHandler)
    write_fms_folder(tmp_path / "raw", [[300, 301, 302]], files=1)
    auto = ArrowShardDocuments(str(tmp_path / "raw"), "text", sep_token=SEP, file_type="auto", tokenizer=tok)
    assert auto.files[0] == "part-00000.parquet" and auto.files[-1] == "shard_0.arrow"
    assert auto.get(30).tolist() == [300, 301, 302, SEP] and auto.get(0).tolist() == want[0][1:]
    # bad files: one line each
    pq.write_table(pa.table({"text": ["a", None]}), str(tmp_path / "raw" / "part-00002.parquet"))
    with pytest.raises(ConfigError, match=r"part-00002.parquet: column 'text' has 1 null rows \(data.col_name=text\)$"):
        ArrowShardDocuments(str(tmp_path / "raw"), "text", file_type="hf_parquet", tokenizer=tok)
    pq.write_table(pa.table({"text": [[1, 2]]}), str(tmp_path / "raw" / "part-00002.parquet"))
    with pytest.raises(ConfigError, match=r"part-00002.parquet: column 'text' is list<element: int64>, not raw text"):
        ArrowShardDocuments(str(tmp_path / "raw"), "text", file_type="hf_parquet", tokenizer=tok)
    with pytest.raises(ConfigError, match=r"^data.datasets: .*arrowonly has no .parquet shards \(data.file_type="):
        write_fms_folder(tmp_path / "arrowonly", [[1, 2]], files=1)
        ArrowShardDocuments(str(tmp_path / "arrowonly"), "text", file_type="hf_parquet", tokenizer=tok)


def test_hf_parquet_datamodule_resumes_bitwise(tmp_path, monkeypatch):
    """Two datasets of raw-text parquet through the logical-shard data module: the state after 2 of 4
    steps, loaded into a fresh module, gives bitwise the batches the first run read next."""
    root = tmp_path / "data"
    _write_text_parquet(root / "a", _texts(40, 1))
    _write_text_parquet(root / "b", _texts(40, 2), files=3)
    cfg = base_cfg(datasets="a,b", weights="3,1", data_path=str(root), logical_shards=2, file_type="hf_parquet",
                   col_name="text", eos_token=SEP, bol_token=BOS, splits_string="100,0,0")
    monkeypatch.chdir(tmp_path)
    dm = build_datamodule(build_spec(cfg), fake_trainer())
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and all(int(r[0]) == BOS for b in batches for r in b["input_ids"])
    dm.trainer.lightning_module.consumed_samples = 8  # 2 steps of 4 trained
    state = dm.state_dict()
    fresh = build_datamodule(build_spec(cfg), fake_trainer(consumed=8))
    fresh.load_state_dict(state)
    resumed = list(fresh.train_dataloader())
    assert len(resumed) == 2 and not torch.equal(resumed[0]["input_ids"], batches[0]["input_ids"])
    for a, b in zip(batches[2:], resumed):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


# ----------------------------------------------------------------------------- fms-fsdp configs train (2 ranks)

TINY_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
              "model.num_kv_heads=2", "model.max_position_embeddings=128", f"model.vocab_size={VOCAB}",
              "trainer.enable_progress_bar=false"]


def _fms_config(path, log_dir, root, **fields) -> None:
    """A train_config as fms-fsdp's users write it: its field names, comma strings, its model_variant."""
    values = {"model_variant": "llama3_194m_4k", "ckpt_load_path": str(log_dir), "ckpt_save_path": str(log_dir),
              "data_path": str(root), "seq_length": 32, "eos_token": SEP, "logical_shards": 2, "num_workers": 0,
              "sharding_strategy": "hsdp", "mixed_precision": True, "batch_size": 2, "num_steps": 4,
              "report_interval": 1, "checkpoint_interval": 2, "use_torch_compile": False,
              "tokenizer_path": str(bundled_tokenizer_dir()), **fields}
    path.write_text("".join(f"{k}: {v!r}\n" if isinstance(v, str) else f"{k}: {v}\n" for k, v in values.items()))


@pytest.fixture(scope="module")
def fms_runs(tmp_path_factory):
    """One 2-rank launch: an imported fms-fsdp config on arrow shards (bol / eol / strip_tokens), one on
    raw-text parquet, that one resumed, and the bf16 gradient-reduction check (tests/fms_runs.py).
    fms-fsdp's presets are too big for CPU: the model is shrunk with nxdt overrides, nothing else."""
    from conftest import run_pool

    from nxdt.cli import main as cli

    tmp = tmp_path_factory.mktemp("fms")
    root = tmp / "data"
    write_fms_folder(root / "en" / "a", _docs(100, 300, 6))
    write_fms_folder(root / "en" / "b", _docs(5000, 150, 7), files=3)
    _write_text_parquet(root / "raw", _texts(300, 8), files=3)
    logs = {name: tmp / name for name in ("arrow", "parquet")}
    _fms_config(tmp / "arrow.yaml", logs["arrow"], root, datasets="en/a,en/b", weights="3,1", bos_token=BOS,
                bol_token=3, eol_token=4, strip_tokens="5,6")
    _fms_config(tmp / "parquet.yaml", logs["parquet"], root, datasets="raw", weights="1", file_type="hf_parquet",
                col_name="text")
    for name in ("arrow", "parquet"):
        assert cli(["import-config", "fms", str(tmp / f"{name}.yaml"), "--seed=7", "--num-gpus", "2",
                    "--output", str(tmp / f"fms_{name}.yaml")]) == 0
    argv = {name: ["--config-path", str(tmp), "--config-name", f"fms_{name}", *TINY_MODEL] for name in logs}
    runs = {"arrow": argv["arrow"], "parquet": argv["parquet"],
            "parquet_resumed": [*argv["parquet"], "trainer.max_steps=6"], "reduce": ["reduce-check"]}
    procs = run_pool(runs, 2, tmp / "pool", entry="fms_runs")
    return tmp, logs, procs


def test_imported_fms_configs_train_on_two_ranks(fms_runs):
    from conftest import read_scalars

    tmp, logs, procs = fms_runs
    imported = (tmp / "fms_arrow.yaml").read_text()
    assert "grad_reduce_dtype: bf16" in imported and "sharding_strategy: HSDP" in imported
    assert "datasets: [en/a, en/b]" in imported and "strip_tokens: [5, 6]" in imported
    arrow = read_scalars(logs["arrow"])["reduced_train_loss"]
    assert sorted(arrow) == [1, 2, 3, 4] and all(np.isfinite(v) and 0 < v < 10 for v in arrow.values())
    text = read_scalars(logs["parquet"])["reduced_train_loss"]
    assert sorted(text) == [1, 2, 3, 4, 5, 6]  # 4 steps, then 2 more resumed from the step-4 checkpoint
    assert "resuming from " in procs["parquet_resumed"].stdout and "step=4-consumed_samples=16.0 (step 4, " in \
        procs["parquet_resumed"].stdout
    assert "reduce-check: bf16 = bf16 reference, fp32 = fp32 reference" in procs["reduce"].stdout
