"""ImageNet-layout folders (root/<class>/<image>): discovery, checks and DataLoaders."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchvision.datasets.folder import make_dataset

from clusterfit.data.decode import BadImage
from clusterfit.data.folders import IMG_EXTENSIONS
from clusterfit.data.quality import BadInputError, BadRead
from clusterfit.data.transforms import CenterCrop, TrainCrop, TrainTransform
from clusterfit.outputs.model_card import VAL_CROP_FRACTION, Preprocessing
from clusterfit.spec.model import ResolvedAugment

# How many other samples a training item tries before giving up; enough for any dataset whose bad share is
# under the job's threshold, and bounded so that a folder of nothing but bad files fails fast.
_SUBSTITUTE_TRIES = 64


class LabeledImages(Dataset):
    """(path, label) pairs -> (uint8 CHW tensor | None, label, bad reads).

    A file that cannot be decoded never stops the job. It is recorded as a bad read (file, reason), and
    then either replaced by another sample (`substitute=True`, for training: every batch keeps its size,
    so ranks stay in step) or dropped (`substitute=False`, for validation: no image is counted twice)."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable[[str], torch.Tensor], substitute: bool):
        self.samples = samples
        self.transform = transform
        self.substitute = substitute
        # A step coprime with the length visits every sample before repeating one.
        self._stride = next(s for s in range(7919, 7919 + len(samples) + 2) if math.gcd(s, max(1, len(samples))) == 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, int, list[BadRead]]:
        bad: list[BadRead] = []
        tries = min(_SUBSTITUTE_TRIES, len(self.samples)) if self.substitute else 1
        for attempt in range(tries):
            path, label = self.samples[(index + attempt * self._stride) % len(self.samples)]
            try:
                return self.transform(path), label, bad
            except BadImage as exc:
                bad.append((path, exc.reason))
        if not self.substitute:
            return None, self.samples[index][1], bad
        raise BadInputError(
            f"none of {tries} samples tried in a row could be decoded ({bad[0][0]}: {bad[0][1]}, ...); "
            "check the data folder"
        )


def collate_labeled(
    items: list[tuple[torch.Tensor | None, int, list[BadRead]]],
) -> tuple[torch.Tensor | None, torch.Tensor | None, int, list[BadRead]]:
    """Stack the good samples; pass on how many reads were made and which failed, for the main process."""
    good = [(image, label) for image, label, _ in items if image is not None]
    bad = [read for _, _, reads in items for read in reads]
    reads = len(good) + len(bad)
    if not good:
        return None, None, reads, bad
    return torch.stack([g[0] for g in good]), torch.tensor([g[1] for g in good], dtype=torch.int64), reads, bad


class CountedBatches:
    """Iterates a loader of `collate_labeled` batches as (images, labels), keeping the read counts until
    the trainer takes them: this runs in the rank's main process, so counts from every DataLoader worker
    arrive here with their batches."""

    def __init__(self, loader: Iterable[tuple[torch.Tensor | None, torch.Tensor | None, int, list[BadRead]]]):
        self.loader = loader
        self._reads = 0
        self._bad: list[BadRead] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels, reads, bad in self.loader:
            self._reads += reads
            self._bad.extend(bad)
            if images is not None and labels is not None:
                yield images, labels

    def take_reads(self) -> tuple[int, list[BadRead]]:
        """Reads and bad reads since the last call."""
        reads, bad = self._reads, self._bad
        self._reads, self._bad = 0, []
        return reads, bad


class KeptBatches:
    """Validation batches read once, then replayed from memory: the validation transform is deterministic, so
    every later validation would decode the same files into the same tensors. For validation sets whose decoded
    share fits `KEPT_VAL_BYTES` (tf.data's `cache()`, chosen here by size): a small job that validates after
    every epoch of seconds otherwise spends part of each validation waiting for its loader. A pass cut short
    keeps nothing; a replay reads no file, so it counts no reads."""

    def __init__(self, batches: CountedBatches) -> None:
        self.batches = batches
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._kept is not None:
            yield from self._kept
            return
        kept = []
        for batch in self.batches:
            kept.append(batch)
            yield batch
        self._kept = kept

    def take_reads(self) -> tuple[int, list[BadRead]]:
        return self.batches.take_reads()


def train_transform(train_crop: int, augment: ResolvedAugment | None = None) -> TrainTransform:
    """The job's augmentation (`trainer.augment`, resolved for its training crop); ImageNet's without one."""
    if augment is None:
        return TrainTransform(TrainCrop(train_crop))
    crop = TrainCrop(train_crop, augment.crop_scale, augment.crop_ratio, augment.flip)
    return TrainTransform(crop, augment.policy, augment.random_erasing)


def val_transform(image_size: int, crop_fraction: float = VAL_CROP_FRACTION) -> CenterCrop:
    """A centre crop of `crop_fraction` of the shorter side, resized to `image_size`."""
    return CenterCrop(image_size, crop_fraction)


def preprocessing_transform(preprocessing: Preprocessing) -> CenterCrop:
    """The validation transform a model card states: what validation ran, and what scoring and serving run."""
    return val_transform(preprocessing.center_crop, preprocessing.crop_fraction)


def list_samples(root: str, classes: list[str]) -> list[tuple[str, int]]:
    class_to_idx = {name: index for index, name in enumerate(classes)}
    present = {entry.name for entry in Path(root).iterdir() if entry.is_dir()}
    return make_dataset(root, {c: i for c, i in class_to_idx.items() if c in present}, IMG_EXTENSIONS, allow_empty=True)


class ResumableSampler(Sampler[int]):
    """A DistributedSampler whose epoch can start part-way, so a resumed job skips what it already saw."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self.skip = 0

    def set_position(self, epoch: int, skip_samples: int) -> None:
        self.sampler.set_epoch(epoch)
        self.skip = skip_samples

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


class ShardSampler(Sampler[int]):
    """Every rank takes every world_size-th sample, with no padding, so each sample is counted once."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class FolderTrainData:
    def __init__(self, loader: CountedBatches, sampler: ResumableSampler, steps_per_epoch: int, batch_size: int):
        self.loader = loader
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.batch_size = batch_size

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_position(epoch, start_step * self.batch_size)
        yield from itertools.islice(self.loader, self.steps_per_epoch - start_step)

    def take_reads(self) -> tuple[int, list[BadRead]]:
        return self.loader.take_reads()
