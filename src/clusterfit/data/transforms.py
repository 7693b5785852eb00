"""Image file -> uint8 CHW tensor, decoding only the pixels the crop needs.

The crop is chosen from the image header before decoding, so JPEGs can be decoded at a reduced scale
(libjpeg DCT scaling through Pillow's `draft`) when the crop is much larger than the output; the crop and
the resize are then one Pillow `resize(box=...)`. Pixels stay uint8 until the device normalises them.
"""

from __future__ import annotations

import math
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

from clusterfit.data.decode import decode_rgb, draft_request, open_image
from clusterfit.outputs.model_card import VAL_CROP_FRACTION  # the validation crop, stated by the model card

Box = tuple[float, float, float, float]  # left, upper, right, lower in full-size pixels


class TrainCrop:
    """RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)) and a horizontal flip with p=0.5 (`flip`), as
    torchvision does them (same parameter sampling, from torch's RNG), on the file itself."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
    ):
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip

    def __call__(self, source: str | bytes | BinaryIO, generator: torch.Generator | None = None) -> torch.Tensor:
        """`generator`: the random stream to draw from; torch's global one if None."""
        img = open_image(source)
        try:
            box = random_resized_box(img.size, self.scale, self.ratio, generator)
            flip = torch.rand(1, generator=generator).item() < 0.5 and self.flip
            out = _resized_crop(img, box, self.size)
        finally:
            img.close()
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_uint8_chw(out)


def random_resized_box(
    size: tuple[int, int], scale: tuple[float, float], ratio: tuple[float, float], generator: torch.Generator | None
) -> Box:
    """torchvision's RandomResizedCrop.get_params, with an explicit generator."""
    width, height = size
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return left, top, left + w, top + h
    # Fallback: a centre crop at the nearest allowed aspect ratio.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


class CenterCrop:
    """Resize(size / crop_fraction) + CenterCrop(size) as one crop-and-resize (0.875: ImageNet's)."""

    def __init__(self, size: int, crop_fraction: float = VAL_CROP_FRACTION) -> None:
        self.size, self.crop_fraction = size, crop_fraction

    def __call__(self, source: str | bytes | BinaryIO, generator: torch.Generator | None = None) -> torch.Tensor:
        img = open_image(source)
        try:
            width, height = img.size
            side = min(width, height) * self.crop_fraction
            left, top = (width - side) / 2, (height - side) / 2
            out = _resized_crop(img, (left, top, left + side, top + side), self.size)
        finally:
            img.close()
        return to_uint8_chw(out)


def _resized_crop(img: Image.Image, box: Box, size: int) -> Image.Image:
    full_w, full_h = img.size
    rgb = decode_rgb(img, draft_request((full_w, full_h), box, (size, size)))
    # `draft` may have decoded at 1/2, 1/4 or 1/8 scale: map the box onto the decoded pixels.
    sx, sy = rgb.size[0] / full_w, rgb.size[1] / full_h
    scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    return rgb.resize((size, size), Image.Resampling.BILINEAR, box=scaled)


def to_uint8_chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()


class TrainTransform:
    """The training transform of a job: the crop and flip above on the file itself, then (optionally) a
    torchvision.transforms.v2 policy and random erasing on the uint8 tensor. The policies draw from torch's
    global RNG; with an explicit `generator` they run under a seed drawn from it, so a sample's pixels depend
    only on that generator, as the crop's do (exact resume)."""

    def __init__(self, crop: TrainCrop, policy: str = "none", random_erasing: float = 0.0) -> None:
        self.crop = crop
        self.tensor_steps = None
        if policy == "none" and not random_erasing:
            return  # transforms.v2 is not even imported: each DataLoader worker would pay for it
        from torchvision.transforms import v2

        steps = []
        if policy == "randaugment":
            steps.append(v2.RandAugment())
        elif policy == "trivialaugment":
            steps.append(v2.TrivialAugmentWide())
        elif policy == "autoaugment":
            steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET))
        if random_erasing:
            steps.append(v2.RandomErasing(p=random_erasing, value=0))
        self.tensor_steps = v2.Compose(steps)

    def __call__(self, source: str | bytes | BinaryIO, generator: torch.Generator | None = None) -> torch.Tensor:
        pixels = self.crop(source, generator)
        if self.tensor_steps is None:
            return pixels
        if generator is None:
            return self.tensor_steps(pixels)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.tensor_steps(pixels)
