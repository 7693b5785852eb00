"""Where the job service keeps its state on this machine: `$CLUSTERFIT_HOME`, else `~/.clusterfit`."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "CLUSTERFIT_HOME"
DATABASE_ENV = "CLUSTERFIT_DATABASE_URL"  # e.g. postgresql+psycopg://user@host/clusterfit
SERVER_ENV = "CLUSTERFIT_SERVER"
TOKEN_ENV = "CLUSTERFIT_TOKEN"
JOB_USER_ENV = "CLUSTERFIT_JOB_USER"  # set by a root server for its supervisors: who the jobs run as
JOB_USERS_ENV = "CLUSTERFIT_JOB_USER_OF"  # and who each named owner's jobs run as instead (JSON: owner -> account)
CAPACITY_ENV = "CLUSTERFIT_CAPACITY"  # local slots; default: the cores (or GPUs) of this machine


def service_home() -> Path:
    """The service's folder, 0700: its database, tokens' hashes and jobs' secrets are no one else's."""
    home = Path(os.environ.get(HOME_ENV) or Path.home() / ".clusterfit").expanduser()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if home.stat().st_mode & 0o077 and home.stat().st_uid == os.geteuid():
        home.chmod(0o700)  # made by an older version, or by hand
    return home


def database_url() -> str:
    return os.environ.get(DATABASE_ENV) or f"sqlite:///{service_home() / 'jobs.db'}"


def threads_per_slot(ranks: int, cores: int | None = None, capacity: int | None = None) -> int:
    """CPU threads for a rank of a local job of the service: its slot's share of the cores, or its job's share
    when the job has more ranks than the machine has slots (it then runs alone). Jobs run side by side up to the
    capacity, so ranks that each took the cores of a machine to themselves would oversubscribe them, and
    libgomp's threads spin while they wait for a core (measured in docs/jobs.md, "Queue")."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // max(ranks, capacity or local_capacity()))


def local_capacity() -> int:
    """Slots for local jobs: one per GPU where there are GPUs, else one per core; a job takes one per rank."""
    configured = os.environ.get(CAPACITY_ENV)
    if configured:
        return max(1, int(configured))
    from clusterfit.backends.local import local_gpu_count

    return local_gpu_count() or len(os.sched_getaffinity(0))
