"""The hardware the planner knows, every number an assumption it states.

Peak rates are the vendors' datasheet figures (dense, no sparsity). A device never trains a convnet at peak:
`utilization` is the fraction that NVIDIA's own ResNet-50 training results reach on one GPU
(DeepLearningExamples, PyTorch ResNet-50 v1.5, pytorch-21.03 container: V100 367 img/s FP32 and 1200 img/s
mixed precision, A100 938 img/s TF32 and 2470 img/s mixed precision, at 24.3 GFLOP per training image).
Devices without such a result borrow the nearest one's, and say so. Link bandwidths are all-reduce bus
bandwidths (what nccl-tests reports), about 90 % of a network's line rate. Pass a measured `--images-per-s`
to replace the compute estimate altogether.

The input pipeline: the V100, A100 and H100 name the host of NVIDIA's DGX system built on them (its physical
cores, which decode and augment the images in loader workers, and its hardware threads, which set how many
workers a job starts by default), and a core's rate is measured by `clusterfit bench data` here. Pass
`--host-cores` and `--decode-per-core` for your own hosts (the P100 has no default)."""

from __future__ import annotations

from dataclasses import dataclass

from clusterfit.plan.costmodel import Link

TERA = 1e12
GB = 1e9
_LINE_RATE_SHARE = 0.9


@dataclass(frozen=True, kw_only=True)
class Device:
    name: str
    # precision -> datasheet FLOP/s. "fp32" is what an fp32 job gets: TF32 tensor cores on Ampere and later
    # (cuDNN's default for convolutions), "amp" is fp16/bf16 mixed precision.
    peak: dict[str, float]
    utilization: dict[str, float]
    intra_node: Link
    note: str
    host: str = ""  # the reference system whose host cores prepare the images
    host_cores: int | None = None  # its physical cores; None: no reference host, pass --host-cores
    # The CPUs a job there sees (two hardware threads per core), which set its loader workers' default count.
    host_cpus: int | None = None


_NVLINK_V100 = Link(name="NVLink (DGX-1, hybrid cube mesh)", bytes_per_s=130 * GB, latency_s=5e-6)
_NVSWITCH_A100 = Link(name="NVLink 3 + NVSwitch", bytes_per_s=230 * GB, latency_s=5e-6)
_NVSWITCH_H100 = Link(name="NVLink 4 + NVSwitch", bytes_per_s=450 * GB, latency_s=5e-6)
_PCIE3 = Link(name="PCIe 3.0 x16", bytes_per_s=10 * GB, latency_s=10e-6)
_SHARED_MEMORY = Link(name="shared memory (gloo)", bytes_per_s=5 * GB, latency_s=20e-6)

DEVICES: dict[str, Device] = {
    "p100": Device(
        name="NVIDIA P100 (PCIe)",
        peak={"fp32": 9.3 * TERA, "amp": 18.7 * TERA},
        utilization={"fp32": 0.57, "amp": 0.57},
        intra_node=_PCIE3,
        note="utilization assumed equal to the V100's FP32 (no published P100 ResNet-50 result used)",
    ),
    "v100": Device(
        name="NVIDIA V100 (SXM2)",
        peak={"fp32": 15.7 * TERA, "amp": 125 * TERA},
        utilization={"fp32": 0.57, "amp": 0.23},
        intra_node=_NVLINK_V100,
        note="utilization from NVIDIA's DGX-1 ResNet-50 results",
        host="DGX-1: 2 x 20-core Xeon E5-2698 v4",
        host_cores=40,
        host_cpus=80,
    ),
    "a100": Device(
        name="NVIDIA A100 (SXM4)",
        peak={"fp32": 156 * TERA, "amp": 312 * TERA},
        utilization={"fp32": 0.146, "amp": 0.19},
        intra_node=_NVSWITCH_A100,
        note="utilization from NVIDIA's DGX A100 ResNet-50 results",
        host="DGX A100: 2 x 64-core EPYC 7742",
        host_cores=128,
        host_cpus=256,
    ),
    "h100": Device(
        name="NVIDIA H100 (SXM5)",
        peak={"fp32": 495 * TERA, "amp": 989 * TERA},
        utilization={"fp32": 0.146, "amp": 0.19},
        intra_node=_NVSWITCH_H100,
        note="utilization assumed equal to the A100's (no published H100 ResNet-50 result used)",
        host="DGX H100: 2 x 56-core Xeon Platinum 8480C",
        host_cores=112,
        host_cpus=224,
    ),
}

# One CPU rank: its rate is measured on this machine, not looked up (see planner.cpu_device).
CPU_UTILIZATION = 0.40  # ResNet-50 training reached ~40 % of the fp32 matmul peak measured by `bench peak`
CPU_INTRA_NODE = _SHARED_MEMORY

# One host core's decode + RandomResizedCrop(224) + flip, images/s: `clusterfit bench data` on a 2.1 GHz Xeon
# (benchmarks/RESULTS.md, "Data loading", the slower of two runs) on ImageNet-sized JPEGs, through clusterfit's
# folder reader and from packed shards. Decoding costs by the source's pixels, so the crop size barely matters.
FOLDER_IMAGES_PER_CORE = 296.0
PACKED_IMAGES_PER_CORE = 656.0


def _network(name: str, gbit_per_s: float, latency_s: float) -> Link:
    return Link(name=name, bytes_per_s=gbit_per_s / 8 * GB * _LINE_RATE_SHARE, latency_s=latency_s)


NETWORKS: dict[str, Link] = {
    "ethernet-10g": _network("10 Gbit/s Ethernet (TCP)", 10, 30e-6),
    "ethernet-25g": _network("25 Gbit/s Ethernet (TCP)", 25, 30e-6),
    "roce-25g": _network("25 Gbit/s Ethernet with RoCE", 25, 8e-6),
    "ethernet-100g": _network("100 Gbit/s Ethernet (TCP)", 100, 30e-6),
    "infiniband-edr": _network("InfiniBand EDR, 100 Gbit/s", 100, 5e-6),
    "infiniband-hdr": _network("InfiniBand HDR, 200 Gbit/s", 200, 5e-6),
    "infiniband-ndr": _network("InfiniBand NDR, 400 Gbit/s", 400, 5e-6),
}


def with_nics(network: Link, nics_per_node: int) -> Link:
    """Rail-optimised nodes (a NIC per GPU, as in DGX systems) spread the ring's traffic over every NIC."""
    if nics_per_node == 1:
        return network
    return Link(
        name=f"{nics_per_node} x {network.name}",
        bytes_per_s=network.bytes_per_s * nics_per_node,
        latency_s=network.latency_s,
    )
