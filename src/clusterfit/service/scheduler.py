"""Start queued jobs when there is room, and keep the states of active jobs true to their processes.

There is no scheduler daemon: `schedule` runs whenever room may have changed (a submission, a job's end, a
cancel, and every few seconds inside `clusterfit server`), under a lock file so two callers never start
the same capacity twice. Local capacity is this machine's slots (cores, or GPUs); a local job takes one
slot per rank. Jobs on other engines are handed to the engine at once: it queues them itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta

from filelock import FileLock

from clusterfit.backends import EngineRef, get_backend
from clusterfit.processes import is_running
from clusterfit.service.home import local_capacity, service_home
from clusterfit.service.records import forget_secrets_of_ended_jobs
from clusterfit.service.states import FailureCause, IllegalTransition, JobState
from clusterfit.service.store import Job, JobStore, StateConflict, utcnow
from clusterfit.storage.filesystems import drop_store_credentials

_SUPERVISOR_SILENCE = timedelta(seconds=60)  # a supervisor on another host writes at least every 2 s
_REQUEUED = "queued again: whoever started it stopped before its supervisor began"


def schedule(store: JobStore, capacity: int | None = None) -> list[str]:
    """Start queued jobs in order (priority, then submission) while they fit; returns the ids started."""
    capacity = capacity or local_capacity()
    started: list[str] = []
    with FileLock(service_home() / "scheduler.lock"):
        reconcile(store)
        used = sum(job.ranks for job in store.active_jobs() if job.backend == "local")
        for job in store.queued_in_order():
            need = job.ranks if job.backend == "local" else 0
            # No backfilling past the head of the queue: a big job is never starved by small ones. A job
            # larger than the machine still runs, alone.
            if need and used and used + need > capacity:
                break
            try:
                store.transition(job.id, JobState.STAGING, "started by the scheduler")
            except (StateConflict, IllegalTransition):
                continue  # cancelled or started by someone else meanwhile
            spawn_supervisor(job.id)
            used += need
            started.append(job.id)
    return started


def spawn_supervisor(job_id: str) -> None:
    env = os.environ.copy()
    drop_store_credentials(env)  # its job's store is reached with the job's own credentials only
    # The supervisor forks and detaches at once, so waiting here is short and leaves no zombie behind.
    subprocess.run(
        [sys.executable, "-m", "clusterfit.service.supervisor", job_id],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
        env=env,
    )


def supervisor_alive(job: Job) -> bool:
    """Whether the process supervising an active job still exists (checked by pid on its own host)."""
    if not job.supervisor:
        return utcnow() - job.updated_at < _SUPERVISOR_SILENCE  # claimed, supervisor still starting
    info = json.loads(job.supervisor)
    if info.get("host") != socket.gethostname():
        return utcnow() - job.updated_at < _SUPERVISOR_SILENCE
    pid = int(info["pid"])
    return is_running(pid, info.get("start_time"))


def reconcile(store: JobStore) -> list[str]:
    """Active jobs whose supervisor is gone are not running: stop what is left of them and say so."""
    settled: list[str] = []
    for job in store.active_jobs():
        if supervisor_alive(job):
            continue
        unstarted = not job.supervisor and job.cancel_requested_at is None
        if unstarted and store.requeue_unsupervised(job.id, _REQUEUED):
            settled.append(job.id)  # the room it held is free again, and it waits for it in its place
            continue
        if job.engine_ref:
            ref = EngineRef(**json.loads(job.engine_ref))
            get_backend(ref.backend).cancel(ref)  # no orphans: whatever still runs of it is stopped
        info = json.loads(job.supervisor) if job.supervisor else {}
        what = f"pid {info['pid']} on {info['host']}" if info else "never started"
        cancelled = job.cancel_requested_at is not None
        target = JobState.CANCELLED if cancelled else JobState.FAILED
        cause = FailureCause.CANCELLED if cancelled else FailureCause.NODE_LOST
        summary = (
            "cancelled by user"
            if cancelled
            else f"the process supervising this job ({what}) is gone; its workers were stopped"
        )
        try:
            store.transition(job.id, target, summary, cause=cause.value, cause_detail=summary)
            settled.append(job.id)
        except (StateConflict, IllegalTransition):
            continue
    forget_secrets_of_ended_jobs(store)
    return settled
