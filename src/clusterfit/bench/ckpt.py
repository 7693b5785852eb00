"""`clusterfit bench ckpt`: how long training stands still per checkpoint, synchronous vs asynchronous saving.

Three `clusterfit run`s of the same synthetic-data job, one after the other: no checkpoints during the epoch
(the reference; every run saves once more at the end of the epoch, after its last timed step),
`checkpoint.async_save: false` and `checkpoint.async_save: true`, each saving every `every` steps. The trainer
records, for every checkpoint, the time its loop was blocked in the save (gathering the state, copying or
writing it, and waiting for the previous save); the figure is the median over the checkpoints taken during the
epoch (the one at its end is followed by export either way). The wall time of the training steps shows what
the background writer costs the steps it overlaps, as a share of the run without checkpoints.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from clusterfit.backends.torchrun import threads_per_worker
from clusterfit.bench.machine import bench_precision
from clusterfit.bench.train import NUM_CLASSES, _run, machine_facts
from clusterfit.outputs import JobOutputs, RecordKind, read_records
from clusterfit.outputs.checkpoints import published
from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import MODEL_NAMES

MODES = ("none", "sync", "async")
_MODE_NAMES = {"none": "none mid-epoch", "sync": "synchronous", "async": "asynchronous"}
RESULTS_JSON = "ckpt.json"


@dataclass(frozen=True, kw_only=True)
class CkptBenchConfig:
    model: str = "resnet50"
    workers: int = 2
    image_size: int = 64
    batch: int = 8  # images per rank per step
    steps: int = 40
    every: int = 5  # steps between checkpoints
    precision: str = "auto"
    directory: Path | None = None  # where the checkpoints go (the disk measured); a temp folder by default

    def __post_init__(self) -> None:
        if self.model not in MODEL_NAMES:
            raise SpecError(f"--model {self.model}: unknown model; choose from {', '.join(MODEL_NAMES)}")
        if self.every >= self.steps:
            raise SpecError(f"--every {self.every}: must be below --steps {self.steps} to checkpoint mid-epoch")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise SpecError(f"--precision {self.precision}: choose auto, fp32, bf16 or fp16")


@dataclass
class ModeResult:
    mode: str
    stalls_s: list[float]  # per mid-epoch checkpoint
    step_seconds: list[float]  # per training step (from the per-step images/s)
    checkpoint_bytes: int

    @property
    def median_stall_s(self) -> float | None:
        return statistics.median(self.stalls_s) if self.stalls_s else None

    @property
    def training_seconds(self) -> float:
        return sum(self.step_seconds)


@dataclass
class CkptBenchReport:
    config: CkptBenchConfig
    machine: dict[str, object]
    precision: str
    results: list[ModeResult] = field(default_factory=list)

    def result(self, mode: str) -> ModeResult:
        return next(r for r in self.results if r.mode == mode)

    @property
    def stall_ratio(self) -> float:
        """async stall / sync stall: the headline (target at most 0.1)."""
        return self.result("async").median_stall_s / self.result("sync").median_stall_s

    def overhead(self, mode: str) -> float:
        """Extra training time over the run without checkpoints, as a share of it."""
        reference = self.result("none").training_seconds
        return self.result(mode).training_seconds / reference - 1

    def to_json(self) -> dict[str, object]:
        config = {**asdict(self.config), "directory": str(self.config.directory) if self.config.directory else None}
        return {
            "config": config,
            "machine": self.machine,
            "precision": self.precision,
            "results": [
                {**asdict(r), "median_stall_s": r.median_stall_s, "training_seconds": r.training_seconds}
                for r in self.results
            ],
            "async_over_sync_stall": self.stall_ratio,
            "overhead_vs_no_checkpoints": {mode: self.overhead(mode) for mode in ("sync", "async")},
        }

    def markdown(self) -> str:
        c, m = self.config, self.machine
        checkpoints = len(self.result("sync").stalls_s)
        lines = [
            f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {m['device']}",
            f"{c.model}, {c.workers} worker(s) x {threads_per_worker(c.workers)} thread(s), {c.image_size} px, "
            f"batch {c.batch} per rank, {self.precision}; {c.steps} steps, a checkpoint every {c.every} "
            f"({checkpoints} mid-epoch, {self.result('sync').checkpoint_bytes / 1e6:.0f} MB each)",
            "",
            "| saving | median stall per checkpoint | stall ÷ sync | training time | vs no checkpoints |",
            "|---|---:|---:|---:|---:|",
        ]
        sync_stall = self.result("sync").median_stall_s
        for r in self.results:
            stall = "-" if r.median_stall_s is None else f"{r.median_stall_s * 1000:.0f} ms"
            ratio = "-" if r.median_stall_s is None else f"{r.median_stall_s / sync_stall:.3f}"
            overhead = "-" if r.mode == "none" else f"{self.overhead(r.mode):+.1%}"
            lines.append(f"| {_MODE_NAMES[r.mode]} | {stall} | {ratio} | {r.training_seconds:.1f} s | {overhead} |")
        return "\n".join(lines)


def run_ckpt_bench(config: CkptBenchConfig, out_dir: Path | None) -> CkptBenchReport:
    precision = bench_precision(config.precision)  # every system gets this concrete dtype
    report = CkptBenchReport(config, machine_facts(), precision)
    if config.directory is not None:
        config.directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="clusterfit-bench-ckpt-", dir=config.directory) as tmp:
        for mode in MODES:
            report.results.append(_run_mode(config, mode, precision, Path(tmp)))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / RESULTS_JSON).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report


def _run_mode(config: CkptBenchConfig, mode: str, precision: str, workdir: Path) -> ModeResult:
    out = workdir / f"{mode}"
    job = {
        "name": f"bench-ckpt-{mode}",
        "trainer": {
            "model": config.model,
            "data": {"train": "synthetic", "image_size": config.image_size, "num_classes": NUM_CLASSES},
            "epochs": 1,
            "steps_per_epoch": config.steps,
            "batch_size": config.batch,
            "precision": precision,
            "channels_last": True,
            "log_every_steps": 1,
            "checkpoint": {
                "every_steps": None if mode == "none" else config.every,
                "keep": 2,
                "async_save": mode == "async",
            },
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": config.workers},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    spec = workdir / f"{mode}.yaml"
    spec.write_text(yaml.safe_dump(job, sort_keys=False))
    _run(f"clusterfit run ({mode} checkpoints)", [sys.executable, "-m", "clusterfit", "run", str(spec)])
    outputs = JobOutputs.at(out)
    global_batch = config.batch * config.workers
    step_seconds = [global_batch / r["images_per_s"] for r in read_records(outputs.metrics, [RecordKind.TRAIN])]
    stalls = [r["stall_s"] for r in read_records(outputs.metrics, [RecordKind.CHECKPOINT]) if r["step"] < config.steps]
    newest = published(outputs.checkpoints)
    size = sum(f.stat().st_size for f in newest[0].iterdir()) if newest else 0
    if len(step_seconds) != config.steps:
        raise SpecError(f"{mode} checkpoints: {len(step_seconds)} step timings, expected {config.steps}")
    return ModeResult(mode, stalls, step_seconds, size)
