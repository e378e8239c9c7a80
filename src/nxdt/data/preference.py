"""`PreferenceDataModule` (`model_alignment_strategy.dpo` / `.orpo`): prompt, chosen, rejected rows
→ one pair of masked sequences per prompt, and the DPO reference log-prob table.

DPO and ORPO learn from pairs: for one prompt a preferred (`chosen`) and a dispreferred
(`rejected`) response. Keys: `data.train_dir` (required), `data.val_dir`, `data.test_dir`: a
`.jsonl` / `.jsonl.gz` file, an `.arrow` file or a `datasets.save_to_disk` directory with string
columns `prompt`, `chosen`, `rejected` (read by nxdt.data.sft.read_rows, so errors name the file
and line). `data.dev_choose_samples` keeps the first N rows.

Tokens, as TRL and NxDT build them:   BOS + prompt  |  response + EOS   (BOS only if the
tokenizer has one; both sequences share the prompt). The prompt (BOS included) is at most the
max prompt length (DPO `max_prompt_length` or its old name `max_dpo_prompt_length`, ORPO
`max_prompt_length`; null = seq_length - 1);
a longer one keeps its first tokens (`truncation_mode: keep_start`) or BOS and its last tokens
(`keep_end`), and with `truncation_mode: null` it is a one-line error naming the row. A sequence
longer than seq_length + 1 tokens then loses the end of its response (the prompt is kept).

Each item (one prompt) holds fixed-length [seq_length] rows in the SFT convention
(nxdt.data.sft.example_arrays: position t predicts token t+1; loss_mask 1 only where that token
belongs to the response, EOS included):
    chosen_input_ids, chosen_labels, chosen_loss_mask,
    rejected_input_ids, rejected_labels, rejected_loss_mask,
    index                 int64: the row's position in its split (the reference table's row).
`data.global_batch_size` counts prompts; the step forwards chosen and rejected together.

Reference log-probs (DPO with precompute_ref_log_probs): `reference_logps[split]` is a float32
[rows, 2] table (chosen, rejected summed log-probs under the initial model), computed once by
nxdt.training.preference.compute_reference_logps and stored with the data module's state
(`state_dict`: a JSON-exact list of floats and a fingerprint of the tokenized rows, so a resume on
other data is refused rather than trained against the wrong reference).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from nxdt.spec.alignment import alignment_of
from nxdt.config.errors import ConfigError
from nxdt.data.sft import SPLIT_KEYS, RowsDataModule, TextRows, example_arrays, read_rows
from nxdt.data.tokenizers import build_tokenizer

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
RESPONSES = ("chosen", "rejected")
TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass(frozen=True)
class PromptLimit:
    """How long a prompt may be, what happens to a longer one, and the config keys that say so."""

    max_length: int  # tokens, BOS included
    truncation_mode: str | None  # keep_start | keep_end | None (an error)
    length_key: str
    mode_key: str


def prompt_limit(cfg, al) -> PromptLimit:
    """The max prompt length and truncation mode of the DPO or ORPO block (`al`: the run spec's alignment)."""
    seq = int(cfg.data.seq_length)
    if al.dpo is not None:
        block, key, length_key = al.dpo, al.dpo_key, al.dpo_prompt_length_key
        length = al.dpo_prompt_length  # either of its two names (nxdt.spec.alignment)
    elif al.orpo is not None:
        block, key = al.orpo, "model_alignment_strategy.orpo"
        length_key, length = f"{key}.max_prompt_length", al.orpo.max_prompt_length
    else:
        raise ConfigError("PreferenceDataModule: needs model_alignment_strategy.dpo or .orpo")
    length = seq - 1 if length is None else int(length)
    if not 1 <= length < seq:
        raise ConfigError(f"{length_key} ({length}) must be in [1, data.seq_length) "
                          f"(data.seq_length = {seq}): the response needs room")
    mode = block.truncation_mode
    if mode is not None and mode not in TRUNCATION_MODES:
        raise ConfigError(f"{key}.truncation_mode: {mode!r} is not one of {list(TRUNCATION_MODES)} or null")
    return PromptLimit(length, mode, length_key, f"{key}.truncation_mode")


# ----------------------------------------------------------------------------- tokens


def truncate_prompt(prompt: list[int], has_bos: bool, limit: PromptLimit, where: str) -> list[int]:
    """`prompt` (BOS first when `has_bos`) cut to limit.max_length tokens by the truncation mode."""
    n = limit.max_length
    if len(prompt) <= n:
        return prompt
    if limit.truncation_mode is None:
        raise ConfigError(f"{where}: the prompt is {len(prompt)} tokens, longer than {limit.length_key} ({n}); "
                          f"set {limit.mode_key} to keep_start or keep_end to truncate it")
    if limit.truncation_mode == "keep_start":
        return prompt[:n]
    head = prompt[:1] if has_bos else []  # keep_end keeps BOS: a sequence always starts as in training
    keep = n - len(head)
    return head + (prompt[len(prompt) - keep:] if keep > 0 else [])


@dataclass
class PreferenceExample:
    """One row's tokens: the (truncated) prompt and each full response + EOS, not yet cut."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def tokenize_preferences(tokenizer, rows: TextRows, limit: PromptLimit) -> list[PreferenceExample]:
    """BOS + prompt (truncated) and response + EOS for every row (see the module docstring)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("data.tokenizer: DPO / ORPO need a tokenizer with an eos token")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    columns = list(zip(*rows.values))
    ids = {name: tokenizer(list(col), add_special_tokens=False)["input_ids"]
           for name, col in zip(PREFERENCE_COLUMNS, columns)}
    out = []
    for i, (p, c, r) in enumerate(zip(ids["prompt"], ids["chosen"], ids["rejected"])):
        prompt = truncate_prompt(bos + list(p), bool(bos), limit, rows.where(i))
        out.append(PreferenceExample(np.asarray(prompt, dtype=np.int64), np.asarray(list(c) + [eos], dtype=np.int64),
                                     np.asarray(list(r) + [eos], dtype=np.int64)))
    return out


def sequence_arrays(prompt: np.ndarray, response: np.ndarray, seq_length: int, pad_id: int):
    """input_ids, labels, loss_mask [seq_length] of prompt + response (response cut to fit, then padded)."""
    tokens = np.concatenate([prompt, response])  # example_arrays cuts at seq_length + 1 tokens
    inputs, labels, mask = example_arrays(tokens, len(prompt), seq_length)
    n = len(inputs)
    out_inputs = np.full(seq_length, pad_id, dtype=np.int64)
    out_labels = np.full(seq_length, pad_id, dtype=np.int64)
    out_mask = np.zeros(seq_length, dtype=np.float32)
    out_inputs[:n], out_labels[:n], out_mask[:n] = inputs, labels, mask
    return out_inputs, out_labels, out_mask


class PreferenceRows(torch.utils.data.Dataset):
    """Tokenized preference rows as fixed-length chosen / rejected tensors (one prompt per item)."""

    def __init__(self, examples: list[PreferenceExample], seq_length: int, pad_id: int):
        self.examples = examples
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self._fingerprint: int | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        ex = self.examples[int(idx)]
        item: dict[str, torch.Tensor] = {}
        for name in RESPONSES:
            inputs, labels, mask = sequence_arrays(ex.prompt, getattr(ex, name), self.seq_length, self.pad_id)
            item[f"{name}_input_ids"] = torch.from_numpy(inputs)
            item[f"{name}_labels"] = torch.from_numpy(labels)
            item[f"{name}_loss_mask"] = torch.from_numpy(mask)
        item["index"] = torch.tensor(int(idx), dtype=torch.int64)
        return item

    def fingerprint(self) -> int:
        """crc32 of every row's tokens and of seq_length: the reference table belongs to exactly these rows."""
        if self._fingerprint is None:
            self._fingerprint = self._crc()
        return self._fingerprint

    def _crc(self) -> int:
        crc = zlib.crc32(np.asarray([self.seq_length, len(self.examples)], dtype=np.int64).tobytes())
        for ex in self.examples:
            for part in (ex.prompt, ex.chosen, ex.rejected):
                crc = zlib.crc32(np.asarray([len(part)], dtype=np.int64).tobytes(), crc)
                crc = zlib.crc32(part.tobytes(), crc)
        return crc


# ----------------------------------------------------------------------------- the module


class PreferenceDataModule(RowsDataModule):
    """DPO / ORPO data and the DPO reference table; see the module docstring."""

    def __init__(self, cfg, trainer=None, alignment=None):
        """`alignment`: the run spec's (nxdt.spec.alignment); read from `cfg` when built on its own."""
        super().__init__(cfg, trainer)
        data = cfg.data
        if data.train_dir is None:
            raise ConfigError("data.train_dir: required for DPO / ORPO (jsonl, arrow or save_to_disk rows of "
                              "prompt/chosen/rejected)")
        self.limit = prompt_limit(cfg, alignment_of(cfg) if alignment is None else alignment)
        self.tokenizer = build_tokenizer(data.tokenizer)
        self.vocab_size = len(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.datasets: dict[str, PreferenceRows | None] = {}
        self.reference_logps: dict[str, torch.Tensor] | None = None
        self._pending_reference: dict | None = None  # loaded before setup(): checked once the rows exist

    def build(self, path: str, key: str) -> PreferenceRows:
        limit = self.cfg.data.dev_choose_samples
        if limit is not None and limit < 1:
            raise ConfigError(f"data.dev_choose_samples: must be >= 1, got {limit}")
        rows = read_rows(path, key, PREFERENCE_COLUMNS, "preference", limit)
        return PreferenceRows(tokenize_preferences(self.tokenizer, rows, self.limit), self.seq_length, self.pad_id)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self._pending_reference is not None:
            pending, self._pending_reference = self._pending_reference, None
            self._load_reference(pending)

    # -- the reference table

    def set_reference_logps(self, split: str, table: torch.Tensor) -> None:
        """Store `table` ([rows of `split`, 2]: chosen, rejected) as float32 on the CPU."""
        self.setup()
        dataset = self.datasets.get(split)
        if dataset is None:
            raise ValueError(f"no {split} split to attach reference log-probs to")
        table = torch.as_tensor(table).detach().to("cpu", torch.float32)
        if tuple(table.shape) != (len(dataset), 2):
            raise ValueError(f"reference log-probs for {split}: shape {tuple(table.shape)}, expected "
                             f"({len(dataset)}, 2)")
        self.reference_logps = {**(self.reference_logps or {}), split: table}

    def state_dict(self) -> dict:
        """The base state plus the reference table: per split its float32 values as Python floats
        (exact through JSON) and the fingerprint of the rows it was computed on."""
        state = dict(super().state_dict())
        if self.reference_logps:
            state["reference_logps"] = {
                split: {"values": table.tolist(), "fingerprint": self.datasets[split].fingerprint()}
                for split, table in self.reference_logps.items()
            }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        reference = state.pop("reference_logps", None)
        super().load_state_dict(state)
        if reference is None:
            return
        if not self.datasets:  # restored before setup(): check once the rows are read
            self._pending_reference = reference
            return
        self._load_reference(reference)

    def _load_reference(self, reference: dict) -> None:
        tables = {}
        for split, entry in reference.items():
            dataset = self.datasets.get(split)
            key = SPLIT_KEYS.get(split, split)
            if dataset is None or dataset.fingerprint() != int(entry["fingerprint"]):
                raise ConfigError(f"checkpoint: its DPO reference log-probs were computed on other {split} rows "
                                  f"than data.{key} gives now (file, dev_choose_samples, tokenizer, seq_length or "
                                  "prompt length changed); resume with the same data, or start a new run")
            tables[split] = torch.tensor(entry["values"], dtype=torch.float32).reshape(len(dataset), 2)
        self.reference_logps = tables
