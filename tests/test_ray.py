"""The Ray engine: its pure parts, its dry-run rendering, and real jobs on a real two-node Ray cluster on
127.0.0.1 (token authentication on) through the CLI as a user would run them."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from azurite import free_port
from conftest import REPO, cli_command, run_cli, tiny_job, wait_for, write_job
from job_accounts import python_for, submit_as_root_service
from raycluster import RayCluster
from test_command_jobs import (
    assert_one_tensorflow_cluster_learned,
    command_job,
    framework_code,
    rank_logs,
    user_code,
)
from test_scoring import assert_every_good_image_scored_once, scoring_job
from test_session import session_job

from clusterfit.backends.job_env import job_base_env
from clusterfit.backends.job_folder import JobAccount
from clusterfit.backends.ray import (
    AgentState,
    NodeAgent,
    NodePlace,
    check_own_host_names,
    check_shared_outputs,
    job_exit_code,
    node_account,
)
from clusterfit.errors import EngineError
from clusterfit.outputs import JobOutputs, RecordKind, membership_changes, read_heartbeats, read_records
from clusterfit.outputs.checkpoints import published, step_of
from clusterfit.service.migrate import open_store
from clusterfit.session.checkpoints import latest_checkpoint
from clusterfit.storage.filesystems import cache_folder

# One worker runs them all: they share one ray cluster, started once per session.
pytestmark = pytest.mark.xdist_group("ray")

ON_RAY = [
    "--set",
    "resources.backend=ray",
    "--set",
    "resources.instance_count=2",
    "--set",
    "distribution.process_count_per_instance=1",
]
RAY_JOB_SCRIPT = str(REPO / "tests" / "scripts" / "ray_job.py")


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([AgentState(None), AgentState(None)], None),
        ([AgentState(0, 5.0), AgentState(None)], None),
        ([AgentState(0, 5.0), AgentState(0, 6.0)], 0),
        ([AgentState(None), AgentState(1, 5.0)], 1),  # a failed node ends the job while others still run
        ([AgentState(-15, 9.0), AgentState(1, 5.0)], 1),  # the first failure is the cause, not the fallout
        ([AgentState(0, 1.0), AgentState(-9, 7.0)], -9),
    ],
)
def test_job_exit_code_is_the_first_failure(states: list[AgentState], expected: int | None) -> None:
    assert job_exit_code(states) == expected


def test_an_elastic_jobs_exit_code_is_its_rendezvous_hosts() -> None:
    """Node 0 hosts the rendezvous: a lost or failed other node is a membership change, not the job's end."""
    assert job_exit_code([AgentState(None), AgentState(1, 5.0)], elastic=True) is None
    assert job_exit_code([AgentState(0, 9.0), AgentState(-9, 5.0)], elastic=True) == 0
    assert job_exit_code([AgentState(1, 9.0), AgentState(None)], elastic=True) == 1


def test_dry_run_renders_the_placement_group_and_node_command(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = tiny_job(out)
    job["resources"] = {"instance_count": 2, "backend": "ray", "ray_address": "ray://head.example:10001"}
    job["distribution"]["process_count_per_instance"] = 2
    job["environment_variables"] = {"OMP_NUM_THREADS": "3", "NCCL_DEBUG": "INFO"}
    job["storage"] = {"account_name": "acct", "sas_token": "sv=2024&sig=SECRETSIGNATURE"}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "SECRETSIGNATURE" not in result.stdout + result.stderr
    rendering = result.stdout.split("# ray backend command\n")[1]
    assert rendering == (
        "# Ray cluster: ray://head.example:10001; namespace clusterfit\n"
        "# placement group tiny-<id>: 2 bundle(s) of {CPU: 6}, strategy STRICT_SPREAD (one node each)\n"
        "# one detached actor per bundle runs this command with its node's python, in a new process group;\n"
        "# node 0 hosts the c10d rendezvous on a free port it picks, other nodes pass --rdzv-conf=is_host=0\n"
        "NCCL_DEBUG=INFO OMP_NUM_THREADS=3 PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "python -m clusterfit.backends.agent --nnodes=2 --rdzv-backend=c10d '--rdzv-endpoint=<node 0 IP>:<free port>' "
        "'--rdzv-id=tiny-<id>' --rdzv-conf=is_host=1 '--local-addr=<node 0 IP>' --nproc-per-node=2 "
        f"--max-restarts=0 --logs-specs=clusterfit --log-dir={out / 'logs'} "
        f"-m clusterfit.worker --spec {out / 'job.yaml'}\n"
    )
    assert not out.exists(), "a dry run writes nothing"


def test_an_mpi_job_renders_mpirun_over_the_nodes_and_refuses_outputs_at_a_url(tmp_path: Path) -> None:
    """An mpi job on Ray: node 0's actor runs mpirun over every node of the job, the others by their aliases,
    whose daemons it starts through the actors already there; with outputs at a URL it is refused in one line."""
    out = tmp_path / "out"
    job = command_job(out, user_code(tmp_path), "python train.py", "mpi", processes=2)
    job["resources"] = {"instance_count": 3, "backend": "ray"}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--dry-run")
    assert result.returncode == 0, result.stderr
    placement, command = result.stdout.split("# ray backend command\n")[1].splitlines()[3:5]
    receiver = f"python -m clusterfit.backends.mpi_remote receive '{out / '.mpi-launch' / 'command-mpi-<id>'}' N"
    assert placement == f"# mpi: node 0 runs this mpirun; node N `{receiver}`, which starts its daemon"
    agent = "'python -m clusterfit.backends.mpi_remote send'"
    assert (
        f"mpirun -np 6 --host '<node 0 host>:2,clusterfit-node-1:2,clusterfit-node-2:2' --prtemca plm ssh "
        f"--prtemca plm_ssh_agent {agent} --prtemca plm_ssh_no_tree_spawn 1 --leave-session-attached "
        "--map-by ppr:2:node:OVERSUBSCRIBE --bind-to none"
    ) in command, command
    job["outputs"] = {"dir": "az://outputs/runs/mpi"}
    job["storage"] = {"account_name": "acct", "sas_token": "sv=2024&sig=SECRETSIGNATURE"}
    refused = run_cli("run", str(write_job(tmp_path / "url.yaml", job)), "--dry-run")
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        "error: outputs.dir = 'az://outputs/runs/mpi': an mpi job on Ray starts every rank from one mpirun, with no "
        "copy of the outputs on each node; give outputs.dir a folder on the cluster's shared filesystem"
    ], refused.stderr


def test_an_mpi_job_on_nodes_that_share_a_host_name_is_refused_in_one_line() -> None:
    """Open MPI's daemons on two nodes of one host name never finish a job: refused before anything starts."""
    places = [NodePlace(ip, "python", "/root", host, "mpirun") for ip, host in [("10.0.0.1", "a"), ("10.0.0.2", "a")]]
    with pytest.raises(EngineError, match=r"^Ray nodes 10.0.0.1 and 10.0.0.2 share the host name 'a', and Open MPI"):
        check_own_host_names(places)
    check_own_host_names([places[0], NodePlace("10.0.0.2", "python", "/root", "b", None)])


def test_a_node_without_mpirun_refuses_in_one_line(tmp_path: Path) -> None:
    """A node whose Python has no mpirun beside it (and none on PATH): the node's agent says what to install."""
    with pytest.raises(EngineError) as refused:
        NodeAgent().start(["/nonexistent/bin/mpirun", "-np", "2"], {}, {}, str(tmp_path / "logs"), str(tmp_path))
    assert re.fullmatch(
        r"Ray node [0-9.]+ has no /nonexistent/bin/mpirun; pip install 'clusterfit\[mpi\]' \(Open MPI's mpirun and "
        r"mpi4py\), or install Open MPI on this machine",
        str(refused.value),
    ), refused.value


def test_gpus_per_node_are_reserved_in_each_bundle(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["resources"] = {"instance_count": 2, "backend": "ray", "gpus_per_instance": 2}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "# placement group tiny-<id>: 2 bundle(s) of {CPU: 2, GPU: 2}, strategy STRICT_SPREAD" in result.stdout


def test_threads_that_are_not_a_count_are_one_line_errors(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["environment_variables"] = {"OMP_NUM_THREADS": "many"}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--dry-run", *ON_RAY)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: environment_variables.OMP_NUM_THREADS = 'many': the ray backend reserves that many CPUs per "
        "process; give a whole number of at least 1"
    ]


def test_no_cluster_at_the_address_is_named_without_a_traceback(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out"))
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    nobody = f"--set=resources.ray_address=127.0.0.1:{_closed_port()}"
    result = subprocess.run(
        cli_command("run", str(job), *ON_RAY, nobody), env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].endswith("failed: the engine or data store was unavailable"), lines
    assert lines[1].startswith("error: ray: resources.ray_address = '127.0.0.1:"), lines
    assert "no Ray cluster answers there (Connection refused); start one with `ray start --head`" in lines[1]
    assert len(lines) == 2, lines  # no worker started, so no "every rank's log is in ..."


def test_a_node_that_does_not_see_the_launcher_s_outputs_folder_refuses_to_start(tmp_path: Path) -> None:
    """A folder of the same name on a node's own disk would split the job's logs and checkpoints."""
    launcher = JobOutputs.at(tmp_path / "out")
    launcher.root.mkdir()
    launcher.lock.write_text('{"job": "a1"}\n')
    check_shared_outputs(launcher, '{"job": "a1"}\n', "10.0.0.2")
    check_shared_outputs(JobOutputs.at(tmp_path / "elsewhere"), None, "10.0.0.2")  # no lock to compare: no check
    with pytest.raises(EngineError, match=r"^outputs.dir .*/elsewhere on Ray node 10.0.0.2 is not the launcher's") as e:
        check_shared_outputs(JobOutputs.at(tmp_path / "elsewhere"), '{"job": "a1"}\n', "10.0.0.2")
    assert not e.value.retryable


def test_example_job_trains_to_an_exported_model_on_two_ray_nodes(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """With its outputs at a URL (a folder store, file://) the nodes share only the store: each works in a folder
    of its own under outputs.cache_dir, and the launcher reads their logs back as they write them. The store ends
    with the model, the checkpoints, both nodes' logs and agents' logs, and no writer; the nodes' folders are
    gone."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    url = f"file://{store}"
    out = cache_folder(url, cache)
    example = REPO / "examples" / "engines-tiny.yaml"  # the example every engine runs; only --set moves it to Ray
    result = subprocess.run(
        cli_command("run", str(example), f"--set=outputs.dir={url}", f"--set=outputs.cache_dir={cache}", *ON_RAY),
        env=ray_cluster.client_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (store / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    assert {"rank-0.log", "rank-1.log", "agent.log", "agent.node-1.log"} <= {p.name for p in (store / "logs").iterdir()}
    assert list((store / "checkpoints").glob("step-*/manifest.json"))
    assert not list((store / "checkpoints").glob(".tmp-*"))
    assert not list((cache / "nodes").iterdir()), "each node's folder is removed once the store holds it"
    assert not (store / ".clusterfit-writer.json").exists()
    assert (out / "model" / "model.safetensors").stat().st_size > 0
    assert (out / "model" / "model.torchscript.pt").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    for rank in (0, 1):  # every rank's log comes back labelled, from its own node
        assert re.search(rf"^\[rank{rank}\] .*rank {rank} of 2 \(local rank 0\)", result.stdout, re.M), result.stdout
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}
    assert not _job_processes(out)


def test_ctrl_c_stops_every_process_and_removes_the_placement_group(ray_cluster: RayCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_job(out, steps_per_epoch=None))  # thousands of steps
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            cli_command("run", str(job), *ON_RAY),
            env=ray_cluster.client_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    processes = _wait_until_training(out, launcher)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(180) == 130, (tmp_path / "launcher.log").read_text()[-3000:]
    assert not [p.pid for p in processes if _alive(p)], "agents or workers outlived the cancel"
    assert not _job_processes(out)
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}
    assert not (out / "summary.json").exists()


def test_a_dead_worker_fails_the_job_and_stops_the_other_node(ray_cluster: RayCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_job(out, steps_per_epoch=None))
    launcher = subprocess.Popen(
        cli_command("run", str(job), *ON_RAY),
        env=ray_cluster.client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    processes = _wait_until_training(out, launcher)
    rank1 = int(re.search(r"rank 1 of 2 .* pid (\d+)", (out / "logs" / "rank-1.log").read_text()).group(1))
    os.kill(rank1, signal.SIGKILL)  # max_restarts 0: node 1's agent gives up, and so the job
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, stderr[-3000:]
    lines = stderr.splitlines()
    assert re.fullmatch(r"error: job tiny \(\w+\) failed: killed by a signal", lines[0]), stderr[-3000:]
    assert lines[1].startswith("error: rank 1 killed by SIGKILL (signal 9)"), stderr[-3000:]
    assert "Traceback" not in stderr
    assert not [p.pid for p in processes if _alive(p)], "node 0 kept running after node 1 failed"
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}


def test_another_process_finds_the_job_for_status_and_cancel(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """The submitter exits at once; the job runs on, and other processes query and cancel it by reference."""
    out = tmp_path / "out"
    job = tiny_job(out, steps_per_epoch=None)
    job["resources"] = {"instance_count": 2, "backend": "ray", "ray_address": ray_cluster.address}
    job["distribution"]["process_count_per_instance"] = 1
    ref = _ray_job(ray_cluster, "submit", str(write_job(tmp_path / "job.yaml", job)))
    assert ref.startswith("{") and '"backend": "ray"' in ref
    processes = _wait_until_training(out, None)
    assert json.loads(_ray_job(ray_cluster, "status", ref)) == {"state": "running", "exit_code": None}
    assert ray_cluster.placement_groups()[json.loads(ref)["id"]] == "CREATED"

    assert _ray_job(ray_cluster, "cancel", ref) == "cancelled"
    assert not [p.pid for p in processes if _alive(p)], "agents or workers outlived the cancel"
    assert json.loads(_ray_job(ray_cluster, "status", ref)) == {"state": "gone", "exit_code": None}
    assert ray_cluster.placement_groups()[json.loads(ref)["id"]] == "REMOVED"


def test_service_runs_a_submitted_ray_job_and_cancels_it(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """`clusterfit submit` hands the job to a detached supervisor, which places it on Ray; `clusterfit cancel`
    stops it there."""
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", tiny_job(out, steps_per_epoch=None))
    env = ray_cluster.client_env()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cli_command(*args), env=env, capture_output=True, text=True, timeout=300)

    submitted = cli("submit", str(job), *ON_RAY)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    processes = _wait_until_training(out, None)
    wait_for(lambda: "RUNNING" in cli("status", job_id).stdout, 60, "RUNNING")
    ref = json.loads(open_store().get(job_id).engine_ref)
    assert ref["backend"] == "ray" and ray_cluster.placement_groups()[ref["id"]] == "CREATED"

    cancelled = cli("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"job {job_id} CANCELLED"
    wait_for(lambda: not [p.pid for p in processes if _alive(p)], 60, "the job's processes to end")
    assert ray_cluster.placement_groups()[ref["id"]] == "REMOVED"


@pytest.fixture(scope="module")
def nobody_python() -> Iterator[str]:
    """A Python that `nobody` may run (job_accounts.python_for), as a root job service's Ray nodes must."""
    assert os.geteuid() == 0, "the tests run as root; the account tests need a root job service"
    with python_for("nobody") as python:
        if python is None:
            pytest.skip("no Python that nobody can run here (as root, a python3 of this version)")
        yield python


def test_a_root_job_service_runs_its_ray_jobs_as_the_job_s_account(nobody_python: str, tmp_path: Path) -> None:
    """Ray's daemons run as root (the tests do), as an operator's might; a root job service runs its jobs as
    `nobody`. On Ray the job's processes run as `nobody` too, and cannot read the Ray cluster's token from its
    daemons' environment: before, such a job ran as root on every node (then was refused on such nodes). The
    cluster runs a Python that `nobody` may run, as its nodes must for this."""
    cluster = RayCluster(python=nobody_python, warm_starts=False)  # its jobs start cold
    folder = Path(tempfile.mkdtemp(prefix="clusterfit-ray-account-"))
    folder.chmod(0o1777)  # where the account makes its outputs folder, as in /tmp
    try:
        cluster.start(nodes=1)
        daemon = cluster.nodes[0].pid  # `ray start`, whose environment holds the cluster's token
        out = folder / "out"
        probe = f"id -un; grep -c RAY_AUTH_TOKEN /proc/{daemon}/environ || echo token-not-readable"
        job = command_job(out, user_code(folder), probe, processes=1)  # code the account may read
        job["resources"] = {"backend": "ray", "instance_count": 1}
        env = cluster.client_env(CLUSTERFIT_JOB_USER="nobody")  # what `clusterfit server` passes its supervisors
        job_id = submit_as_root_service(nobody_python, write_job(tmp_path / "job.yaml", job), env)
        ended = wait_for(lambda: (j := open_store().get(job_id)).job_state.is_terminal and j, 180, "the end")
        assert ended.state == "SUCCEEDED", f"{ended.cause_detail}\n{_logs(out)}"
        log = (out / "logs" / "rank-0.log").read_text()
        assert "nobody" in log and "token-not-readable" in log and "Permission denied" in log, log
        assert out.stat().st_uid == pwd.getpwnam("nobody").pw_uid
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


NODE_ACCOUNT_PROBE = """
from clusterfit.backends.ray import node_account
from clusterfit.errors import EngineError
print(node_account("nobody", "10.0.0.2"))
try:
    node_account("root", "10.0.0.2")
except EngineError as error:
    print(error, error.retryable)
"""


def test_ray_daemons_of_another_user_refuse_a_job_of_an_account_in_one_line(nobody_python: str) -> None:
    """Ray's daemons run as `nobody`: a job of the account `nobody` runs as they do, and one a root job service
    runs as another account is refused in one line on the node. Before, it ran as the daemons' user (who holds
    the cluster's token), in a folder the account had made and closed to it, and failed without saying why."""
    probe = subprocess.run(
        [nobody_python, "-c", NODE_ACCOUNT_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        **JobAccount.named("nobody").helper_options(job_base_env("/")),
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines() == [
        "None",
        "Ray node 10.0.0.2: Ray's processes run as nobody, who cannot start the job as root, the account this job "
        "service runs it as; start Ray's nodes as root (or as root) False",
    ]
    assert node_account("nobody", "10.0.0.2") == JobAccount.named("nobody"), "daemons as root switch"
    assert node_account(None, "10.0.0.2") is None
    with pytest.raises(EngineError, match=r"^Ray node 10.0.0.2 has no account no-such-account, which"):
        node_account("no-such-account", "10.0.0.2")


def _logs(out: Path) -> str:
    return "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted((out / "logs").glob("*.log")))


ELASTIC_STEPS = 120
# A join takes 16 s on an idle machine and 29 s beside two other test modules, where unpaced one node alone
# trains 400 steps in 20 s. Rank 0 is made a straggler (a sleep after each step) so that the job outlasts a loss
# and a join on any machine: over 70 s of steps alone. Few long sleeps rather than many short ones: a sleeping
# rank costs no CPU, a step does (with 400 steps of 0.05 s, the steps after the join took 43 of the test's 103
# core-seconds). Once the test has seen the join, the rest of the steps run at full speed: alone on an idle
# machine the test took 45-46 s instead of 105.
ELASTIC_PACE = "slow:rank=0:step=1:seconds=0.6"


def test_an_elastic_job_loses_a_node_trains_on_and_takes_a_new_one(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """1:2 nodes: the job starts on both nodes; every process of node 1 is killed (as a reclaimed VM's would be)
    and node 0 trains on alone from the last checkpoint; a new Ray node joins and the job takes it; it ends with
    an exported model, and each membership change is in its records and on the console. Its outputs are at a URL
    (file://), as on spot VMs without a file share: each node works in a folder of its own, the joining node fills
    its folder from the store, and every rank resumes each round from rank 0's checkpoint."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    url = f"file://{store}"
    out = cache_folder(url, cache)  # the launcher's copy, read back from the store
    job = tiny_job(out, steps_per_epoch=ELASTIC_STEPS, checkpoint={"every_steps": 10, "keep": 2}, log_every_steps=5)
    job["outputs"] = {"dir": url, "cache_dir": str(cache), "upload_every_s": 1}
    job["resources"] = {"instance_count": "1:2", "backend": "ray"}
    job["distribution"] = {"type": "pytorch", "process_count_per_instance": 1, "max_restarts": 3}
    joined = tmp_path / "joined"
    job["environment_variables"] = {"CLUSTERFIT_FAULT": f"{ELASTIC_PACE}:until={joined}"}
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            cli_command("run", str(write_job(tmp_path / "job.yaml", job))),
            env=ray_cluster.client_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    metrics = JobOutputs.at(out).metrics

    def last_start() -> dict:
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        starts = read_records(metrics, (RecordKind.START,))
        return starts[-1] if starts else {}

    def trained_since(start: dict) -> bool:
        return any(r["time"] > start["time"] for r in read_records(metrics, (RecordKind.TRAIN,)))

    wait_for(lambda: last_start().get("nodes") == 2, 300, "the job to start on 2 nodes")
    # Complete in the store, whichever node rank 0 was on: the node left must resume from it (or a newer one).
    saved = step_of(wait_for(lambda: published(store / "checkpoints", 1), 120, "a checkpoint in the store")[0])
    lost = _node_processes(cache, host=False)
    for process in lost:  # the actor, its agent and its worker at once, as when a VM is reclaimed
        # A short-lived child listed with them (a helper a process ran) may have ended by itself since.
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    lost_at = time.time()
    alone = wait_for(lambda: last_start().get("nodes") == 1 and last_start(), 180, "training on the remaining node")
    assert alone["step"] >= saved > 0, (saved, alone)  # from the last checkpoint, not from the start
    wait_for(lambda: trained_since(alone), 120, "a step on one node")
    back_at = min(r["time"] for r in read_records(metrics, (RecordKind.TRAIN,)) if r["time"] > alone["time"])
    print(f"from the node loss to training again on the remaining node: {back_at - lost_at:.1f} s")

    new_node = ray_cluster.add_node()
    try:
        wait_for(lambda: last_start().get("nodes") == 2 and last_start()["time"] > alone["time"], 240, "the join")
        joined.touch()
        assert launcher.wait(600) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        ray_cluster.remove_node(new_node)
    console = (tmp_path / "launcher.log").read_text()
    changes = membership_changes(read_records(metrics, (RecordKind.START,)))
    assert [(c.nodes_before, c.nodes) for c in changes][-2:] == [(2, 1), (1, 2)], changes
    assert changes[-2].world_size == 1 and changes[-1].world_size == 2
    for change in changes[-2:]:
        assert f"nodes: {change.text}" in console, console[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and (out / "model" / "model.safetensors").stat().st_size > 0
    assert read_records(metrics, (RecordKind.END,))[-1]["step"] == ELASTIC_STEPS
    assert (store / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    assert not [p.pid for p in lost if _alive(p)]
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}
    assert not _job_processes(cache)


def _node_processes(out: Path, *, host: bool) -> list[psutil.Process]:
    """The agent that hosts the job's rendezvous (or the one that does not), its Ray actor and its workers."""
    agents = [p for p in _agents(_job_processes(out)) if ("is_host=1" in " ".join(p.cmdline())) == host]
    assert len(agents) == 1, [p.cmdline() for p in agents]
    _, actor = _warm_start_and_actor(agents[0])
    return [actor, agents[0], *agents[0].children(recursive=True)]


def _warm_start_and_actor(agent: psutil.Process) -> tuple[psutil.Process, psutil.Process]:
    """The warm-start process of the node that forked `agent` (the test cluster's nodes run one each), and the
    job's Ray actor on that node, for which it did."""
    warm_start = agent.parent()
    assert "warm-start" in " ".join(warm_start.cmdline()), f"started cold: {warm_start.cmdline()}"
    node = warm_start.parent()  # the node's `ray start`, whose daemons start its actors
    actors = [p for p in node.children(recursive=True) if _title(p).startswith("ray::NodeAgent")]
    assert len(actors) == 1, [_title(p) for p in actors]
    return warm_start, actors[0]


def _title(process: psutil.Process) -> str:
    """Its command line as `ps` shows it (Ray retitles its workers); "" once it has ended (a node's helpers may)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _ray_job(cluster: RayCluster, action: str, argument: str) -> str:
    result = subprocess.run(
        [sys.executable, RAY_JOB_SCRIPT, action, argument],
        env=cluster.client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def _wait_until_training(out: Path, launcher: subprocess.Popen[bytes] | None) -> list[psutil.Process]:
    """Once rank 0 logged a step: the job's agents and workers, two of each at least."""
    deadline = time.monotonic() + 300
    rank0 = out / "logs" / "rank-0.log"
    while not (rank0.exists() and " step " in rank0.read_text()):
        assert launcher is None or launcher.poll() is None, "the launcher ended before training started"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    processes = _job_processes(out)
    agents = _agents(processes)
    assert len(agents) == 2 and len(processes) >= 4, [p.cmdline() for p in processes]
    for agent in agents:  # forked by its node's warm start, at the niceness Ray gives its actor (15)
        _, actor = _warm_start_and_actor(agent)
        assert agent.nice() == actor.nice() > 0, (agent.nice(), actor.nice())
    return processes


def _agents(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The torchrun agents among `processes`. A process an agent forks (its fork server, before that server
    retitles itself) shows the agent's command for a moment: on a loaded machine, long enough to be seen."""
    titled = {p.pid for p in processes if "clusterfit.backends.agent" in " ".join(p.cmdline())}
    return [p for p in processes if p.pid in titled and p.ppid() not in titled]


def _job_processes(out: Path) -> list[psutil.Process]:
    """torchrun agents (--log-dir=OUT/logs) and workers (--spec OUT/job.yaml) of the job writing to `out`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(out) in cmdline and "clusterfit" in cmdline and process.pid != os.getpid() and _alive(process):
            found.append(process)
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_to_success(ray_cluster: RayCluster, job: Path) -> str:
    """`clusterfit run JOB` on the test cluster, 2 nodes x 1 process; its output."""
    result = subprocess.run(
        cli_command("run", str(job), *ON_RAY), env=ray_cluster.client_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("kind", ["pytorch", "mpi", "tensorflow"])
def test_a_command_job_gets_its_environment_on_two_ray_nodes(
    ray_cluster: RayCluster, tmp_path: Path, kind: str
) -> None:
    """The user-script contract of each distribution.type holds across two Ray nodes (1 process each)."""
    out = tmp_path / "out"
    job = command_job(out, framework_code(tmp_path), f"python env_contract.py {kind}", kind, processes=1)
    if kind == "tensorflow":  # and a real cluster of both workers
        job["command"] += " && python tf_multiworker.py"
    if kind == "mpi":  # and one MPI world across both nodes, from node 0's mpirun
        if not ray_cluster.own_host_names:
            pytest.skip("needs root: the second Ray node's host name of its own (unshare --uts), as Open MPI needs")
        job["command"] += " && python mpi_allreduce.py"
    stdout = _run_to_success(ray_cluster, write_job(tmp_path / "job.yaml", job))
    for rank in range(2):
        assert f"[rank{rank}] env ok: {kind} rank {rank}/2 in code" in stdout, stdout[-3000:]
    if kind == "tensorflow":
        assert_one_tensorflow_cluster_learned(out, workers=2)
    if kind == "mpi":
        for rank in range(2):
            assert f"mpi world of 2: rank {rank} agrees on the sum 3" in rank_logs(out), rank_logs(out)[-3000:]
        assert list((out / ".mpi-launch").iterdir()) == [], "node 1 took mpirun's request"
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}
    assert not _job_processes(out)


def test_a_scoring_job_scores_every_image_once_across_two_ray_nodes(
    ray_cluster: RayCluster, scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    """`clusterfit score`'s job on Ray: one rank per node, each scoring its own chunks."""
    model, images = scoring_case
    out = tmp_path / "scored"
    job = scoring_job(model, images, out, backend="ray", instances=2, per_instance=1)
    stdout = _run_to_success(ray_cluster, write_job(tmp_path / "score.yaml", job))
    assert "scored 21 of 22 images on 2 rank(s)" in stdout, stdout[-3000:]
    assert_every_good_image_scored_once(out, model, images)
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}


def test_a_gpu_job_gets_a_gpu_bundle_on_each_ray_node(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """Each test node declares one GPU: the job's bundles reserve it, and every rank sees the device Ray gave its
    node's actor."""
    out = tmp_path / "out"
    show = "import os; print('visible GPUs:', os.environ.get('CUDA_VISIBLE_DEVICES'))"
    job = command_job(out, user_code(tmp_path), f'python -c "{show}"', processes=1)
    job["resources"]["gpus_per_instance"] = 1
    stdout = _run_to_success(ray_cluster, write_job(tmp_path / "job.yaml", job))
    for rank in range(2):
        assert f"[rank{rank}] visible GPUs: 0" in stdout, stdout[-3000:]
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}


def test_a_session_script_reports_checkpoints_and_resumes_on_two_ray_nodes(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """clusterfit.session on Ray with outputs at a URL: each node's rank reports and writes its part in its own
    folder, rank 1's part reaches rank 0's node through the store, and a second run resumes from the store."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    url = f"file://{store}"
    out = JobOutputs.at(cache_folder(url, cache))  # the launcher's copy, read back from the store
    spec = session_job(tmp_path, "on-ray", "python session_user.py --steps 6 --every 3")
    at_url = [f"--set=outputs.dir={url}", f"--set=outputs.cache_dir={cache}", "--set=outputs.upload_every_s=1"]

    def run(*changes: str) -> str:
        result = subprocess.run(
            cli_command("run", str(spec), *ON_RAY, *at_url, *changes),
            env=ray_cluster.client_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    run()
    assert [record["step"] for record in read_records(out.metrics)] == list(range(6))
    beats = read_heartbeats(out, 2)
    assert {rank: beat.metrics["node"] for rank, beat in beats.items()} == {0: 0.0, 1: 1.0}  # one rank per node
    resume = latest_checkpoint(JobOutputs.at(store).checkpoints, rank=1)
    assert resume is not None and resume.step == 5 and resume.world_size == 2
    assert not list((cache / "nodes").iterdir()), "each node's folder is removed once the store holds it"
    resumed = run("--set", "command=python session_user.py --steps 9 --every 3")
    assert "resumed from step 5" in resumed
    assert latest_checkpoint(JobOutputs.at(store).checkpoints, rank=0).step == 8
    assert set(ray_cluster.placement_groups().values()) == {"REMOVED"}


# --- `clusterfit bench train` end to end, with its Ray Train baseline ---------------------------------------
# NOTE: on the tests' Ray cluster (a worker per node, one CPU each), not the fresh local Ray instance a real
# measurement starts: that takes a minute on 2 busy cores and starts the same TorchTrainer code path. The other
# systems run here too, so this one run covers the whole command (the report's pure parts: tests/test_bench.py).
def test_bench_train_compares_clusterfit_with_the_hand_written_loop_and_ray_train(tmp_path, ray_cluster) -> None:
    # One core per rank: each of the 2 ranks runs on its own core, so every system gets 1 thread.
    result = run_cli(
        "bench", "train", "--models", "resnet_tiny", "--workers", "2", "--image-size", "32", "--batch", "2",
        "--steps", "4", "--warmup", "2", "--window", "2", "--precision", "fp32", "--out", str(tmp_path),
        "--cores-per-rank", "1",
        "--rounds", "1", "--ray-address", ray_cluster.address, "--grad-compression", "bf16",
        env=ray_cluster.client_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "train.json").read_text())
    assert set(report) == {"config", "machine", "precision", "cells", "ratios", "orders"}
    assert report["config"]["cores_per_rank"] == 1
    # One round here (each run costs seconds of start-up); the rotation of more rounds is tested on its own.
    compressed = "clusterfit + bf16 gradients"  # --grad-compression: clusterfit once more, with that DDP hook
    assert report["orders"] == {
        "resnet_tiny/2": [["compute only", "hand-written DDP", "Ray Train", "clusterfit", compressed]]
    }
    assert {"cpu", "cores", "torch"} <= set(report["machine"]) and report["precision"] == "fp32"
    cells = {c["system"]: c for c in report["cells"]}
    assert set(cells) == {"hand-written DDP", "clusterfit", "Ray Train", compressed}
    for cell in cells.values():
        assert cell["workers"] == 2 and cell["threads_per_rank"] == 1
        # 4 steps in windows of 2: clusterfit logged twice (log_every_steps), the loops' steps were summed by 2.
        assert [len(run) for run in cell["window_images_per_s"]] == [2] and len(cell["round_images_per_s"]) == 1
        assert cell["images_per_s"] == cell["round_images_per_s"][0] > 0
        assert cell["scaling_efficiency"] is None  # no 1-rank cell to compare with
        assert cell["efficiency_vs_reference"] is None and cell["efficiency_bound"] is None
        split = cell["split"]
        assert split["step_s"] > 0 and split["compute_s"] > 0 and split["data_wait_s"] >= 0
        assert split["communication_s"] == pytest.approx(split["step_s"] - split["compute_s"] - split["data_wait_s"])
    [ratios] = report["ratios"]
    assert set(ratios) == {
        "model",
        "workers",
        *(
            f"{ours}_over_{baseline}"
            for ours in ("clusterfit", "clusterfit_bf16_gradients")
            for baseline in ("hand_written_ddp", "ray_train")
        ),
    }
    assert (ratios["model"], ratios["workers"]) == ("resnet_tiny", 2) and ratios["clusterfit_over_ray_train"] > 0
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "clusterfit ÷ hand-written" in result.stdout and "clusterfit ÷ Ray Train" in result.stdout
    assert f"{compressed} ÷ hand-written DDP" in result.stdout
    for system in cells:
        assert f"| resnet_tiny | 2 | {system} |" in result.stdout, result.stdout


def _replica_pids() -> list[int]:
    """Ray titles an actor's process after its class: `ray::ServeReplica:<app>:<deployment>`."""
    return [
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if any("ServeReplica:clusterfit:ModelReplica" in part for part in process.info["cmdline"] or [])
    ]


def _predict(http: Any, image: bytes) -> Any:
    return http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})


def test_ray_serve_replicas_answer_and_outlive_a_killed_one(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """The model as a Ray Serve app autoscaled from 2 replicas (one per node): answers equal the model's, a burst
    shares batches; SIGKILL one replica's process and requests keep being answered, by the other replica and then
    by its replacement."""
    import httpx
    import torch
    from conftest import exported_test_model, shared_by_threads
    from test_serve import CLASSES, _jpeg

    from clusterfit.data.imagefolder import val_transform
    from clusterfit.scoring import load_classifier

    model = exported_test_model(tmp_path / "model", CLASSES)
    port = free_port()
    deployed = run_cli(
        "serve",
        str(model),
        "--backend",
        "ray",
        "--replicas",
        "2:3",  # autoscaled from 2 (both nodes) up to 3
        "--cpus-per-replica",
        "0.25",
        "--max-wait-ms",
        "100",  # a burst's requests reach a replica within this window on these busy cores
        "--no-auth",
        "--port",
        str(port),
        env=ray_cluster.client_env(),
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    assert "2-3 (autoscaled) replica(s) at " in deployed.stdout, deployed.stdout
    try:
        images = [_jpeg(300 + n, (40, 40)) for n in range(4)]
        expected = load_classifier(model).predict(torch.stack([val_transform(32)(image) for image in images]))
        burst_threads = 64
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=30, limits=shared_by_threads(burst_threads)
        ) as http:
            for image, probabilities in zip(images, expected, strict=True):
                answer = http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})
                assert answer.status_code == 200, answer.text
                assert answer.json()["top_k"][0]["class"] == CLASSES[int(probabilities.argmax())]
            refused = http.post("/predict", content=b"x", headers={"Content-Type": "text/plain"})
            assert refused.status_code == 415 and "send image/jpeg" in refused.json()["detail"]
            # A burst shares batches past Ray Serve's default of 5 requests in flight per replica.
            with ThreadPoolExecutor(burst_threads) as pool:
                burst = list(pool.map(lambda image: _predict(http, image), images * 16))
            assert all(answer.status_code == 200 for answer in burst)
            stats = http.get("/stats").json()  # one replica's (the proxy prefers its own node's)
            assert stats["replica"] and stats["requests"] >= 16, stats
            assert max(int(size) for size in stats["batch_sizes"]) > 5, stats

            pids = _replica_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            # One request at a time until 30 are answered (each waits out the 0.1 s batch window alone, so how
            # long that takes depends on the machine's load): the failures stay within a short window, and the
            # endpoint answers every request after it.
            failures, answers, started = [], [], time.monotonic()
            while sum(answers) < 30:
                assert time.monotonic() - started < 120, f"30 answers after the kill took over 120 s: {failures}"
                try:
                    ok = http.post("/predict", content=images[0], headers={"Content-Type": "image/jpeg"}).status_code
                except httpx.HTTPError:
                    ok = 0
                answers.append(ok == 200)
                if ok != 200:
                    failures.append(time.monotonic() - started)
                time.sleep(0.05)
            window = (failures[-1] - failures[0]) if failures else 0.0
            print(
                f"after a replica was killed: {len(failures)} failed, {sum(answers)} answered; error window "
                f"{window:.2f} s"
            )
            assert window < 5 and all(answers[-10:]), (failures, answers)
            wait_for(lambda: len(_replica_pids()) == 2, 180, "Ray Serve to replace the killed replica")
    finally:
        stopped = run_cli("serve-stop", env=ray_cluster.client_env())
        assert stopped.returncode == 0, stopped.stderr[-2000:]
