"""Cutting a torchvision ResNet into pipeline stages at its residual stages, keeping parameter names."""

from __future__ import annotations

import torch
from torch import nn

_STEM = ["conv1", "bn1", "relu", "maxpool"]
_RESIDUAL = ["layer1", "layer2", "layer3", "layer4"]
_HEAD = ["avgpool", "fc"]


def stage_parts(stages: int) -> list[list[str]]:
    """Top-level module names per stage: residual stages split as evenly as possible (earlier stages get
    the extra one), the stem with the first stage and the classifier head with the last."""
    if not 2 <= stages <= len(_RESIDUAL):
        raise ValueError(f"a ResNet splits into 2 to {len(_RESIDUAL)} pipeline stages, not {stages}")
    per_stage, extra = divmod(len(_RESIDUAL), stages)
    parts, start = [], 0
    for index in range(stages):
        count = per_stage + (1 if index < extra else 0)
        parts.append(_RESIDUAL[start : start + count])
        start += count
    parts[0] = _STEM + parts[0]
    parts[-1] = parts[-1] + _HEAD
    return parts


class ResNetStage(nn.Module):
    """The modules of one stage, registered under their original names so state dict keys (FQNs) match
    the whole model's: checkpoints and exports do not depend on how the model was cut."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.names = names
        for name in names:
            self.add_module(name, getattr(model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "conv1" not in self.names:
            x = _ContiguousGrad.apply(x)
        for name in self.names:
            if name == "fc":
                x = torch.flatten(x, 1)
            x = getattr(self, name)(x)
        # NOTE: activations and gradients cross ranks with send/recv, which needs contiguous tensors;
        # channels_last convolutions produce (and take gradients in) another layout.
        return x.contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward hands on a contiguous gradient (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
