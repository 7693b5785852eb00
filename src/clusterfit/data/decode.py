"""Decoding one image file to RGB, and naming why a file cannot be used. Pillow only, no torch: the packer
and the launcher use it too.

Every failure is a `BadImage` with a short reason from `REASONS`, so skips can be counted by reason.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from struct import error as struct_error
from typing import BinaryIO

import numpy as np
from PIL import Image, UnidentifiedImageError

EMPTY = "empty file"
NOT_AN_IMAGE = "not an image"
CORRUPT = "corrupt or truncated"
TOO_LARGE = "too large (decompression bomb)"
UNREADABLE = "unreadable file"
REASONS = (EMPTY, NOT_AN_IMAGE, CORRUPT, TOO_LARGE, UNREADABLE)

# Alpha is composited over this background rather than dropped: dropping it exposes whatever colour the
# encoder left under transparent pixels (often black), which the network would then learn.
_BACKGROUND = (255, 255, 255)


class BadImage(Exception):
    """A file that cannot be decoded; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def open_image(source: str | bytes | BinaryIO) -> Image.Image:
    """Open lazily (header only): size and format are known, pixels are not decoded yet.

    Images larger than Pillow's MAX_IMAGE_PIXELS are refused here, before any memory is spent on them."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        with warnings.catch_warnings():
            # NOTE: Pillow only warns between 1x and 2x its pixel limit; treat both as too large, so a
            # DataLoader worker never allocates gigabytes for one sample.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(source)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(TOO_LARGE, str(exc).split(" pixels")[0]) from None
    except UnidentifiedImageError:
        raise BadImage(_empty_or_not_image(source)) from None
    except FileNotFoundError:
        raise BadImage(UNREADABLE, "no such file") from None
    except OSError as exc:
        # An errno means the file system failed (permissions, I/O); without one, Pillow failed to parse it.
        raise BadImage(UNREADABLE if exc.errno else CORRUPT, exc.strerror or str(exc)) from None
    except (ValueError, SyntaxError, struct_error) as exc:  # malformed headers in some plugins
        raise BadImage(CORRUPT, str(exc)) from None
    return img


def decode_rgb(img: Image.Image, min_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode an opened image to 8-bit RGB.

    `min_size`: the smallest (width, height) the caller needs. JPEGs are then decoded at 1/2, 1/4 or 1/8
    scale by libjpeg (DCT scaling) when that still gives at least this size, which is several times faster
    than a full decode followed by a downscale."""
    if min_size is not None and img.format == "JPEG":
        with contextlib.suppress(OSError, ValueError):  # no draft for this file: decode at full size
            img.draft("RGB", min_size)
    try:
        # NOTE: truncated files are refused (Pillow's default), never padded with grey: a half-grey image
        # is a wrong training sample.
        img.load()
    except (OSError, SyntaxError, ValueError, IndexError, struct_error, EOFError) as exc:
        # "image file is truncated", "broken data stream", bad Huffman tables, ...
        raise BadImage(CORRUPT, str(exc)) from None
    except MemoryError:
        raise BadImage(TOO_LARGE, f"{img.size[0]}x{img.size[1]}") from None
    try:
        return to_rgb(img)
    except (OSError, ValueError) as exc:
        raise BadImage(CORRUPT, str(exc)) from None


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode to RGB: CMYK and YCbCr by Pillow's conversions, 16/32-bit greyscale scaled (not
    clipped) to 8 bits, palettes and alpha composited over a white background."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        pixels = np.asarray(img, dtype=np.float64)
        top = 65535.0 if mode != "F" and pixels.max(initial=0) > 255 else 255.0
        if mode == "F":
            top = max(1.0, float(pixels.max(initial=1.0)))
        grey = np.clip(pixels * (255.0 / top), 0, 255).round().astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    elif mode == "P":
        return img.convert("RGB")
    if mode in ("RGBA", "LA", "La", "RGBa", "PA") or img.mode == "RGBA":
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def load_rgb(source: str | bytes | BinaryIO, min_size: tuple[int, int] | None = None) -> Image.Image:
    """open_image + decode_rgb; raises BadImage."""
    img = open_image(source)
    try:
        rgb = decode_rgb(img, min_size)
    except BadImage:
        img.close()
        raise
    if rgb is not img:
        img.close()
    return rgb


def draft_request(
    size: tuple[int, int], box: tuple[float, float, float, float], out: tuple[int, int]
) -> tuple[int, int]:
    """The whole-image size to ask `draft` for, so that `box` (in full-size pixels) keeps at least `out` pixels."""
    width, height = size
    box_w, box_h = max(box[2] - box[0], 1.0), max(box[3] - box[1], 1.0)
    factor = min(1.0, max(out[0] / box_w, out[1] / box_h))
    return max(1, math.ceil(width * factor)), max(1, math.ceil(height * factor))


# Signatures of the formats Pillow reads: a file that starts like one but cannot be opened is corrupt.
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"II*\x00", b"MM\x00*", b"RIFF")


def _empty_or_not_image(source: str | BinaryIO) -> str:
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                head = f.read(16)
        else:
            source.seek(0)
            head = source.read(16)
    except OSError:
        return UNREADABLE
    if not head:
        return EMPTY
    return CORRUPT if head.startswith(_MAGIC) else NOT_AN_IMAGE
