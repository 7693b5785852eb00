"""`clusterfit bench ...`: measure clusterfit's parts on this machine. Each command builds its benchmark's config
(which checks the flags), runs it and prints its report; the modules beside this one do the measuring."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional, Protocol, TypeVar

import typer

from clusterfit.console import HELP_MARKUP, console, fail
from clusterfit.errors import ClusterfitError

bench_app = typer.Typer(
    help="Measure clusterfit's parts on this machine.", no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)


class _Report(Protocol):
    def markdown(self) -> str: ...


Report = TypeVar("Report", bound=_Report)


def _run(measure: Callable[[], Report], footer: Callable[[Report], str] | None = None) -> None:
    """Run a benchmark, print its report and then `footer` (where the results went). A bad flag, found when
    `measure` builds the config, or a missing extra is one line and exit 2, before anything is measured."""
    try:
        report = measure()
    except ClusterfitError as exc:
        raise fail(str(exc)) from None
    console.print(report.markdown(), markup=False, soft_wrap=True)
    if footer is not None:
        console.print(footer(report), markup=False)


@bench_app.command("data")
def bench_data(
    images: Annotated[int, typer.Option(min=1, help="Photos to generate and read once per pipeline.")] = 400,
    batch_size: Annotated[int, typer.Option(min=1, help="Images per batch.")] = 32,
    image_size: Annotated[int, typer.Option(min=16, help="RandomResizedCrop output side.")] = 224,
    max_side: Annotated[int, typer.Option(min=16, help="--max-side of the packed dataset.")] = 320,
) -> None:
    """Images/s per CPU core of decode + RandomResizedCrop + flip on real photos: torchvision's ImageFolder +
    PIL transforms vs clusterfit's folder reader vs clusterfit's shards, side by side (needs clusterfit[bench])."""
    from clusterfit.bench.data import DataBenchConfig, run_data_bench

    _run(
        lambda: run_data_bench(
            DataBenchConfig(images=images, batch_size=batch_size, image_size=image_size, max_side=max_side)
        )
    )


@bench_app.command("train")
def bench_train(
    models: Annotated[str, typer.Option(help="Comma-separated model names.")] = "resnet18,resnet50",
    workers: Annotated[str, typer.Option(help="Comma-separated worker (rank) counts on this machine.")] = "1,2",
    image_size: Annotated[int, typer.Option(min=16, max=1024, help="Side of the synthetic images.")] = 128,
    batch: Annotated[int, typer.Option(min=1, help="Images per rank per step.")] = 16,
    steps: Annotated[int, typer.Option(min=1, help="Training steps per run.")] = 30,
    warmup: Annotated[int, typer.Option(min=0, help="First steps left out of the median.")] = 5,
    window: Annotated[
        int,
        typer.Option(help="Steps per timed window; clusterfit's job logs (an all-reduce) once per window."),
    ] = 5,
    rounds: Annotated[int, typer.Option(help="Runs of every system per cell, in alternating order.")] = 3,
    precision: Annotated[str, typer.Option(help="auto | fp32 | bf16 | fp16, the same for every system.")] = "auto",
    ray: Annotated[bool, typer.Option(help="Also run the loop under Ray Train's TorchTrainer (the ray extra).")] = True,
    ray_address: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="Run Ray Train on this running cluster (host:port or auto); default: a fresh local Ray."),
    ] = None,
    cores_per_rank: Annotated[
        Optional[int],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="Run a cell of n ranks on n x this many cores (CPU affinity); default: all cores shared."),
    ] = None,
    grad_compression: Annotated[
        str,
        typer.Option(help="Also measure clusterfit with this trainer.grad_compression: fp16, bf16 or powersgd."),
    ] = "none",
    out: Annotated[Path, typer.Option(help="Folder for train.json and train.png.")] = Path("benchmarks/results"),
) -> None:
    """Training images/s of clusterfit vs a hand-written torchrun + DDP loop and the same loop under Ray Train,
    per model x worker count, with weak-scaling efficiency and the step time split into compute, communication
    and data wait; writes JSON and a PNG chart (needs matplotlib: the bench extra)."""
    from clusterfit.bench.train import (
        RESULTS_JSON,
        RESULTS_PNG,
        TrainBenchConfig,
        TrainBenchReport,
        parse_list,
        run_train_bench,
    )

    def measure() -> TrainBenchReport:
        config = TrainBenchConfig(
            models=parse_list("--models", models),
            workers=parse_list("--workers", workers, int),
            image_size=image_size,
            batch=batch,
            steps=steps,
            warmup=warmup,
            window=window,
            rounds=rounds,
            precision=precision,
            ray=ray,
            ray_address=ray_address,
            cores_per_rank=cores_per_rank,
            grad_compression=grad_compression,
        )
        return run_train_bench(config, out)

    _run(measure, lambda _: f"results: {out / RESULTS_JSON}  chart: {out / RESULTS_PNG}")


@bench_app.command("ckpt")
def bench_ckpt(
    model: Annotated[str, typer.Option(help="Model to checkpoint.")] = "resnet50",
    workers: Annotated[int, typer.Option(min=1, help="Worker (rank) count on this machine.")] = 2,
    image_size: Annotated[int, typer.Option(min=16, max=1024, help="Side of the synthetic images.")] = 64,
    batch: Annotated[int, typer.Option(min=1, help="Images per rank per step.")] = 8,
    steps: Annotated[int, typer.Option(min=2, help="Training steps per run.")] = 40,
    every: Annotated[int, typer.Option(min=1, help="Steps between checkpoints.")] = 5,
    precision: Annotated[str, typer.Option(help="auto | fp32 | bf16 | fp16.")] = "auto",
    directory: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="Where the checkpoints are written (the disk measured); a temp folder by default."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for ckpt.json.")] = Path("benchmarks/results"),
) -> None:
    """Time the training loop stands still per checkpoint, synchronous vs asynchronous saving
    (trainer.checkpoint.async_save), and what each costs the whole run against no checkpoints."""
    from clusterfit.bench.ckpt import RESULTS_JSON, CkptBenchConfig, CkptBenchReport, run_ckpt_bench

    def measure() -> CkptBenchReport:
        config = CkptBenchConfig(
            model=model,
            workers=workers,
            image_size=image_size,
            batch=batch,
            steps=steps,
            every=every,
            precision=precision,
            directory=directory,
        )
        return run_ckpt_bench(config, out)

    _run(measure, lambda report: f"async stall / sync stall: {report.stall_ratio:.3f}  results: {out / RESULTS_JSON}")


@bench_app.command("comm")
def bench_comm(
    workers: Annotated[int, typer.Option(min=2, help="Ranks on this machine.")] = 2,
    sizes: Annotated[
        str, typer.Option(help="Comma-separated all-reduce sizes in bytes (default 1 KiB to 64 MiB and 100 MiB).")
    ] = "",
    repeats: Annotated[int, typer.Option(min=1, help="Timed all-reduces per size; the median counts.")] = 10,
    model: Annotated[str, typer.Option(help="Model of the bucket-size sweep.")] = "resnet50",
    buckets_mb: Annotated[
        str, typer.Option(help="Comma-separated trainer.ddp_bucket_cap_mb values; empty skips the sweep.")
    ] = "1,5,25,100",
    image_size: Annotated[int, typer.Option(min=16, max=1024, help="Side of the synthetic images.")] = 64,
    batch: Annotated[int, typer.Option(min=1, help="Images per rank per step.")] = 8,
    steps: Annotated[int, typer.Option(min=1, help="Training steps per bucket size.")] = 20,
    warmup: Annotated[int, typer.Option(min=0, help="First steps left out of the median.")] = 5,
    precision: Annotated[str, typer.Option(help="auto | fp32 | bf16 | fp16.")] = "auto",
    out: Annotated[Path, typer.Option(help="Folder for comm.json.")] = Path("benchmarks/results"),
) -> None:
    """All-reduce time, algorithm and bus bandwidth (2(n-1)/n x bytes / time) over message sizes (gloo on CPU,
    NCCL on GPUs), and the median training step of a model for each DDP bucket size."""
    from clusterfit.bench.comm import RESULTS_JSON, CommBenchConfig, CommBenchReport, run_comm_bench
    from clusterfit.bench.train import parse_list

    def measure() -> CommBenchReport:
        settings = {"sizes": parse_list("--sizes", sizes, int)} if sizes.strip() else {}
        config = CommBenchConfig(
            workers=workers,
            repeats=repeats,
            model=model,
            buckets_mb=parse_list("--buckets-mb", buckets_mb, float),
            image_size=image_size,
            batch=batch,
            steps=steps,
            warmup=warmup,
            precision=precision,
            **settings,
        )
        return run_comm_bench(config, out)

    _run(measure, lambda _: f"results: {out / RESULTS_JSON}")


@bench_app.command("peak")
def bench_peak(
    dtypes: Annotated[str, typer.Option(help="Comma-separated: fp32, bf16 (and fp16 on CUDA).")] = "fp32,bf16",
    size: Annotated[int, typer.Option(min=64, max=16384, help="Side of the square matrices.")] = 2048,
    repeats: Annotated[int, typer.Option(min=1, help="Timed multiplies; the fastest counts.")] = 5,
    images_per_s: Annotated[
        Optional[float],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="A measured ResNet-50 training rate, to report as a fraction of peak."),
    ] = None,
    image_size: Annotated[int, typer.Option(min=16, help="Image side of that training rate.")] = 224,
) -> None:
    """The machine's matmul FLOP/s per dtype (all cores, or the GPU), and optionally a ResNet-50 training rate
    as a fraction of it (24.5 GFLOP per 224x224 image, scaled by the pixel count)."""
    from clusterfit.bench.peak import run_peak_bench
    from clusterfit.bench.train import parse_list

    _run(lambda: run_peak_bench(list(parse_list("--dtypes", dtypes)), size, repeats, images_per_s, image_size))
