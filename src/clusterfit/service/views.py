"""What users see of a job, as plain JSON-able dicts: the same for the CLI, the HTTP API and the dashboard."""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from clusterfit.outputs import (
    JobOutputs,
    RecordKind,
    last_record,
    membership_changes,
    own_metrics,
    read_heartbeats,
    read_summary,
    recent_records,
)
from clusterfit.outputs.checkpoints import published
from clusterfit.service.records import outputs_url
from clusterfit.service.states import FailureCause, JobState
from clusterfit.service.store import Job, JobStore

_STALE_BEAT_S = 30.0  # a rank silent this long while its job runs is flagged


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def job_row(job: Job) -> dict[str, Any]:
    """One line of `clusterfit list` / the dashboard's table."""
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "backend": job.backend,
        "ranks": job.ranks,
        "priority": job.priority,
        "attempt": job.attempt,
        "max_retries": job.max_retries,
        "step": job.step,
        "total_steps": job.total_steps,
        "epoch": job.epoch,
        "images_per_s": job.images_per_s,
        "loss": job.loss,
        "submitted_at": _iso(job.submitted_at),
        "started_at": _iso(job.started_at),
        "ended_at": _iso(job.ended_at),
        "cause": job.cause,
        "cause_words": FailureCause(job.cause).words if job.cause else None,
        "cause_detail": job.cause_detail,
        "owner": job.owner,
    }


def rank_health(job: Job) -> list[dict[str, Any]]:
    """Each rank's newest heartbeat of the current attempt and how old it is."""
    now = time.time()
    rows = []
    for rank, beat in sorted(read_heartbeats(JobOutputs.at(job.outputs_dir), job.ranks, job.attempt or None).items()):
        age = now - beat.time
        if not job.job_state.is_active:
            health = "ended"
        elif age > _STALE_BEAT_S and beat.training:
            health = "silent"
        else:
            health = "ok"
        rows.append(
            {
                "rank": rank,
                "host": beat.host,
                "pid": beat.pid,
                "phase": beat.phase,
                "step": beat.step,
                "images_per_s": beat.images_per_s,
                "seconds_since_heartbeat": round(age, 1),
                "health": health,
            }
        )
    return rows


def latest_metrics(job: Job) -> tuple[int | None, dict[str, Any]]:
    """The newest train record's step and its metrics beyond the progress line's (a user script's own names).
    Read live from metrics.jsonl, so its step may be ahead of the stored progress."""
    record = last_record(JobOutputs.at(job.outputs_dir).metrics, RecordKind.TRAIN) or {}
    return record.get("step"), own_metrics(record)


def node_membership(job: Job) -> dict[str, Any] | None:
    """An elastic job's nodes: allowed (MIN:MAX), now (the last round's), and each change with its step."""
    allowed = yaml.safe_load(job.spec_yaml).get("resources", {}).get("instance_count")
    if not isinstance(allowed, str):
        return None  # a fixed node count: nothing to follow
    starts = recent_records(JobOutputs.at(job.outputs_dir).metrics, (RecordKind.START,))
    return {
        "allowed": allowed,
        "now": starts[-1].get("nodes") if starts else None,
        "changes": [{**asdict(change), "text": change.text} for change in membership_changes(starts)],
    }


def job_status(store: JobStore, job: Job) -> dict[str, Any]:
    metrics_step, metrics = latest_metrics(job)
    return {
        **job_row(job),
        "nodes": node_membership(job),
        "metrics_step": metrics_step,
        "metrics": metrics,
        "outputs_dir": job.outputs_dir,
        "outputs_url": outputs_url(job),
        "logs_dir": str(JobOutputs.at(job.outputs_dir).logs),
        "ranks_health": rank_health(job),
        "history": [
            {"at": _iso(event.at), "state": event.state, "message": event.message} for event in store.events(job.id)
        ],
    }


# The most entries of a folder a job writes (its model, its checkpoints) that one answer lists: a job may make
# millions, and the answer is read by a browser or a terminal.
_LISTED = 100


def _first_names(folder: Path, count: int) -> list[str]:
    return heapq.nsmallest(count, (entry.name for entry in os.scandir(folder))) if folder.is_dir() else []


def job_details(store: JobStore, job: Job) -> dict[str, Any]:
    """`clusterfit show`: the resolved spec, where everything went, the final metrics, the checkpoints."""
    out = JobOutputs.at(job.outputs_dir)
    return {
        **job_status(store, job),
        "spec": yaml.safe_load(job.spec_yaml),
        "summary": read_summary(out),
        "model_files": [str(out.model / name) for name in _first_names(out.model, _LISTED)],
        "checkpoints": [str(path) for path in published(out.checkpoints, newest=_LISTED)],
        "metrics_file": str(out.metrics),
        "tensorboard_dir": str(out.tensorboard),
    }


def metrics_series(job: Job, limit: int = 2000) -> list[dict[str, Any]]:
    """The job's last training records (step, loss, images/s), for charts."""
    return recent_records(JobOutputs.at(job.outputs_dir).metrics, (RecordKind.TRAIN, RecordKind.VAL), limit)


ACTIVE_STATES = [state.value for state in JobState if state.is_active]
