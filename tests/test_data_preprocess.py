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
