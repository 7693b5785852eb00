"""`clusterfit plan`: the cost model's formulas as values, the model profile against known counts, and the
command as a user types it. No timing is asserted: the planner predicts, it does not measure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from clusterfit.plan.costmodel import Link, Workload, exposed_allreduce_s, ring_allreduce_s, step_split
from clusterfit.plan.hardware import FOLDER_IMAGES_PER_CORE
from clusterfit.plan.planner import gpu_hardware, input_pipeline
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


def test_the_input_pipeline_shows_only_when_a_nodes_devices_outrun_its_host_cores() -> None:
    # Each device computes 1,000 images/s (32 images in 32 ms); the host's cores prepare 4,000/s for the node.
    # The links are fast enough that the all-reduce takes nanoseconds: what is left is compute against input.
    fed = _work(node_images_per_s=4000.0)
    fast = Link(name="fast", bytes_per_s=1e18, latency_s=0.0)
    one = step_split(fed, 1, fast, devices_per_node=8)
    assert one.data_s == pytest.approx(0.008) and one.step_s == pytest.approx(0.032) and one.efficiency == 1.0
    four = step_split(fed, 4, fast, devices_per_node=8)  # 4,000/s consumed: the host keeps up, just
    assert four.data_s == pytest.approx(0.032) and not four.data_bound
    node = step_split(fed, 8, fast, devices_per_node=8)
    assert node.data_bound and node.step_s == pytest.approx(0.064)
    assert node.efficiency == pytest.approx(0.5) and node.images_per_s == pytest.approx(4000.0)
    two_nodes = step_split(fed, 16, fast, devices_per_node=8)  # each node feeds its own 8 devices
    assert two_nodes.data_s == pytest.approx(0.064) and two_nodes.images_per_s == pytest.approx(8000.0)
    assert step_split(_work(), 8, fast, devices_per_node=8).data_s == 0.0  # synthetic data: nothing to prepare


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
    assert "input pipeline per node: synthetic, nothing to decode" in result.stdout
    assert "twice the batch per device (128): " in result.stdout and "scale up before scaling out" in result.stdout


def test_plan_says_when_the_hosts_cores_cannot_feed_the_devices() -> None:
    # Real images the planner never reads: planning needs neither the data nor the GPUs.
    result = run_cli(
        "plan", str(REPO / "examples" / "resnet50-synthetic.yaml"), "--set", "trainer.data.train=/absent/train",
        "--device", "a100", "--gpus-per-node", "8", "--host-cores", "16", "--decode-per-core", "250",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "input pipeline per node: 16 host cores x 250 images/s each (--decode-per-core) = 4,000/s" in result.stdout
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 1 | ")]
    one, node = rows
    assert float(one[8]) == pytest.approx(64 / 4000 * 1e3, abs=0.05)  # data ms: the whole host for one device
    assert float(node[8]) == pytest.approx(8 * 64 / 4000 * 1e3, abs=0.05) == float(node[4])  # the step waits
    assert "the input pipeline is the limit; a node's host cores prepare 4,000 images/s" in result.stdout
    assert "if the job reads image files, packed shards (`clusterfit data pack`, 2.2x the images" in result.stdout
    dgx1 = input_pipeline(False, gpu_hardware("v100", "bf16", 1, 8, "infiniband-edr", 1), None)  # the defaults
    assert dgx1.node_images_per_s == 40 * FOLDER_IMAGES_PER_CORE
    assert dgx1.description.startswith("40 host cores (DGX-1: 2 x 20-core Xeon E5-2698 v4) x 296 images/s each")
    assert input_pipeline(False, gpu_hardware("p100", "fp32", 1, 4, "roce-25g", 1), None).node_images_per_s is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "error: --device tpu: unknown; choose one of p100, v100, a100, h100, cpu"),
        (["--interconnect", "wifi"], "error: --interconnect wifi: unknown; choose one of ethernet-10g,"),
        (["--set", "trainer.strategy=pipeline"], "error: trainer.strategy = 'pipeline': the planner models ddp"),
        (["--device", "cpu", "--host-cores", "4"], "error: --host-cores/--decode-per-core: CPU ranks decode on the"),
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
    assert "within ±10 points: 9 of 10" in result.stdout, result.stdout
    assert all(abs(int(row.split("|")[9])) <= 3 for row in rows if row.startswith("| Horovod")), rows
