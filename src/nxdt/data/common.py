"""What every nxdt data module shares: the dp layout, sample counts, resume position, loaders.

`NxdtDataModuleBase(cfg, trainer)` (trainer may be None: dp rank 0 of 1, nothing consumed) asks
the strategy for `dp_rank` / `dp_size` and the LightningModule for `consumed_samples`, and builds
loaders from nxdt's batch samplers (one global step's share per batch, never Lightning's
injected sampler). Subclasses set `self.tokenizer` / `self.vocab_size` in `__init__` (the model
is sized from it before `setup()`).

Sample counts (Megatron/NeMo), used by modules whose data is an endless stream:
    train      = trainer.max_steps × global_batch_size
    validation = (max_steps // val_check_interval + 1) × limit_val_batches × global_batch_size
    test       = limit_test_batches × global_batch_size
A float limit (a fraction, ≤ 1.0) counts as one batch; 0 turns the split off.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import numpy as np
import torch

from nxdt.config.errors import ConfigError
from nxdt.data.samplers import MegatronPretrainingBatchSampler, MegatronPretrainingRandomBatchSampler

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
"""What a loader worker ignores: a stop signal is its rank's to act on (nxdt.training.fault_tolerance)."""


def _stop_signals() -> set[signal.Signals]:
    return {getattr(signal, name) for name in STOP_SIGNALS}


class NxdtDataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose workers are started with the stop signals blocked: a signal that
    arrives while a worker starts (validation's workers start at the first validation, often the
    step a preemption lands on) stays pending until `worker_init` ignores it, instead of killing
    the worker before it could. The rank unblocks them once its workers are started and gets its
    own signal then."""

    def _get_iterator(self):  # where torch starts the workers (once, with persistent_workers)
        if self.num_workers == 0:
            return super()._get_iterator()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, _stop_signals())
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def worker_init(worker_id: int) -> None:
    """Every loader worker's `worker_init_fn`: ignore the stop signals, then Lightning's seeding.

    `kill -TERM -- -PGID`, Ctrl-C and torchrun's forwarding (`killpg` of each rank's group) reach
    the workers as well as their rank; by default a worker dies of SIGTERM (torch's own handler
    re-raises it) and its rank fails with "DataLoader worker ... is killed by signal" before it can
    save. Ignoring them, a worker lives until its rank has saved and ends, and ends with it as
    before (torch's worker loop exits when its parent is gone). Lightning adds its
    `pl_worker_init_function` only to loaders without a worker_init_fn, so it is called here
    where Lightning would have (seed_everything(workers=True) sets PL_SEED_WORKERS)."""
    for sig in _stop_signals():
        signal.signal(sig, signal.SIG_IGN)  # a signal pending since the fork (NxdtDataLoader) is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _stop_signals())
    if int(os.environ.get("PL_SEED_WORKERS", "0")):
        from lightning.fabric.utilities.seed import pl_worker_init_function  # only where Lightning would call it

        pl_worker_init_function(worker_id)


def limit_batches(limit, key: str) -> int:
    """A Lightning limit_*_batches as a number of batches: int as is, a fraction → 1, 0 → 0."""
    if isinstance(limit, bool):
        raise ConfigError(f"{key}: expected a number, got {limit}")
    if isinstance(limit, float):
        if limit < 0:
            raise ConfigError(f"{key}: must be >= 0, got {limit}")
        if limit <= 1.0:
            return 0 if limit == 0 else 1
        return int(limit)
    return max(int(limit), 0)


class RepeatedDataset(torch.utils.data.Dataset):
    """`num_samples` items cycling over `dataset` (epoch after epoch).

    With `shuffle`, epoch e visits the items in `RandomState(seed + e).permutation(len)`; the map
    from index to item is fixed, so resuming at `consumed_samples` continues exactly.
    """

    def __init__(self, dataset, num_samples: int, seed: int = 1234, shuffle: bool = False):
        if len(dataset) == 0:
            raise ValueError("cannot repeat an empty dataset")
        self.dataset = dataset
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def source_index(self, idx: int) -> int:
        epoch, i = divmod(int(idx), len(self.dataset))
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self.dataset)))
        return int(self._perm[1][i])

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range ({self.num_samples})")
        return self.dataset[self.source_index(idx)]


class NxdtDataModuleBase(pl.LightningDataModule):
    """Layout, counts and loaders shared by the nxdt data modules (see the module docstring)."""

    def __init__(self, cfg, trainer=None):
        super().__init__()
        self.cfg = cfg
        self.trainer = trainer
        data = cfg.data
        if data.seq_length is None:
            raise ConfigError("data.seq_length: required (tokens per training sample)")
        self.seq_length = int(data.seq_length)
        self.micro_batch_size = data.micro_batch_size
        self.global_batch_size = data.global_batch_size
        self.num_workers = data.num_workers
        self.seed = cfg.seed

    # -- layout

    def _strategy_attr(self, name: str, default: int) -> int:
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        return int(getattr(strategy, name, default)) if strategy is not None else default

    @property
    def dp_rank(self) -> int:
        return self._strategy_attr("dp_rank", 0)

    @property
    def dp_size(self) -> int:
        return self._strategy_attr("dp_size", 1)

    def _consumed_samples(self) -> int:
        if self.trainer is None:
            return 0
        try:
            module = self.trainer.lightning_module
        except (AttributeError, RuntimeError):
            return 0
        return int(getattr(module, "consumed_samples", 0) or 0)

    def local_batch_size(self) -> int:
        dp_size = self.dp_size
        if self.global_batch_size % dp_size:
            raise ConfigError(
                f"data.global_batch_size: {self.global_batch_size} is not divisible by the data-parallel size {dp_size}"
            )
        return self.global_batch_size // dp_size

    # -- sample counts

    def num_samples(self) -> dict[str, int]:
        tr = self.cfg.trainer
        gbs = self.global_batch_size
        max_steps = tr.max_steps
        if max_steps <= 0:
            raise ConfigError(f"trainer.max_steps: must be > 0 for nxdt data modules (got {max_steps})")
        # null is Lightning's default: validate once per epoch, i.e. a fraction 1.0
        vci = 1.0 if tr.val_check_interval is None else tr.val_check_interval
        if isinstance(vci, float) and vci <= 1.0:
            vci = max(1, int(vci * max_steps))
        vci = max(1, int(vci))
        val_batches = limit_batches(tr.limit_val_batches, "trainer.limit_val_batches")
        test_batches = limit_batches(tr.limit_test_batches, "trainer.limit_test_batches")
        return {
            "train": max_steps * gbs,
            "validation": (max_steps // vci + 1) * val_batches * gbs,
            "test": test_batches * gbs,
        }

    # -- loaders

    def _loader(self, dataset, consumed: int, drop_last: bool = True, cyclic: bool = False, collate_fn=None):
        local = self.local_batch_size()
        common = dict(
            total_samples=len(dataset), consumed_samples=consumed, local_batch_size=local,
            global_batch_size=self.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size, drop_last=drop_last,
        )
        if cyclic:
            sampler = MegatronPretrainingRandomBatchSampler(**common, seed=self.seed)
        else:
            sampler = MegatronPretrainingBatchSampler(**common)
        workers = self.num_workers
        return NxdtDataLoader(
            dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
            collate_fn=collate_fn, worker_init_fn=worker_init if workers > 0 else None,
        )

    # -- loaders: subclasses fill self.datasets in setup() and may override _train_dataset

    def _train_dataset(self):
        """The training split repeated (or cut) to the samples max_steps needs."""
        return RepeatedDataset(self.datasets["train"], self.num_samples()["train"], seed=self.seed)

    def train_dataloader(self):
        self.setup("fit")
        return self._loader(self._train_dataset(), self._consumed_samples())

    def val_dataloader(self):
        self.setup("validate")
        return self._eval_loader(self.datasets["validation"])

    def test_dataloader(self):
        self.setup("test")
        return self._eval_loader(self.datasets["test"])

    def _eval_loader(self, dataset):
        """A validation/test loader: whole global batches only (the step needs B = local batch)."""
        if dataset is None or len(dataset) < self.global_batch_size:
            return []
        return self._loader(dataset, 0, drop_last=True)
