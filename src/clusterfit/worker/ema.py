"""An exponential moving average of the weights (torchvision reference's --model-ema, timm's ModelEmaV2):
validated and exported instead of the raw weights, and kept in every checkpoint so a resumed job averages on
exactly where it stopped."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from clusterfit.spec.model import EmaSpec


class WeightAverage:
    def __init__(self, module: nn.Module, spec: EmaSpec, device: torch.device) -> None:
        # NOTE: use_buffers averages BatchNorm's running statistics too, so the averaged model is usable as it is.
        self.averaged = AveragedModel(
            module, device=device, multi_avg_fn=get_ema_multi_avg_fn(spec.decay), use_buffers=True
        )
        self.every_steps = spec.every_steps

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    def update(self, module: nn.Module, global_step: int) -> None:
        if global_step % self.every_steps == 0:
            self.averaged.update_parameters(module)

    def state_dict(self) -> dict[str, Any]:
        return {name: tensor.detach().cpu() for name, tensor in self.averaged.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state)
