"""Synthetic images: a few fixed batches reused every step, like the classic synthetic benchmark mode."""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Distinct batches kept in memory; enough that consecutive steps do not see the same images.
_DISTINCT_BATCHES = 4


class SyntheticData:
    """Each global batch is made from the seed alone and sliced by rank, so 2 ranks x batch b see
    exactly the images 1 rank x batch 2b would see (and 1 rank x batch b accumulating 2 batches per step)."""

    def __init__(
        self,
        *,
        image_size: int,
        num_classes: int,
        batch_size: int,
        rank: int,
        world_size: int,
        steps_per_epoch: int,
        seed: int,
        batches_per_step: int = 1,
    ) -> None:
        self.steps_per_epoch = steps_per_epoch
        global_batch = batch_size * world_size
        self._batches = []
        # With gradient accumulation, the cycle spans whole optimizer steps: step s sees the images it would
        # see without accumulation, however its batches are split.
        for batch_index in range(_DISTINCT_BATCHES * batches_per_step):
            first = batch_index * global_batch + rank * batch_size
            self._batches.append(_make_batch(range(first, first + batch_size), image_size, num_classes, seed))

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(start_step, self.steps_per_epoch):
            yield self._batches[step % len(self._batches)]

    def take_reads(self) -> tuple[int, list[tuple[str, str]]]:
        return 0, []  # generated, never read from files


def _make_batch(sample_ids: range, image_size: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for sample_id in sample_ids:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sample_id)
        images.append(torch.randint(0, 256, (3, image_size, image_size), generator=gen, dtype=torch.uint8))
        labels.append(torch.randint(0, num_classes, (), generator=gen))
    return torch.stack(images), torch.stack(labels)
