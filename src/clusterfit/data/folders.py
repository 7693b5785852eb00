"""ImageNet-layout folders (root/<class>/<image>) checked without importing torch, so the launcher stays light."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusterfit.errors import DataError, SpecError
from clusterfit.spec.model import DataSpec, StorageSpec, TrainerSpec

# The extensions torchvision's ImageFolder accepts.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class FolderInfo:
    classes: list[str]
    image_count: int


@dataclass(frozen=True)
class DataFacts:
    """What the trainer must know about the data before building the model."""

    classes: list[str]
    train_images: int | None  # None: at a URL, known once staged
    val_images: int


def inspect_folder(root: str, field: str) -> FolderInfo:
    """Check that `root` is an ImageNet-layout folder or a packed dataset; every problem becomes a one-line
    DataError (a SpecError when the spec names the folder above the data)."""
    from clusterfit.data.shards import inspect_packed, is_packed  # shards imports this module

    if is_packed(root):
        classes, samples = inspect_packed(root, field)
        return FolderInfo(classes=classes, image_count=samples)
    path = Path(root)
    if not path.exists():
        raise DataError(
            f"{field} = {root!r}: no such folder; give an ImageNet-layout folder (<class>/<image>.jpg)", retryable=False
        )
    if not path.is_dir():
        raise DataError(
            f"{field} = {root!r}: is a file; give a folder of class subfolders (<class>/<image>.jpg)", retryable=False
        )
    classes = sorted(entry.name for entry in path.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise DataError(
            f"{field} = {root!r}: has no class subfolders; expected {root}/<class>/<image>.jpg", retryable=False
        )
    if classes == ["train"] or set(classes) >= {"train", "val"}:  # the data is there; the spec points above it
        raise SpecError(f"{field} = {root!r}: holds a train/ folder; point {field} at {root.rstrip('/')}/train")
    count = sum(1 for cls in classes for f in (path / cls).iterdir() if f.suffix.lower() in IMG_EXTENSIONS)
    if count == 0:
        raise DataError(
            f"{field} = {root!r}: its class folders hold no images ({', '.join(IMG_EXTENSIONS)})", retryable=False
        )
    return FolderInfo(classes=classes, image_count=count)


@dataclass(frozen=True)
class ScoreInputs:
    # A folder's files sorted, relative to it, with / between parts; a packed dataset's samples in shard order,
    # named SHARD:KEY.jpg.
    files: list[str]
    labels: list[str] | None  # each file's class (folder) when the input has classes, else None


def list_score_inputs(root: str, field: str) -> ScoreInputs:
    """The images to score: an ImageNet-layout folder (labels from the class folders), a flat folder of images,
    or a packed dataset (`clusterfit data pack`). A missing or empty one is a one-line DataError naming `field`."""
    from clusterfit.data.shards import is_packed, list_packed  # shards imports this module

    if is_packed(root):
        return ScoreInputs(*list_packed(root, field))
    path = Path(root)
    if not path.is_dir():
        what = "is a file" if path.exists() else "no such folder"
        raise DataError(
            f"{field} = {root!r}: {what}; give a folder of images, or of class folders (<class>/<image>.jpg)",
            retryable=False,
        )
    flat = sorted(f.name for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS)
    classes = sorted(e.name for e in path.iterdir() if e.is_dir() and not e.name.startswith("."))
    nested = [
        (f"{cls}/{f.name}", cls)
        for cls in classes
        for f in sorted((path / cls).iterdir())
        if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS
    ]
    if flat and nested:
        raise DataError(
            f"{field} = {root!r}: holds both images and class folders of images; score one layout at a time "
            "(move the loose images into a folder of their own)",
            retryable=False,
        )
    if nested:
        return ScoreInputs([file for file, _ in nested], [label for _, label in nested])
    if flat:
        return ScoreInputs(flat, None)
    raise DataError(
        f"{field} = {root!r}: holds no images ({', '.join(IMG_EXTENSIONS)}), directly or in class folders; "
        "give a folder of images",
        retryable=False,
    )


def inspect_data(data: DataSpec, storage: StorageSpec | None = None) -> DataFacts:
    """Check the spec's data against the file system (or, for URLs, the storage service's listing); raises
    DataError for data that is missing or unusable, SpecError where the spec says something the data denies."""
    if data.is_synthetic:
        assert data.num_classes is not None
        return DataFacts([str(i) for i in range(data.num_classes)], data.synthetic_images, 0)
    from clusterfit.data.staging import is_url

    storage = storage or StorageSpec()
    if is_url(data.train):
        classes, count = _remote(data, "train", storage)
        val_images = _remote(data, "val", storage)[1] if data.val is not None and is_url(data.val) else 0
        return DataFacts(classes, count, val_images or 0)
    train = inspect_folder(data.train, "trainer.data.train")
    if data.num_classes is not None and data.num_classes != len(train.classes):
        raise SpecError(
            f"trainer.data.num_classes = {data.num_classes}: {data.train} has {len(train.classes)} class folders; "
            "remove num_classes or make them agree"
        )
    val_images = 0
    if data.val is not None and is_url(data.val):
        val_images = _remote(data, "val", storage)[1] or 0
    elif data.val is not None:
        val = inspect_folder(data.val, "trainer.data.val")
        unknown = sorted(set(val.classes) - set(train.classes))
        if unknown:
            raise DataError(
                f"trainer.data.val: classes {unknown[:5]} are not in trainer.data.train; they cannot be scored",
                retryable=False,
            )
        val_images = val.image_count
    return DataFacts(train.classes, train.image_count, val_images)


def _remote(data: DataSpec, name: str, storage: StorageSpec) -> tuple[list[str], int | None]:
    """(classes, samples or None for loose files) of trainer.data.<name> at a URL, from one listing."""
    from clusterfit.data.staging import remote_summary

    url = getattr(data, name)
    classes, count = remote_summary(url, storage, f"trainer.data.{name}")
    if data.mode == "direct" and count is None:
        raise SpecError(
            f"trainer.data.{name} = {url!r}: mode direct streams packed shards only, and this is a folder of "
            "loose files; use mode: download, or pack it first (clusterfit data pack)"
        )
    return classes, count


def steps_per_epoch(trainer: TrainerSpec, facts: DataFacts, world_size: int) -> int:
    """Optimizer steps per epoch; each takes `accumulate_steps` batches on every worker."""
    global_batch = trainer.batch_size * world_size * trainer.accumulate_steps
    if facts.train_images is None:
        raise ValueError("the training data must be staged before its steps can be counted")
    full = facts.train_images // global_batch
    if full == 0:
        accumulating = f" x {trainer.accumulate_steps} accumulated batches" if trainer.accumulate_steps > 1 else ""
        raise SpecError(
            f"trainer.batch_size = {trainer.batch_size}: {world_size} workers{accumulating} need {global_batch} "
            f"images per step but the training data has {facts.train_images}; lower batch_size or the worker count"
        )
    return min(full, trainer.steps_per_epoch) if trainer.steps_per_epoch else full
