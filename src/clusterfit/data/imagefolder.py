"""ImageNet-layout folders (root/<class>/<image>): discovery, checks and DataLoaders."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision.datasets.folder import make_dataset
from torchvision.transforms import v2

from clusterfit.data.folders import IMG_EXTENSIONS


class LabeledImages(Dataset):
    """(path, label) pairs decoded by PIL and transformed to a uint8 CHW tensor."""

    def __init__(self, samples: list[tuple[str, int]], transform: v2.Transform) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label


def train_transform(image_size: int) -> v2.Transform:
    return v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])


def val_transform(image_size: int) -> v2.Transform:
    # The classic ImageNet evaluation: resize to size/0.875, then a centre crop.
    return v2.Compose([v2.PILToTensor(), v2.Resize(int(image_size / 0.875), antialias=True), v2.CenterCrop(image_size)])


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
    def __init__(self, loader: DataLoader, sampler: ResumableSampler, steps_per_epoch: int, batch_size: int) -> None:
        self.loader = loader
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.batch_size = batch_size

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_position(epoch, start_step * self.batch_size)
        yield from itertools.islice(self.loader, self.steps_per_epoch - start_step)
