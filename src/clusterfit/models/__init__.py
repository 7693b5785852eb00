"""Image classifiers by name. Models know nothing of distribution: the worker wraps them in DDP."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torchvision.models import get_model, resnet
from torchvision.models.resnet import BasicBlock

from clusterfit.spec.model_names import has_residual_stages, input_size_is_fixed, unknown_model


def _group_norm(channels: int) -> nn.GroupNorm:
    # NOTE: GroupNorm normalises each sample on its own, so results do not depend on how the
    # global batch is split across ranks; useful for tiny per-rank batches and exact tests.
    return nn.GroupNorm(num_groups=min(32, channels // 4), num_channels=channels)


def build_model(name: str, num_classes: int, norm_layer: str = "batch", image_size: int = 224) -> nn.Module:
    """A randomly initialised classifier by torchvision's name; `resnet_tiny` is a one-block-per-stage ResNet
    for tests. `image_size` matters only to vision transformers, whose position embeddings depend on it."""
    norm = _group_norm if norm_layer == "group" else nn.BatchNorm2d
    problem = unknown_model(name)
    if problem:
        raise ValueError(f"model {problem}")
    if name == "resnet_tiny":
        return resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm)
    if has_residual_stages(name):
        return get_model(name, weights=None, num_classes=num_classes, norm_layer=norm)
    return get_model(name, weights=None, num_classes=num_classes, **_construction(name, image_size))


def _construction(name: str, image_size: int) -> dict[str, Any]:
    if input_size_is_fixed(name):
        return {"image_size": image_size}
    if name in ("googlenet", "inception_v3"):
        # NOTE: their auxiliary classifiers return a tuple in training mode, which no loss here expects.
        return {"aux_logits": False, "init_weights": True}
    return {}


def load_weights(model: nn.Module, state: Mapping[str, Tensor], *, strict: bool = True) -> None:
    """Plain tensors by name (as safetensors holds them) into `model`, in place."""
    weights = OrderedDict(state)
    # NOTE: a plain dict lacks the per-module `version` a state_dict() carries, and some torchvision modules refuse
    # to load without it (MNASNet: "version should be set to 1 or 2"); the freshly built model's own versions are
    # the weights' versions, since the same torchvision built both.
    weights._metadata = getattr(model.state_dict(), "_metadata", OrderedDict())  # type: ignore[attr-defined]
    model.load_state_dict(weights, strict=strict)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["build_model", "count_parameters", "load_weights"]
