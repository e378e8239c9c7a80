"""Reading JSON lines: one helper for every jsonl reader (SFT rows, `nxdt preprocess`).

No torch or lightning imports: `nxdt preprocess` uses it and starts fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from nxdt.config.errors import ConfigError


def iter_jsonl(lines: Iterable[str], path: str) -> Iterator[tuple[int, Any]]:
    """(line number from 1, parsed value) per non-blank line; blank lines are skipped (a trailing
    newline or a spacer is not a row). Invalid JSON is a one-line ConfigError naming `path:line`.

    Parses lazily: a reader that stops early (a row limit) never reads, or fails on, the rest.
    """
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
        yield lineno, row
