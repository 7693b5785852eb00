"""Decoding real files of every awkward kind: what is decoded, what is skipped and why, what is counted."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clusterfit.data.decode import CORRUPT, EMPTY, NOT_AN_IMAGE, TOO_LARGE, UNREADABLE, BadImage, load_rgb
from clusterfit.data.imagefolder import CountedBatches, LabeledImages, collate_labeled
from clusterfit.data.quality import InputTally, verdict
from clusterfit.data.transforms import CenterCrop, TrainCrop


def _photo(width: int = 96, height: int = 64) -> Image.Image:
    """A smooth colour gradient: compresses like a photograph, and colours are easy to check."""
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    pixels = np.concatenate(
        [
            np.broadcast_to(x, (height, width, 1)),
            np.broadcast_to(y, (height, width, 1)),
            np.full((height, width, 1), 128.0),
        ],
        axis=2,
    )
    return Image.fromarray(pixels.astype(np.uint8))


def _jpeg_bytes(img: Image.Image, **kw: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="JPEG", quality=92, **kw)
    return buffer.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels: a decompression bomb's calling card."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


BAD_FILES = {
    "empty.jpg": (b"", EMPTY),
    "text.jpg": (b"this is a text file, not a photograph\n", NOT_AN_IMAGE),
    "truncated.jpg": (_jpeg_bytes(_photo(400, 300))[:3000], CORRUPT),
    "truncated-header.jpg": (_jpeg_bytes(_photo(400, 300))[:300], CORRUPT),
    "bomb.png": (_png_claiming(20_000, 20_000), TOO_LARGE),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_are_named_by_reason(tmp_path: Path, name: str) -> None:
    content, reason = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(BadImage) as caught:
        load_rgb(str(path))
    assert caught.value.reason == reason


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(BadImage) as caught:
        load_rgb(str(tmp_path / "gone.jpg"))
    assert caught.value.reason == UNREADABLE


def test_corrupt_middle_of_jpeg_is_refused_or_decoded_whole(tmp_path: Path) -> None:
    data = bytearray(_jpeg_bytes(_photo(200, 150)))
    data[600:1200] = b"\xff" * 600
    try:
        img = load_rgb(bytes(data))
    except BadImage as exc:
        assert exc.reason == CORRUPT
    else:
        assert img.size == (200, 150) and img.mode == "RGB"


@pytest.mark.parametrize("mode", ["L", "CMYK", "P", "RGBA", "LA", "I;16", "1"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    source = _photo(48, 32)
    if mode == "I;16":
        grey = np.asarray(source.convert("L"), dtype=np.uint16) * 257
        img = Image.fromarray(grey)
        assert img.mode == "I;16"
    else:
        img = source.convert(mode)
    buffer = io.BytesIO()
    img.save(buffer, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
    rgb = load_rgb(buffer.getvalue())
    assert rgb.mode == "RGB" and rgb.size == (48, 32)
    if mode == "I;16":
        # 16-bit greyscale is scaled to 8 bits, not clipped to white
        assert np.abs(np.asarray(rgb)[..., 0].astype(int) - np.asarray(source.convert("L")).astype(int)).max() <= 1


def test_cmyk_jpeg_keeps_its_colours() -> None:
    source = _photo(64, 64)
    rgb = load_rgb(_jpeg_bytes(source.convert("CMYK")))
    assert np.abs(np.asarray(rgb, dtype=int) - np.asarray(source, dtype=int)).mean() < 8


def test_transparent_pixels_become_white_not_black() -> None:
    img = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    img.putpixel((0, 0), (255, 0, 0, 255))
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    rgb = np.asarray(load_rgb(buffer.getvalue()))
    assert tuple(rgb[0, 0]) == (255, 0, 0)
    assert tuple(rgb[4, 4]) == (255, 255, 255)


def test_large_jpeg_is_decoded_at_reduced_scale_with_the_same_content() -> None:
    data = _jpeg_bytes(_photo(1600, 1200))
    full = np.asarray(load_rgb(data).resize((100, 75), Image.Resampling.BILINEAR), dtype=int)
    drafted = load_rgb(data, min_size=(200, 150))
    assert drafted.size == (200, 150)  # 1/8 scale by libjpeg
    assert np.abs(np.asarray(drafted.resize((100, 75), Image.Resampling.BILINEAR), dtype=int) - full).mean() < 3


def test_crops_are_uint8_of_the_target_size() -> None:
    data = _jpeg_bytes(_photo(640, 480))
    torch.manual_seed(0)
    train = TrainCrop(32)(data)
    val = CenterCrop(32)(data)
    assert train.shape == val.shape == (3, 32, 32)
    assert train.dtype == val.dtype == torch.uint8
    # the centre crop of the gradient: red grows left to right, green top to bottom
    assert val[0, 16, 0] < val[0, 16, 31] and val[1, 0, 16] < val[1, 31, 16]


def test_bad_training_samples_are_replaced_and_counted(tmp_path: Path) -> None:
    good = tmp_path / "good.jpg"
    good.write_bytes(_jpeg_bytes(_photo()))
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"")
    samples = [(str(good), 0), (str(bad), 1), (str(good), 0)]
    train = LabeledImages(samples, TrainCrop(16), substitute=True)
    batches = CountedBatches([collate_labeled([train[i] for i in range(3)])])
    ((images, labels),) = list(batches)
    assert images.shape == (3, 3, 16, 16) and labels.tolist() == [0, 0, 0]
    assert batches.take_reads() == (4, [(str(bad), EMPTY)])
    assert batches.take_reads() == (0, [])

    val = CountedBatches(
        [collate_labeled([LabeledImages(samples, CenterCrop(16), substitute=False)[i] for i in range(3)])]
    )
    ((images, labels),) = list(val)
    assert images.shape[0] == 2 and val.take_reads() == (3, [(str(bad), EMPTY)])


def test_tally_verdict_names_the_worst_files() -> None:
    tally = InputTally()
    tally.add(100, [("a.jpg", EMPTY), ("b.jpg", CORRUPT), ("b.jpg", CORRUPT)])
    assert verdict(tally, samples_per_epoch=200, max_bad_fraction=0.01) is None
    tally.add(100, [("c.jpg", NOT_AN_IMAGE)])
    message = verdict(tally, samples_per_epoch=200, max_bad_fraction=0.01)
    assert message is not None and "\n" not in message
    assert message.startswith("3 unreadable input files, over trainer.data.max_bad_fraction = 0.01")
    assert message.index("b.jpg (corrupt or truncated)") < message.index("a.jpg")
    assert InputTally.from_dict(tally.to_dict()) == tally
    assert tally.to_dict()["by_reason"] == {EMPTY: 1, CORRUPT: 1, NOT_AN_IMAGE: 1}


def test_augmentation_presets_and_policies_keep_the_fast_path_s_shape_and_determinism(tmp_path: Path) -> None:
    from clusterfit.data.imagefolder import train_transform
    from clusterfit.spec.model import AugmentSpec

    assert AugmentSpec().resolved(32).describe() == (
        "augmentation: preset small (auto: train crop 32 px <= 64), crop scale 0.64-1, no flip"
    )
    big = AugmentSpec().resolved(224)
    assert (big.preset, big.crop_scale, big.flip) == ("imagenet", (0.08, 1.0), True)
    assert AugmentSpec(preset="small", flip=True).resolved(224).flip  # a field overrides its preset
    photo = tmp_path / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(photo)
    for policy in ("none", "randaugment", "trivialaugment", "autoaugment"):
        augment = AugmentSpec(policy=policy, random_erasing=0.5).resolved(48)
        transform = train_transform(48, augment)
        first = transform(str(photo), torch.Generator().manual_seed(7))
        again = transform(str(photo), torch.Generator().manual_seed(7))
        assert first.shape == (3, 48, 48) and first.dtype == torch.uint8, policy
        assert torch.equal(first, again), f"{policy}: the same generator must give the same pixels"
    with pytest.raises(ValueError, match=r"crop_scale = \[0.5, 1.5\]: the area share is at most 1"):
        AugmentSpec(crop_scale=(0.5, 1.5))
