"""`clusterfit bench train`: training images/s of clusterfit vs a hand-written torchrun + DDP loop.

For each model x worker count, in the same run and on the same model, per-rank batch, image size, precision,
channels_last and threads per rank (cores / ranks; with `cores_per_rank`, a cell of n ranks gets n x that
many cores):

- clusterfit: `clusterfit run` of a synthetic-data job that logs every `window` steps; images/s per window from
  its metrics.jsonl;
- hand-written: the baselines package's ddp_loop under torchrun; per-step wall time printed by rank 0;
- Ray Train: the same loop function run by Ray Train's TorchTrainer on a local Ray instance
  (the baselines package's ray_loop); per-step wall time of rank 0;
- with `grad_compression`, clusterfit once more with that DDP communication hook (`trainer.grad_compression`):
  an option of clusterfit's that the baselines do not take, measured against the same references.

Every system is measured in windows of `window` steps (the baselines' step times summed per window). A window,
not a step, because clusterfit's per-step figures would need a log record every step, and each costs a
collective (the interval's loss averaged over the ranks) that a job pays every `log_every_steps` (10 by
default): logging every step is a setting no job needs, and it cost about 3 % of a 2-rank ResNet-18 step.

These machines' speed drifts by a quarter within minutes, so a cell runs every system `rounds` times in
alternation, each round starting with the next system in turn (no system is always first, which measured
fastest). A run's figure is its median window after `warmup` steps; a system's figure is the median of its
rounds, shown with their range, and a ratio whose two ranges overlap is marked as within noise. Weak-scaling
efficiency is throughput(n) / (n x throughput(1)); the headline is the ratio clusterfit / each baseline per cell.

The step time is split into compute, communication and data wait. Compute is measured in the same run by the
hand-written loop with `--no-comm`: the same ranks on the same cores, each training its own replica without DDP.
Data wait is what clusterfit's trainer measures around its data loader (the hand-written loop reuses one batch).
What remains of the step is the part of the collectives that backward did not hide, plus the system's other
per-step work; it is negative where a system's own step is cheaper than the hand-written loop's compute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import get_args

import yaml

from clusterfit.backends.torchrun import threads_per_worker
from clusterfit.bench.machine import bench_precision, cpu_model
from clusterfit.outputs import JobOutputs, RecordKind, read_records
from clusterfit.plots import pyplot
from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import MODEL_NAMES, TrainerSpec

# Run as modules of the installed package (`python -m`), from any working directory.
BASELINE_MODULE = "clusterfit.bench.baselines.ddp_loop"
RAY_MODULE = "clusterfit.bench.baselines.ray_loop"
HAND_WRITTEN, RAY_TRAIN, CLUSTERFIT = "hand-written DDP", "Ray Train", "clusterfit"
SYSTEMS = (HAND_WRITTEN, RAY_TRAIN, CLUSTERFIT)
# trainer.grad_compression's values other than none
GRAD_COMPRESSIONS = tuple(k for k in get_args(TrainerSpec.model_fields["grad_compression"].annotation) if k != "none")
RESULTS_JSON = "train.json"
RESULTS_PNG = "train.png"
NUM_CLASSES = 1000
_TAIL = 1500  # characters of a failed run's output quoted in the error


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    models: tuple[str, ...] = ("resnet18", "resnet50")
    workers: tuple[int, ...] = (1, 2)
    image_size: int = 128
    batch: int = 16  # images per rank per step
    steps: int = 30
    warmup: int = 5  # steps left out of the median
    window: int = 5  # steps per measurement (clusterfit's log_every_steps); divides steps and warmup
    rounds: int = 3  # runs of every system per cell, in alternation
    precision: str = "auto"
    channels_last: bool = True
    ray: bool = True  # Ray Train's TorchTrainer as a second baseline (needs the ray extra)
    # None: a fresh local Ray instance per run, alone on the machine as the other systems are. An address joins a
    # running cluster instead (its start-up is not paid again), which must have a CPU free for every worker.
    ray_address: str | None = None
    # None: every cell shares all cores (threads per rank = cores / ranks). K: a cell of n ranks runs on n x K
    # cores (CPU affinity), as if each rank brought its own cores: the weak scaling of more machines or GPUs.
    cores_per_rank: int | None = None
    # "none", or a trainer.grad_compression value: clusterfit is also measured with that communication hook.
    grad_compression: str = "none"

    @property
    def warmup_windows(self) -> int:
        return self.warmup // self.window

    @property
    def systems(self) -> tuple[str, ...]:
        return (*(SYSTEMS if self.ray else (HAND_WRITTEN, CLUSTERFIT)), *self.compressed)

    @property
    def compressed(self) -> tuple[str, ...]:
        """clusterfit with the gradient compression asked for, as a system of its own (or none)."""
        return () if self.grad_compression == "none" else (compressed_system(self.grad_compression),)

    @property
    def ours(self) -> tuple[str, ...]:
        return (CLUSTERFIT, *self.compressed)

    @property
    def baselines(self) -> tuple[str, ...]:
        return tuple(s for s in self.systems if s not in self.ours)

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODEL_NAMES]
        if not self.models or unknown:
            raise SpecError(f"--models {','.join(self.models)}: unknown model; choose from {', '.join(MODEL_NAMES)}")
        if not self.workers or min(self.workers) < 1:
            raise SpecError(f"--workers {','.join(map(str, self.workers))}: worker counts must be 1 or more")
        if self.rounds < 1:
            raise SpecError(f"--rounds {self.rounds}: run every system at least once per cell")
        if self.steps <= self.warmup:
            raise SpecError(f"--steps {self.steps}: must exceed --warmup {self.warmup} to leave steps to measure")
        if self.window < 1 or self.steps % self.window or self.warmup % self.window:
            raise SpecError(
                f"--window {self.window}: must divide --steps {self.steps} and --warmup {self.warmup} "
                "(windows of whole steps)"
            )
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise SpecError(f"--precision {self.precision}: choose auto, fp32, bf16 or fp16")
        if self.grad_compression not in ("none", *GRAD_COMPRESSIONS):
            raise SpecError(f"--grad-compression {self.grad_compression}: choose none, {', '.join(GRAD_COMPRESSIONS)}")
        if self.cores_per_rank is not None:
            cores = len(os.sched_getaffinity(0))
            if self.cores_per_rank < 1 or max(self.workers) * self.cores_per_rank > cores:
                raise SpecError(
                    f"--cores-per-rank {self.cores_per_rank}: {max(self.workers)} worker(s) x "
                    f"{self.cores_per_rank} core(s) must fit the {cores} core(s) this process may use"
                )

    def cores_for(self, workers: int) -> set[int]:
        """The cores a cell of `workers` ranks runs on."""
        available = sorted(os.sched_getaffinity(0))
        return set(available if self.cores_per_rank is None else available[: workers * self.cores_per_rank])


def compressed_system(kind: str) -> str:
    return f"clusterfit + {kind} gradients"


def parse_list(flag: str, text: str, kind: type = str) -> tuple:
    """'a,b' -> ('a', 'b'); a one-line error naming the flag otherwise."""
    try:
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecError(f"{flag} {text}: expected a comma-separated list of {kind.__name__}") from None


@dataclass
class Cell:
    system: str
    model: str
    workers: int
    threads_per_rank: int
    window_images_per_s: list[list[float]]  # every window of every round, warm-up included
    round_images_per_s: list[float]  # each round's median window after warm-up
    scaling_efficiency: float | None = None  # throughput(n) / (n x throughput(1)); None without a 1-worker cell
    # Against one reference for every system, the hand-written loop's 1-rank cell: the throughput reached, and
    # what the cell's compute alone would reach (its exposed communication and other per-step work hidden).
    efficiency_vs_reference: float | None = None
    efficiency_bound: float | None = None
    split: StepSplit | None = None

    @property
    def images_per_s(self) -> float:
        return statistics.median(self.round_images_per_s)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.round_images_per_s), max(self.round_images_per_s)

    def overlaps(self, other: Cell) -> bool:
        """Whether the two systems' round ranges overlap: their difference is within the machine's noise."""
        return self.spread[0] <= other.spread[1] and other.spread[0] <= self.spread[1]


@dataclass(frozen=True)
class StepSplit:
    """Seconds per step in the median window after warm-up, and its parts."""

    step_s: float
    compute_s: float  # the same per-rank work without communication (hand-written loop, --no-comm)
    data_wait_s: float
    # NOTE: what remains, step - compute - data wait: the communication backward did not hide plus the system's
    # other per-step work. Not clipped at 0: below 0 the system's own step is cheaper than the hand-written one.
    communication_s: float

    @classmethod
    def of(cls, step_s: float, compute_s: float, data_wait_s: float) -> StepSplit:
        return cls(step_s, compute_s, data_wait_s, step_s - compute_s - data_wait_s)


@dataclass
class TrainBenchReport:
    config: TrainBenchConfig
    machine: dict[str, object]
    precision: str
    cells: list[Cell] = field(default_factory=list)
    orders: dict[str, list[list[str]]] = field(default_factory=dict)  # "model/workers" -> each round's order

    def cell(self, system: str, model: str, workers: int) -> Cell:
        found = self._find(system, model, workers)
        if found is None:
            raise KeyError(f"no {system} cell for {model} on {workers} worker(s)")
        return found

    def _find(self, system: str, model: str, workers: int) -> Cell | None:
        return next((c for c in self.cells if (c.system, c.model, c.workers) == (system, model, workers)), None)

    def ratio(self, model: str, workers: int, baseline: str = HAND_WRITTEN, system: str = CLUSTERFIT) -> float:
        return self.cell(system, model, workers).images_per_s / self.cell(baseline, model, workers).images_per_s

    def _ratio_text(self, model: str, workers: int, baseline: str, system: str) -> str:
        ours, theirs = self.cell(system, model, workers), self.cell(baseline, model, workers)
        noise = " ~" if self.config.rounds > 1 and ours.overlaps(theirs) else ""
        return f"{self.ratio(model, workers, baseline, system):.2f}x{noise}"

    def _pairs(self) -> list[tuple[str, str]]:
        """(one of ours, a baseline): the ratio columns."""
        return [(system, baseline) for system in self.config.ours for baseline in self.config.baselines]

    def _never_first(self) -> list[str]:
        """A note naming the systems no round started with (fewer rounds than systems): on a drifting machine
        the first run of a round measured fastest, so their figures lack that advantage."""
        rounds = [order for orders in self.orders.values() for order in orders]
        firsts = {order[0] for order in rounds}
        never = [system for system in self.config.systems if rounds and system not in firsts]
        if not never:
            return []
        cell_rounds = max(len(orders) for orders in self.orders.values())
        return [
            f"Never first in a round ({cell_rounds} round(s) of {len(rounds[0])} runs per cell): "
            f"{', '.join(never)}; on a drifting machine the first run measured fastest."
        ]

    def fill_scaling(self) -> None:
        for c in self.cells:
            own, reference = self._find(c.system, c.model, 1), self._find(HAND_WRITTEN, c.model, 1)
            c.scaling_efficiency = c.images_per_s / (c.workers * own.images_per_s) if own else None
            if reference:
                c.efficiency_vs_reference = c.images_per_s / (c.workers * reference.images_per_s)
                if c.split is not None:
                    c.efficiency_bound = self.config.batch / (c.split.compute_s * reference.images_per_s)

    def to_json(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "machine": self.machine,
            "precision": self.precision,
            "cells": [{**asdict(c), "images_per_s": c.images_per_s} for c in self.cells],
            "orders": self.orders,
            "ratios": [
                {"model": m, "workers": n, **{_ratio_key(s, b): self.ratio(m, n, b, s) for s, b in self._pairs()}}
                for m in self.config.models
                for n in self.config.workers
            ],
        }

    def markdown(self) -> str:
        c, m = self.config, self.machine
        lines = [
            f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {m['device']}",
            f"{c.image_size}x{c.image_size} synthetic images, batch {c.batch} per rank, {self.precision}, "
            f"channels_last {c.channels_last}; images/s: median over {c.rounds} alternating round(s) of each run's "
            f"median window of {c.window} step(s) over steps {c.warmup + 1}-{c.steps} (min-max of the rounds); "
            + (f"a cell of n ranks on n x {c.cores_per_rank} core(s)" if c.cores_per_rank else "all cores shared"),
            "",
            "| model | workers | threads/rank | "
            + " | ".join(f"{system} images/s" for system in c.systems)
            + " | "
            + " | ".join(f"{s} ÷ {b}" for s, b in self._pairs())
            + " | "
            + " | ".join(f"scaling eff. {system}" for system in c.systems)
            + " |",
            "|---|---:|---:|" + "---:|" * (2 * len(c.systems) + len(self._pairs())),
        ]
        for model in c.models:
            for n in c.workers:
                cells = [self.cell(s, model, n) for s in c.systems]
                lines.append(
                    f"| {model} | {n} | {cells[0].threads_per_rank} | "
                    + " | ".join(_rate(cell) for cell in cells)
                    + " | "
                    + " | ".join(self._ratio_text(model, n, b, s) for s, b in self._pairs())
                    + " | "
                    + " | ".join(_eff(cell) for cell in cells)
                    + " |"
                )
        lines += [
            "",
            "~: the two systems' round ranges overlap, so the difference is within this machine's noise.",
            *self._never_first(),
            *(
                [
                    "On 1 worker clusterfit trains without a DDP wrapper (nothing to all-reduce, so nothing to"
                    " compress); the baselines keep theirs, so a gain there is not a gain of distributed training."
                ]
                if 1 in c.workers
                else []
            ),
        ]
        lines += [
            "",
            "Step time split (ms per step in the median window after warm-up; compute = the hand-written loop's"
            " ranks without communication; the rest = step - compute - data wait):",
            "",
            "| model | workers | system | step | compute | rest: exposed communication + other | data wait "
            "| eff. vs hand-written 1 rank | eff. with the rest hidden |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for model in c.models:
            for n in c.workers:
                for system in c.systems:
                    cell = self.cell(system, model, n)
                    if cell.split is not None:
                        split = cell.split
                        lines.append(
                            f"| {model} | {n} | {system} | {1000 * split.step_s:.0f} | {1000 * split.compute_s:.0f} "
                            f"| {1000 * split.communication_s:.0f} | {1000 * split.data_wait_s:.0f} "
                            f"| {_fraction(cell.efficiency_vs_reference)} | {_fraction(cell.efficiency_bound)} |"
                        )
        if 1 in c.workers:
            lines += [
                "",
                "Efficiencies against one reference for every system, the hand-written loop on 1 rank:"
                " throughput(n) / (n x its throughput), and the same with the step cut to its compute (the"
                " bound if the exposed communication and other per-step work were hidden).",
            ]
        return "\n".join(lines)


def _rate(cell: Cell) -> str:
    low, high = cell.spread
    return f"{cell.images_per_s:.1f}" if low == high else f"{cell.images_per_s:.1f} ({low:.1f}-{high:.1f})"


def _ratio_key(system: str, baseline: str) -> str:
    return f"{_snake(system)}_over_{_snake(baseline)}"


def _snake(name: str) -> str:
    return "_".join(name.lower().replace("-", " ").replace("+", " ").split())


def _eff(cell: Cell) -> str:
    return _fraction(cell.scaling_efficiency)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def machine_facts() -> dict[str, object]:
    import torch  # here, not at the top: the bench commands check their flags before torch's seconds of import

    cpu = cpu_model()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
    }


def median_after_warmup(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:])


def per_window(step_images_per_s: list[float], window: int) -> list[float]:
    """Images/s of each run of `window` steps: their images over their summed time."""
    return [
        window / sum(1 / rate for rate in step_images_per_s[start : start + window])
        for start in range(0, len(step_images_per_s), window)
    ]


def run_clusterfit(
    config: TrainBenchConfig,
    model: str,
    workers: int,
    precision: str,
    workdir: Path,
    trainer_settings: dict[str, object] | None = None,
) -> tuple[list[float], list[float]]:
    """Global images/s and data-wait seconds per step of each window of `clusterfit run` on synthetic data,
    from its metrics (one record per window)."""
    out = workdir / f"clusterfit-{model}-{workers}"
    shutil.rmtree(out, ignore_errors=True)  # each round trains from scratch, not a resume of the last one
    job = {
        "name": f"bench-{model}-{workers}",
        "trainer": {
            "model": model,
            "data": {"train": "synthetic", "image_size": config.image_size, "num_classes": NUM_CLASSES},
            "epochs": 1,
            "steps_per_epoch": config.steps,
            "batch_size": config.batch,
            "precision": precision,
            "channels_last": config.channels_last,
            "log_every_steps": config.window,
            "checkpoint": {"every_steps": None, "keep": 1},
            **(trainer_settings or {}),
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": workers},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"clusterfit-{model}-{workers}.yaml"
    spec.write_text(yaml.safe_dump(job, sort_keys=False))
    _run(f"clusterfit run ({model}, {workers} worker(s))", [sys.executable, "-m", "clusterfit", "run", str(spec)])
    steps = read_records(JobOutputs.at(out).metrics, [RecordKind.TRAIN])
    global_batch = config.batch * workers
    return [r["images_per_s"] for r in steps], [r["data_wait"] * global_batch / r["images_per_s"] for r in steps]


def run_baseline(
    config: TrainBenchConfig, model: str, workers: int, precision: str, communicate: bool = True, ray: bool = False
) -> list[float]:
    """Per-step global images/s of the hand-written loop under torchrun (or Ray Train), from rank 0's step
    times; without communication (`--no-comm`) every rank trains its own replica."""
    if ray:
        launcher = [sys.executable, "-m", RAY_MODULE, f"--workers={workers}"]
        if config.ray_address:
            launcher.append(f"--address={config.ray_address}")
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={workers}",
            "-m",
            BASELINE_MODULE,
        ]
    command = [
        *launcher,
        f"--model={model}",
        f"--image-size={config.image_size}",
        f"--batch={config.batch}",
        f"--steps={config.steps}",
        f"--num-classes={NUM_CLASSES}",
        f"--precision={precision}",
        *([] if config.channels_last else ["--no-channels-last"]),
        *([] if communicate else ["--no-comm"]),
    ]
    threads = threads_per_worker(workers)  # of the cell's cores
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    what = RAY_TRAIN if ray else "hand-written DDP loop" if communicate else "hand-written loop without communication"
    stdout = _run(f"{what} ({model}, {workers} worker(s))", command, env)
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"kind": ')]
    started = next((r for r in records if r["kind"] == "start"), {})
    if started.get("threads") != threads:
        raise SpecError(f"{what} ran with {started.get('threads')} threads per rank, not the cell's {threads}")
    return [config.batch * workers / r["seconds"] for r in records if r["kind"] == "step"]


def _median_seconds(images_per_s: list[float], config: TrainBenchConfig, workers: int) -> float:
    return median_after_warmup([config.batch * workers / rate for rate in images_per_s], config.warmup_windows)


def _run(what: str, command: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        tail = (result.stderr or result.stdout)[-_TAIL:].strip().splitlines()
        raise SpecError(f"{what} failed with exit code {result.returncode}: {tail[-1] if tail else 'no output'}")
    return result.stdout


def run_train_bench(config: TrainBenchConfig, out_dir: Path) -> TrainBenchReport:
    """Every model x worker count, each cell's systems measured in alternating rounds."""
    pyplot("clusterfit bench train", "bench")  # before minutes of training, not after
    if config.ray:
        _require_ray()
    precision = bench_precision(config.precision)  # every system gets this concrete dtype
    report = TrainBenchReport(config, machine_facts(), precision)
    with tempfile.TemporaryDirectory(prefix="clusterfit-bench-train-") as tmp:
        for model in config.models:
            for workers in config.workers:
                with _on_cores(config.cores_for(workers)):  # every system's processes inherit the affinity
                    cells, orders = _measure_cell(config, model, workers, precision, Path(tmp))
                report.cells += cells
                report.orders[f"{model}/{workers}"] = orders
    report.fill_scaling()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_JSON).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    plot(report, out_dir / RESULTS_PNG)
    return report


@contextmanager
def _on_cores(cores: set[int]) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


COMPUTE_ONLY = "compute only"  # the hand-written loop without communication: the split's reference


def rotations(names: tuple[str, ...], rounds: int) -> list[list[str]]:
    """Each round's order: the rows of a Williams design (a Latin square balanced for neighbours; the rows of its
    mirror follow for an odd number of names), repeated. Over n rounds (2n for an odd n) each name takes the first
    slot, measured fastest on drifting machines, equally often, and runs right after each other name equally
    often: no system always follows the same one (Ray Train leaves its processes winding down after its run)."""
    count = len(names)
    base = [0]  # 0, 1, n-1, 2, n-2, ...
    for index in range(1, count):
        base.append((index + 1) // 2 if index % 2 else count - index // 2)
    square = [[(slot + row) % count for slot in base] for row in range(count)]
    if count % 2:
        square += [order[::-1] for order in square]
    # Named so that the first round runs the systems in the order given (a relabelling keeps the balance).
    name_of = {slot: names[position] for position, slot in enumerate(base)}
    return [[name_of[slot] for slot in square[round_index % len(square)]] for round_index in range(rounds)]


def _measure_cell(
    config: TrainBenchConfig, model: str, workers: int, precision: str, tmp: Path
) -> tuple[list[Cell], list[list[str]]]:
    """Every system on one model x worker count in alternating rounds, with the step split against the loop
    without communication (itself one of the alternating runs)."""
    orders = rotations((COMPUTE_ONLY, *config.systems), config.rounds)
    windows: dict[str, list[list[float]]] = {name: [] for name in orders[0]}
    waits: dict[str, list[list[float]]] = {name: [] for name in orders[0]}
    for order in orders:
        for name in order:
            run_windows, run_waits = _run_system(name, config, model, workers, precision, tmp)
            if len(run_windows) != config.steps // config.window:
                raise SpecError(
                    f"{name} ({model}, {workers}): {len(run_windows)} timed windows, expected "
                    f"{config.steps // config.window}"
                )
            windows[name].append(run_windows)
            waits[name].append(run_waits)
    compute_s = statistics.median(_median_seconds(run, config, workers) for run in windows[COMPUTE_ONLY])
    threads = threads_per_worker(workers)
    cells = []
    for system in config.systems:
        split = StepSplit.of(
            statistics.median(_median_seconds(run, config, workers) for run in windows[system]),
            compute_s,
            statistics.median(median_after_warmup(run, config.warmup_windows) for run in waits[system]),
        )
        rounds = [median_after_warmup(run, config.warmup_windows) for run in windows[system]]
        cells.append(Cell(system, model, workers, threads, windows[system], rounds, split=split))
    return cells, orders


def _run_system(
    name: str, config: TrainBenchConfig, model: str, workers: int, precision: str, tmp: Path
) -> tuple[list[float], list[float]]:
    """One run: images/s and data-wait seconds per step of each window (the baselines reuse one batch: no wait)."""
    if name == CLUSTERFIT:
        return run_clusterfit(config, model, workers, precision, tmp)
    if name in config.compressed:
        return run_clusterfit(config, model, workers, precision, tmp, {"grad_compression": config.grad_compression})
    if name == COMPUTE_ONLY:
        run = run_baseline(config, model, workers, precision, communicate=False)
    else:
        run = run_baseline(config, model, workers, precision, ray=name == RAY_TRAIN)
    windows = per_window(run, config.window)
    return windows, [0.0] * len(windows)


def plot(report: TrainBenchReport, path: Path) -> None:
    """Bars: images/s per model x workers, hand-written beside clusterfit; line: scaling efficiency (right axis)."""
    plt = pyplot("clusterfit bench train", "bench")

    c = report.config
    groups = [(m, n) for m in c.models for n in c.workers]
    x = list(range(len(groups)))
    systems = c.systems
    width = 0.8 / len(systems)
    colours = {
        HAND_WRITTEN: "#9e9e9e",
        RAY_TRAIN: "#ff7f0e",
        CLUSTERFIT: "#1f77b4",
        **dict.fromkeys(c.compressed, "#2ca02c"),
    }
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups) + 2), 5.0))
    offsets = [(i - (len(systems) - 1) / 2) * width for i in range(len(systems))]
    for offset, system in zip(offsets, systems, strict=True):
        cells = [report.cell(system, m, n) for m, n in groups]
        values = [cell.images_per_s for cell in cells]
        spread = [
            [cell.images_per_s - cell.spread[0] for cell in cells],
            [cell.spread[1] - cell.images_per_s for cell in cells],
        ]
        bars = ax.bar(
            [i + offset for i in x],
            values,
            width,
            yerr=spread,
            capsize=3,
            label=f"{system} images/s",
            color=colours[system],
        )
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(x, [f"{m}\n{n} worker{'s' if n > 1 else ''}" for m, n in groups])
    ax.set_ylabel("images/s (median of rounds; bars: their range)")
    eff_ax = ax.twinx()
    markers = {HAND_WRITTEN: "s--", RAY_TRAIN: "^:", CLUSTERFIT: "o-", **dict.fromkeys(c.compressed, "D-.")}
    for system in systems:
        for model in c.models:
            points = [
                (i, report.cell(system, m, n).scaling_efficiency)
                for i, (m, n) in enumerate(groups)
                if m == model and report.cell(system, m, n).scaling_efficiency is not None
            ]
            if points:
                eff_ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    markers[system],
                    color=colours[system],
                    label=f"{system} scaling efficiency" if model == c.models[0] else None,
                )
    efficiencies = [cell.scaling_efficiency or 0.0 for cell in report.cells]
    eff_ax.set_ylim(0, max(1.2, 1.1 * max(efficiencies)))
    eff_ax.set_ylabel("weak-scaling efficiency")
    ax.set_ylim(0, 1.2 * max(cell.spread[1] for cell in report.cells))  # room for the bar labels
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = eff_ax.get_legend_handles_labels()
    ax.legend(
        handles + more_handles,
        labels + more_labels,
        fontsize=8,
        ncol=2,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),  # below the axes: never over a bar
    )
    m = report.machine
    ax.set_title(
        f"{c.image_size} px, batch {c.batch}/rank, {report.precision}; {m['cpu']}, {m['cores']} cores, "
        f"torch {m['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise SpecError("the Ray Train baseline needs ray[train]: pip install 'clusterfit[ray]', or pass --no-ray")
