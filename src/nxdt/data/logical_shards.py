"""fms-fsdp style data: `data.datasets` + `data.weights` + `data.logical_shards`, resumable on any rank count.

    data:
      datasets: [data/kjv/kjv_text_document, data/other/other_text_document]  # Megatron prefixes
      weights: [3, 1]          # relative; null = equal
      logical_shards: 8        # a multiple of every data-parallel size you will run with

The training documents of each dataset (its first range under `data.splits_string`) are dealt
into `logical_shards` logical shards (document i → shard i mod L). Each shard is an endless
stream of fixed samples: epoch e of shard k is its documents in a seeded order, concatenated,
cut into samples of seq_length + 1 tokens (stride seq_length, as Megatron). Sample j of a shard
is always the same tokens, whoever reads it.

Data-parallel rank r of n reads the shards k with k mod n == r (L must be a multiple of n). For
each sample it picks the dataset by Megatron's deterministic weighted rule over what it has
read, then, within that dataset, its shard furthest behind in its epoch. The whole reading
position is therefore one table: samples consumed per (dataset, shard). That table is the data
module's `state_dict()` (gathered from every rank, stored by Lightning in the checkpoint) and
`load_state_dict()` restores it, whatever the new number of ranks: every shard continues exactly
where it stopped, so within an epoch no sample is read twice or skipped.

The table is recomputed from the number of optimizer steps taken (the LightningModule's
`consumed_samples`), so samples the DataLoader prefetched but did not train on are not counted.
With `logical_shards: null` the number of shards is the data-parallel size (resumable only on
that many ranks). Validation and test use the other two `splits_string` ranges, as Megatron data.
"""

from __future__ import annotations

import numpy as np
import torch

from nxdt.config.blend import DataBlend, data_blend
from nxdt.config.errors import ConfigError
from nxdt.data.indexed import IndexedDataset
from nxdt.data.megatron_module import MegatronDataModule

STATE_VERSION = 1


class ShardedStreams(torch.utils.data.Dataset):
    """Samples of the logical shards of several datasets; item key = (dataset, shard, sample index)."""

    def __init__(self, parts: list[tuple[IndexedDataset, np.ndarray]], logical_shards: int, seq_length: int,
                 seed: int, names: list[str] | None = None):
        self.parts = parts
        self.L = int(logical_shards)
        self.S = int(seq_length)
        self.seed = int(seed)
        self.names = names or [ix.prefix for ix, _ in parts]
        if self.L < 1:
            raise ConfigError(f"data.logical_shards: must be >= 1, got {self.L}")
        self.shard_docs: list[list[np.ndarray]] = []
        self.samples_per_epoch = np.zeros((len(parts), self.L), dtype=np.int64)
        for d, (ix, docs) in enumerate(parts):
            sizes = np.asarray(ix.sizes, dtype=np.int64)
            if len(docs) < self.L:
                raise ConfigError(f"data.logical_shards: {self.L} shards but {ix.prefix} has only {len(docs)} "
                                  "training documents; use fewer logical shards")
            per = [np.asarray(docs[k :: self.L], dtype=np.int64) for k in range(self.L)]
            for k, shard in enumerate(per):
                spe = (int(sizes[shard].sum()) - 1) // self.S
                if spe < 1:
                    raise ConfigError(f"data.logical_shards: shard {k} of {ix.prefix} holds fewer than "
                                      f"seq_length + 1 = {self.S + 1} tokens; use fewer logical shards")
                self.samples_per_epoch[d, k] = spe
            self.shard_docs.append(per)
        self._epoch_cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, d: int, k: int, e: int):
        key = (d, k, e)
        if key not in self._epoch_cache:
            if len(self._epoch_cache) > 256:
                self._epoch_cache.clear()
            order = np.random.RandomState([self.seed % 2**32, d, k, e]).permutation(self.shard_docs[d][k])
            lengths = np.asarray(self.parts[d][0].sizes, dtype=np.int64)[order]
            self._epoch_cache[key] = (order, np.concatenate([[0], np.cumsum(lengths)]))
        return self._epoch_cache[key]

    def tokens(self, d: int, k: int, j: int) -> np.ndarray:
        """Sample j of shard k of dataset d: seq_length + 1 tokens of that shard's stream."""
        e, i = divmod(int(j), int(self.samples_per_epoch[d, k]))
        order, starts = self._epoch(d, k, e)
        begin, end = i * self.S, i * self.S + self.S + 1
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        ix = self.parts[d][0]
        out, pos, doc = [], begin, first
        while pos < end:
            take = min(end, int(starts[doc + 1])) - pos
            if take > 0:
                out.append(ix.get(int(order[doc]), pos - int(starts[doc]), take))
            pos += max(take, 0)
            doc += 1
        return np.concatenate(out).astype(np.int64)

    def __len__(self) -> int:  # nominal: keys are tuples drawn by LogicalShardSampler
        return int(self.samples_per_epoch.sum())

    def __getitem__(self, key) -> dict[str, torch.Tensor]:
        d, k, j = key
        text = torch.from_numpy(self.tokens(d, k, j))
        return {
            "input_ids": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.S, dtype=torch.float32),
            "position_ids": torch.arange(self.S, dtype=torch.int64),
        }


def owned_shards(logical_shards: int, dp_rank: int, dp_size: int) -> list[int]:
    if logical_shards % dp_size:
        raise ConfigError(f"data.logical_shards: {logical_shards} is not a multiple of the data-parallel size "
                          f"{dp_size} (each rank reads whole logical shards)")
    return [k for k in range(logical_shards) if k % dp_size == dp_rank]


def pick(consumed: np.ndarray, owned: list[int], weights: np.ndarray, samples_per_epoch: np.ndarray):
    """The next (dataset, shard, sample index) for a rank owning `owned`; advances `consumed` in place."""
    taken = consumed[:, owned].sum(axis=1)
    n = float(taken.sum())
    d = int(np.argmax(weights * (n + 1.0) - taken))
    progress = consumed[d, owned] / samples_per_epoch[d, owned]
    k = owned[int(np.argmin(progress))]
    j = int(consumed[d, k])
    consumed[d, k] += 1
    return d, k, j


class LogicalShardSampler:
    """Batches of (dataset, shard, index) keys for one dp rank, from a consumed table (see module doc)."""

    def __init__(self, streams: ShardedStreams, consumed: np.ndarray, weights, local_batch_size: int,
                 dp_rank: int, dp_size: int, num_batches: int):
        self.streams = streams
        self.start = np.array(consumed, dtype=np.int64, copy=True)
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.local_batch_size = int(local_batch_size)
        self.owned = owned_shards(streams.L, dp_rank, dp_size)
        self.num_batches = max(int(num_batches), 0)
        self.yielded = 0

    def __len__(self) -> int:
        return self.num_batches

    def consumed_after(self, batches: int) -> np.ndarray:
        """The table after this rank reads `batches` batches from the start (a replay; no data read)."""
        table = self.start.copy()
        for _ in range(batches * self.local_batch_size):
            pick(table, self.owned, self.weights, self.streams.samples_per_epoch)
        return table

    def __iter__(self):
        table = self.start.copy()
        for b in range(self.num_batches):
            batch = [pick(table, self.owned, self.weights, self.streams.samples_per_epoch)
                     for _ in range(self.local_batch_size)]
            self.yielded = b + 1
            yield batch


def merge_tables(reports: list[tuple[int, int, np.ndarray]], logical_shards: int) -> np.ndarray:
    """One global table from each rank's (dp_rank, dp_size, table): shard k comes from rank k mod size."""
    out = None
    for dp_rank, dp_size, table in reports:
        table = np.asarray(table, dtype=np.int64)
        out = np.zeros_like(table) if out is None else out
        for k in owned_shards(logical_shards, dp_rank, dp_size):
            out[:, k] = table[:, k]
    return out


class LogicalShardDataModule(MegatronDataModule):
    """`data.datasets` / `data.weights` / `data.logical_shards`; see the module docstring."""

    def __init__(self, cfg, trainer=None):
        super().__init__(cfg, trainer)
        data = cfg.data
        self.blend = data_blend(data)  # data.datasets + data.weights
        self.names, self.weights = [p for _, p in self.blend.blend], [w for w, _ in self.blend.blend]
        self.logical_shards = data.logical_shards
        self.streams: ShardedStreams | None = None
        self.sampler: LogicalShardSampler | None = None
        self._loaded: dict | None = None
        self._start_consumed = 0

    def data_blend(self) -> DataBlend:
        return self.blend

    def build_split(self, k: int, n: int):
        if k != 0:
            return super().build_split(k, n)
        parts = []
        for name in self.names:
            ix = self._open(name)
            from nxdt.data.gpt_dataset import get_train_valid_test_split_

            bounds = get_train_valid_test_split_(self.data.splits_string, len(ix))
            parts.append((ix, np.arange(bounds[0], bounds[1], dtype=np.int64)))
        L = int(self.logical_shards) if self.logical_shards is not None else self.dp_size
        self.streams = ShardedStreams(parts, L, self.seq_length, self.seed, self.names)
        return self.streams

    # -- state

    def _table_from_state(self, state: dict) -> np.ndarray:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"checkpoint data state: unsupported version {state.get('version')}")
        if list(state["datasets"]) != self.names:
            raise ConfigError(f"data.datasets: the checkpoint was written for {list(state['datasets'])}, "
                              f"this run has {self.names}")
        if int(state["logical_shards"]) != self.streams.L:
            raise ConfigError(f"data.logical_shards: the checkpoint has {state['logical_shards']} logical shards, "
                              f"this run {self.streams.L}; set data.logical_shards={state['logical_shards']}")
        return np.asarray(state["consumed"], dtype=np.int64)

    def _local_table(self) -> np.ndarray:
        if self.sampler is None:
            return self._start_table()
        if self.trainer is not None:
            steps = (self._consumed_samples() - self._start_consumed) // self.global_batch_size
        else:
            steps = self.sampler.yielded
        return self.sampler.consumed_after(max(steps, 0))

    def _start_table(self) -> np.ndarray:
        if self._loaded is not None:
            return self._table_from_state(self._loaded)
        return np.zeros((len(self.names), self.streams.L), dtype=np.int64)

    def state_dict(self) -> dict:
        """The global consumed table (gathered over all ranks; identical on every rank)."""
        self.setup("fit")
        report = (self.dp_rank, self.dp_size, self._local_table())
        reports = [report]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reports = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(reports, report)
        table = merge_tables(reports, self.streams.L)
        return {"version": STATE_VERSION, "datasets": list(self.names), "logical_shards": self.streams.L,
                "consumed": table.tolist()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._loaded = dict(state_dict)
        self.sampler = None

    def train_dataloader(self):
        self.setup("fit")
        table = self._start_table()
        consumed = self._consumed_samples()
        self._start_consumed = consumed
        if self._loaded is None and consumed:
            # A checkpoint without data state: replay the steps taken (exact when the layout is the same).
            replay = LogicalShardSampler(self.streams, table, self.weights, self.local_batch_size(),
                                         self.dp_rank, self.dp_size, 0)
            table = replay.consumed_after(consumed // self.global_batch_size)
        steps_left = self.num_samples()["train"] // self.global_batch_size - consumed // self.global_batch_size
        self.sampler = LogicalShardSampler(self.streams, table, self.weights, self.local_batch_size(),
                                           self.dp_rank, self.dp_size, steps_left)
        workers = self.num_workers
        return torch.utils.data.DataLoader(self.streams, batch_sampler=self.sampler, num_workers=workers,
                                           persistent_workers=workers > 0)
