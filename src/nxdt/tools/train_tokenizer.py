"""Train the small byte-level BPE tokenizer bundled with nxdt (`nxdt/assets/tokenizer/`).

    python -m nxdt.tools.train_tokenizer                     # regenerate the bundled tokenizer
    python -m nxdt.tools.train_tokenizer --input corpus.jsonl.gz --output DIR --vocab-size 8192

The input is a jsonl file (optionally gzipped) with a `text` field per line. Special tokens, in
this order (ids 0-3): `<s>` (bos), `</s>` (eos, also the end-of-document token), `<pad>`, `<unk>`.
The tokenizer adds no special tokens by itself (`tokenizer(text)` gives the bare BPE ids, like
GPT-2); pre-training data appends `</s>` per document, SFT adds `<s>`/`</s>` explicitly.

The output is a `transformers` tokenizer directory (`save_pretrained`), loadable offline with
`AutoTokenizer.from_pretrained(DIR)`. Training is deterministic: same corpus and vocab size give
byte-identical files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nxdt.data.assets import bundled_corpus_path, bundled_tokenizer_dir

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]


def _iter_texts(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as stream:
        for line in stream:
            if line.strip():
                yield json.loads(line)["text"]


def train(input_path: str, output_dir: str, vocab_size: int = 8192):
    """Train the BPE on `input_path` and save a `transformers` tokenizer to `output_dir`."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A list (not a generator) keeps the order, and so the merges, independent of batching.
    tok.train_from_iterator(list(_iter_texts(input_path)), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1_000_000,
    )
    os.makedirs(output_dir, exist_ok=True)
    fast.save_pretrained(output_dir)
    # transformers 5 writes its own class name ("TokenizersBackend"); the generic 4.x name loads
    # under both major versions, so the committed files work with `transformers>=4.45`.
    config_path = os.path.join(output_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as stream:
        config = json.load(stream)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as stream:
        json.dump(config, stream, indent=2, sort_keys=True)
        stream.write("\n")
    return fast


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxdt-train-tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--input", default=str(bundled_corpus_path()), help="jsonl(.gz) with a 'text' field")
    parser.add_argument("--output", default=str(bundled_tokenizer_dir()), help="output tokenizer directory")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    fast = train(args.input, args.output, args.vocab_size)
    print(f"saved tokenizer ({len(fast)} tokens) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
