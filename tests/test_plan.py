"""`clusterfit plan`: the cost model's formulas as values, the model profile against known counts, and the
command as a user types it. No timing is asserted: the planner predicts, it does not measure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from clusterfit.plan.costmodel import HostInput, Link, Workload, exposed_allreduce_s, ring_allreduce_s, step_split
from clusterfit.plan.hardware import FOLDER_IMAGES_PER_CORE
from clusterfit.plan.planner import gpu_hardware, input_pipeline, markdown, plan_job
from clusterfit.plan.profile import profile_model
from clusterfit.spec import load_spec
from clusterfit.spec.model import AUTO_LOADER_WORKERS_MAX, DataSpec

LINK = Link(name="test", bytes_per_s=1e9, latency_s=1e-5)


def _work(**changes: object) -> Workload:
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
    fed = _work(host=HostInput(cores=16, images_per_core=250.0))  # a worker on every core
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


def test_a_device_gets_only_its_own_loader_workers_and_a_node_no_more_workers_than_cores() -> None:
    host = HostInput(cores=16, images_per_core=250.0, workers_per_device=4)
    assert host.images_per_s(1) == 1000.0  # 4 workers, 4 cores busy on an otherwise idle host
    assert host.images_per_s(4) == 4000.0 and host.images_per_s(8) == 4000.0  # 32 workers share 16 cores
    assert HostInput(cores=16, images_per_core=250.0, workers_per_device=0).images_per_s(2) == 500.0  # ranks load
    # Each device computes 1,000 images/s: its 4 workers just keep up on one device, and 8 devices wait.
    work = _work(host=host)
    fast = Link(name="fast", bytes_per_s=1e18, latency_s=0.0)
    one, node = step_split(work, 1, fast, devices_per_node=8), step_split(work, 8, fast, devices_per_node=8)
    assert one.data_s == pytest.approx(0.032) and not one.data_bound and one.efficiency == 1.0
    assert node.data_bound and node.images_per_s == pytest.approx(4000.0) and node.efficiency == pytest.approx(0.5)


def test_a_rank_s_loader_workers_default_to_its_share_of_the_cpus_at_most_16() -> None:
    data = DataSpec(train="synthetic", num_classes=10)
    assert data.workers_per_rank(cpus=2, ranks_on_node=2) == 1 and data.workers_per_rank(1, 4) == 1
    assert data.workers_per_rank(cpus=80, ranks_on_node=8) == 10  # a DGX-1's 80 hardware threads
    assert data.workers_per_rank(cpus=256, ranks_on_node=8) == AUTO_LOADER_WORKERS_MAX == 16  # a DGX A100
    assert data.model_copy(update={"loader_workers": 3}).workers_per_rank(256, 8) == 3
    assert data.model_copy(update={"loader_workers": 0}).workers_per_rank(256, 8) == 0


def test_the_planner_feeds_the_devices_with_the_job_s_loader_workers_and_says_when_more_would_help() -> None:
    """On a DGX A100, the default gives each device 16 workers, one per core; a job that asks for 8 uses half the
    host and its devices wait, which the plan says, with the count that would feed them."""
    job, real_images = REPO / "examples" / "resnet50-synthetic.yaml", "trainer.data.train=/absent/train"
    options = {"device": "a100", "nodes": 1, "devices_per_node": 8, "interconnect": "infiniband-hdr"}
    default = plan_job(load_spec(job, [real_images]), **options, images_per_s=2470)
    assert default.work.host == HostInput(cores=128, images_per_core=FOLDER_IMAGES_PER_CORE, workers_per_device=16)
    assert not default.rows[-1][1].data_bound
    plan = plan_job(load_spec(job, [real_images, "trainer.data.loader_workers=8"]), **options, images_per_s=2470)
    split = plan.rows[-1][1]
    assert split.data_bound and split.images_per_s == pytest.approx(8 * 8 * FOLDER_IMAGES_PER_CORE)  # 64 cores busy
    text = markdown(plan)
    assert "8 loader workers per device = 2,368/s for 1 device, 18,944/s for 8" in text
    assert "and the input pipeline is the limit: a node's loader workers prepare 18,944 images/s" in text
    assert "trainer.data.loader_workers: 16, a worker for each of the host's 128 cores: 19,5" in text
    # 4 devices on 10 cores: 3 workers each (rounded up), not 2 again.
    few = plan_job(
        load_spec(job, [real_images, "trainer.data.loader_workers=2"]),
        **{**options, "devices_per_node": 4},
        images_per_s=2470,
        host_cores=10,
    )
    assert "trainer.data.loader_workers: 3, a worker for each of the host's 10 cores: 2,960 images/s" in markdown(few)
    # One device on 512 cores: the most workers the spec accepts, not a count it would refuse.
    big_host = plan_job(
        load_spec(job, [real_images, "trainer.data.loader_workers=8"]),
        **{**options, "devices_per_node": 1},
        images_per_s=2470,
        host_cores=512,
    )
    assert "trainer.data.loader_workers: 128, a worker for as many of the host's 512 cores" in markdown(big_host)
    load_spec(job, [real_images, "trainer.data.loader_workers=128"])  # the advice is a valid spec


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
    # A host named by its cores runs two threads on each: 32 CPUs, so the default is 4 workers per device.
    assert (
        "input pipeline per node: 16 host cores x 250 images/s each (--decode-per-core), 4 loader workers per "
        "device = 1,000/s for 1 device, 4,000/s for 8" in result.stdout
    )
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 1 | ")]
    one, node = rows
    assert float(one[8]) == pytest.approx(64 / 1000 * 1e3, abs=0.05)  # data ms: one device's 4 workers
    assert float(node[8]) == pytest.approx(8 * 64 / 4000 * 1e3, abs=0.05) == float(node[4])  # the step waits
    assert "and the input pipeline is the limit: a node's loader workers prepare 4,000 images/s" in result.stdout
    assert "if the job reads image files, packed shards (`clusterfit data pack`, 2.2x the images" in result.stdout
    assert "trainer.data.loader_workers:" not in result.stdout  # 32 workers already keep the 16 cores busy
    dgx1 = input_pipeline(False, gpu_hardware("v100", "bf16", 1, 8, "infiniband-edr", 1), None, None)
    assert dgx1.host is not None and dgx1.host.images_per_s(8) == 40 * FOLDER_IMAGES_PER_CORE
    assert dgx1.description.startswith("40 host cores (DGX-1: 2 x 20-core Xeon E5-2698 v4) x 296 images/s each")
    assert input_pipeline(False, gpu_hardware("p100", "fp32", 1, 4, "roce-25g", 1), None, None).host is None


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
