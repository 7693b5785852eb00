"""Training and validation data for the worker: synthetic batches or ImageNet-layout folders.

Every source yields (uint8 NCHW images, int64 labels); normalisation happens on the device, where it is cheap.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler

from clusterfit.data.folders import DataFacts, steps_per_epoch
from clusterfit.data.imagefolder import (
    CountedBatches,
    FolderTrainData,
    KeptBatches,
    LabeledImages,
    ResumableSampler,
    ShardSampler,
    collate_labeled,
    list_samples,
    preprocessing_transform,
    train_transform,
)
from clusterfit.data.quality import BadRead
from clusterfit.data.shardreader import ShardEvalSamples, ShardTrainSamples, as_is
from clusterfit.data.shards import PackedIndex, is_packed, read_index, read_remote_index
from clusterfit.data.staging import credentials, is_url
from clusterfit.data.synthetic import SyntheticData
from clusterfit.outputs.model_card import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from clusterfit.spec.model import DataSpec, StorageSpec, TrainerSpec

NO_CREDENTIALS = StorageSpec()  # frozen: safe to share as a default


class TrainData(Protocol):
    steps_per_epoch: int

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def take_reads(self) -> tuple[int, list[BadRead]]:
        """Samples read since the last call, and the (file, reason) of each that could not be used."""
        ...


def loader_workers(data: DataSpec, local_world_size: int) -> int:
    return data.workers_per_rank(len(os.sched_getaffinity(0)), local_world_size)


def val_preprocessing(data: DataSpec) -> Preprocessing:
    """The job's validation transform (data.val_crop_size, data.val_resize_size), as its model card states it."""
    return Preprocessing.for_size(data.val_crop, data.val_resize_size)


def packed_index(location: str, storage: StorageSpec) -> PackedIndex | None:
    """The index of a packed dataset (local, or at a URL to stream from), or None for a folder of files."""
    if is_url(location):  # only mode: direct leaves URLs in the spec the trainer gets
        return read_remote_index(location, credentials(storage))
    return read_index(location) if is_packed(location) else None


def build_train_data(
    trainer: TrainerSpec,
    facts: DataFacts,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    pin_memory: bool,
    storage: StorageSpec = NO_CREDENTIALS,
) -> TrainData:
    # The loaders count batches: accumulate_steps of them make one optimizer step.
    steps = steps_per_epoch(trainer, facts, world_size) * trainer.accumulate_steps
    data = trainer.data
    if data.is_synthetic:
        return SyntheticData(
            image_size=data.train_crop,
            num_classes=len(facts.classes),
            batch_size=trainer.batch_size,
            rank=rank,
            world_size=world_size,
            steps_per_epoch=steps,
            seed=trainer.seed,
            batches_per_step=trainer.accumulate_steps,
        )
    workers = loader_workers(data, local_world_size)
    index = packed_index(data.train, storage)
    if index is not None:
        shards = ShardTrainSamples(
            index,
            train_transform(data.train_crop, trainer.resolved_augment()),
            seed=trainer.seed,
            rank=rank,
            world_size=world_size,
            batch_size=trainer.batch_size,
            steps_per_epoch=steps,
            block_steps=max(1, data.shuffle_buffer // trainer.batch_size),
        )
        # NOTE: not persistent: workers must copy the dataset's (epoch, start step) when an epoch starts.
        loader = DataLoader(shards, batch_size=None, num_workers=workers, pin_memory=pin_memory, collate_fn=as_is)
        return ShardTrainData(CountedBatches(loader), shards, steps)
    dataset = LabeledImages(
        list_samples(data.train, facts.classes),
        train_transform(data.train_crop, trainer.resolved_augment()),
        substitute=True,
    )
    sampler = ResumableSampler(
        DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=trainer.seed, drop_last=True)
    )
    loader = DataLoader(
        dataset,
        batch_size=trainer.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        collate_fn=collate_labeled,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(trainer.seed + rank),
    )
    return FolderTrainData(CountedBatches(loader), sampler, steps, trainer.batch_size)


def val_batch_size(trainer: TrainerSpec) -> int:
    """Twice the training batch: validation keeps no activations for a backward pass, so it fits wherever
    training fits, and larger batches run forward faster per image (ResNet-18 at 32 px on one CPU thread:
    828 images/s in batches of 16, 1,146 in batches of 32)."""
    return 2 * trainer.batch_size


# What a rank keeps of its validation share, decoded, to replay it at every later validation (KeptBatches):
# 256 MiB holds 1,780 images of 224 px, or an ImageNet validation share on 32 ranks; larger shares are read
# again each time, as before.
KEPT_VAL_BYTES = 256 * 2**20


def build_val_loader(
    trainer: TrainerSpec,
    facts: DataFacts,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    pin_memory: bool,
    storage: StorageSpec = NO_CREDENTIALS,
) -> CountedBatches | KeptBatches | None:
    """Each rank scores its own unpadded share; unreadable files are dropped (and counted), never replaced."""
    data = trainer.data
    if data.val is None:
        return None
    transform = preprocessing_transform(val_preprocessing(data))
    workers = loader_workers(data, local_world_size)
    index = packed_index(data.val, storage)
    if index is not None:
        keep = _fits_in_memory(index.samples, world_size, data.val_crop)
        shards = ShardEvalSamples(
            index,
            transform,
            rank=rank,
            world_size=world_size,
            batch_size=val_batch_size(trainer),
        )
        loader = DataLoader(shards, batch_size=None, num_workers=workers, pin_memory=pin_memory, collate_fn=as_is)
    else:
        dataset = LabeledImages(list_samples(data.val, facts.classes), transform, substitute=False)
        keep = _fits_in_memory(len(dataset), world_size, data.val_crop)
        loader = DataLoader(
            dataset,
            batch_size=val_batch_size(trainer),
            sampler=ShardSampler(len(dataset), rank, world_size),
            num_workers=workers,
            pin_memory=pin_memory,
            collate_fn=collate_labeled,
            # Kept between validations unless the batches are: starting workers anew cost more than a small
            # validation set's decoding.
            persistent_workers=workers > 0 and not keep,
        )
    return KeptBatches(CountedBatches(loader)) if keep else CountedBatches(loader)


def _fits_in_memory(samples: int, world_size: int, crop: int) -> bool:
    """Whether a rank's share of `samples` validation images, decoded to uint8 crops, fits KEPT_VAL_BYTES."""
    return math.ceil(samples / world_size) * 3 * crop * crop <= KEPT_VAL_BYTES


class ShardTrainData:
    def __init__(self, loader: CountedBatches, shards: ShardTrainSamples, steps_per_epoch: int) -> None:
        self.loader, self.shards, self.steps_per_epoch = loader, shards, steps_per_epoch

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.shards.set_position(epoch, start_step)
        yield from self.loader

    def take_reads(self) -> tuple[int, list[BadRead]]:
        return self.loader.take_reads()


Triple = tuple[float, float, float]


@functools.cache
def _mean_std(device: torch.device, mean: Triple, std: Triple) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: made once per device. Building them every step copies from pageable host memory, which on CUDA
    # waits for all queued GPU work and so stalls the training loop once per step.
    return (
        torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255,
        torch.tensor(std, device=device).view(1, 3, 1, 1) * 255,
    )


def normalize_on_device(
    images: torch.Tensor,
    device: torch.device,
    channels_last: bool,
    mean: Triple = IMAGENET_MEAN,
    std: Triple = IMAGENET_STD,
) -> torch.Tensor:
    """uint8 NCHW on the host -> normalised float on the device; the copy moves 4x fewer bytes than float.
    `mean`/`std` per channel on the [0, 1] scale (scoring passes its model card's)."""
    mean, std = _mean_std(device, tuple(mean), tuple(std))
    out = (images.to(device, non_blocking=True).float() - mean) / std
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out
