"""Write a small ImageNet-layout folder of generated JPEGs: ROOT/{train,val}/<class>/<n>.jpg.

Each class is a colour with noise and a stripe pattern, so a small ResNet can learn it in a few epochs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = [(200, 40, 40), (40, 160, 60), (40, 60, 200), (220, 200, 40), (160, 60, 200), (40, 200, 200)]


def make_tiny_imagefolder(
    root: Path, classes: int = 4, train_per_class: int = 24, val_per_class: int = 8, size: int = 48, seed: int = 0
) -> Path:
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for index in range(classes):
            folder = root / split / f"class_{index}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(count):
                pixels = np.array(COLOURS[index % len(COLOURS)], dtype=np.float32) + rng.normal(0, 30, (size, size, 3))
                pixels[:, :: 2 + index] *= 0.5  # class-specific stripes
                image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
                image.save(folder / f"{n:04d}.jpg", quality=90)
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--classes", type=int, default=4)
    args = parser.parse_args()
    print(make_tiny_imagefolder(args.root, classes=args.classes))
