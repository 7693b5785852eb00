"""MixUp and CutMix over a whole batch, on the device, after normalisation (torchvision.transforms.v2, as in
torchvision's classification reference). Labels become class probabilities, which CrossEntropyLoss takes as
they are (label smoothing still applies). The draws come from torch's global RNG, which every checkpoint
saves, so a resumed job mixes exactly as an uninterrupted one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from clusterfit.spec.model import ResolvedAugment

BatchMix = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def batch_mix(augment: ResolvedAugment, num_classes: int) -> BatchMix | None:
    """The job's batch-level mixing, or None when neither MixUp nor CutMix is on."""
    if not (augment.mixup_alpha or augment.cutmix_alpha):
        return None
    from torchvision.transforms import v2

    choices = []
    if augment.mixup_alpha:
        choices.append(v2.MixUp(alpha=augment.mixup_alpha, num_classes=num_classes))
    if augment.cutmix_alpha:
        choices.append(v2.CutMix(alpha=augment.cutmix_alpha, num_classes=num_classes))
    return choices[0] if len(choices) == 1 else v2.RandomChoice(choices)
