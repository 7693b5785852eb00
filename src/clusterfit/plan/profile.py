"""A model's training FLOP per image and its parameter count, counted by torch's FLOP counter on the meta
device: nothing is allocated or computed, so ResNet-101 at 224 px is profiled in about a second."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    name: str
    image_size: int
    train_flop_per_image: float  # forward + backward, multiply-adds counted as 2
    parameters: int


def profile_model(name: str, image_size: int, num_classes: int = 1000) -> ModelProfile:
    """clusterfit's trainer models by name, or any torchvision classification model (to compare with
    published results on models the trainer does not offer)."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    from clusterfit.models import build_model
    from clusterfit.spec.model import MODEL_NAMES

    batch = 2  # batch norm needs more than one value per channel in training mode
    with torch.device("meta"):
        if name in MODEL_NAMES:
            model = build_model(name, num_classes)
        else:
            extra = {"aux_logits": False, "init_weights": False} if name == "inception_v3" else {}
            model = torchvision.models.get_model(name, num_classes=num_classes, **extra)
        images = torch.empty(batch, 3, image_size, image_size)
    counter = FlopCounterMode(display=False)
    with counter:
        model(images).sum().backward()
    return ModelProfile(
        name=name,
        image_size=image_size,
        train_flop_per_image=counter.get_total_flops() / batch,
        parameters=sum(p.numel() for p in model.parameters()),
    )
