"""Image classifiers by name. Models know nothing of distribution: the worker wraps them in DDP."""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet
from torchvision.models.resnet import BasicBlock

_TORCHVISION_RESNETS = {
    "resnet18": resnet.resnet18,
    "resnet34": resnet.resnet34,
    "resnet50": resnet.resnet50,
    "resnet101": resnet.resnet101,
    "resnet152": resnet.resnet152,
}


def _group_norm(channels: int) -> nn.GroupNorm:
    # NOTE: GroupNorm normalises each sample on its own, so results do not depend on how the
    # global batch is split across ranks; useful for tiny per-rank batches and exact tests.
    return nn.GroupNorm(num_groups=min(32, channels // 4), num_channels=channels)


def build_model(name: str, num_classes: int, norm_layer: str = "batch") -> nn.Module:
    """A randomly initialised classifier; `resnet_tiny` is a one-block-per-stage ResNet for tests."""
    norm = _group_norm if norm_layer == "group" else nn.BatchNorm2d
    if name == "resnet_tiny":
        return resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm)
    if name not in _TORCHVISION_RESNETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join([*_TORCHVISION_RESNETS, 'resnet_tiny'])}")
    return _TORCHVISION_RESNETS[name](weights=None, num_classes=num_classes, norm_layer=norm)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["build_model", "count_parameters"]
