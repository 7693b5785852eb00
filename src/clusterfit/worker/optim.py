"""Optimizer and learning-rate schedule: linear scaling by global batch / 256, warm-up, then decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from clusterfit.spec.model import OptimizerSpec, ScheduleSpec


def scaled_lr(spec: OptimizerSpec, global_batch: int) -> float:
    return spec.lr * global_batch / 256


def build_optimizer(model: nn.Module, spec: OptimizerSpec, global_batch: int) -> torch.optim.Optimizer:
    # Weight decay on BatchNorm/GroupNorm scales and on biases (all 1-D) hurts accuracy; decay weights only.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    lr = scaled_lr(spec, global_batch)
    fused = _fused_kernel_applies([*decay, *no_decay])
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=spec.momentum, nesterov=spec.nesterov, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, fused=fused)


def match_kernel_to_parameters(optimizer: torch.optim.Optimizer) -> None:
    """After loading a checkpoint: its param groups carry the kernel choice of the job that saved them (say
    fused under DDP), which may not apply to these parameters (FSDP's shards)."""
    for group in optimizer.param_groups:
        group["fused"] = _fused_kernel_applies(group["params"])
        if group["fused"]:
            group["foreach"] = False


def _fused_kernel_applies(params: list[torch.Tensor]) -> bool:
    """Whether to step all parameters in one fused kernel rather than torch's default.
    NOTE: torch's default on the CPU is a Python loop over the parameters; the fused kernel takes half its time
    for ResNet-50 there (benchmarks/RESULTS.md, the bf16 step profile). FSDP's sharded parameters (DTensor) keep
    the default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Multiplier of the peak LR at `step` (0-based): linear warm-up, then cosine/linear decay or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_schedule(
    optimizer: torch.optim.Optimizer, spec: ScheduleSpec, steps_per_epoch: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup_steps = round(spec.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, spec.kind)
    )
