"""Unigram entropy of a tokenized corpus, in nats per token: the loss of a model that knows only
token frequencies. A language model that learned anything beyond that ends well below it.

    python -m nxdt.tools.unigram_entropy --data-prefix data/kjv/kjv_text_document
"""

from __future__ import annotations

import argparse

import numpy as np

from nxdt.data.indexed import IndexedDataset, data_file_path


def unigram_entropy(prefix: str) -> tuple[float, int]:
    """(entropy in nats, number of tokens) of the token ids in PREFIX.bin."""
    dataset = IndexedDataset(prefix)  # validates the index against the .bin
    tokens = np.memmap(data_file_path(prefix), dtype=dataset.dtype, mode="r")
    counts = np.bincount(tokens.astype(np.int64))
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum()), int(tokens.size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-prefix", required=True, help="PREFIX of PREFIX.bin / PREFIX.idx")
    args = parser.parse_args(argv)
    entropy, n = unigram_entropy(args.data_prefix)
    print(f"unigram entropy of {args.data_prefix}: {entropy:.4f} nats/token over {n:,} tokens "
          f"(a loss well below this means the model learned more than token frequencies)")
    return 0


if __name__ == "__main__":
    from nxdt.config.load import main_guard

    raise SystemExit(main_guard(main)())
