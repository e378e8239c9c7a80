"""A small preference set (prompt, chosen, rejected) from the bundled King James Bible, so DPO and
ORPO can be tried and tested without downloading anything.

    nxdt preference-data --output data/kjv_preference.jsonl --rows 512 --seed 1234

Each row: the prompt is W words from a random place in a chapter, `chosen` the R words that follow
them there, `rejected` R words from a chapter of another book. A model that learns the corpus
prefers the true continuation, so DPO's reward accuracy rises above 0.5 quickly. Responses start
with a space (they continue the prompt's text, and the byte-level tokenizer marks word starts).
The same arguments and seed give the same file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

from nxdt.data.assets import bundled_corpus_path


def read_chapters(path: str | Path) -> list[tuple[str, list[str]]]:
    """(book, words) per chapter of a jsonl(.gz) corpus of {"title": "Book N", "text": ...}."""
    opener = gzip.open if str(path).endswith(".gz") else open
    chapters = []
    with opener(path, "rt", encoding="utf-8") as stream:
        for line in stream:
            if line.strip():
                row = json.loads(line)
                chapters.append((row["title"].rsplit(" ", 1)[0], row["text"].split()))
    return chapters


def make_preference_rows(chapters: list[tuple[str, list[str]]], rows: int, prompt_words: int = 24,
                         response_words: int = 16, seed: int = 1234) -> list[dict[str, str]]:
    """`rows` preference rows (see the module docstring), deterministic for `seed`."""
    if rows < 1 or prompt_words < 1 or response_words < 1:
        raise ValueError("rows, prompt_words and response_words must be >= 1")
    need = prompt_words + response_words
    usable = [i for i, (_, words) in enumerate(chapters) if len(words) >= need]
    if len({chapters[i][0] for i in usable}) < 2:
        raise ValueError(f"need chapters of {need}+ words from at least two books")
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    while len(out) < rows:
        book, words = chapters[rng.choice(usable)]
        at = rng.randrange(len(words) - need + 1)
        prompt = " ".join(words[at:at + prompt_words])
        chosen = " " + " ".join(words[at + prompt_words:at + need])
        other_book, other = chapters[rng.choice(usable)]
        if other_book == book:
            continue  # the rejected continuation comes from another book
        start = rng.randrange(prompt_words, len(other) - response_words + 1)
        rejected = " " + " ".join(other[start:start + response_words])
        if rejected != chosen:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def write_jsonl(rows: list[dict[str, str]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as stream:
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxdt preference-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the jsonl (or .jsonl.gz) file to write")
    parser.add_argument("--rows", type=int, default=512, help="number of rows (default 512)")
    parser.add_argument("--prompt-words", type=int, default=24, help="words per prompt (default 24)")
    parser.add_argument("--response-words", type=int, default=16, help="words per response (default 16)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    parser.add_argument("--corpus", default=str(bundled_corpus_path()),
                        help="jsonl(.gz) of {title, text} chapters (default: the bundled KJV)")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)
    if not Path(args.corpus).is_file():
        parser.error(f"--corpus {args.corpus}: file not found")
    if Path(args.output).exists() and not args.force:
        parser.error(f"--output {args.output} exists (nothing is overwritten; --force replaces it)")
    try:
        rows = make_preference_rows(read_chapters(args.corpus), args.rows, args.prompt_words, args.response_words,
                                    args.seed)
    except (ValueError, KeyError) as err:  # KeyError: a corpus row without title / text
        parser.error(f"--corpus {args.corpus}: {err}" if isinstance(err, KeyError) else str(err))
    write_jsonl(rows, args.output)
    print(f"wrote {len(rows)} preference rows to {args.output}")
    return 0


if __name__ == "__main__":
    from nxdt.config.load import main_guard

    raise SystemExit(main_guard(main)())
