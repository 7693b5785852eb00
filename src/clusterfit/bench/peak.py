"""The machine's measured matrix-multiply rate, so training throughput can be read as a fraction of peak."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clusterfit.bench.machine import cpu_model
from clusterfit.spec.errors import SpecError

if TYPE_CHECKING:
    import torch

# Forward + backward of ResNet-50 on one 224x224 image: 3 x 4.1 GFLOP (multiply-adds counted as 2).
RESNET50_TRAIN_GFLOP_224 = 24.5
DTYPES = ("fp32", "bf16", "fp16")  # names of torch.float32, torch.bfloat16, torch.float16


@dataclass(frozen=True)
class PeakResult:
    dtype: str
    size: int
    tflops: float  # the best of the timed repeats


def resnet50_train_flop(image_size: int) -> float:
    """FLOP of one training step per image; convolution cost scales with the pixel count."""
    return RESNET50_TRAIN_GFLOP_224 * 1e9 * (image_size / 224) ** 2


def measure_matmul(dtype_name: str, size: int, repeats: int, device: torch.device) -> PeakResult:
    import torch

    check_dtype(dtype_name, device.type)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, AMX tile set-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return PeakResult(dtype_name, size, 2 * size**3 / best / 1e12)


def machine_description(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


@dataclass(frozen=True)
class PeakReport:
    machine: str
    results: list[PeakResult]
    images_per_s: float | None = None  # a measured ResNet-50 training rate, read as a fraction of each peak
    image_size: int = 224  # of that training rate

    def markdown(self) -> str:
        lines = [self.machine]
        for result in self.results:
            line = f"{result.dtype} matmul {result.size}x{result.size}: {result.tflops * 1000:.1f} GFLOP/s"
            if self.images_per_s is not None:
                achieved = self.images_per_s * resnet50_train_flop(self.image_size) / 1e12
                line += (
                    f"; ResNet-50 at {self.images_per_s:g} images/s ({self.image_size} px) is "
                    f"{achieved / result.tflops:.0%} of it"
                )
            lines.append(line)
        return "\n".join(lines)


def check_dtype(dtype_name: str, device_type: str) -> None:
    if dtype_name not in DTYPES:
        raise SpecError(f"--dtypes: {dtype_name!r} is not one of {', '.join(DTYPES)}")
    if dtype_name == "fp16" and device_type != "cuda":
        raise SpecError("--dtypes: fp16 matmul is only measured on a CUDA GPU; use fp32 or bf16 here")


def run_peak_bench(
    dtypes: list[str], size: int, repeats: int, images_per_s: float | None = None, image_size: int = 224
) -> PeakReport:
    """Every dtype's matmul rate on the GPU if there is one, else on all cores."""
    for name in dtypes:  # a misspelt name is refused before torch is imported (seconds on a cold start)
        if name not in DTYPES:
            check_dtype(name, "")
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = [measure_matmul(name, size, repeats, device) for name in dtypes]
    return PeakReport(machine_description(device), results, images_per_s, image_size)
