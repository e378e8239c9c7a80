"""`SFTDataModule` (`model_alignment_strategy.sft`): input/output pairs → masked (and packed) batches.

Keys: `data.train_dir` (required), `data.val_dir`, `data.test_dir`: a `.jsonl` / `.jsonl.gz`
file, an `.arrow` file, or a `datasets.save_to_disk` directory, with string columns `input` and
`output`. `data.dev_choose_samples` keeps the first N rows. `model_alignment_strategy.sft`:
  packing          true: several examples per sequence (also read from `data.packing`)
  prompt_template  optional, e.g. "### Question:\\n{input}\\n### Answer:\\n" ({input} is replaced)

Each example is the token sequence  BOS + prompt  |  output + EOS  (BOS only if the tokenizer has
one); position t is trained to predict token t+1, and only predictions of output tokens count:
`loss_mask` is 0 on the prompt (transformers' labels = -100) and on padding. An example longer
than seq_length + 1 tokens is cut; one whose prompt alone fills seq_length is dropped (with a warning).

Without packing every example is one row, padded to seq_length (pad labels masked).
With packing, examples are placed in order into rows of seq_length tokens (first fit: a new row
starts when the next example does not fit); each keeps its own loss mask and its position_ids
restart at 0, so the model attends only within the example (the native model and transformers 5
with SDPA both turn restarting position_ids into a per-document causal mask). The tail of a row
is padding: masked, positions restarting at 0 (its own segment).

Training goes round the rows as many times as `trainer.max_steps × global_batch_size` needs,
starting at the LightningModule's `consumed_samples` when resuming.
"""

from __future__ import annotations

import gzip
import itertools
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from nxdt.spec.alignment import alignment_of, check_prompt_template
from nxdt.config.errors import ConfigError
from nxdt.config.schema import SFTConfig
from nxdt.data.common import NxdtDataModuleBase
from nxdt.data.jsonl import iter_jsonl
from nxdt.data.tokenizers import build_tokenizer

SPLIT_KEYS = {"train": "train_dir", "validation": "val_dir", "test": "test_dir"}
SFT_COLUMNS = ("input", "output")


# ----------------------------------------------------------------------------- reading rows


def _listed(columns: tuple[str, ...]) -> str:
    """('prompt', 'chosen', 'rejected') -> "'prompt', 'chosen' and 'rejected'" (for error messages)."""
    quoted = [f"'{c}'" for c in columns]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _needs(kind: str, columns: tuple[str, ...]) -> str:
    return f"{kind} rows need {_listed(columns)}"


def _check_row(row, where: str, columns: tuple[str, ...], kind: str) -> tuple[str, ...]:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with {_listed(columns)}, got {type(row).__name__}")
    for key in columns:
        if key not in row or row[key] is None:
            raise ConfigError(f"{where}: row has no '{key}' ({_needs(kind, columns)}; has {sorted(row)})")
        if not isinstance(row[key], str):
            raise ConfigError(f"{where}: '{key}' is {type(row[key]).__name__}, expected a string")
    return tuple(row[key] for key in columns)


@dataclass
class TextRows:
    """String rows read from one file, and where each came from (for errors that name a row)."""

    path: str
    values: list[tuple[str, ...]]
    lines: list[int] | None  # jsonl: the line of each row; arrow / save_to_disk: None (row i)

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}" if self.lines is not None else f"{self.path}: row {i}"


def read_rows(path: str, key: str, columns: tuple[str, ...], kind: str, limit: int | None = None) -> TextRows:
    """The string `columns` of every row of a jsonl, arrow or save_to_disk file (the first `limit`
    rows); errors name the file and line (or row) and what `kind` of rows needs. SFT reads
    input/output with it, nxdt.data.preference prompt/chosen/rejected."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise ConfigError(f"data.{key}: {path}: file not found")
    values: list[tuple[str, ...]] = []
    lines: list[int] | None = None
    if os.path.isfile(path) and path.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        lines = []
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as stream:
            # islice stops before reading the row after the limit (None: all rows)
            for lineno, row in itertools.islice(iter_jsonl(stream, path), limit):
                values.append(_check_row(row, f"{path}:{lineno}", columns, kind))
                lines.append(lineno)
    else:
        ds = _read_arrow(path, key)
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise ConfigError(f"{path}: no '{missing[0]}' column ({_needs(kind, columns)}; "
                              f"columns: {ds.column_names})")
        n = len(ds) if limit is None else min(limit, len(ds))
        cols = ds.select(range(n)).select_columns(list(columns)).to_dict()
        for i, row in enumerate(zip(*(cols[c] for c in columns))):
            values.append(_check_row(dict(zip(columns, row)), f"{path}: row {i}", columns, kind))
    if not values:
        raise ConfigError(f"{path}: no examples (empty file)")
    return TextRows(path, values, lines)


def read_pairs(path: str, key: str, limit: int | None = None) -> list[tuple[str, str]]:
    """(input, output) pairs from jsonl, arrow or a save_to_disk dir; errors name the file (and line)."""
    return read_rows(path, key, SFT_COLUMNS, "SFT", limit).values


def _read_arrow(path: str, key: str):
    import datasets  # about 1 s to import: only for arrow / save_to_disk input, not in every run

    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[next(iter(ds))] if len(ds) == 1 else ds["train"] if "train" in ds else None
                if ds is None:
                    raise ConfigError(f"data.{key}: {path}: a DatasetDict with several splits and no 'train'")
            return ds
        if path.endswith(".arrow"):
            return datasets.Dataset.from_file(path)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets / pyarrow raise many kinds
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"data.{key}: {path}: cannot read ({first})") from None
    raise ConfigError(f"data.{key}: {path}: expected a .jsonl file, an .arrow file or a save_to_disk directory")


# ----------------------------------------------------------------------------- examples


def tokenize_pairs(tokenizer, pairs, template: str | None) -> list[tuple[np.ndarray, int]]:
    """Per example: (token ids, prompt length): BOS + prompt + output + EOS, and len(BOS + prompt)."""
    check_prompt_template(template)  # validation's rule (nxdt.spec.alignment), for templates given in code
    prompts = [template.replace("{input}", i) if template is not None else i for i, _ in pairs]
    outputs = [o for _, o in pairs]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    o_ids = tokenizer(outputs, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("data.tokenizer: SFT needs a tokenizer with an eos token")
    out = []
    for p, o in zip(p_ids, o_ids):
        prompt = bos + list(p)
        out.append((np.asarray(prompt + list(o) + [eos], dtype=np.int64), len(prompt)))
    return out


def example_arrays(tokens: np.ndarray, prompt_len: int, seq_length: int):
    """inputs, labels, loss_mask of one example (at most seq_length positions)."""
    tokens = tokens[: seq_length + 1]
    inputs, labels = tokens[:-1], tokens[1:]
    # label t is token t+1: it counts when that token belongs to the output
    mask = (np.arange(1, len(tokens)) >= prompt_len).astype(np.float32)
    return inputs, labels, mask


def pack_examples(lengths: list[int], seq_length: int) -> list[list[int]]:
    """First-fit in order: rows of example indices whose positions (len - 1 each) fit in seq_length."""
    rows, current, used = [], [], 0
    for i, n in enumerate(lengths):
        need = min(n - 1, seq_length)
        if current and used + need > seq_length:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += need
    if current:
        rows.append(current)
    return rows


class SFTRows(torch.utils.data.Dataset):
    """Tokenized examples as fixed-length rows, one example per row or packed."""

    def __init__(self, examples: list[tuple[np.ndarray, int]], seq_length: int, pad_id: int, packing: bool):
        self.examples = examples
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self.packing = packing
        if packing:
            self.rows = pack_examples([len(t) for t, _ in examples], self.seq_length)
        else:
            self.rows = [[i] for i in range(len(examples))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        S = self.seq_length
        tokens = np.full(S, self.pad_id, dtype=np.int64)
        labels = np.full(S, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(S, dtype=np.float32)
        position_ids = np.arange(S, dtype=np.int64)
        at = 0
        for e in self.rows[int(idx)]:
            inputs, lab, mask = example_arrays(*self.examples[e], S)
            n = len(inputs)
            tokens[at : at + n], labels[at : at + n], loss_mask[at : at + n] = inputs, lab, mask
            position_ids[at : at + n] = np.arange(n)
            at += n
        if self.packing and at < S:
            position_ids[at:] = np.arange(S - at)  # padding is a segment of its own
        return {
            "input_ids": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
        }


def sft_options(cfg, alignment) -> dict:
    """model_alignment_strategy.sft (`alignment`: the run spec's) as a dict (packing also from data.packing)."""
    sft = alignment.sft or SFTConfig()
    return {"packing": bool(sft.packing or cfg.data.packing), "prompt_template": sft.prompt_template}


class RowsDataModule(NxdtDataModuleBase):
    """A data module whose splits are row files (data.train_dir / val_dir / test_dir), each read by
    `build(path, key)` once, at setup (SFT, preference rows)."""

    def build(self, path: str, key: str):
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        for split, key in SPLIT_KEYS.items():
            path = getattr(self.cfg.data, key)
            self.datasets[split] = None if path is None else self.build(path, key)


class SFTDataModule(RowsDataModule):
    """Supervised fine-tuning data; see the module docstring."""

    def __init__(self, cfg, trainer=None, alignment=None):
        """`alignment`: the run spec's (nxdt.spec.alignment); read from `cfg` when built on its own."""
        super().__init__(cfg, trainer)
        data = cfg.data
        if data.train_dir is None:
            raise ConfigError("data.train_dir: required for SFT (jsonl, arrow or save_to_disk rows of input/output)")
        opts = sft_options(cfg, alignment_of(cfg) if alignment is None else alignment)
        self.packing = opts["packing"]
        self.prompt_template = opts["prompt_template"]
        self.tokenizer = build_tokenizer(data.tokenizer)
        self.vocab_size = len(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.datasets: dict[str, SFTRows | None] = {}

    def build(self, path: str, key: str) -> SFTRows:
        limit = self.cfg.data.dev_choose_samples
        if limit is not None and limit < 1:
            raise ConfigError(f"data.dev_choose_samples: must be >= 1, got {limit}")
        pairs = read_pairs(path, key, limit)
        examples = tokenize_pairs(self.tokenizer, pairs, self.prompt_template)
        # an example whose prompt fills the whole sequence has nothing left to train on: drop it
        kept = [(t, p) for t, p in examples if p < min(len(t), self.seq_length + 1)]
        if not kept:
            raise ConfigError(f"{path}: every prompt is at least data.seq_length ({self.seq_length}) tokens long; "
                              "no output token is left to train on")
        if len(kept) < len(examples):
            warnings.warn(f"{path}: {len(examples) - len(kept)} of {len(examples)} examples dropped: their prompt "
                          f"fills data.seq_length ({self.seq_length})", stacklevel=2)
        return SFTRows(kept, self.seq_length, self.pad_id, self.packing)
