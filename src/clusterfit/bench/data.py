"""`clusterfit bench data`: how many training images one CPU core prepares per second.

The work measured is what every training sample costs on the host: read, decode, RandomResizedCrop(224) and a
horizontal flip, collated into batches. Three pipelines run side by side on the same photographs, each in this
one process with one thread (`num_workers=0`), so images per CPU-second is images/s per core:

- baseline: torchvision `ImageFolder` + the PIL transforms of torchvision's reference ImageNet recipe
  (RandomResizedCrop, RandomHorizontalFlip, PILToTensor, ConvertImageDtype, Normalize);
- folder: clusterfit's folder reader (crop chosen from the header, DCT-scaled decode, one resize, uint8);
- shards: the same reader on a packed dataset (`clusterfit data pack` with its default --max-side).

The photographs are scikit-learn's two sample photos (`pip install clusterfit[bench]`), re-encoded at
ImageNet-like sizes as JPEG q=90 from random crops, flips and rescales, written into a temp folder.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from clusterfit.bench.machine import cpu_model
from clusterfit.data.imagefolder import LabeledImages, collate_labeled, list_samples, train_transform
from clusterfit.data.loaders import IMAGENET_MEAN, IMAGENET_STD
from clusterfit.data.shardreader import ShardTrainSamples, as_is
from clusterfit.data.shards import pack_folder, read_index
from clusterfit.spec.errors import SpecError

# (width, height) of the generated photos, in turn: mostly ImageNet's typical 500x375, some larger.
PHOTO_SIZES = ((500, 375), (500, 375), (375, 500), (500, 333), (640, 480), (800, 600), (1024, 768))
JPEG_QUALITY = 90


@dataclass(frozen=True, kw_only=True)
class DataBenchConfig:
    images: int = 400
    batch_size: int = 32
    image_size: int = 224
    max_side: int = 320  # `clusterfit data pack`'s default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.images < self.batch_size:
            raise SpecError(f"--images {self.images}: fewer than one batch of {self.batch_size}; raise --images")


@dataclass(frozen=True)
class PipelineResult:
    name: str
    images: int
    wall_s: float
    cpu_s: float

    @property
    def images_per_core_s(self) -> float:
        return self.images / max(self.cpu_s, 1e-9)

    @property
    def images_per_s(self) -> float:
        return self.images / max(self.wall_s, 1e-9)


@dataclass
class DataBenchReport:
    config: DataBenchConfig
    machine: str
    photos_mb: float
    packed_mb: float
    pack_s: float
    results: list[PipelineResult] = field(default_factory=list)

    def ratio(self, result: PipelineResult) -> float:
        return result.images_per_core_s / self.results[0].images_per_core_s

    def markdown(self) -> str:
        c = self.config
        lines = [
            f"machine: {self.machine}",
            f"{c.images} photos ({self.photos_mb:.1f} MB of JPEG q={JPEG_QUALITY}), batch {c.batch_size}, "
            f"crop {c.image_size}; packed at --max-side {c.max_side}: {self.packed_mb:.1f} MB in {self.pack_s:.1f} s",
            "",
            "| pipeline | images/s/core | images/s (1 process) | vs baseline |",
            "|---|---:|---:|---:|",
        ]
        for r in self.results:
            lines.append(f"| {r.name} | {r.images_per_core_s:.1f} | {r.images_per_s:.1f} | {self.ratio(r):.2f}x |")
        return "\n".join(lines)


def machine_description() -> str:
    model = cpu_model()
    import PIL
    import torchvision

    cores = len(os.sched_getaffinity(0))
    return (
        f"{model}, {cores} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, Pillow {PIL.__version__}"
    )


def sample_photos() -> list[np.ndarray]:
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        raise SpecError(
            "clusterfit bench data needs scikit-learn's sample photos: pip install 'clusterfit[bench]'"
        ) from None
    return list(load_sample_images().images)


def make_photos(root: Path, count: int, seed: int = 0, sizes: Sequence[tuple[int, int]] = PHOTO_SIZES) -> Path:
    """An ImageNet-layout folder of `count` JPEGs (one class per source photo): random crops, flips and
    rescales of the sample photos at `sizes` (width, height), in turn."""
    rng = np.random.default_rng(seed)
    sources = [Image.fromarray(pixels) for pixels in sample_photos()]
    for index in range(count):
        label = index % len(sources)
        source = sources[label]
        width, height = sizes[index % len(sizes)]
        # The largest crop of the target's aspect ratio, shrunk to 60-100 % of its side, anywhere in the photo.
        fit = min(source.width / width, source.height / height) * rng.uniform(0.6, 1.0)
        crop_w, crop_h = int(width * fit), int(height * fit)
        left = int(rng.integers(0, source.width - crop_w + 1))
        top = int(rng.integers(0, source.height - crop_h + 1))
        photo = source.resize((width, height), Image.Resampling.LANCZOS, box=(left, top, left + crop_w, top + crop_h))
        if rng.random() < 0.5:
            photo = photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        folder = root / f"photo_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        photo.save(folder / f"{index:05d}.jpg", quality=JPEG_QUALITY)
    return root


def baseline_batches(root: Path, config: DataBenchConfig) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(config.image_size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.RandomHorizontalFlip(0.5),
            transforms.PILToTensor(),
            transforms.ConvertImageDtype(torch.float),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(root), transform=transform)
    return DataLoader(dataset, batch_size=config.batch_size, shuffle=True, drop_last=True, num_workers=0)


def folder_batches(root: Path, config: DataBenchConfig) -> Iterable[tuple[torch.Tensor, ...]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    dataset = LabeledImages(list_samples(str(root), classes), train_transform(config.image_size), substitute=True)
    return DataLoader(
        dataset, batch_size=config.batch_size, shuffle=True, drop_last=True, num_workers=0, collate_fn=collate_labeled
    )


def shard_batches(packed: Path, config: DataBenchConfig) -> Iterable[tuple[torch.Tensor, ...]]:
    index = read_index(packed)
    dataset = ShardTrainSamples(
        index,
        train_transform(config.image_size),
        seed=config.seed,
        rank=0,
        world_size=1,
        batch_size=config.batch_size,
        steps_per_epoch=index.samples // config.batch_size,
        block_steps=max(1, 2048 // config.batch_size),  # the default shuffle_buffer
    )
    dataset.set_position(0, 0)
    return DataLoader(dataset, batch_size=None, num_workers=0, collate_fn=as_is)


def measure(name: str, batches: Iterable[tuple[torch.Tensor, ...]]) -> PipelineResult:
    """One epoch in this process; CPU time is this process's own (user + system)."""
    images = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        images += batch[0].shape[0]
    return PipelineResult(name, images, time.perf_counter() - wall, time.process_time() - cpu)


def run_data_bench(config: DataBenchConfig, workdir: Path | None = None) -> DataBenchReport:
    with tempfile.TemporaryDirectory(prefix="clusterfit-bench-") as tmp:
        root = Path(workdir or tmp)
        photos = make_photos(root / "photos", config.images, config.seed)
        started = time.perf_counter()
        pack_folder(str(photos), str(root / "packed"), max_side=config.max_side, seed=config.seed)
        pack_s = time.perf_counter() - started
        report = DataBenchReport(config, machine_description(), _mb(photos), _mb(root / "packed"), pack_s)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core per pipeline: images per CPU-second is images/s per core
        try:
            torch.manual_seed(config.seed)
            report.results.append(measure("torchvision ImageFolder + PIL transforms", baseline_batches(photos, config)))
            torch.manual_seed(config.seed)
            report.results.append(measure("clusterfit folder reader", folder_batches(photos, config)))
            report.results.append(
                measure(f"clusterfit shards (--max-side {config.max_side})", shard_batches(root / "packed", config))
            )
        finally:
            torch.set_num_threads(threads)
    return report


def _mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
