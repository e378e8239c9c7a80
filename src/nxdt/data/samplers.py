"""Batch samplers over the data-parallel axis (Megatron's pretraining samplers).

Both yield, per global step, this dp rank's `local_batch_size = global_batch_size // dp_size`
sample indices, and start at `consumed_samples` so a resumed run continues with exactly the
batches an uninterrupted run would have seen. Use them as `DataLoader(batch_sampler=...)`;
never let Lightning inject its distributed sampler (the Trainer runs with
`use_distributed_sampler=False`).
"""

from __future__ import annotations

import numpy as np


class _MegatronSampler:
    """The arguments both samplers take, checked and kept once (the cyclic sampler repeats the
    signature only to keep `seed` in its positional place, before drop_last)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if local_batch_size * dp_size != global_batch_size:
            raise ValueError(
                f"local batch {local_batch_size} x dp {dp_size} != global batch {global_batch_size}"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.local_batch_size = int(local_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.drop_last = drop_last


class MegatronPretrainingBatchSampler(_MegatronSampler):
    """Sequential: global batch b is samples [b*gbs, (b+1)*gbs); rank r takes its contiguous slice.

    Starts at `consumed_samples` (a multiple of global_batch_size when resuming at a step
    boundary). With drop_last=False a final partial global batch is split the same way (ranks
    past its end get a shorter, possibly empty, slice; empty slices are not yielded).
    Takes exactly the common arguments (`_MegatronSampler.__init__`).
    """

    def __len__(self) -> int:
        remaining = max(self.total_samples - self.consumed_samples, 0)
        if self.drop_last:
            return remaining // self.global_batch_size
        full, rest = divmod(remaining, self.global_batch_size)
        return full + (1 if rest > self.dp_rank * self.local_batch_size else 0)

    def __iter__(self):
        begin = self.dp_rank * self.local_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.global_batch_size):
            stop = min(start + self.global_batch_size, self.total_samples)
            if stop - start < self.global_batch_size and self.drop_last:
                return
            batch = list(range(start + begin, min(start + begin + self.local_batch_size, stop)))
            if batch:
                yield batch


class MegatronPretrainingRandomBatchSampler(_MegatronSampler):
    """`dataloader_type: cyclic`: a seeded permutation of the samples per epoch.

    An epoch is `total_samples // global_batch_size` full global batches; epoch e uses
    `RandomState(seed + e).permutation(total_samples)`. Iteration continues from
    `consumed_samples` (which it advances while yielding) to the end of the current epoch, so the
    next `iter()` starts the next epoch, and a sampler built with a saved consumed_samples
    resumes exactly where it stopped.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 1234,
        drop_last: bool = True,
    ):
        # drop_last: partial batches never occur here, an epoch holds only full ones
        super().__init__(total_samples, consumed_samples, local_batch_size, global_batch_size, dp_rank, dp_size,
                         drop_last)
        if total_samples < global_batch_size:
            raise ValueError(f"total_samples {total_samples} < global batch {global_batch_size}")
        self.seed = int(seed)
        self.samples_per_epoch = (self.total_samples // self.global_batch_size) * self.global_batch_size

    def __len__(self) -> int:
        done = self.consumed_samples % self.samples_per_epoch
        return (self.samples_per_epoch - done) // self.global_batch_size

    def __iter__(self):
        epoch, done = divmod(self.consumed_samples, self.samples_per_epoch)
        perm = np.random.RandomState((self.seed + epoch) % 2**32).permutation(self.total_samples)
        begin = self.dp_rank * self.local_batch_size
        for start in range(done - done % self.global_batch_size, self.samples_per_epoch, self.global_batch_size):
            batch = perm[start + begin : start + begin + self.local_batch_size]
            self.consumed_samples = epoch * self.samples_per_epoch + start + self.global_batch_size
            yield [int(i) for i in batch]
