"""`clusterfit plan`'s cost model against published multi-GPU scaling results: for each published point, the
model's predicted weak-scaling efficiency next to the published one, and the error in points.

    python benchmarks/plan_validation.py          # prints the markdown table of benchmarks/RESULTS.md

Published points (efficiency = N-device images/s / (N x 1-device images/s)):
- NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README, "Training performance results"
  (pytorch-21.03 NGC container): DGX-1 16 GB (8x V100, NVLink) FP32 367 -> 2855 img/s, mixed precision
  1200 -> 8322; DGX A100 80 GB (8x A100, NVSwitch) TF32 938 -> 7248, mixed precision 2470 -> 16621.
  Batch 256 per GPU assumed (the README's default configurations).
- Horovod's README and docs/benchmarks: 128 servers x 4 Pascal GPUs on RoCE-capable 25 Gbit/s Ethernet,
  90 % for Inception V3 and ResNet-101, 68 % for VGG-16; 32 servers x 4 GPUs: 90 %, 90 %, 79 %
  (TensorFlow's tf_cnn_benchmarks, batch 64 per GPU, fp32; P100 PCIe assumed).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clusterfit.plan.costmodel import StepSplit, slowest_link, step_split  # noqa: E402
from clusterfit.plan.hardware import DEVICES, NETWORKS  # noqa: E402
from clusterfit.plan.planner import device_rate, gpu_hardware, workload  # noqa: E402
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


NVIDIA = "NVIDIA DGX, PyTorch"
HOROVOD = "Horovod, TensorFlow"
POINTS = [
    Published(NVIDIA, "resnet50", 224, 256, "v100", "fp32", 1, 8, "infiniband-edr", 2855 / (8 * 367)),
    Published(NVIDIA, "resnet50", 224, 256, "v100", "bf16", 1, 8, "infiniband-edr", 8322 / (8 * 1200)),
    Published(NVIDIA, "resnet50", 224, 256, "a100", "fp32", 1, 8, "infiniband-hdr", 7248 / (8 * 938)),
    Published(NVIDIA, "resnet50", 224, 256, "a100", "bf16", 1, 8, "infiniband-hdr", 16621 / (8 * 2470)),
    *[
        Published(HOROVOD, model, size, 64, "p100", "fp32", nodes, 4, "roce-25g", efficiency)
        for nodes, efficiencies in ((32, (0.90, 0.90, 0.79)), (128, (0.90, 0.90, 0.68)))
        for (model, size), efficiency in zip(
            (("inception_v3", 299), ("resnet101", 224), ("vgg16", 224)), efficiencies, strict=True
        )
    ],
]


@functools.cache
def _profile(model: str, image_size: int) -> ModelProfile:
    return profile_model(model, image_size)


def predicted(point: Published) -> StepSplit:
    profile = _profile(point.model, point.image_size)
    hardware = gpu_hardware(point.device, point.precision, point.nodes, point.per_node, point.network, 1)
    work = workload(profile, point.batch, "ddp", "none", device_rate(hardware, profile, None))
    link = slowest_link(point.nodes, DEVICES[point.device].intra_node, NETWORKS[point.network])
    return step_split(work, point.nodes * point.per_node, link)


def main() -> None:
    print("| published by | model | devices | links | published | predicted | error (points) | without overlap |")
    print("|---|---|---|---|---|---|---|---|")
    errors, inside = [], 0
    for point in POINTS:
        split = predicted(point)
        guess = split.efficiency
        errors.append(abs(guess - point.efficiency) * 100)
        inside += split.efficiency_without_overlap <= point.efficiency <= guess
        devices = f"{point.nodes} x {point.per_node} {point.device} ({point.precision})"
        link = DEVICES[point.device].intra_node if point.nodes == 1 else NETWORKS[point.network]
        print(
            f"| {point.source} | {point.model} | {devices} | {link.name} | {point.efficiency:.0%} | {guess:.0%} | "
            f"{(guess - point.efficiency) * 100:+.0f} | {split.efficiency_without_overlap:.0%} |"
        )
    within = sum(error <= 10 for error in errors)
    print(
        f"\nwithin ±10 points: {within} of {len(errors)}; largest error {max(errors):.0f} points; "
        f"published value between the two predictions: {inside} of {len(errors)}"
    )


if __name__ == "__main__":
    main()
