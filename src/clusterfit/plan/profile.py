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
    """Any model the trainer offers, by name (every torchvision classification model but MaxViT)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from clusterfit.models import build_model

    batch = 2  # batch norm needs more than one value per channel in training mode
    # NOTE: the meta device allocates nothing; RegNet's initialisation copies data, so it is built on the CPU.
    device = torch.device("cpu" if name.startswith("regnet") else "meta")
    with device:
        model = build_model(name, num_classes, image_size=image_size)
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
