"""Validation accuracy computed exactly across ranks: every image is scored once, by one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from clusterfit.data.loaders import normalize_on_device
from clusterfit.worker.dist import DistEnv
from clusterfit.worker.precision import Precision


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]  # top1, top5, loss, images
    confusion: list[list[int]]  # [true class][predicted class] -> images


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    precision: Precision,
    channels_last: bool,
    env: DistEnv,
    num_classes: int,
) -> Evaluation:
    """`model` is the unwrapped module: ranks may hold different numbers of batches, so no collective
    may run inside the forward pass."""
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.float64, device=device)
    top5 = loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for images, labels in loader:
        inputs = normalize_on_device(images, device, channels_last)
        targets = labels.to(device, non_blocking=True)
        with precision.autocast(device):
            logits = model(inputs)
        logits = logits.float()
        loss_sum = loss_sum + nn.functional.cross_entropy(logits, targets, reduction="sum")
        best = logits.topk(min(5, logits.shape[1]), dim=1).indices
        top5 = top5 + best.eq(targets.unsqueeze(1)).any(dim=1).sum()
        confusion += torch.bincount(targets * num_classes + best[:, 0], minlength=num_classes**2).double()
    # One collective for everything: top-1 and the image count are the confusion matrix's trace and sum.
    totals = torch.cat([confusion, top5.view(1), loss_sum.view(1)])
    if env.is_distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train(was_training)
    matrix = totals[:-2].view(num_classes, num_classes)
    count = float(matrix.sum())
    n = max(count, 1.0)
    metrics = {
        "top1": float(matrix.trace()) / n,
        "top5": float(totals[-2]) / n,
        "loss": float(totals[-1]) / n,
        "images": int(count),
    }
    return Evaluation(metrics, matrix.long().tolist())
