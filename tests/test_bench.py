"""Smoke tests of the benchmarks at tiny sizes, so they keep working; no timing is asserted."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from services import skip_reason


def test_bench_data_runs_the_three_pipelines_side_by_side() -> None:
    result = run_cli("bench", "data", "--images", "4", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| torchvision ImageFolder + PIL transforms",
        "| clusterfit folder reader",
        "| clusterfit shards (--max-side 320)",
    ]
    assert rows[0].endswith("| 1.00x |") and "cores; Python" in result.stdout


def test_bench_data_refuses_fewer_images_than_a_batch() -> None:
    result = run_cli("bench", "data", "--images", "1", "--batch-size", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --images 1: fewer than one batch of 2; raise --images"]


@pytest.mark.skipif(bool(skip_reason("azurite")), reason=str(skip_reason("azurite")))
def test_staging_benchmark_script_against_azurite() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "staging.py"),
            *("--files", "3", "--file-kb", "4", "--workers", "2", "--rounds", "2", "--ceiling-concurrency", "1,2"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ")[0].lstrip("| ") for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "ceiling: GETs into memory, 1 in flight",
        "ceiling: GETs into memory, 2 in flight",
        "ceiling: GETs into memory, 2 in flight, no environment lookups",
        "ceiling: plain GETs with a SAS (aiohttp, no SDK pipeline) into memory, 2 in flight",
        "ceiling with the listing: the store's listing, then plain GETs into memory, 2 in flight",
        "GETs into files, 2 in flight",
        "clusterfit staging, 2 transfers",
        "clusterfit staging, 2 transfers, a proxy variable set",
        "clusterfit staging, 1 file of 0 MB",
    ]
    assert "small-file staging: " in result.stdout
    listed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "staging.py"), "--listed", "3", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr  # each way of listing found the 3 objects
    assert [line.split(" | ")[0].lstrip("| ") for line in listed.stdout.splitlines() if line.startswith("| ")][1:] == [
        "fsspec find (adlfs: the SDK's blob properties)",
        "clusterfit list_files through the SDK's names-only listing (where a proxy is set)",
        "clusterfit list_files by plain GETs under a SAS, each page parsed once",
    ]


def test_the_baselines_ship_inside_the_package_and_run_from_anywhere(tmp_path, monkeypatch) -> None:
    import ast
    import importlib.util

    import setuptools

    import clusterfit
    from clusterfit.bench.train import BASELINE_MODULE, RAY_MODULE, TrainBenchConfig, run_baseline

    package = Path(clusterfit.__file__).parent
    assert "clusterfit.bench.baselines" in setuptools.find_packages(str(REPO / "src"))  # what pyproject installs
    for module in (BASELINE_MODULE, RAY_MODULE):
        source = Path(importlib.util.find_spec(module).origin)
        assert source.is_relative_to(package / "bench" / "baselines"), source
        # Hand-written plain PyTorch: of clusterfit they may import only each other.
        imported = [
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        ]
        assert all(not name.startswith("clusterfit") or name == BASELINE_MODULE for name in imported), imported
    monkeypatch.chdir(tmp_path)  # nowhere near the repository
    config = TrainBenchConfig(
        models=("resnet_tiny",), workers=(1,), image_size=32, batch=2, steps=2, warmup=1, window=1
    )
    assert len(run_baseline(config, "resnet_tiny", 1, "fp32")) == 2


def test_bench_train_scaling_efficiency_and_ratio_and_chart(tmp_path) -> None:
    from clusterfit.bench.train import Cell, StepSplit, TrainBenchConfig, TrainBenchReport, plot

    config = TrainBenchConfig(models=("resnet18",), workers=(1, 2), batch=16, steps=3, warmup=1, window=1)
    report = TrainBenchReport(config, {"cpu": "a CPU", "cores": 2, "torch": "x", "device": "no GPU"}, "fp32")
    for system, one, two in (("hand-written DDP", 10.0, 19.0), ("Ray Train", 8.0, 15.0), ("clusterfit", 11.0, 16.5)):
        report.cells += [
            Cell(system, "resnet18", 1, 2, [[one] * 3], [one]),
            # Compute alone takes 2.0 s per 2-rank step: that bounds the cell at 16 / (2.0 x 10.0) = 0.80 of the
            # reference, whatever its communication.
            Cell(system, "resnet18", 2, 1, [[two] * 3], [two], split=StepSplit.of(32 / two, 2.0, 0.0)),
        ]
    report.fill_scaling()
    assert report.cell("hand-written DDP", "resnet18", 2).scaling_efficiency == 0.95
    assert report.cell("clusterfit", "resnet18", 2).scaling_efficiency == 0.75
    # Against one reference for all, the hand-written 1-rank cell: clusterfit's fast 1-rank cell no longer counts.
    clusterfit_two = report.cell("clusterfit", "resnet18", 2)
    assert clusterfit_two.efficiency_vs_reference == pytest.approx(16.5 / 20.0)
    assert clusterfit_two.efficiency_bound == pytest.approx(0.8)
    assert report.cell("clusterfit", "resnet18", 1).efficiency_vs_reference == pytest.approx(1.1)
    assert "| resnet18 | 2 | clusterfit | 1939 | 2000 | -61 | 0 | 0.82 | 0.80 |" in report.markdown()
    assert report.ratio("resnet18", 1) == 1.1 and report.ratio("resnet18", 2) == 16.5 / 19.0
    assert report.ratio("resnet18", 2, "Ray Train") == 1.1
    assert "| resnet18 | 2 | 1 | 19.0 | 15.0 | 16.5 | 0.87x | 1.10x | 0.95 | 0.94 | 0.75 |" in report.markdown()
    plot(report, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_bench_train_times_every_system_in_windows_of_whole_steps() -> None:
    from clusterfit.bench.train import TrainBenchConfig, per_window

    # Windows of 2 steps: the second one's steps take 1/2 and 1 time unit per batch, so 2 batches in 1.5 units
    # (1.33), not the mean of the two rates (1.5).
    assert per_window([4.0, 4.0, 2.0, 1.0], 2) == pytest.approx([4.0, 4 / 3])
    config = TrainBenchConfig(steps=30, warmup=10, window=5)
    assert config.warmup_windows == 2


def test_bench_train_rotates_the_systems_and_marks_ratios_within_noise() -> None:
    from clusterfit.bench.train import Cell, TrainBenchConfig, TrainBenchReport, rotations

    assert rotations(("a", "b", "c"), 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["c", "b", "a"]]
    for names, rounds in [(("a", "b", "c", "d"), 4), (("a", "b", "c"), 6), (("a", "b", "c", "d", "e", "f"), 6)]:
        orders = rotations(names, rounds)
        assert all(sorted(order) == sorted(names) for order in orders)
        firsts = Counter(order[0] for order in orders)
        neighbours = Counter(pair for order in orders for pair in itertools.pairwise(order))
        assert set(firsts.values()) == {rounds // len(names)} and len(firsts) == len(names)
        assert set(neighbours.values()) == {rounds // len(names)} and len(neighbours) == len(names) * (len(names) - 1)
    config = TrainBenchConfig(models=("resnet18",), workers=(2,), steps=3, warmup=1, window=1, ray=False)
    report = TrainBenchReport(config, {"cpu": "a CPU", "cores": 2, "torch": "x", "device": "no GPU"}, "fp32")
    report.cells = [
        Cell("hand-written DDP", "resnet18", 2, 1, [], [10.0, 12.0, 11.0]),
        Cell("clusterfit", "resnet18", 2, 1, [], [11.5, 13.0, 12.5]),  # overlaps 10-12
    ]
    assert report.cell("clusterfit", "resnet18", 2).spread == (11.5, 13.0)
    assert "| resnet18 | 2 | 1 | 11.0 (10.0-12.0) | 12.5 (11.5-13.0) | 1.14x ~ |" in report.markdown()
    report.cells[1] = Cell("clusterfit", "resnet18", 2, 1, [], [12.5, 13.0, 14.0])  # all above 12
    assert "| 12.5x |" not in report.markdown() and "| 1.18x |" in report.markdown()
    assert "Never first" not in report.markdown()  # no rounds recorded here
    # 2 rounds for 3 runs (the loop without communication, the loop, clusterfit): clusterfit never led a round.
    report.orders = {"resnet18/2": rotations(("compute only", "hand-written DDP", "clusterfit"), 2)}
    assert "Never first in a round (2 round(s) of 3 runs per cell): clusterfit;" in report.markdown()
    report.orders = {"resnet18/2": rotations(("compute only", "hand-written DDP", "clusterfit"), 3)}
    assert "Never first" not in report.markdown()


def test_bench_train_measures_gradient_compression_as_a_system_of_its_own() -> None:
    from clusterfit.bench.train import Cell, StepSplit, TrainBenchConfig, TrainBenchReport

    config = TrainBenchConfig(
        models=("resnet50",), workers=(1, 2), steps=3, warmup=1, window=1, ray=False, grad_compression="fp16"
    )
    assert config.systems == ("hand-written DDP", "clusterfit", "clusterfit + fp16 gradients")
    assert config.baselines == ("hand-written DDP",)  # compared with the baselines, never with clusterfit itself
    report = TrainBenchReport(config, {"cpu": "a CPU", "cores": 2, "torch": "x", "device": "no GPU"}, "bf16")
    for system, one, two in (("hand-written DDP", 10.0, 18.0), ("clusterfit", 10.5, 18.2)):
        report.cells += [Cell(system, "resnet50", 1, 2, [], [one]), Cell(system, "resnet50", 2, 1, [], [two])]
    report.cells += [
        Cell("clusterfit + fp16 gradients", "resnet50", 1, 2, [], [10.4]),
        Cell("clusterfit + fp16 gradients", "resnet50", 2, 1, [], [19.4], split=StepSplit.of(32 / 19.4, 1.6, 0.0)),
    ]
    report.fill_scaling()
    compressed = report.cell("clusterfit + fp16 gradients", "resnet50", 2)
    assert compressed.efficiency_vs_reference == pytest.approx(0.97)  # 19.4 / (2 x the hand-written 10.0)
    assert compressed.efficiency_bound == pytest.approx(1.0)  # 16 images in 1.6 s of compute against 10.0
    assert report.ratio("resnet50", 2, system="clusterfit + fp16 gradients") == pytest.approx(19.4 / 18.0)
    table = report.markdown()
    assert "| clusterfit ÷ hand-written DDP | clusterfit + fp16 gradients ÷ hand-written DDP |" in table
    assert "| resnet50 | 2 | 1 | 18.0 | 18.2 | 19.4 | 1.01x | 1.08x | 0.90 | 0.87 | 0.93 |" in table
    assert "| resnet50 | 2 | clusterfit + fp16 gradients | 1649 | 1600 | 49 | 0 | 0.97 | 1.00 |" in table
    [_, two_ranks] = report.to_json()["ratios"]
    assert two_ranks["clusterfit_fp16_gradients_over_hand_written_ddp"] == pytest.approx(19.4 / 18.0)
    assert two_ranks["clusterfit_over_hand_written_ddp"] == pytest.approx(18.2 / 18.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--models", "resnet18,lenet5"], "error: --models resnet18,lenet5: unknown model; choose from resnet18,"),
        (["--workers", "0,2"], "error: --workers 0,2: worker counts must be 1 or more"),
        (["--workers", "one"], "error: --workers one: expected a comma-separated list of int"),
        (["--steps", "5", "--warmup", "5"], "error: --steps 5: must exceed --warmup 5 to leave steps to measure"),
        (["--steps", "30", "--window", "4"], "error: --window 4: must divide --steps 30 and --warmup 5"),
        (["--window", "0"], "error: --window 0: must divide --steps 30 and --warmup 5"),
        (["--rounds", "0"], "error: --rounds 0: run every system at least once per cell"),
        (["--grad-compression", "int8"], "error: --grad-compression int8: choose none, bf16, fp16, powersgd"),
        (
            ["--workers", "1,64", "--cores-per-rank", "1"],
            "error: --cores-per-rank 1: 64 worker(s) x 1 core(s) must fit",
        ),
    ],
)
def test_bench_train_refuses_bad_flags_in_one_line(tmp_path, flags: list[str], message: str) -> None:
    result = run_cli("bench", "train", *flags, "--out", str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not (tmp_path / "train.json").exists()


def test_bench_peak_reports_flops_and_fraction_of_peak() -> None:
    result = run_cli("bench", "peak", "--dtypes", "fp32", "--size", "128", "--repeats", "2", "--images-per-s", "50")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("fp32 matmul 128x128: "))
    assert "GFLOP/s; ResNet-50 at 50 images/s (224 px) is " in line and line.endswith("% of it")


def test_bench_peak_refuses_an_unknown_dtype() -> None:
    result = run_cli("bench", "peak", "--dtypes", "fp8")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --dtypes: 'fp8' is not one of fp32, bf16, fp16"]


def test_bench_ckpt_times_sync_and_async_checkpoints(tmp_path) -> None:
    result = run_cli(
        "bench", "ckpt", "--model", "resnet_tiny", "--workers", "2", "--image-size", "32", "--batch", "2",
        "--steps", "4", "--every", "2", "--precision", "fp32", "--directory", str(tmp_path / "disk"),
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "ckpt.json").read_text())
    results = {r["mode"]: r for r in report["results"]}
    assert list(results) == ["none", "sync", "async"]
    assert results["none"]["stalls_s"] == []
    for mode in ("sync", "async"):
        assert len(results[mode]["stalls_s"]) == 1, "one checkpoint mid-epoch (step 2); step 4 ends the epoch"
        assert results[mode]["checkpoint_bytes"] > 10_000 and len(results[mode]["step_seconds"]) == 4
    assert report["async_over_sync_stall"] > 0
    assert list((tmp_path / "disk").iterdir()) == [], "the runs' checkpoints are removed afterwards"
    assert "| asynchronous |" in result.stdout and "async stall / sync stall: " in result.stdout


def test_bench_comm_measures_allreduce_and_bucket_sizes(tmp_path) -> None:
    result = run_cli(
        "bench", "comm", "--workers", "2", "--sizes", "1024,65536", "--repeats", "2", "--model", "resnet_tiny",
        "--buckets-mb", "1,25", "--image-size", "32", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--precision", "fp32", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "comm.json").read_text())
    assert report["backend"] == "gloo" and [r["bytes"] for r in report["allreduce"]] == [1024, 65536]
    for r in report["allreduce"]:  # 2 ranks: the bus carries 2(n-1)/n = 1x the message
        assert r["seconds"] > 0 and r["bus_gb_per_s"] == pytest.approx(r["algorithm_gb_per_s"])
    assert [(b["bucket_cap_mb"], len(b["step_seconds"])) for b in report["buckets"]] == [(1.0, 2), (25.0, 2)]
    assert "| 64 KiB |" in result.stdout and "| 25 | " in result.stdout


def test_bus_bandwidth_of_a_ring_all_reduce() -> None:
    from clusterfit.bench.comm import bus_bandwidth

    assert bus_bandwidth(1000, 1.0, 2) == 1000.0
    assert bus_bandwidth(1000, 1.0, 4) == 1500.0


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["ckpt", "--steps", "4", "--every", "4"], "error: --every 4: must be below --steps 4 to checkpoint mid-epoch"),
        (["ckpt", "--model", "vgg"], "error: --model vgg: unknown model; choose from resnet18,"),
        (["comm", "--sizes", "2"], "error: --sizes 2: sizes are bytes, at least 4 (one fp32)"),
        (["comm", "--buckets-mb", "0"], "error: --buckets-mb 0.0: bucket sizes must be above 0"),
    ],
)
def test_bench_ckpt_and_comm_refuse_bad_flags_in_one_line(tmp_path, command: list[str], message: str) -> None:
    result = run_cli("bench", *command, "--out", str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
