"""Load an exported clusterfit model and score images with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from clusterfit.data.loaders import IMAGENET_MEAN, IMAGENET_STD
from clusterfit.models import build_model, load_weights
from clusterfit.outputs import model_weights


@dataclass
class Classifier:
    model: nn.Module
    classes: list[str]
    image_size: int
    metadata: dict[str, Any]

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW images (already image_size square) -> class probabilities, N x classes."""
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
        return self.model((images.float() - mean) / std).softmax(dim=1)


def load_classifier(model_dir: str | Path) -> Classifier:
    """Rebuild the network named in the safetensors metadata and load its weights (no pickle involved)."""
    path = model_weights(model_dir)
    with safe_open(str(path), framework="pt") as f:
        metadata = {key: json.loads(value) for key, value in (f.metadata() or {}).items()}
    model = build_model(metadata["model"], len(metadata["classes"]), metadata["norm_layer"], metadata["image_size"])
    load_weights(model, load_file(str(path)))
    return Classifier(model.eval(), metadata["classes"], metadata["image_size"], metadata)
