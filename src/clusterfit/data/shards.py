"""Packed datasets: an ImageNet-layout folder turned into tar shards, plus an index. No torch here: the
launcher checks packed datasets and `clusterfit data pack` writes them without it.

A packed dataset is a folder holding `index.json` and `shard-NNNNNN.tar` files. The shards follow
WebDataset's naming (members `KEY.jpg` + `KEY.cls`, the class index as text, consecutive per sample), so
webdataset and other tar-shard readers can read them too. Samples are shuffled once when packing, so every
shard mixes all classes; the trainer shuffles the shard order and a buffer of samples every epoch.

The index also lists, per shard, the byte offset of every `SEEK_EVERY`-th sample: a reader that starts in the
middle of a shard seeks close to its first sample instead of reading every header before it, which matters when
shards are streamed from object storage (`mode: direct`) by ranged reads.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import tarfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from PIL import Image

from clusterfit.data.decode import BadImage, decode_rgb, open_image
from clusterfit.data.folders import IMG_EXTENSIONS, inspect_folder
from clusterfit.errors import DataError, SpecError
from clusterfit.files import write_atomically
from clusterfit.storage.checksums import sha256_of

INDEX = "index.json"
INDEX_FORMAT = "clusterfit-shards/1"
SHARD_NAME = "shard-{:06d}.tar"
_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_JPEG_QUALITY = 90
SEEK_EVERY = 64  # samples between recorded seek points
_REMOTE_BLOCK = 4 << 20  # bytes fetched per ranged read when streaming a shard


class ShardError(ValueError):
    """A packed dataset that cannot be used as it is; one line naming the shard and the problem."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str
    seek: tuple[int, ...] = ()  # byte offset of samples 0, SEEK_EVERY, 2 * SEEK_EVERY, ... (older packs: none)


class LocalShards:
    """Shards in a local folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def open(self, name: str) -> BinaryIO:
        return open(self.root / name, "rb")  # noqa: SIM115 - the caller closes it

    def __str__(self) -> str:
        return str(self.root)


class RemoteShards:
    """Shards at an fsspec URL, streamed by ranged reads (`mode: direct`). Picklable for DataLoader workers:
    each process opens its own filesystem (a client made before a fork must not be used after it)."""

    def __init__(self, url: str, creds: Any) -> None:
        self.url, self.creds = url.rstrip("/"), creds
        self._fs: tuple[int, Any, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    def filesystem(self) -> tuple[Any, str]:
        from clusterfit.storage.filesystems import open_filesystem

        if self._fs is None or self._fs[0] != os.getpid():
            fs, root = open_filesystem(self.url, self.creds)
            self._fs = (os.getpid(), fs, root)
        return self._fs[1], self._fs[2]

    def open(self, name: str) -> BinaryIO:
        fs, root = self.filesystem()
        # NOTE: readahead: a shard is read front to back, so each ranged read fetches the next block too.
        return fs.open(f"{root}/{name}", "rb", block_size=_REMOTE_BLOCK, cache_type="readahead")

    def read_text(self, name: str) -> str:
        fs, root = self.filesystem()
        return fs.cat_file(f"{root}/{name}").decode()

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class PackedIndex:
    source: LocalShards | RemoteShards
    classes: list[str]
    samples: int
    shards: list[ShardInfo]
    seek_every: int = 0
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def root(self) -> Path:
        assert isinstance(self.source, LocalShards), "a streamed dataset has no local folder"
        return self.source.root

    def shard_path(self, shard: ShardInfo) -> Path:
        return self.root / shard.name

    def iter_samples(
        self, shard: ShardInfo, skip: int = 0, limit: int | None = None
    ) -> Iterator[tuple[str, bytes, int]]:
        """(key, image bytes, class index) of samples skip .. skip+limit of `shard`, wherever it is stored."""
        with self.source.open(shard.name) as f:
            yield from iter_samples(f, skip, limit, seek=shard.seek, seek_every=self.seek_every, name=shard.name)

    def iter_labels(self, shard: ShardInfo) -> Iterator[tuple[str, int]]:
        """(key, class index) of every sample of `shard`: member headers and the small .cls members only, no
        image is read."""
        with self.source.open(shard.name) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for key, parts in _grouped(tar, shard.name):
                yield key, _label(tar, shard.name, key, parts)


def is_packed(root: str | Path) -> bool:
    return (Path(root) / INDEX).is_file()


def read_index(root: str | Path) -> PackedIndex:
    path = Path(root) / INDEX
    try:
        text = path.read_text()
    except OSError as exc:
        raise ShardError(f"{path}: not a packed-dataset index ({exc}); pack the folder again") from None
    return parse_index(text, LocalShards(root), str(path))


def read_remote_index(url: str, creds: Any) -> PackedIndex:
    """The index of a packed dataset at a URL; its shards are streamed when read (`mode: direct`)."""
    source = RemoteShards(url, creds)
    try:
        text = source.read_text(INDEX)
    except Exception as exc:  # noqa: BLE001 - every storage backend raises its own types
        from clusterfit.storage.filesystems import say

        raise ShardError(f"{url}/{INDEX}: {say(exc, creds)}") from None
    return parse_index(text, source, f"{url}/{INDEX}")


def parse_index(text: str, source: LocalShards | RemoteShards, where: str) -> PackedIndex:
    try:
        raw = json.loads(text)
        shards = [
            ShardInfo(s["name"], int(s["samples"]), int(s["bytes"]), s["sha256"], tuple(map(int, s.get("seek", ()))))
            for s in raw["shards"]
        ]
        index = PackedIndex(
            source, list(raw["classes"]), int(raw["samples"]), shards, int(raw.get("seek_every", 0)), raw
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardError(f"{where}: not a packed-dataset index ({exc}); pack the folder again") from None
    for shard in shards:
        if "/" in shard.name or shard.name.startswith(".") or not shard.name.endswith(".tar"):
            raise ShardError(f"{where}: shard name {shard.name!r} is not a plain NAME.tar in the dataset folder")
    return index


# ---------------------------------------------------------------------------------------------- reading


def member_key(name: str, shard: str) -> tuple[str, str]:
    """`KEY.ext` -> (KEY, ext); any path, absolute name or `..` is refused: members never leave the shard."""
    if "/" in name or "\\" in name or name.startswith(".") or ".." in name:
        raise ShardError(f"{shard}: member {name!r} has a path that escapes the shard; refusing this shard")
    key, dot, ext = name.partition(".")
    if not dot or not _KEY.match(key):
        raise ShardError(f"{shard}: member {name!r} is not named KEY.ext; refusing this shard")
    return key, ext


def iter_samples(
    source: Path | BinaryIO,
    skip: int = 0,
    limit: int | None = None,
    *,
    seek: Sequence[int] = (),
    seek_every: int = 0,
    name: str | None = None,
) -> Iterator[tuple[str, bytes, int]]:
    """(key, image bytes, class index) for samples skip .. skip+limit of one shard (a path or an open file),
    in shard order.

    Reading starts at the last seek point before `skip`; the samples between cost only header reads."""
    name = name or (source.name if isinstance(source, Path) else "shard")
    point = min(skip // seek_every, len(seek) - 1) if seek and seek_every else 0
    skip -= point * seek_every
    end = math.inf if limit is None else skip + limit
    with ExitStack() as stack:
        f = stack.enter_context(open(source, "rb")) if isinstance(source, Path) else source
        f.seek(seek[point] if point else 0)
        # NOTE: a TarFile opened on a file positioned at a member header reads on from there.
        tar = stack.enter_context(tarfile.open(fileobj=f, mode="r:"))
        yield from _members(tar, name, skip, end)


def _members(tar: tarfile.TarFile, name: str, skip: int, end: float) -> Iterator[tuple[str, bytes, int]]:
    for position, (key, parts) in enumerate(_grouped(tar, name)):
        if position >= skip:
            label = _label(tar, name, key, parts)  # first: it checks that both members are there
            yield key, _read_member(tar, parts["jpg"], name), label
        if position + 1 >= end:
            return


def _grouped(tar: tarfile.TarFile, name: str) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) of each sample in shard order; a sample's members are consecutive, so each
    is complete when the next key starts (its data is read from there by seeking back)."""
    current, parts = None, {}
    for member in tar:
        if not member.isfile():
            raise ShardError(f"{name}: member {member.name!r} is not a regular file; refusing this shard")
        key, ext = member_key(member.name, name)
        if key != current:
            if current is not None:
                yield current, parts
            current, parts = key, {}
        parts[ext] = member
    if current is not None:
        yield current, parts


def _label(tar: tarfile.TarFile, shard: str, key: str, parts: dict[str, tarfile.TarInfo]) -> int:
    if "jpg" not in parts or "cls" not in parts:
        raise ShardError(f"{shard}: sample {key!r} lacks a .jpg or .cls member")
    text = _read_member(tar, parts["cls"], shard).decode(errors="replace").strip()
    if not text.isdigit():
        raise ShardError(f"{shard}: sample {key!r} has class {text[:40]!r} in its .cls member; expected a class index")
    return int(text)


def sample_name(shard: str, key: str) -> str:
    """How a packed sample is named to people (skipped-file reports, predictions): `shard-000003.tar:KEY.jpg`."""
    return f"{shard}:{key}.jpg"


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, shard: str) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise ShardError(f"{shard}: member {member.name!r} has no data")
    return handle.read()


def check_members(path: Path) -> int:
    """Read every member header of a shard (no data); returns the sample count, raises ShardError."""
    keys: set[str] = set()
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                raise ShardError(f"{path.name}: member {member.name!r} is not a regular file; refusing this shard")
            keys.add(member_key(member.name, path.name)[0])
    return len(keys)


_EMPTY = "the packed dataset holds no samples"


@contextmanager
def _one_line(field_name: str, root: str) -> Iterator[None]:
    """A packed dataset's problems as one-line DataErrors naming the field and the folder."""
    try:
        yield
    except (ShardError, tarfile.TarError, OSError) as exc:
        raise DataError(f"{field_name} = {root!r}: {' '.join(str(exc).split())}", retryable=False) from None


def inspect_packed(root: str, field_name: str) -> tuple[list[str], int]:
    """Check a packed dataset before training: index, shard sizes, member names. Returns (classes, samples)."""
    with _one_line(field_name, root):
        index = read_index(root)
        for shard in index.shards:
            path = index.shard_path(shard)
            if not path.is_file():
                raise ShardError(f"shard {shard.name} is missing")
            if path.stat().st_size != shard.bytes:
                raise ShardError(f"shard {shard.name} has {path.stat().st_size} bytes, the index says {shard.bytes}")
            if check_members(path) != shard.samples:
                raise ShardError(f"shard {shard.name} does not hold the {shard.samples} samples the index lists")
        if index.samples == 0:
            raise ShardError(_EMPTY)
    return index.classes, index.samples


def list_packed(root: str, field_name: str) -> tuple[list[str], list[str]]:
    """Every sample's name (`sample_name`) and class, in shard order: what a scoring job scores. Reads the member
    headers and .cls members of every shard, no image."""
    with _one_line(field_name, root):
        index = read_index(root)
        samples = [(shard, key, label) for shard in index.shards for key, label in index.iter_labels(shard)]
        if len(samples) != index.samples:
            raise ShardError(f"the shards hold {len(samples)} samples, the index lists {index.samples}")
        unknown = sorted({label for _, _, label in samples if not 0 <= label < len(index.classes)})
        if unknown:
            raise ShardError(f"class indices {unknown[:5]} are not among the index's {len(index.classes)} classes")
        if not samples:
            raise ShardError(_EMPTY)
    return [sample_name(shard.name, key) for shard, key, _ in samples], [index.classes[label] for *_, label in samples]


# ---------------------------------------------------------------------------------------------- packing


@dataclass
class PackReport:
    samples: int = 0
    shards: int = 0
    bytes: int = 0
    kept_original: int = 0
    seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def parse_size(text: str) -> int:
    """'256MB' -> bytes; K/M/G (powers of 1000) or KiB/MiB/GiB (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not match:
        raise ValueError(f"--shard-size {text!r}: expected a size such as 256MB or 1GiB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


def encode_sample(path: str, max_side: int) -> bytes:
    """JPEG bytes with the longer side at most `max_side`; small RGB/grey JPEGs are kept byte for byte."""
    img = open_image(path)
    width, height = img.size
    keep = img.format == "JPEG" and img.mode in ("RGB", "L") and max(width, height) <= max_side
    factor = min(1.0, max_side / max(width, height))
    try:
        rgb = decode_rgb(img, (max(1, math.ceil(width * factor)), max(1, math.ceil(height * factor))))
    except BadImage:
        img.close()
        raise
    if keep:  # it decodes, and is small enough: no second lossy encoding
        img.close()
        with open(path, "rb") as f:
            return f.read()
    if max(rgb.size) > max_side:
        rgb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS, reducing_gap=3.0)
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=_JPEG_QUALITY)
    img.close()
    return buffer.getvalue()


def _encode_job(job: tuple[str, int]) -> tuple[bytes | None, str]:
    path, max_side = job
    try:
        return encode_sample(path, max_side), ""
    except BadImage as exc:
        return None, exc.reason


def pack_folder(
    src: str, dst: str, *, shard_size: int = 256_000_000, max_side: int = 320, workers: int | None = None, seed: int = 0
) -> PackReport:
    """Write `dst/shard-*.tar` and `dst/index.json` from an ImageNet-layout folder. Unreadable images are
    skipped and listed in the report and the index. The index is written last: a folder without one is an
    unfinished pack."""
    started = time.perf_counter()
    info = inspect_folder(src, "SRC")
    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise SpecError(f"DST = {dst!r}: exists and is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    samples = [
        (str(path), label)
        for label, cls in enumerate(info.classes)
        for path in sorted((Path(src) / cls).iterdir())
        if path.suffix.lower() in IMG_EXTENSIONS and path.is_file()
    ]
    random.Random(seed).shuffle(samples)  # every shard mixes the classes
    report = PackReport()
    writer = _ShardWriter(out, shard_size)
    counts: Counter[str] = Counter()
    workers = workers or max(1, len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(workers) as pool:
        encoded = pool.map(_encode_job, [(path, max_side) for path, _ in samples], chunksize=16)
        for (path, label), (data, reason) in zip(samples, encoded, strict=True):
            if data is None:
                report.skipped.append((path, reason))
                continue
            writer.add(f"{report.samples:09d}", data, label)
            counts[info.classes[label]] += 1
            report.samples += 1
    shards = writer.close()
    index = {
        "format": INDEX_FORMAT,
        "classes": info.classes,
        "samples": report.samples,
        "class_counts": {cls: counts[cls] for cls in info.classes},
        "max_side": max_side,
        "seek_every": SEEK_EVERY,
        "source": str(Path(src).resolve()),
        "shards": [shard.__dict__ for shard in shards],
        "skipped": [{"file": f, "reason": r} for f, r in report.skipped],
    }
    write_atomically(out / INDEX, json.dumps(index, indent=1))
    report.shards = len(shards)
    report.bytes = sum(s.bytes for s in shards)
    report.seconds = time.perf_counter() - started
    return report


class _ShardWriter:
    """Appends samples to shard-N.tar, starting a new shard before one would pass `shard_size` bytes."""

    def __init__(self, out: Path, shard_size: int) -> None:
        self.out, self.shard_size = out, shard_size
        self.shards: list[ShardInfo] = []
        self._tar: tarfile.TarFile | None = None
        self._samples = 0
        self._seek: list[int] = []
        self._tmp: Path | None = None

    def add(self, key: str, image: bytes, label: int) -> None:
        if self._tar is not None and self._samples and self._size_with(len(image)) > self.shard_size:
            self._finish()
        if self._tar is None:
            self._tmp = self.out / f".{SHARD_NAME.format(len(self.shards))}.tmp"
            self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed per shard
            self._samples, self._seek = 0, []
        if self._samples % SEEK_EVERY == 0:
            assert self._tar.fileobj is not None
            self._seek.append(self._tar.fileobj.tell())
        for name, data in ((f"{key}.cls", str(label).encode()), (f"{key}.jpg", image)):
            member = tarfile.TarInfo(name)
            member.size, member.mode, member.mtime = len(data), 0o644, 0
            self._tar.addfile(member, io.BytesIO(data))
        self._samples += 1

    def _size_with(self, image_bytes: int) -> int:
        """The shard's file size if this sample were its last: two headers, data padded to 512-byte blocks,
        the end-of-archive blocks, all padded to tar's 10240-byte record."""
        assert self._tar is not None and self._tar.fileobj is not None
        blocks = self._tar.fileobj.tell() + 512 * (2 + 1 + math.ceil(image_bytes / 512) + 2)
        return math.ceil(blocks / tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def _finish(self) -> None:
        assert self._tar is not None and self._tmp is not None
        self._tar.close()
        name = SHARD_NAME.format(len(self.shards))
        final = self.out / name
        os.replace(self._tmp, final)
        self.shards.append(ShardInfo(name, self._samples, final.stat().st_size, sha256_of(final), tuple(self._seek)))
        self._tar = None

    def close(self) -> list[ShardInfo]:
        if self._tar is not None:
            self._finish()
        return self.shards
