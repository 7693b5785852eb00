"""`clusterfit bench comm`: all-reduce bandwidth over message sizes, and the effect of DDP's bucket size on the
training step.

All-reduce: torchrun starts `workers` ranks of clusterfit.bench.allreduce (gloo on CPU, NCCL on GPUs); each size
is reduced `repeats` times after a barrier and the median time counts. Algorithm bandwidth is bytes / time; bus
bandwidth, 2(n-1)/n x bytes / time, is what each rank's link carries in a ring all-reduce, so it can be compared
across rank counts and with the link's own speed.

Bucket size: `clusterfit run` of the same synthetic job with `trainer.ddp_bucket_cap_mb` set to each value;
median step time after warm-up.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clusterfit.backends.torchrun import threads_per_worker
from clusterfit.bench.machine import bench_precision
from clusterfit.bench.train import TrainBenchConfig, _run, machine_facts, run_clusterfit
from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import MODEL_NAMES

RESULTS_JSON = "comm.json"


@dataclass(frozen=True, kw_only=True)
class CommBenchConfig:
    workers: int = 2
    sizes: tuple[int, ...] = tuple(4**k for k in range(5, 14)) + (100 * 2**20,)  # 1 KiB ... 64 MiB, 100 MiB
    repeats: int = 10
    model: str = "resnet50"
    buckets_mb: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)
    image_size: int = 64
    batch: int = 8
    steps: int = 20
    warmup: int = 5
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise SpecError(f"--workers {self.workers}: an all-reduce needs at least 2 ranks")
        if not self.sizes or min(self.sizes) < 4:
            raise SpecError(f"--sizes {','.join(map(str, self.sizes))}: sizes are bytes, at least 4 (one fp32)")
        if self.model not in MODEL_NAMES:
            raise SpecError(f"--model {self.model}: unknown model; choose from {', '.join(MODEL_NAMES)}")
        if any(mb <= 0 for mb in self.buckets_mb):
            raise SpecError(f"--buckets-mb {','.join(map(str, self.buckets_mb))}: bucket sizes must be above 0")
        if self.steps <= self.warmup:
            raise SpecError(f"--steps {self.steps}: must exceed --warmup {self.warmup} to leave steps to measure")


@dataclass(frozen=True)
class AllReduceResult:
    bytes: int
    seconds: float
    algorithm_gb_per_s: float
    bus_gb_per_s: float


@dataclass(frozen=True)
class BucketResult:
    bucket_cap_mb: float
    step_seconds: list[float]
    median_step_s: float


@dataclass
class CommBenchReport:
    config: CommBenchConfig
    machine: dict[str, object]
    backend: str = ""
    precision: str = ""
    allreduce: list[AllReduceResult] = field(default_factory=list)
    buckets: list[BucketResult] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "machine": self.machine,
            "backend": self.backend,
            "precision": self.precision,
            "allreduce": [asdict(r) for r in self.allreduce],
            "buckets": [asdict(b) for b in self.buckets],
        }

    def markdown(self) -> str:
        c, m = self.config, self.machine
        n = c.workers
        lines = [
            f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {m['device']}",
            f"all-reduce of fp32 tensors, {n} ranks x {threads_per_worker(n)} thread(s), {self.backend}, "
            f"median of {c.repeats}",
            "",
            "| size | time | algorithm bandwidth | bus bandwidth 2(n-1)/n x bytes/time |",
            "|---:|---:|---:|---:|",
        ]
        for r in self.allreduce:
            lines.append(
                f"| {_size(r.bytes)} | {_duration(r.seconds)} | {r.algorithm_gb_per_s:.3f} GB/s "
                f"| {r.bus_gb_per_s:.3f} GB/s |"
            )
        if self.buckets:
            base = next((b for b in self.buckets if b.bucket_cap_mb == 25.0), self.buckets[0])
            lines += [
                "",
                f"DDP bucket size: {c.model}, {n} ranks, {c.image_size} px, batch {c.batch} per rank, "
                f"{self.precision}, median step after {c.warmup} warm-up steps",
                "",
                f"| bucket_cap_mb | median step | vs {base.bucket_cap_mb:g} MB |",
                "|---:|---:|---:|",
            ]
            for b in self.buckets:
                lines.append(
                    f"| {b.bucket_cap_mb:g} | {1000 * b.median_step_s:.0f} ms "
                    f"| {b.median_step_s / base.median_step_s:.2f}x |"
                )
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> float:
    """Bytes per second each rank's link carries in a ring all-reduce: 2(n-1)/n x bytes / time."""
    return 2 * (ranks - 1) / ranks * size_bytes / seconds


def measure_allreduce(config: CommBenchConfig) -> tuple[str, list[AllReduceResult]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={config.workers}",
        "-m",
        "clusterfit.bench.allreduce",
        f"--sizes={','.join(map(str, config.sizes))}",
        f"--repeats={config.repeats}",
    ]
    env = {"OMP_NUM_THREADS": str(threads_per_worker(config.workers)), "PYTHONUNBUFFERED": "1"}
    stdout = _run(f"all-reduce sweep ({config.workers} ranks)", command, env)
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"kind": "allreduce"')]
    if len(records) != len(config.sizes):
        raise SpecError(f"all-reduce sweep: {len(records)} results, expected {len(config.sizes)}")
    results = [
        AllReduceResult(
            r["bytes"],
            r["seconds"],
            r["bytes"] / r["seconds"] / 1e9,
            bus_bandwidth(r["bytes"], r["seconds"], config.workers) / 1e9,
        )
        for r in records
    ]
    return records[0]["backend"], results


def measure_buckets(config: CommBenchConfig, precision: str, workdir: Path) -> list[BucketResult]:
    train = TrainBenchConfig(
        models=(config.model,),
        workers=(config.workers,),
        image_size=config.image_size,
        batch=config.batch,
        steps=config.steps,
        warmup=config.warmup,
        window=1,  # every step timed: the bucket sizes are compared within clusterfit, each logging alike
        precision=precision,
    )
    results = []
    for mb in config.buckets_mb:
        rates, _ = run_clusterfit(
            train, config.model, config.workers, precision, workdir / f"bucket-{mb:g}", {"ddp_bucket_cap_mb": mb}
        )
        seconds = [config.batch * config.workers / rate for rate in rates]
        results.append(BucketResult(mb, seconds, statistics.median(seconds[config.warmup :])))
    return results


def run_comm_bench(config: CommBenchConfig, out_dir: Path | None) -> CommBenchReport:
    precision = bench_precision(config.precision)  # every system gets this concrete dtype
    report = CommBenchReport(config, machine_facts(), precision=precision)
    report.backend, report.allreduce = measure_allreduce(config)
    with tempfile.TemporaryDirectory(prefix="clusterfit-bench-comm-") as tmp:
        report.buckets = measure_buckets(config, precision, Path(tmp))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / RESULTS_JSON).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
