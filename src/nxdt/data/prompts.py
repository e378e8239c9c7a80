"""`PromptDataModule` (`model_alignment_strategy.grpo`): the prompts online RL samples completions for.

Rows: `data.train_dir` names a `.jsonl` / `.jsonl.gz` file or a `datasets.save_to_disk` folder (or
an `.arrow` file) whose rows have a `prompt` field: plain text, or chat messages
(`[{"role": "user", "content": ...}, ...]`, rendered with the tokenizer's chat template and its
generation prompt). Every other field of a row is kept as a column, handed to the reward functions
by name (TRL's convention: `answer` reaches `f(prompts, completions, answer=[...])`).
`model_alignment_strategy.grpo.task: arithmetic` uses nxdt's shipped task instead: `arithmetic_rows`,
sums and products of small numbers with their `answer`, generated from a fixed seed (nothing to
download; the demo and the tests use it).

Tokens: BOS (when the tokenizer has one) + prompt, its last `max_prompt_length` tokens kept (TRL
keeps the end of a prompt).

Batches: `data.global_batch_size` counts completions, as TRL's batch sizes do; a step samples
`global_batch_size / num_generations` prompts, and with `num_iterations` > 1 the same prompts
come back for that many consecutive steps (the rollouts are reused). Every data-parallel rank gets
the whole step's prompts (a few token lists): each samples its own share of the completions
(nxdt.rl.rollout). A batch is `{"index": LongTensor[P] (the rows, in the step's order), "rows":
[PromptRow, ...]}`. Resuming at `consumed_samples` (completions) continues with the same prompts.
"""

from __future__ import annotations

import gzip
import itertools
import os
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from nxdt.config.errors import ConfigError
from nxdt.data.common import NxdtDataModuleBase, RepeatedDataset
from nxdt.data.jsonl import iter_jsonl
from nxdt.data.sft import _read_arrow
from nxdt.data.tokenizers import build_tokenizer
from nxdt.spec.alignment import alignment_of

ARITHMETIC_ROWS = 1024


def arithmetic_rows(n: int = ARITHMETIC_ROWS, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows {"prompt": "What is 12 + 7?", "answer": "19"}: sums and products of numbers below
    20, drawn from `random.Random(seed)` (the same rows on every machine and Python)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        op = rng.choice("+*")
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a * b)})
    return rows


@dataclass
class PromptRow:
    """One prompt: its text (as the reward functions see it), its token ids and its other columns."""

    prompt: Any
    """The row's `prompt` as given: a string, or the chat messages."""
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


def _check_prompt(row: Any, where: str) -> Any:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with a 'prompt', got {type(row).__name__}")
    if row.get("prompt") is None:
        raise ConfigError(f"{where}: row has no 'prompt' (GRPO rows need 'prompt'; has {sorted(row)})")
    prompt = row["prompt"]
    chat = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    if not isinstance(prompt, str) and not (chat and prompt):
        raise ConfigError(f"{where}: 'prompt' is {type(prompt).__name__}; expected a string or chat messages "
                          "[{role, content}, ...]")
    return prompt


def read_prompt_rows(path: str, limit: int | None = None) -> list[tuple[dict[str, Any], str]]:
    """(row, where) of every row of a jsonl file or a save_to_disk folder / .arrow file, each checked
    to have a usable `prompt`; errors name the file and line (or row)."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise ConfigError(f"data.train_dir: {path}: file not found")
    out: list[tuple[dict[str, Any], str]] = []
    if os.path.isfile(path) and path.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as stream:
            for lineno, row in itertools.islice(iter_jsonl(stream, path), limit):
                where = f"{path}:{lineno}"
                _check_prompt(row, where)
                out.append((row, where))
    else:
        ds = _read_arrow(path, "train_dir")
        if "prompt" not in ds.column_names:
            raise ConfigError(f"{path}: no 'prompt' column (GRPO rows need 'prompt'; columns: {ds.column_names})")
        n = len(ds) if limit is None else min(limit, len(ds))
        for i in range(n):
            row = dict(ds[i])
            _check_prompt(row, f"{path}: row {i}")
            out.append((row, f"{path}: row {i}"))
    if not out:
        raise ConfigError(f"{path}: no prompts (empty file)")
    return out


def prompt_ids(tokenizer, prompt: Any, max_length: int) -> list[int]:
    """BOS + the prompt's tokens (chat messages through the chat template with its generation
    prompt), the last `max_length` kept (BOS stays first)."""
    if isinstance(prompt, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = bos + list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("data.tokenizer: the prompts are chat messages but the tokenizer has no chat template")
        ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        bos = ids[:1] if ids and ids[0] == tokenizer.bos_token_id else []
    if len(ids) > max_length:
        ids = bos + ids[len(ids) - (max_length - len(bos)):]
    return ids


class PromptRows(torch.utils.data.Dataset):
    """Tokenized prompt rows; item i is a PromptRow."""

    def __init__(self, rows: list[PromptRow]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> tuple[int, PromptRow]:
        return int(idx), self.rows[int(idx)]


class _Indexed(torch.utils.data.Dataset):
    """A RepeatedDataset's items with the source row's index (the rollouts seed by it)."""

    def __init__(self, repeated: RepeatedDataset):
        self.repeated = repeated

    def __len__(self) -> int:
        return len(self.repeated)

    def __getitem__(self, idx: int) -> tuple[int, PromptRow]:
        return self.repeated.source_index(idx), self.repeated[idx][1]


def collate_prompts(items: list[tuple[int, PromptRow]]) -> dict[str, Any]:
    return {"index": torch.tensor([i for i, _ in items], dtype=torch.long), "rows": [r for _, r in items]}


class StepPromptSampler:
    """Per step the indices of its prompts (the same on every rank): step s uses prompt block
    s // num_iterations; starts at `start_step`."""

    def __init__(self, prompts_per_step: int, num_iterations: int, steps: int, start_step: int):
        self.p, self.mu, self.steps, self.start = prompts_per_step, num_iterations, steps, start_step

    def __len__(self) -> int:
        return max(self.steps - self.start, 0)

    def __iter__(self):
        for step in range(self.start, self.steps):
            block = step // self.mu
            yield list(range(block * self.p, (block + 1) * self.p))


class PromptDataModule(NxdtDataModuleBase):
    """GRPO's prompts; see the module docstring."""

    def __init__(self, cfg, trainer=None, alignment=None):
        super().__init__(cfg, trainer)
        al = alignment_of(cfg) if alignment is None else alignment
        if al.grpo is None:
            raise ConfigError("PromptDataModule: needs model_alignment_strategy.grpo")
        self.grpo = al.grpo
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.vocab_size = len(self.tokenizer)
        g = self.grpo
        self.max_prompt_length = (g.max_prompt_length if g.max_prompt_length is not None
                                  else self.seq_length - g.max_completion_length)
        self.prompts_per_step = self.global_batch_size // g.num_generations
        self.datasets: dict[str, PromptRows | None] = {}

    def build_rows(self) -> PromptRows:
        if self.grpo.task == "arithmetic":
            rows = [(row, f"arithmetic row {i}") for i, row in enumerate(arithmetic_rows())]
            limit = self.cfg.data.dev_choose_samples
            rows = rows[:limit] if limit else rows
        else:
            rows = read_prompt_rows(self.cfg.data.train_dir, self.cfg.data.dev_choose_samples)
        out = []
        for row, _ in rows:
            columns = {k: v for k, v in row.items() if k != "prompt"}
            out.append(PromptRow(row["prompt"], prompt_ids(self.tokenizer, row["prompt"], self.max_prompt_length),
                                 columns))
        return PromptRows(out)

    def setup(self, stage: str | None = None) -> None:
        if not self.datasets:
            self.datasets = {"train": self.build_rows(), "validation": None, "test": None}

    def train_dataloader(self):
        self.setup("fit")
        steps = int(self.cfg.trainer.max_steps)
        mu = self.grpo.num_iterations
        blocks = -(-steps // mu)
        repeated = RepeatedDataset(self.datasets["train"], blocks * self.prompts_per_step, seed=self.seed,
                                   shuffle=True)
        start = self._consumed_samples() // self.global_batch_size  # completions per step
        sampler = StepPromptSampler(self.prompts_per_step, mu, steps, start)
        return torch.utils.data.DataLoader(_Indexed(repeated), batch_sampler=sampler, num_workers=0,
                                           collate_fn=collate_prompts)

    def val_dataloader(self):
        return []

    def test_dataloader(self):
        return []
