"""`nxdt preprocess` reports its rate (tokens/s) and writes files the readers accept."""

from __future__ import annotations

import json

from nxdt.data.indexed import IndexedDataset
from nxdt.tools import preprocess


def test_progress_reports_tokens_per_second(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"In the beginning {i}"}) + "\n" for i in range(50)))
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "50 documents" in out
    ix = IndexedDataset(str(tmp_path / "o"))
    assert len(ix) == 50 and ix.dtype.name == "uint16"


def _one_line_error(capsys, argv) -> str:
    from nxdt.cli import main

    code = main(["preprocess", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_tokenizer_without_eos_and_a_hub_id_get_their_fix(tmp_path, capsys):
    """A bare tokenizer.json (no tokenizer_config.json): the line to add and --no-append-eod, under the
    flag preprocess has (not data.tokenizer); a hub id: how to download it; --no-append-eod works."""
    import shutil

    from conftest import TOKENIZER_DIR

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", bare / "tokenizer.json")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    common = ["--input", src, "--output-prefix", tmp_path / "o", "--quiet"]
    line = _one_line_error(capsys, [*common, "--tokenizer", bare])
    assert line.startswith(f"error: --tokenizer: the tokenizer {bare} has no eos token")
    assert 'add "eos_token": "</s>" to its tokenizer_config.json' in line and "--no-append-eod" in line
    assert "data.tokenizer" not in line
    line = _one_line_error(capsys, [*common, "--tokenizer", "meta-llama/Llama-2-7b-hf"])
    assert "looks like a Hugging Face hub id" in line
    assert "hf download meta-llama/Llama-2-7b-hf --local-dir DIR" in line and "pass the folder" in line
    assert preprocess.main([*map(str, common), "--tokenizer", str(bare), "--no-append-eod"]) == 0
    assert list(IndexedDataset(str(tmp_path / "o"))[0]) == [int(t) for t in _ids(bare, "In the beginning")]


def _ids(folder, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False)["input_ids"]
