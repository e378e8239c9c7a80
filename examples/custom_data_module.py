"""A custom data module, loaded by class path: `data.data_module: custom_data_module.KJVBlocksDataModule`.

    python examples/train.py --config-path examples/conf --config-name custom_data_module

(examples/train.py puts this folder on sys.path; elsewhere make the module importable, e.g.
PYTHONPATH=examples, or run from the folder that holds it: the working directory is searched too.)

The contract nxdt relies on:
1. a `lightning.pytorch.LightningDataModule` built as `Cls(cfg, trainer)`: `cfg` is the whole
   validated config (typed: `nxdt.config.schema.NxdtConfig`, read `cfg.data.global_batch_size`), `trainer` the Lightning Trainer (its strategy knows the data-parallel layout);
2. a `vocab_size` attribute (the model's embedding is sized from it), or `model.vocab_size` set;
3. `train_dataloader()` yields dicts: `input_ids`, `labels` LongTensor[B, S] (labels are the next
   tokens: already shifted), `loss_mask` FloatTensor[B, S], optional `position_ids` LongTensor[B, S]
   (restarting at 0 marks a new document: the model then attends within it only), with
   B = global_batch_size // dp_size, this rank's share of one optimizer step;
4. resuming: start at `trainer.lightning_module.consumed_samples` (read it in train_dataloader(),
   which Lightning calls after restoring a checkpoint), or keep the position in
   `state_dict()` / `load_state_dict()`, which Lightning stores in the checkpoint;
5. optional `val_dataloader()` / `test_dataloader()`, same batches (whole global batches only).
Keys under `data:` that nxdt does not know are free for the module (here `data.chapters`): they
arrive in the plain dict `cfg.data.custom` (and are written back under `data:` in the saved config.yaml).

This one tokenizes the first `data.chapters` chapters of the bundled King James Bible, cuts the
token stream into blocks of seq_length + 1, and reuses nxdt's Megatron batch sampler for the
data-parallel split and the resume position.
"""

from __future__ import annotations

import gzip
import json

import lightning.pytorch as pl
import torch

from nxdt.data.assets import bundled_corpus_path
from nxdt.data.samplers import MegatronPretrainingBatchSampler
from nxdt.data.tokenizers import build_tokenizer


class Blocks(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, seq_length: int, num_samples: int):
        self.tokens, self.seq_length, self.num_samples = tokens, seq_length, num_samples
        self.blocks = (len(tokens) - 1) // seq_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = (i % self.blocks) * self.seq_length  # go round the corpus as often as needed
        text = self.tokens[start : start + self.seq_length + 1]
        return {"input_ids": text[:-1], "labels": text[1:], "loss_mask": torch.ones(self.seq_length)}


class KJVBlocksDataModule(pl.LightningDataModule):
    def __init__(self, cfg, trainer):
        super().__init__()
        self.cfg, self.trainer = cfg, trainer
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.vocab_size = len(self.tokenizer)  # contract point 2
        # a key of our own under data: (nxdt does not know it, so it is in data.custom; our default)
        self.chapters = int(cfg.data.custom.get("chapters", 50))

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_tokens"):
            return
        ids = []
        with gzip.open(bundled_corpus_path(), "rt", encoding="utf-8") as f:
            for n, line in enumerate(f):
                if n >= self.chapters:
                    break
                ids += self.tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
                ids.append(self.tokenizer.eos_token_id)
        tokens = torch.tensor(ids, dtype=torch.long)
        cut = int(len(tokens) * 0.9)
        self.train_tokens, self.val_tokens = tokens[:cut], tokens[cut:]

    def _loader(self, tokens, num_samples, consumed):
        gbs = self.cfg.data.global_batch_size
        strategy = self.trainer.strategy
        dp_rank, dp_size = getattr(strategy, "dp_rank", 0), getattr(strategy, "dp_size", 1)
        sampler = MegatronPretrainingBatchSampler(
            total_samples=num_samples, consumed_samples=consumed, local_batch_size=gbs // dp_size,
            global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size, drop_last=True)
        return torch.utils.data.DataLoader(Blocks(tokens, self.cfg.data.seq_length, num_samples), batch_sampler=sampler)

    def train_dataloader(self):
        self.setup()
        gbs = self.cfg.data.global_batch_size
        consumed = self.trainer.lightning_module.consumed_samples  # contract point 4
        return self._loader(self.train_tokens, self.cfg.trainer.max_steps * gbs, consumed)

    def val_dataloader(self):
        self.setup()
        gbs = self.cfg.data.global_batch_size
        return self._loader(self.val_tokens, int(self.cfg.trainer.limit_val_batches) * gbs, 0)
