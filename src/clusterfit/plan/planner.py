"""A job spec + hardware you name -> the predicted step split and scaling efficiency on 1 device, one node and
more nodes, and what would help. Pure apart from profiling the model (meta device) and, for `--device cpu`,
timing this machine's matmul peak."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from clusterfit.plan.costmodel import (
    DDP_BUCKET_BYTES,
    HostInput,
    Link,
    StepSplit,
    Workload,
    slowest_link,
    step_split,
)
from clusterfit.plan.hardware import (
    CPU_INTRA_NODE,
    CPU_UTILIZATION,
    DEVICES,
    FOLDER_IMAGES_PER_CORE,
    NETWORKS,
    PACKED_IMAGES_PER_CORE,
    Device,
    with_nics,
)
from clusterfit.plan.profile import ModelProfile
from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import LOADER_WORKERS_MAX

if TYPE_CHECKING:
    from clusterfit.spec import JobSpec

GOOD_EFFICIENCY = 0.9
# Bytes that cross the links per gradient element and step: DDP all-reduces fp32 gradients whatever the
# compute precision; FSDP's all-gather (forward) + reduce-scatter (backward) move 1.5x an all-reduce's data.
_STRATEGY_TRAFFIC = {"ddp": 1.0, "fsdp": 1.5}
_COMPRESSED_BYTES = {"none": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    device: Device
    precision: str  # "fp32" or "amp", the device table's keys
    nodes: int
    devices_per_node: int
    network: Link
    host_cores: int | None = None  # per node, preparing the images; None: not modelled
    host_cpus: int | None = None  # what a job on the node counts as its CPUs (hardware threads)


@dataclass(frozen=True)
class InputPipeline:
    """What prepares the job's images on each node, as the plan states it."""

    host: HostInput | None  # None: not modelled (synthetic data, or no host cores known)
    description: str


@dataclass(frozen=True)
class Plan:
    model: ModelProfile
    hardware: Hardware
    work: Workload
    rows: list[tuple[int, StepSplit]]  # (nodes, split), from one device to all of them
    advice: list[str]
    data: str  # the input pipeline's description, as assumed


def device_precision(job_precision: str) -> str:
    return "fp32" if job_precision == "fp32" else "amp"


def workload(
    profile: ModelProfile,
    batch: int,
    strategy: str,
    compression: str,
    device_flop_per_s: float,
    bucket_mb: float | None = None,
    host: HostInput | None = None,
) -> Workload:
    check_modelled(strategy, compression)
    return Workload(
        train_flop_per_image=profile.train_flop_per_image,
        gradient_bytes=profile.parameters * _COMPRESSED_BYTES[compression] * _STRATEGY_TRAFFIC[strategy],
        batch_per_device=batch,
        device_flop_per_s=device_flop_per_s,
        bucket_bytes=bucket_mb * 2**20 if bucket_mb else DDP_BUCKET_BYTES,
        host=host,
    )


def check_modelled(strategy: str, compression: str) -> None:
    if strategy not in _STRATEGY_TRAFFIC:
        raise SpecError(
            f"trainer.strategy = {strategy!r}: the planner models ddp and fsdp; plan the job with strategy ddp"
        )
    if compression not in _COMPRESSED_BYTES:
        raise SpecError(
            f"trainer.grad_compression = {compression!r}: the planner models none, bf16 and fp16; plan without it"
        )


def gpu_hardware(
    device: str, precision: str, nodes: int, per_node: int, network: str, nics: int, host_cores: int | None = None
) -> Hardware:
    """`host_cores` per node; None: the reference system's (a DGX's) where the device table names one. A host
    named by its cores is taken to run two hardware threads on each, as every DGX does."""
    if device not in DEVICES:
        raise SpecError(f"--device {device}: unknown; choose one of {', '.join([*DEVICES, 'cpu'])}")
    cpus = 2 * host_cores if host_cores else DEVICES[device].host_cpus
    return Hardware(
        device=DEVICES[device],
        precision=device_precision(precision),
        nodes=nodes,
        devices_per_node=per_node,
        network=network_link(network, nics),
        host_cores=host_cores or DEVICES[device].host_cores,
        host_cpus=cpus,
    )


def input_pipeline(
    synthetic: bool, hardware: Hardware, per_core: float | None, workers_per_device: int | None
) -> InputPipeline:
    """The node's loader workers (`workers_per_device` for each device, a core each at most; None: enough for
    every core) at one core's decode + augment rate (`--decode-per-core`, or clusterfit's folder reader as
    measured here)."""
    if synthetic:
        return InputPipeline(None, "synthetic, nothing to decode")
    cores = hardware.host_cores
    if cores is None:
        return InputPipeline(None, f"not modelled: pass --host-cores for the hosts of {hardware.device.name}")
    rate = per_core or FOLDER_IMAGES_PER_CORE
    host = HostInput(cores=cores, images_per_core=rate, workers_per_device=workers_per_device)
    measured = "--decode-per-core" if per_core else "clusterfit's folder reader, measured on a 2.1 GHz Xeon"
    if hardware.device.host and cores == hardware.device.host_cores:
        cores_of = f"{cores} host cores ({hardware.device.host})"
    else:
        cores_of = f"{cores} host cores"
    per_node = hardware.devices_per_node
    workers = "" if workers_per_device is None else f", {workers_per_device} loader workers per device"
    return InputPipeline(
        host,
        f"{cores_of} x {rate:,.0f} images/s each ({measured}){workers} = {host.images_per_s(1):,.0f}/s for 1 "
        f"device, {host.images_per_s(per_node):,.0f}/s for {per_node}",
    )


def network_link(network: str, nics: int) -> Link:
    if network not in NETWORKS:
        raise SpecError(f"--interconnect {network}: unknown; choose one of {', '.join(NETWORKS)}")
    return with_nics(NETWORKS[network], nics)


def cpu_device(peak_flop_per_s: float, precision: str, what: str) -> Device:
    """A CPU rank of this machine, at the matmul peak measured here."""
    return Device(
        name=what,
        peak={precision: peak_flop_per_s},
        utilization={precision: CPU_UTILIZATION},
        intra_node=CPU_INTRA_NODE,
        note="peak measured on this machine now; utilization from `bench train` on such a CPU",
    )


def device_rate(hardware: Hardware, profile: ModelProfile, images_per_s: float | None) -> float:
    """FLOP/s one device reaches on this model: measured (`--images-per-s`) or peak x utilization."""
    if images_per_s is not None:
        return images_per_s * profile.train_flop_per_image
    device = hardware.device
    return device.peak[hardware.precision] * device.utilization[hardware.precision]


def node_counts(nodes: int) -> list[int]:
    counts, n = [], 1
    while n < nodes:
        counts.append(n)
        n *= 2
    return [*counts, nodes]


def make_plan(profile: ModelProfile, hardware: Hardware, work: Workload, data: str) -> Plan:
    intra = hardware.device.intra_node
    per_node = hardware.devices_per_node
    rows = [(1, step_split(work, 1, intra))]
    for nodes in node_counts(hardware.nodes):
        devices = nodes * per_node
        if devices > 1:
            rows.append((nodes, step_split(work, devices, slowest_link(nodes, intra, hardware.network), per_node)))
    return Plan(profile, hardware, work, rows, advice(work, hardware, rows[-1]), data)


def advice(work: Workload, hardware: Hardware, last: tuple[int, StepSplit]) -> list[str]:
    """What would lift the largest configuration's efficiency, each option's effect computed, not guessed."""
    nodes, split = last
    # A node whose loader workers cannot feed even one device scales "well" against a reference that waits too.
    if split.efficiency >= GOOD_EFFICIENCY and not split.data_bound:
        return [
            f"{split.efficiency:.0%} efficient on {split.devices} devices: neither communication nor the input "
            "pipeline is the limit"
        ]
    per_node = hardware.devices_per_node
    link = slowest_link(nodes, hardware.device.intra_node, hardware.network)

    def efficiency(changed: Workload, link: Link = link) -> str:
        # images/s too: a change that speeds up the 1-device reference as much leaves the efficiency as it was
        changed_split = step_split(changed, split.devices, link, per_node)
        return f"{changed_split.images_per_s:,.0f} images/s, {changed_split.efficiency:.0%} efficient"

    if split.data_bound and work.host is not None:
        host, on_node = work.host, min(split.devices, per_node)
        consumed = on_node * work.batch_per_device / (split.compute_s + split.exposed_s)
        lines = [
            f"{split.efficiency:.0%} efficient on {split.devices} devices, and the input pipeline is the limit: a "
            f"node's loader workers prepare {host.images_per_s(on_node):,.0f} images/s where its devices would take "
            f"{consumed:,.0f}",
        ]
        # rounded up, so that every core gets a worker, and never past what the spec accepts
        one_per_core = min(-(-host.cores // per_node), LOADER_WORKERS_MAX)
        if host.workers_per_device is not None and host.workers_per_device < one_per_core:
            cores = "each of the host's" if one_per_core * per_node >= host.cores else "as many of the host's"
            lines.append(
                f"trainer.data.loader_workers: {one_per_core}, a worker for {cores} {host.cores} cores: "
                + efficiency(replace(work, host=replace(host, workers_per_device=one_per_core)))
            )
        packed = replace(host, images_per_core=host.images_per_core * PACKED_IMAGES_PER_CORE / FOLDER_IMAGES_PER_CORE)
        lines += [
            f"if the job reads image files, packed shards (`clusterfit data pack`, "
            f"{PACKED_IMAGES_PER_CORE / FOLDER_IMAGES_PER_CORE:.1f}x the images per core, measured here): "
            + efficiency(replace(work, host=packed)),
            "twice the host cores per node, a loader worker on each: "
            + efficiency(replace(work, host=replace(host, cores=2 * host.cores, workers_per_device=None))),
        ]
    else:
        lines = [
            f"{split.efficiency:.0%} efficient on {split.devices} devices: {split.exposed_s * 1e3:.0f} ms of each "
            f"{split.step_s * 1e3:.0f} ms step is all-reduce over {link.name} that backward does not hide"
        ]
    lines.append(
        f"twice the batch per device ({2 * work.batch_per_device}): "
        + efficiency(replace(work, batch_per_device=2 * work.batch_per_device))
    )
    lines.append(
        "bf16 gradient compression (trainer.grad_compression: bf16): "
        + efficiency(replace(work, gradient_bytes=work.gradient_bytes / 2))
    )
    if nodes > 1:
        lines.append(f"twice the network bandwidth per node: {efficiency(work, with_nics(hardware.network, 2))}")
        lines.append(
            f"scale up before scaling out: {per_node} devices on one node run at "
            f"{step_split(work, per_node, hardware.device.intra_node, per_node).efficiency:.0%}"
        )
    return lines


def markdown(plan: Plan) -> str:
    hw, work, profile = plan.hardware, plan.work, plan.model
    head = [
        f"{profile.name} at {profile.image_size} px: {profile.train_flop_per_image / 1e9:.1f} GFLOP per training "
        f"image, {profile.parameters / 1e6:.1f} M parameters, {work.gradient_bytes / 1e6:.0f} MB all-reduced per step",
        f"device: {hw.device.name}, {hw.precision}: {work.device_flop_per_s / 1e12:.1f} TFLOP/s reached "
        f"({hw.device.note}); batch {work.batch_per_device} per device",
        f"links: {hw.device.intra_node.name} in a node, {hw.network.name} between nodes",
        f"input pipeline per node: {plan.data}",
        "",
        "| nodes | devices | images/s | per device | step ms | compute ms | all-reduce ms | exposed ms | data ms "
        "| efficiency | without overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for nodes, s in plan.rows:
        head.append(
            f"| {nodes} | {s.devices} | {s.images_per_s:,.0f} | {s.images_per_s / s.devices:,.0f} | "
            f"{s.step_s * 1e3:.1f} | {s.compute_s * 1e3:.1f} | {s.allreduce_s * 1e3:.1f} | {s.exposed_s * 1e3:.1f} | "
            f"{s.data_s * 1e3:.1f} | {s.efficiency:.0%} | {s.efficiency_without_overlap:.0%} |"
        )
    return "\n".join([*head, "", *plan.advice])


def plan_job(
    spec: JobSpec,
    *,
    device: str,
    nodes: int,
    devices_per_node: int,
    interconnect: str,
    nics_per_node: int = 1,
    images_per_s: float | None = None,
    host_cores: int | None = None,
    decode_per_core: float | None = None,
) -> Plan:
    """The plan of a trainer job's spec on `nodes` x `devices_per_node` devices of kind `device`."""
    from clusterfit.plan.profile import profile_model

    if spec.trainer is None:
        raise SpecError("a command job has no model to profile; `clusterfit plan` plans trainer jobs")
    trainer = spec.trainer
    check_modelled(trainer.strategy, trainer.grad_compression)  # before the slower profile and peak
    if device == "cpu":
        if host_cores is not None or decode_per_core is not None:
            raise SpecError(
                "--host-cores/--decode-per-core: CPU ranks decode on the cores they train on, which their "
                "measured rate already pays; drop these options with --device cpu"
            )
        hardware = _cpu_hardware(trainer.precision, nodes, devices_per_node, interconnect, nics_per_node)
        data = InputPipeline(None, "on the ranks' own cores, not modelled apart")
    else:
        hardware = gpu_hardware(
            device, trainer.precision, nodes, devices_per_node, interconnect, nics_per_node, host_cores
        )
        workers = (
            None if hardware.host_cpus is None else trainer.data.workers_per_rank(hardware.host_cpus, devices_per_node)
        )
        data = input_pipeline(trainer.data.is_synthetic, hardware, decode_per_core, workers)
    profile = profile_model(trainer.model, trainer.data.train_crop, trainer.data.num_classes or 1000)
    rate = device_rate(hardware, profile, images_per_s)
    work = workload(
        profile,
        trainer.batch_size,
        trainer.strategy,
        trainer.grad_compression,
        rate,
        trainer.ddp_bucket_cap_mb,
        data.host,
    )
    return make_plan(profile, hardware, work, data.description)


def _cpu_hardware(precision: str, nodes: int, per_node: int, interconnect: str, nics: int) -> Hardware:
    """CPU ranks like this machine's: its matmul peak at the job's precision, measured now (a second) on all
    cores and shared by the node's ranks, as `bench train` shares them."""
    import torch

    from clusterfit.bench.machine import bench_precision, cpu_model
    from clusterfit.bench.peak import measure_matmul

    link = network_link(interconnect, nics)  # a misspelt network is refused before a second of measuring
    resolved = bench_precision(precision)
    peak = measure_matmul(resolved, 1024, 5, torch.device("cpu")).tflops * 1e12
    table_precision = device_precision(precision)
    device = cpu_device(peak / per_node, table_precision, f"{cpu_model()} ({resolved}), 1/{per_node} of its cores")
    return Hardware(device=device, precision=table_precision, nodes=nodes, devices_per_node=per_node, network=link)
