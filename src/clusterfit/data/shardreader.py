"""Reading packed shards for training, validation and scoring.

Each epoch, the shards are put in an order drawn from (seed, epoch) and read as one stream of samples.
Rank r trains on its own contiguous range of that stream, `steps_per_epoch * batch_size` samples, so across
ranks every sample is seen once per epoch (what does not fill a whole global batch is left out). The range
is cut into blocks of `block_steps` steps; samples are shuffled inside a block (the shuffle buffer), and
blocks are dealt to DataLoader workers in turn, so no two workers read the same sample.

Everything is a function of (seed, epoch, rank, step): two runs with the same seed see the same batches,
and a job resumed at step k reads exactly the batches it had not yet trained on.

Validation and scoring read the stream unshuffled, in index order: a validation rank its own share of it, a
scoring rank the chunks of its plan (`PackedImages`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from clusterfit.data.decode import BadImage
from clusterfit.data.quality import BadRead
from clusterfit.data.shards import PackedIndex, ShardError, ShardInfo, sample_name

Batch = tuple[torch.Tensor | None, torch.Tensor | None, int, list[BadRead]]
Transform = Callable[[bytes, torch.Generator | None], torch.Tensor]


@dataclass(frozen=True)
class Segment:
    shard: ShardInfo
    skip: int
    count: int


def shard_order(shards: list[ShardInfo], seed: int, epoch: int) -> list[ShardInfo]:
    order = list(shards)
    random.Random(f"clusterfit-shards:{seed}:{epoch}").shuffle(order)
    return order


def locate(order: list[ShardInfo], start: int, stop: int) -> list[Segment]:
    """The shard pieces holding stream positions [start, stop)."""
    segments, offset = [], 0
    for shard in order:
        lo, hi = max(start, offset), min(stop, offset + shard.samples)
        if lo < hi:
            segments.append(Segment(shard, lo - offset, hi - lo))
        offset += shard.samples
        if offset >= stop:
            break
    return segments


def blocks_of_role(steps: int, block_steps: int, roles: int, role: int) -> list[range]:
    """The step ranges (blocks) that DataLoader worker `role` produces, in order."""
    blocks = [range(b, min(b + block_steps, steps)) for b in range(0, steps, block_steps)]
    return blocks[role::roles]


def delivery_order(batches_per_role: list[int]) -> list[int]:
    """Which role delivers each step: a DataLoader takes one batch from each worker in turn, skipping
    workers that have finished."""
    left, order = list(batches_per_role), []
    while any(left):
        for role, count in enumerate(left):
            if count:
                order.append(role)
                left[role] -= 1
    return order


def consumed_per_role(steps: int, block_steps: int, roles: int, start_step: int) -> list[int]:
    counts = [sum(len(b) for b in blocks_of_role(steps, block_steps, roles, r)) for r in range(roles)]
    consumed = [0] * roles
    for role in delivery_order(counts)[:start_step]:
        consumed[role] += 1
    return consumed


class ShardTrainSamples(IterableDataset):
    """Yields whole batches (images, labels, reads, bad reads) for one rank; see the module docstring."""

    def __init__(
        self,
        index: PackedIndex,
        transform: Transform,
        *,
        seed: int,
        rank: int,
        world_size: int,
        batch_size: int,
        steps_per_epoch: int,
        block_steps: int,
    ) -> None:
        self.index, self.transform, self.seed = index, transform, seed
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.steps, self.block_steps = steps_per_epoch, max(1, block_steps)
        self.epoch, self.start_step = 0, 0

    def set_position(self, epoch: int, start_step: int) -> None:
        """Call before iterating; DataLoader workers copy the dataset when an iteration starts."""
        self.epoch, self.start_step = epoch, start_step

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        # NOTE: a resumed epoch's DataLoader starts again at worker 0; rotating the roles keeps every
        # remaining step on the worker that would have delivered it in an uninterrupted epoch.
        role = (worker + self.start_step) % workers
        skip = consumed_per_role(self.steps, self.block_steps, workers, self.start_step)[role]
        order = shard_order(self.index.shards, self.seed, self.epoch)
        rank_start = self.rank * self.steps * self.batch_size
        for block in blocks_of_role(self.steps, self.block_steps, workers, role):
            if skip >= len(block):
                skip -= len(block)
                continue
            samples = self._read_block(order, rank_start, block)
            for step in block[skip:]:
                yield self._batch(samples, step - block.start, step)
            skip = 0

    def _read_block(self, order: list[ShardInfo], rank_start: int, block: range) -> list[tuple[str, bytes, int]]:
        start = rank_start + block.start * self.batch_size
        samples = [
            (sample_name(seg.shard.name, key), data, label)
            for seg in locate(order, start, start + len(block) * self.batch_size)
            for key, data, label in self.index.iter_samples(seg.shard, seg.skip, seg.count)
        ]
        random.Random(f"clusterfit-buffer:{self.seed}:{self.epoch}:{self.rank}:{block.start}").shuffle(samples)
        return samples

    def _batch(self, samples: list[tuple[str, bytes, int]], first_step: int, step: int) -> Batch:
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, self.rank, step)) & (2**62 - 1))
        images, labels, bad = [], [], []
        lo = first_step * self.batch_size
        for position in range(lo, lo + self.batch_size):
            # A sample that does not decode is replaced by the next good one of the block (counted).
            for probe in range(len(samples)):
                name, data, label = samples[(position + probe) % len(samples)]
                try:
                    images.append(self.transform(data, generator))
                    labels.append(label)
                    break
                except BadImage as exc:
                    bad.append((name, exc.reason))
        reads = len(images) + len(bad)
        if not images:
            return None, None, reads, bad
        return torch.stack(images), torch.tensor(labels, dtype=torch.int64), reads, bad


class ShardEvalSamples(IterableDataset):
    """Validation: rank r scores its own unpadded share of the unshuffled stream; bad samples are dropped."""

    def __init__(self, index: PackedIndex, transform: Transform, *, rank: int, world_size: int, batch_size: int):
        self.index, self.transform, self.batch_size = index, transform, batch_size
        total = index.samples
        self.start, self.stop = total * rank // world_size, total * (rank + 1) // world_size

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        batches = math.ceil((self.stop - self.start) / self.batch_size)
        for batch in range(worker, batches, workers):
            lo = self.start + batch * self.batch_size
            hi = min(lo + self.batch_size, self.stop)
            images, labels, bad = [], [], []
            for name, label, pixels, reason in decode_range(self.index, lo, hi, self.transform):
                if pixels is None:
                    bad.append((name, reason))
                else:
                    images.append(pixels)
                    labels.append(label)
            reads = len(images) + len(bad)
            if not images:
                yield None, None, reads, bad
            else:
                yield torch.stack(images), torch.tensor(labels, dtype=torch.int64), reads, bad


class PackedImages(Dataset):
    """A packed dataset's samples by position in shard order, for a DataLoader with a batch sampler whose batches
    are runs of consecutive positions (scoring's): each batch is one sequential read from the nearest seek
    point, where a sample at a time would re-read the headers before it. Items are LabeledImages' with
    `substitute=False`: (pixels or None, position, bad reads); `names` (from `list_packed`) pins the order."""

    def __init__(self, index: PackedIndex, names: list[str], transform: Transform) -> None:
        self.index, self.transform = index, transform
        self.samples = [(name, position) for position, name in enumerate(names)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> tuple[torch.Tensor | None, int, list[BadRead]]:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: list[int]) -> list[tuple[torch.Tensor | None, int, list[BadRead]]]:
        first = positions[0]
        assert positions == list(range(first, first + len(positions))), "a batch of consecutive positions"
        items: list[tuple[torch.Tensor | None, int, list[BadRead]]] = []
        decoded = decode_range(self.index, first, first + len(positions), self.transform)
        for position, (name, _, pixels, reason) in enumerate(decoded, start=first):
            if name != self.samples[position][0]:
                raise ShardError(f"sample {position} is {name}, it was {self.samples[position][0]}: the pack changed")
            items.append((pixels, position, [] if pixels is not None else [(name, reason)]))
        if len(items) != len(positions):
            raise ShardError(f"samples {first}-{positions[-1]}: the shards hold fewer than the index lists")
        return items


def decode_range(
    index: PackedIndex, start: int, stop: int, transform: Transform
) -> Iterator[tuple[str, int, torch.Tensor | None, str]]:
    """(name, class index, pixels, "") for each of positions [start, stop) of the unshuffled stream; a sample
    that does not decode gives (name, class index, None, the reason)."""
    for seg in locate(index.shards, start, stop):
        for key, data, label in index.iter_samples(seg.shard, seg.skip, seg.count):
            name = sample_name(seg.shard.name, key)
            try:
                yield name, label, transform(data, None), ""
            except BadImage as exc:
                yield name, label, None, exc.reason


def as_is(batch: Batch) -> Batch:
    """collate_fn for loaders whose dataset yields whole batches."""
    return batch
