"""`DummyDataModule` (`data.use_dummy_dataset: true`, fms-fsdp): random tokens for performance runs.

Sample i is `seq_length + 1` token ids drawn uniformly from the vocabulary by a generator seeded
with (seed, split, i): the same on every run, rank and resume, and costs no I/O. The vocabulary
is `model.vocab_size` when set, else the tokenizer's (`data.tokenizer`, the bundled one by
default). Train / validation / test sample counts follow trainer.max_steps and the limits, as
for Megatron data.
"""

from __future__ import annotations

import numpy as np
import torch

from nxdt.data.common import NxdtDataModuleBase
from nxdt.data.tokenizers import build_tokenizer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: int = 0):
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.split = int(split)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range ({self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split, int(idx)])
        text = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))
        return {
            "input_ids": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


class DummyDataModule(NxdtDataModuleBase):
    def __init__(self, cfg, trainer=None):
        super().__init__(cfg, trainer)
        vocab = cfg.model.vocab_size
        if vocab is None:
            self.tokenizer = build_tokenizer(cfg.data.tokenizer)
            vocab = len(self.tokenizer)
        self.vocab_size = int(vocab)
        self.datasets: dict[str, RandomTokens] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        for k, (split, n) in enumerate(self.num_samples().items()):
            self.datasets[split] = RandomTokens(n, self.seq_length, self.vocab_size, self.seed, k)

    def _train_dataset(self):
        return self.datasets["train"]  # already sized to the samples max_steps needs
