"""model/model_card.json: everything a scorer needs besides the weights, so a model folder stands alone: the
model and its classes in order, the exact preprocessing the validation data had, the input it expects, its
final metrics, the spec it came from (by hash) and the clusterfit version, and each model file's sha256."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clusterfit.files import write_atomically
from clusterfit.outputs.layout import model_card_file
from clusterfit.storage.checksums import sha256_of

# The trainer's validation transform (data/loaders.py and data/transforms.py import these), stated for scorers.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
VAL_CROP_FRACTION = 0.875


@dataclass(frozen=True)
class Preprocessing:
    """The validation transform: decode to RGB, resize the shorter side, centre-crop, scale to [0, 1],
    normalise per channel; the network takes NCHW float32."""

    resize_shorter_side: int  # rounded, for other tools; the crop itself is `crop_fraction` of the shorter side
    center_crop: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    channel_order: str = "RGB"
    layout: str = "NCHW"
    scale: float = 1 / 255
    crop_fraction: float = VAL_CROP_FRACTION  # the centre square's side over the shorter side, then resized
    # Pillow's bilinear resize, which widens its filter when it shrinks (torchvision's antialias=True). A JPEG
    # much larger than the crop is first decoded at 1/2, 1/4 or 1/8 scale (Pillow's draft), as in training.
    interpolation: str = "bilinear"
    antialias: bool = True

    @classmethod
    def for_size(cls, center_crop: int, resize_shorter_side: int | None = None) -> Preprocessing:
        """Resize(resize_shorter_side) + CenterCrop(center_crop), torchvision's validation transform; without a
        resize, ImageNet's proportion (the crop is 0.875 of the shorter side, 224 of 256)."""
        if resize_shorter_side is None:
            return cls(resize_shorter_side=round(center_crop / VAL_CROP_FRACTION), center_crop=center_crop)
        return cls(resize_shorter_side, center_crop, crop_fraction=center_crop / resize_shorter_side)


@dataclass(frozen=True)
class ModelCard:
    model: str
    classes: list[str]
    image_size: int  # the side of the images the model takes: the validation crop (preprocessing.center_crop)
    preprocessing: Preprocessing
    metrics: dict[str, float]  # the last epoch's validation metrics (empty without validation data)
    spec_sha256: str
    clusterfit_version: str
    job: str
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    checks: dict[str, Any] = field(default_factory=dict)  # e.g. the ONNX export's agreement with PyTorch


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def write_model_card(model_dir: Path, card: ModelCard) -> Path:
    files = {
        f.name: sha256_of(f) for f in sorted(model_dir.iterdir()) if f.is_file() and f != model_card_file(model_dir)
    }
    path = model_card_file(model_dir)
    body = {**asdict(card), "files": files}
    write_atomically(path, (json.dumps(body, indent=2) + "\n").encode())
    return path


def read_model_card(model_dir: Path) -> ModelCard:
    raw = json.loads(model_card_file(model_dir).read_text())
    raw["preprocessing"] = Preprocessing(
        **{
            **raw["preprocessing"],
            "mean": tuple(raw["preprocessing"]["mean"]),
            "std": tuple(raw["preprocessing"]["std"]),
        }
    )
    return ModelCard(**raw)
