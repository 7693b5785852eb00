"""How a synchronous data-parallel step scales, as pure arithmetic: compute from the model's FLOP and the
device's rate, the gradient all-reduce from its bytes and the slowest link it crosses (ring, latency-bandwidth),
and the part of that all-reduce that backward does not hide (DDP's bucketed overlap). No torch, no I/O, so
every formula is tested on its own and the planner's table is reproducible from its inputs.

The host's cores decode and augment the images in loader workers that run ahead of the devices, so the input
pipeline only shows when a node's devices consume images faster than its workers prepare them: step time on n
devices = the longer of (compute + exposed all-reduce) and (the node's share of images / its workers' rate),
where a worker is one process, so the node's devices get at most one core per worker;
efficiency = 1-device step / n-device step (weak scaling, a fixed batch per device), the figure published for
NVIDIA's and Horovod's multi-GPU results."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # backward costs about twice forward: 2/3 of a training step's FLOP
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


@dataclass(frozen=True, kw_only=True)
class Link:
    """The slowest link an all-reduce crosses: NVLink/PCIe inside a node, the network between nodes."""

    name: str
    bytes_per_s: float  # all-reduce bus bandwidth the link sustains (not its line rate)
    latency_s: float  # per ring step


@dataclass(frozen=True, kw_only=True)
class HostInput:
    """One node's host preparing images for its devices: DataLoader workers, each a process that keeps at most
    one of the host's cores busy, each core at `images_per_core`."""

    cores: int
    images_per_core: float
    workers_per_device: int | None = None  # None: enough to keep every core busy

    def images_per_s(self, devices_on_node: int) -> float:
        if self.workers_per_device is None:
            return self.cores * self.images_per_core
        workers = max(1, self.workers_per_device) * devices_on_node  # 0 workers: the rank loads its own
        return min(self.cores, workers) * self.images_per_core


@dataclass(frozen=True, kw_only=True)
class Workload:
    train_flop_per_image: float  # forward + backward, at the job's image size
    gradient_bytes: float  # what one all-reduce moves per step (parameters x gradient element size)
    batch_per_device: int
    device_flop_per_s: float  # the rate one device reaches on this model (peak x utilization, or measured)
    bucket_bytes: float = DDP_BUCKET_BYTES
    # What decodes and augments one node's images; None: not modelled (synthetic data has nothing to prepare).
    host: HostInput | None = None


@dataclass(frozen=True)
class StepSplit:
    devices: int
    compute_s: float
    allreduce_s: float  # the whole all-reduce, as if nothing overlapped it
    exposed_s: float  # what backward does not hide
    data_s: float  # the host preparing this step's images for the node's devices, ahead of them
    images_per_s: float  # all devices together
    efficiency: float  # images/s / (devices x one device's images/s)
    efficiency_without_overlap: float  # the bound if nothing of the all-reduce ran under backward

    @property
    def step_s(self) -> float:
        return max(self.compute_s + self.exposed_s, self.data_s)

    @property
    def data_bound(self) -> bool:
        return self.data_s > self.compute_s + self.exposed_s


def ring_allreduce_s(nbytes: float, ranks: int, link: Link, buckets: int = 1) -> float:
    """A ring all-reduce of `nbytes` over `ranks`: every rank sends and receives 2(n-1)/n of the data through
    the slowest link, in 2(n-1) steps that each pay the link's latency, once per bucket."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / link.bytes_per_s + steps * link.latency_s * buckets


def buckets_of(gradient_bytes: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> int:
    return max(1, math.ceil(gradient_bytes / bucket_bytes))


def exposed_allreduce_s(allreduce_s: float, backward_s: float, buckets: int) -> float:
    """DDP starts a bucket's all-reduce as soon as backward has produced it, so all but the last bucket can
    run under the rest of backward; what remains is the longer of the last bucket and the overflow."""
    if allreduce_s == 0.0:
        return 0.0
    last_bucket = allreduce_s / buckets
    return max(last_bucket, allreduce_s - backward_s)


def input_s(work: Workload, devices_on_node: int) -> float:
    """The node's loader workers preparing one step's batch for each of its devices (0 for synthetic data)."""
    if work.host is None:
        return 0.0
    return work.batch_per_device * devices_on_node / work.host.images_per_s(devices_on_node)


def step_split(work: Workload, devices: int, link: Link, devices_per_node: int = 1) -> StepSplit:
    """`devices` in all, `devices_per_node` of them sharing one host's cores for their input."""
    compute = work.batch_per_device * work.train_flop_per_image / work.device_flop_per_s
    buckets = buckets_of(work.gradient_bytes, work.bucket_bytes)
    allreduce = ring_allreduce_s(work.gradient_bytes, devices, link, buckets)
    exposed = exposed_allreduce_s(allreduce, BACKWARD_SHARE * compute, buckets)
    data = input_s(work, min(devices, devices_per_node))
    one_device = max(compute, input_s(work, 1))  # the reference: one device, its own workers on an idle host
    step = max(compute + exposed, data)
    return StepSplit(
        devices=devices,
        compute_s=compute,
        allreduce_s=allreduce,
        exposed_s=exposed,
        data_s=data,
        images_per_s=devices * work.batch_per_device / step,
        efficiency=one_device / step,
        efficiency_without_overlap=one_device / max(compute + allreduce, data),
    )


def slowest_link(nodes: int, intra_node: Link, network: Link) -> Link:
    """One node's devices all-reduce over its own links; more nodes put the network in every ring."""
    return intra_node if nodes == 1 else network
