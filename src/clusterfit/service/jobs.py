"""The job service as one interface, whoever serves it: this machine's store (`LocalJobs`, which the HTTP API
serves too) or a clusterfit server (`ServiceClient`, for `--server`). Each method returns the JSON-able dicts of
`views`, so the CLI and the dashboard print the same thing either way.

Every refusal is a `ServiceError` with one line to show and the exit code a CLI leaves with: 1 when trying again
later may help (a server or store that does not answer), 2 when the request itself must change (`Refused`,
which also names the HTTP status the API answers it with). The helpers below the interface (waiting for a
cancelled job to end, following logs) work on any implementation, so their rules exist once."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from clusterfit.service.states import JobState


class ServiceError(RuntimeError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Refused(ServiceError):
    """The request is wrong (an unknown job, a bad spec or state name, a job already ended): change it to succeed."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message, exit_code=2)
        self.status = status  # the HTTP status of this refusal: 404, 409, 422, or a client error the server gave


class JobService(Protocol):
    def submit(self, spec_file: Path, overrides: list[str] | None = None) -> dict[str, Any]:
        """Check a job file and queue it; returns the new job's row. Where the check runs, its paths are read."""
        ...

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Ask every process of the job to stop (a queued job never starts); returns its status at once."""
        ...

    def list_jobs(self, state: JobState | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """Rows of the newest jobs (in `state` only, when given)."""
        ...

    def status(self, job_id: str) -> dict[str, Any]: ...

    def details(self, job_id: str) -> dict[str, Any]:
        """The status plus the resolved spec, summary, model files and checkpoints (`clusterfit show`)."""
        ...

    def logs(self, job_id: str, cursor: str | None = None, rank: int | None = None) -> dict[str, Any]:
        """The labelled log lines after `cursor`: {lines, cursor (for the next call), more (ask again at once),
        ended, state}. Once the job has ended, a last line without a newline comes too."""
        ...

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        """The job's training and validation records, for charts."""
        ...


def parse_state(name: str | None, what: str) -> JobState | None:
    """A job state as people type it (`running`); `what` names where it came from, for the error."""
    if name is None:
        return None
    try:
        return JobState(name.upper())
    except ValueError:
        allowed = ", ".join(state.value.lower() for state in JobState)
        raise Refused(f"{what} {name!r} is not a job state; use one of: {allowed}", 422) from None


def cancel_and_wait(jobs: JobService, job_id: str, wait_s: float, poll_s: float = 0.2) -> dict[str, Any]:
    """Cancel a job and wait until it has ended; its status then. After `wait_s` a ServiceError (exit 1) says
    it still runs: the request stands, and asking again waits again."""
    found = jobs.cancel(job_id)
    deadline = time.monotonic() + wait_s
    while not JobState(found["state"]).is_terminal:
        if time.monotonic() > deadline:
            job_id = found["id"]
            raise ServiceError(
                f"job {job_id} is still {found['state']} after {wait_s:g} s; run `clusterfit cancel {job_id}` again", 1
            )
        time.sleep(poll_s)
        found = jobs.status(found["id"])
    return found


def follow_logs(
    jobs: JobService,
    job_id: str,
    emit: Callable[[str], None],
    *,
    rank: int | None = None,
    follow: bool = False,
    poll_s: float = 0.5,
) -> None:
    """Emit every log line of a job from the start; with `follow`, keep emitting new ones until the job ends."""
    cursor = None
    while True:
        chunk = jobs.logs(job_id, cursor, rank)
        cursor = chunk["cursor"]
        for line in chunk["lines"]:
            emit(line)
        if chunk["more"]:
            continue
        if chunk["ended"] or not follow:
            return
        time.sleep(poll_s)
