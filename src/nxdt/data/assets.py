"""Paths of the data files shipped inside the nxdt package (`nxdt/assets/`)."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def assets_dir() -> Path:
    """The package's `assets/` directory."""
    return _ASSETS


def bundled_corpus_path() -> Path:
    """The KJV Bible, one JSON object per chapter (`{"title", "text"}`), gzipped jsonl."""
    return _ASSETS / "kjv_chapters.jsonl.gz"


def bundled_tokenizer_dir() -> Path:
    """The byte-level BPE tokenizer (vocab 8192) trained on the bundled corpus."""
    return _ASSETS / "tokenizer"
