"""`clusterfit plan`'s cost model against published multi-GPU scaling results: for each published point, the
model's predicted weak-scaling efficiency next to the published one, and the error in points.

    python benchmarks/plan_validation.py          # prints the markdown table of benchmarks/RESULTS.md

Published points (efficiency = N-device images/s / (N x 1-device images/s)):
- NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README, "Training performance results"
  (pytorch-21.03 NGC container): DGX-1 16 GB (8x V100, NVLink) FP32 367 -> 2855 img/s, mixed precision
  1200 -> 8322; DGX A100 80 GB (8x A100, NVSwitch) TF32 938 -> 7248, mixed precision 2470 -> 16621.
  Batch per GPU from the recipe's configs.yml: 256, but 112 for FP32 on the DGX-1. Its `pytorch` data backend
  decodes the JPEGs with PIL in DataLoader worker processes (8 per GPU on a DGX-1, 16 on a DGX A100) on the
  host's CPUs: 2 x 20-core Xeon E5-2698 v4 (DGX-1), 2 x 64-core EPYC 7742 (DGX A100). A core's rate is
  torchvision's reference pipeline as `clusterfit bench data` measured it here (benchmarks/RESULTS.md,
  "Data loading": 215 images/s per core on a 2.1 GHz Xeon).
- Horovod's README and docs/benchmarks: 128 servers x 4 Pascal GPUs on RoCE-capable 25 Gbit/s Ethernet,
  90 % for Inception V3 and ResNet-101, 68 % for VGG-16; 32 servers x 4 GPUs: 90 %, 90 %, 79 %
  (TensorFlow's tf_cnn_benchmarks, batch 64 per GPU, fp32; P100 PCIe assumed). Horovod then fused gradients
  into 64 MB buffers (docs/tensor-fusion.rst; the default became 128 MB in v0.21.0), its all-reduce "buckets".
  Synthetic data (docs/benchmarks.rst: "the synthetic data benchmark"): nothing to decode.

One device's rate (images/s) is what the planner takes as `--images-per-s`, published where it exists:
NVIDIA's 1-GPU results above, and TensorFlow's own tf_cnn_benchmarks results on one P100 of a DGX-1 (TensorFlow
r1 guide, "Benchmarks", May 2017, synthetic data, batch 64): Inception V3 142, ResNet-152 91.8, VGG-16 154
images/s. ResNet-101 has no published rate there: it runs at ResNet-152's FLOP rate (same blocks, same device).
The column "from datasheet" is the planner without any measured rate: peak x utilization (plan/hardware.py).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clusterfit.plan.costmodel import StepSplit, slowest_link, step_split  # noqa: E402
from clusterfit.plan.hardware import DEVICES, NETWORKS  # noqa: E402
from clusterfit.plan.planner import device_rate, gpu_hardware, input_pipeline, workload  # noqa: E402
from clusterfit.plan.profile import ModelProfile, profile_model  # noqa: E402


@dataclass(frozen=True)
class Published:
    source: str
    model: str
    image_size: int
    batch: int
    device: str
    precision: str  # the job's: fp32 or bf16 (mixed)
    nodes: int
    per_node: int
    network: str
    efficiency: float
    rate_of: tuple[str, float]  # (model, its published 1-device images/s) whose FLOP rate this model runs at
    bucket_mb: float | None = None  # the all-reduce's bucket (fusion buffer); None: DDP's 25 MB
    synthetic: bool = True  # else the images are decoded on the host cores of the device's DGX
    workers_per_device: int | None = None  # the DataLoader workers feeding each GPU


NVIDIA = "NVIDIA DGX, PyTorch"
HOROVOD = "Horovod, TensorFlow"
FUSION_MB = 64  # Horovod's fusion buffer then
TORCHVISION_IMAGES_PER_CORE = 215.0  # `clusterfit bench data`, torchvision's ImageFolder + PIL transforms


# DataLoader workers per GPU in the recipe's configs.yml of the time (`platform: ... workers:`).
RECIPE_WORKERS = {"v100": 8, "a100": 16}


def _nvidia(device: str, precision: str, batch: int, network: str, one_gpu: float, eight_gpus: float) -> Published:
    """A ResNet-50 result on one 8-GPU DGX node, with its own 1-GPU rate, decoding on the DGX's host cores."""
    efficiency = eight_gpus / (8 * one_gpu)
    return Published(
        NVIDIA, "resnet50", 224, batch, device, precision, 1, 8, network, efficiency, ("resnet50", one_gpu),
        synthetic=False, workers_per_device=RECIPE_WORKERS[device],
    )  # fmt: skip


POINTS = [
    _nvidia("v100", "fp32", 112, "infiniband-edr", 367, 2855),
    _nvidia("v100", "bf16", 256, "infiniband-edr", 1200, 8322),
    _nvidia("a100", "fp32", 256, "infiniband-hdr", 938, 7248),
    _nvidia("a100", "bf16", 256, "infiniband-hdr", 2470, 16621),
    *[
        Published(HOROVOD, model, size, 64, "p100", "fp32", nodes, 4, "roce-25g", efficiency, rate_of, FUSION_MB)
        for nodes, efficiencies in ((32, (0.90, 0.90, 0.79)), (128, (0.90, 0.90, 0.68)))
        for (model, size, rate_of), efficiency in zip(
            (
                ("inception_v3", 299, ("inception_v3", 142)),
                ("resnet101", 224, ("resnet152", 91.8)),
                ("vgg16", 224, ("vgg16", 154)),
            ),
            efficiencies,
            strict=True,
        )
    ],
]


@functools.cache
def _profile(model: str, image_size: int) -> ModelProfile:
    return profile_model(model, image_size)


def predicted(point: Published, *, from_datasheet: bool = False, with_input: bool = True) -> StepSplit:
    profile = _profile(point.model, point.image_size)
    hardware = gpu_hardware(point.device, point.precision, point.nodes, point.per_node, point.network, 1)
    rated_model, rated_images_per_s = point.rate_of
    flop_per_s = rated_images_per_s * _profile(rated_model, point.image_size).train_flop_per_image
    images_per_s = None if from_datasheet else flop_per_s / profile.train_flop_per_image
    rate = device_rate(hardware, profile, images_per_s)
    synthetic = point.synthetic or not with_input
    data = input_pipeline(synthetic, hardware, TORCHVISION_IMAGES_PER_CORE, point.workers_per_device)
    work = workload(profile, point.batch, "ddp", "none", rate, point.bucket_mb, data.host)
    link = slowest_link(point.nodes, DEVICES[point.device].intra_node, NETWORKS[point.network])
    return step_split(work, point.nodes * point.per_node, link, point.per_node)


def main() -> None:
    print(
        "| published by | model | devices | links | buckets | input per node | published | predicted | error (points) "
        "| without overlap | without the input term | from datasheet |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors, datasheet_errors, inside = [], [], 0
    for point in POINTS:
        split, datasheet = predicted(point), predicted(point, from_datasheet=True)
        no_input = predicted(point, with_input=False)
        cores = DEVICES[point.device].host_cores
        data = (
            "synthetic"
            if point.synthetic
            else f"{cores} cores x {TORCHVISION_IMAGES_PER_CORE:.0f}/s, {point.workers_per_device} workers per GPU"
        )
        errors.append(abs(split.efficiency - point.efficiency) * 100)
        datasheet_errors.append(abs(datasheet.efficiency - point.efficiency) * 100)
        inside += split.efficiency_without_overlap <= point.efficiency <= split.efficiency
        devices = f"{point.nodes} x {point.per_node} {point.device} ({point.precision})"
        link = DEVICES[point.device].intra_node if point.nodes == 1 else NETWORKS[point.network]
        buckets = f"{point.bucket_mb:.0f} MB" if point.bucket_mb else "25 MB"
        print(
            f"| {point.source} | {point.model} | {devices} | {link.name} | {buckets} | {data} "
            f"| {point.efficiency:.0%} | {split.efficiency:.0%} | {(split.efficiency - point.efficiency) * 100:+.0f} "
            f"| {split.efficiency_without_overlap:.0%} | {no_input.efficiency:.0%} "
            f"| {datasheet.efficiency:.0%} ({(datasheet.efficiency - point.efficiency) * 100:+.0f}) |"
        )
    within = sum(error <= 10 for error in errors)
    print(
        f"\nwithin ±10 points: {within} of {len(errors)}; largest error {max(errors):.0f} points; "
        f"published value between the two predictions: {inside} of {len(errors)}; from the datasheet alone: "
        f"{sum(error <= 10 for error in datasheet_errors)} of {len(errors)} within ±10 points"
    )


if __name__ == "__main__":
    main()
