"""`clusterfit plan`: the cost model's formulas as values, the model profile against known counts, and the
command as a user types it. No timing is asserted: the planner predicts, it does not measure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from clusterfit.plan.costmodel import Link, Workload, exposed_allreduce_s, ring_allreduce_s, step_split
from clusterfit.plan.profile import profile_model

LINK = Link(name="test", bytes_per_s=1e9, latency_s=1e-5)


def _work(**changes: float) -> Workload:
    values = {
        "train_flop_per_image": 1e9,
        "gradient_bytes": 100e6,
        "batch_per_device": 32,
        "device_flop_per_s": 1e12,
        **changes,
    }
    return Workload(**values)


def test_a_ring_allreduce_moves_2_n_minus_1_over_n_of_the_data_in_2_n_minus_1_steps() -> None:
    assert ring_allreduce_s(100e6, 1, LINK) == 0.0
    assert ring_allreduce_s(100e6, 2, LINK) == pytest.approx(0.1 + 2 * 1e-5)
    assert ring_allreduce_s(100e6, 4, LINK, buckets=3) == pytest.approx(6 / 4 * 0.1 + 6 * 1e-5 * 3)


def test_backward_hides_all_but_the_last_bucket_or_what_overflows_it() -> None:
    assert exposed_allreduce_s(0.04, backward_s=1.0, buckets=4) == pytest.approx(0.01)  # only the last bucket
    assert exposed_allreduce_s(1.5, backward_s=1.0, buckets=4) == pytest.approx(0.5)  # the overflow
    assert exposed_allreduce_s(0.0, backward_s=1.0, buckets=1) == 0.0


def test_one_device_is_the_reference_and_more_bandwidth_or_batch_never_hurts() -> None:
    one = step_split(_work(), 1, LINK)
    assert one.efficiency == 1.0 and one.exposed_s == 0.0 and one.compute_s == pytest.approx(0.032)
    slow = step_split(_work(), 16, LINK)
    assert slow.efficiency < 1 and slow.efficiency_without_overlap <= slow.efficiency
    assert slow.images_per_s == pytest.approx(16 * 32 / slow.step_s)
    faster = step_split(_work(), 16, Link(name="fast", bytes_per_s=1e10, latency_s=1e-5))
    bigger = step_split(_work(batch_per_device=64), 16, LINK)
    assert faster.efficiency > slow.efficiency and bigger.efficiency > slow.efficiency


def test_the_profile_counts_resnet50_as_published() -> None:
    full = profile_model("resnet50", 224)
    assert full.parameters == 25_557_032  # torchvision's ResNet-50 with 1000 classes
    assert full.train_flop_per_image == pytest.approx(3 * 8.2e9, rel=0.02)  # 3 x 4.1 GMAC forward
    smaller = profile_model("resnet50", 128)  # a size every stride divides: convolution cost ~ pixels
    assert smaller.train_flop_per_image == pytest.approx(full.train_flop_per_image * (128 / 224) ** 2, rel=0.02)


def test_plan_prints_the_scaling_table_and_what_would_help() -> None:
    result = run_cli(
        "plan", str(REPO / "examples" / "resnet50-synthetic.yaml"), "--nodes", "4", "--gpus-per-node", "8",
        "--device", "a100", "--interconnect", "ethernet-25g",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[:2] for row in rows] == [["| 1", "1"], ["| 1", "8"], ["| 2", "16"], ["| 4", "32"]]
    assert rows[0].endswith("| 100% | 100% |")
    assert "25.6 M parameters, 102 MB all-reduced per step" in result.stdout
    assert "twice the batch per device (128): " in result.stdout and "scale up before scaling out" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "error: --device tpu: unknown; choose one of p100, v100, a100, h100, cpu"),
        (["--interconnect", "wifi"], "error: --interconnect wifi: unknown; choose one of ethernet-10g,"),
        (["--set", "trainer.strategy=pipeline"], "error: trainer.strategy = 'pipeline': the planner models ddp"),
    ],
)
def test_plan_refuses_what_it_cannot_model_in_one_line(args: list[str], message: str) -> None:
    result = run_cli("plan", str(REPO / "examples" / "resnet50-synthetic.yaml"), *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_the_validation_script_compares_every_published_point() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "plan_validation.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| NVIDIA") or line.startswith("| Horovod")]
    assert len(rows) == 10
    # Deterministic: the cost model's inputs are published figures and counted FLOP, nothing measured here.
    assert "within ±10 points: 8 of 10" in result.stdout, result.stdout
    assert all(abs(int(row.split("|")[8])) <= 3 for row in rows if row.startswith("| Horovod")), rows
