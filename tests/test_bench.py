"""Smoke tests of the benchmarks at tiny sizes, so they keep working; no timing is asserted."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, run_cli


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


def test_staging_benchmark_script_against_azurite() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "staging.py"), "--files", "3", "--file-kb", "4", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "| 3 files of 4 KB | 3 |" in result.stdout and "| 1 file of 0.0 MB | 1 |" in result.stdout
