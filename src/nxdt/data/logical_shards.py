"""fms-fsdp style data: `data.datasets` + `data.weights` + `data.logical_shards`, resumable on any rank count.

    data:
      datasets: [data/kjv/kjv_text_document, data/other/other_text_document]  # Megatron prefixes
      weights: [3, 1]          # relative; null = equal
      logical_shards: 8        # a multiple of every data-parallel size you will run with

The training documents of each dataset (its first range under `data.splits_string`) are dealt
into `logical_shards` logical shards (document i → shard i mod L). Each shard is an endless
stream of fixed samples: epoch e of shard k is its documents in a seeded order, concatenated,
cut into samples of seq_length + 1 tokens (stride seq_length, as Megatron). With
`data.bol_token` / `data.eol_token` a sample is fms-fsdp's packed line instead: [bol] + the next
seq_length + 1 - (one per token set) stream tokens + [eol], the lines back to back. Sample j of a shard
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

A dataset is a Megatron prefix or a folder of arrow / parquet shards (nxdt.data.arrow_shards).
With `data.dynamic_data_selection` (nxdt.data.dynamic_selection) the domain of every sample is
drawn per global step instead, every rank follows the whole global batch (domain d's n-th sample is
sample n // L of shard n mod L: the same samples on any number of ranks), Megatron `data_prefix`
blends are read here too, and the checkpointed state adds the weight schedule.
"""

from __future__ import annotations

import numpy as np
import torch

from nxdt.spec.data import DataBlend, data_blend, domain_names, reference_losses
from nxdt.config.errors import ConfigError
from nxdt.data.dynamic_selection import DomainDraw, DomainSelection
from nxdt.data.common import NxdtDataLoader, worker_init
from nxdt.data.gpt_dataset import get_train_valid_test_split_
from nxdt.data.indexed import IndexedDataset
from nxdt.data.megatron_module import MegatronDataModule
from nxdt.data.vocab_check import tokenizer_label

STATE_VERSION = 1
PREFETCH_FACTOR = 2  # batches each DataLoader worker prepares ahead (torch's default, pinned here)


class ShardedStreams(torch.utils.data.Dataset):
    """Samples of the logical shards of several datasets; item key = (dataset, shard, sample index)."""

    def __init__(self, parts: list[tuple[IndexedDataset, np.ndarray]], logical_shards: int, seq_length: int,
                 seed: int, names: list[str] | None = None, bol: int | None = None, eol: int | None = None):
        self.parts = parts
        self.L = int(logical_shards)
        self.S = int(seq_length)
        # fms-fsdp's lines (BufferDataset, pack_hard): [bol] + stream + [eol], seq_length + 1 tokens, and the
        # next line goes on where this one's stream part ended. Without bol / eol: Megatron's samples of
        # seq_length + 1 tokens at stride seq_length (consecutive samples share one token).
        self.bol, self.eol = bol, eol
        self.window = self.S + 1 - (bol is not None) - (eol is not None)  # stream tokens per sample
        self.stride = self.S if self.window == self.S + 1 else self.window
        if self.window < 1:
            raise ConfigError(f"data.bol_token / data.eol_token: seq_length {self.S} leaves no room for data")
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
                spe = (int(sizes[shard].sum()) - self.window) // self.stride + 1
                if spe < 1:
                    raise ConfigError(f"data.logical_shards: shard {k} of {ix.prefix} holds fewer than "
                                      f"{self.window} tokens (a sample's); use fewer logical shards")
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
        """Sample j of shard k of dataset d: seq_length + 1 tokens, [bol] + that shard's stream + [eol]."""
        e, i = divmod(int(j), int(self.samples_per_epoch[d, k]))
        order, starts = self._epoch(d, k, e)
        begin, end = i * self.stride, i * self.stride + self.window
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        ix = self.parts[d][0]
        out, pos, doc = [], begin, first
        while pos < end:
            take = min(end, int(starts[doc + 1])) - pos
            if take > 0:
                out.append(ix.get(int(order[doc]), pos - int(starts[doc]), take))
            pos += max(take, 0)
            doc += 1
        head = [np.asarray([self.bol])] if self.bol is not None else []
        tail = [np.asarray([self.eol])] if self.eol is not None else []
        return np.concatenate(head + out + tail).astype(np.int64)

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
                 dp_rank: int, dp_size: int, num_batches: int, draw: DomainDraw | None = None, first_step: int = 0):
        self.streams = streams
        self.start = np.array(consumed, dtype=np.int64, copy=True)
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.local_batch_size = int(local_batch_size)
        self.dp_rank = int(dp_rank)
        # static weights: this rank reads its own shards; drawn domains: any shard (global positions)
        self.owned = owned_shards(streams.L, dp_rank, dp_size) if draw is None else list(range(streams.L))
        self.num_batches = max(int(num_batches), 0)
        self.draw = draw  # dynamic selection: domains drawn per global step; None: the weighted rule
        self.first_step = int(first_step)  # the global step of the first batch
        self.yielded = 0

    def __len__(self) -> int:
        return self.num_batches

    def _batch(self, table: np.ndarray, b: int) -> list[tuple[int, int, int]]:
        spe = self.streams.samples_per_epoch
        if self.draw is None:
            return [pick(table, self.owned, self.weights, spe) for _ in range(self.local_batch_size)]
        # Every rank follows the whole global batch, slot by slot: domain d's n-th sample overall is
        # sample n // L of shard n mod L. The table (the same on every rank) is then a function of the
        # samples per domain, and a global step's samples do not depend on the number of ranks.
        keys = []
        for d in self.draw.domains(self.first_step + b):
            d = int(d)
            k = int(table[d].sum()) % self.streams.L
            keys.append((d, k, int(table[d, k])))
            table[d, k] += 1
        return keys[self.dp_rank * self.local_batch_size: (self.dp_rank + 1) * self.local_batch_size]

    def consumed_after(self, batches: int) -> np.ndarray:
        """The table after this rank reads `batches` batches from the start (a replay; no data read)."""
        table = self.start.copy()
        for b in range(batches):
            self._batch(table, b)
        return table

    @property
    def next_step(self) -> int:
        """The global step of the next batch this sampler will draw."""
        return self.first_step + self.yielded

    def __iter__(self):
        table = self.start.copy()
        for b in range(self.num_batches):
            batch = self._batch(table, b)
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
        # data.dynamic_data_selection: the weights move during training (nxdt.data.dynamic_selection)
        self.selection: DomainSelection | None = None
        self._heldout: dict[int, list[dict[str, torch.Tensor]]] = {}
        if data.dynamic_data_selection != "none":
            self.selection = DomainSelection(
                domain_names(self.names), reference_losses(data.dynamic_selection.reference_losses, self.names),
                data.dynamic_selection, self.weights, self.seed, self.global_batch_size, rule=data.dynamic_data_selection)

    def data_blend(self) -> DataBlend:
        return self.blend

    def _split_documents(self, name: str, k: int):
        """(documents, ids of split k) of one dataset, cut by data.splits_string."""
        ix = self._open(name)
        bounds = get_train_valid_test_split_(self.data.splits_string, len(ix))
        return ix, np.arange(bounds[k], bounds[k + 1], dtype=np.int64)

    def build_split(self, k: int, n: int):
        if k != 0:
            return super().build_split(k, n)
        parts = [self._split_documents(name, 0) for name in self.names]
        # null: one shard per dp rank (fms-fsdp); with dynamic selection the ranks share every shard: one
        L = int(self.logical_shards) if self.logical_shards is not None else (
            1 if self.selection is not None else self.dp_size)
        for key in ("bol_token", "eol_token"):  # fms-fsdp's line tokens go into every sample
            token = getattr(self.data, key)
            if token is not None and token >= self.vocab_size:
                raise ConfigError(f"data.{key}: {token} is not below the tokenizer's vocabulary "
                                  f"({tokenizer_label(self.data.tokenizer)}: {self.vocab_size} tokens)")
        self.streams = ShardedStreams(parts, L, self.seq_length, self.seed, self.names,
                                      bol=self.data.bol_token, eol=self.data.eol_token)
        if self.selection is not None:
            for d in range(len(self.names)):  # a domain without held-out documents stops the run now
                self.heldout_batches(d)
        return self.streams

    # -- dynamic selection

    def heldout_batches(self, d: int) -> list[dict[str, torch.Tensor]]:
        """This rank's share of domain d's held-out global batches (`eval_batches` of them, fixed
        samples of its validation range), built once."""
        if d not in self._heldout:
            ix, docs = self._split_documents(self.names[d], 1)
            gbs, local, rank = self.global_batch_size, self.local_batch_size(), self.dp_rank
            if not len(docs) or not int(np.asarray(ix.sizes, dtype=np.int64)[docs].sum()):
                raise ConfigError(
                    f"data.dynamic_data_selection: domain '{self.selection.names[d]}' ({self.names[d]}) has no "
                    f"held-out documents: its validation range under data.splits_string "
                    f"'{self.data.splits_string}' is empty")
            held = self._gpt(ix, docs, self.selection.eval_batches * gbs, "heldout")
            self._heldout[d] = [
                torch.utils.data.default_collate([held[b * gbs + rank * local + i] for i in range(local)])
                for b in range(self.selection.eval_batches)]
        return self._heldout[d]

    def lookahead(self) -> int:
        """Batches the loader draws ahead of the step being trained: Lightning's one, plus each
        worker's prefetch (PREFETCH_FACTOR)."""
        return 1 + PREFETCH_FACTOR * self.num_workers

    def update_selection(self, losses, steps_done: int) -> np.ndarray:
        """New weights from the domains' held-out losses measured after `steps_done` steps; they draw
        the batches from step steps_done + lookahead on (those before were drawn already)."""
        first = steps_done + self.lookahead()
        if self.sampler is not None and self.sampler.next_step > first:
            raise RuntimeError(f"dynamic selection: the loader drew step {self.sampler.next_step - 1} before the "
                               f"weights for step {first} were known")
        return self.selection.update(losses, first)

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
        if self.selection is not None:  # every rank follows every shard (LogicalShardSampler._batch)
            table = self._local_table()
        else:
            report = (self.dp_rank, self.dp_size, self._local_table())
            reports = [report]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                reports = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(reports, report)
            table = merge_tables(reports, self.streams.L)
        state = {"version": STATE_VERSION, "datasets": list(self.names), "logical_shards": self.streams.L,
                 "consumed": table.tolist()}
        if self.selection is not None:
            state["selection"] = self.selection.state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._loaded = dict(state_dict)
        self.sampler = None
        if self.selection is not None and state_dict.get("selection") is not None:
            self.selection.load(state_dict["selection"])

    def train_dataloader(self):
        self.setup("fit")
        table = self._start_table()
        consumed = self._consumed_samples()
        self._start_consumed = consumed
        draw = self.selection.draw if self.selection is not None else None
        done = consumed // self.global_batch_size
        if self._loaded is None and consumed:
            # A checkpoint without data state: replay the steps taken (exact when the layout is the same).
            replay = LogicalShardSampler(self.streams, table, self.weights, self.local_batch_size(),
                                         self.dp_rank, self.dp_size, 0, draw=draw)
            table = replay.consumed_after(done)
        steps_left = self.num_samples()["train"] // self.global_batch_size - done
        self.sampler = LogicalShardSampler(self.streams, table, self.weights, self.local_batch_size(),
                                           self.dp_rank, self.dp_size, steps_left, draw=draw, first_step=done)
        workers = self.num_workers
        return NxdtDataLoader(self.streams, batch_sampler=self.sampler, num_workers=workers,
                                           persistent_workers=workers > 0,
                                           prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
                                           worker_init_fn=worker_init if workers > 0 else None)
