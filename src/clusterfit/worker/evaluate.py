"""Validation accuracy computed exactly across ranks: every image is scored once, by one rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from clusterfit.data.loaders import normalize_on_device
from clusterfit.worker.dist import DistEnv, all_reduce_sum
from clusterfit.worker.precision import Precision


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, device: torch.device, precision: Precision, channels_last: bool, env: DistEnv
) -> dict[str, float]:
    """`model` is the unwrapped module: ranks may hold different numbers of batches, so no collective
    may run inside the forward pass."""
    was_training = model.training
    model.eval()
    top1 = top5 = count = loss_sum = 0.0
    for images, labels in loader:
        inputs = normalize_on_device(images, device, channels_last)
        targets = labels.to(device, non_blocking=True)
        with precision.autocast(device):
            logits = model(inputs)
        logits = logits.float()
        loss_sum += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        best = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = best.eq(targets.unsqueeze(1))
        top1 += hits[:, 0].sum().item()
        top5 += hits.any(dim=1).sum().item()
        count += targets.numel()
    top1, top5, count, loss_sum = all_reduce_sum([top1, top5, count, loss_sum], env, device)
    model.train(was_training)
    n = max(count, 1.0)
    return {"top1": top1 / n, "top5": top5 / n, "loss": loss_sum / n, "images": int(count)}
