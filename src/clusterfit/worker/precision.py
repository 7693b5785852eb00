"""Mixed precision: which autocast dtype to use, and a grad scaler where fp16 needs one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    autocast_dtype: torch.dtype | None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


def cpu_has_native_bf16() -> bool:
    # NOTE: without AVX512-BF16 or AMX, bf16 on the CPU is emulated and ~20x slower than fp32.
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(requested: str, device: torch.device) -> Precision:
    if requested == "auto":
        if device.type == "cuda":
            requested = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            requested = "bf16" if cpu_has_native_bf16() else "fp32"
    if requested == "fp16" and device.type != "cuda":
        raise ValueError("trainer.precision = 'fp16' needs a CUDA GPU; use bf16, fp32 or auto on this machine")
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]
    return Precision(requested, dtype)


def make_grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    # fp16 gradients underflow without loss scaling; bf16 and fp32 keep the fp32 exponent range.
    return torch.amp.GradScaler(device.type, enabled=precision.name == "fp16")
