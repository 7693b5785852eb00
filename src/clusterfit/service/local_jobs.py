"""The job service over this machine's store: the one place where its requests are decided. The CLI uses it
without `--server`, and `clusterfit server` answers every job request of its HTTP API with it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterfit.errors import ClusterfitError, DataError, SpecError
from clusterfit.outputs import JobOutputs, read_heartbeats
from clusterfit.service.accounts import job_account
from clusterfit.service.jobs import Refused, ServiceError
from clusterfit.service.logview import read_logs
from clusterfit.service.records import forget_secrets, outputs_url, record_job, spec_of
from clusterfit.service.scheduler import reconcile, schedule
from clusterfit.service.states import FailureCause, IllegalTransition, JobState
from clusterfit.service.store import Job, JobNotFound, JobStore, StateConflict
from clusterfit.service.views import job_details, job_row, job_status, metrics_series
from clusterfit.spec import JobSpec, load_spec, load_spec_text
from clusterfit.spec.model import anchored, is_url, named_places, submission_relative_paths
from clusterfit.storage.filesystems import job_credentials
from clusterfit.storage.outputs_mirror import OutputsMirror


def local_user() -> str:
    """Who owns what is submitted from this machine's command line."""
    return os.environ.get("USER") or os.environ.get("LOGNAME") or str(os.getuid())


@dataclass(frozen=True)
class SubmissionChecks:
    """How a server checks a submitted job's data. In this process when it reads only this machine's files with
    the server's own rights; otherwise (a store to ask, or a job account's rights to check with) in a process of
    its own, killed after `timeout_s`, at most `at_once` at a time and `per_owner` of one owner's, and a request
    waits for a free one no longer than one lasts: hostile specs (data at an address that never answers) hold no
    request thread for long, and one owner's cannot hold every other owner's submissions."""

    timeout_s: float = 30.0
    at_once: int = 4
    per_owner: int = 2
    slots: threading.BoundedSemaphore = field(init=False, repr=False, compare=False)
    _running: dict[str, int] = field(init=False, repr=False, compare=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", threading.BoundedSemaphore(self.at_once))

    def check(self, spec: JobSpec, owner: str) -> None:
        from clusterfit.launch import preflight, preflight_apart

        account = job_account(owner, spec.resources.backend)
        if account is None and not any(is_url(place) for place in named_places(spec).values()):
            preflight(spec)
            return
        with self._lock:
            if self._running.get(owner, 0) >= self.per_owner:
                raise DataError(
                    f"the server is already checking {self.per_owner} of this owner's submissions; submit again "
                    "once they are answered",
                    retryable=True,
                )
            self._running[owner] = self._running.get(owner, 0) + 1
        try:
            if not self.slots.acquire(timeout=self.timeout_s):
                raise DataError(
                    f"the server is already checking {self.at_once} other submissions' data; submit again in a moment",
                    retryable=True,
                )
            try:
                preflight_apart(spec, account, self.timeout_s)
            finally:
                self.slots.release()
        finally:
            with self._lock:
                self._running[owner] -= 1
                if not self._running[owner]:
                    del self._running[owner]


def checked_spec(
    load: Callable[[], JobSpec],
    placed: Callable[[JobSpec], JobSpec] | None = None,
    checks: SubmissionChecks | None = None,
    owner: str = "",
) -> JobSpec:
    """The spec `load` reads (from a file or from text), its relative paths settled by `placed` if given (a job
    run in the foreground reads them from the current folder as they are), validated and
    preflighted: its data is there and its outputs folder fits; by `checks` for a server (as `owner`'s job),
    else in this process. Any problem, reading included, is one line: a refusal, or, when the data's store did
    not answer, an error that submitting again later may not meet (503, exit code 1)."""
    try:
        spec = load() if placed is None else placed(load())
        if checks is not None:
            checks.check(spec, owner)
        else:
            from clusterfit.launch import preflight  # imported only once the spec itself is valid

            preflight(spec)
    except ClusterfitError as exc:
        if exc.retryable:
            raise ServiceError(str(exc), exit_code=1) from None
        raise Refused(str(exc), 422) from None
    return spec


def without_relative_paths(source: str) -> Callable[[JobSpec], JobSpec]:
    """For a spec a client sent: its relative paths refused, since the client's folder is not this machine's."""

    def refuse(spec: JobSpec) -> JobSpec:
        relative = submission_relative_paths(spec)
        if relative:
            field, path = next(iter(relative.items()))
            raise SpecError(
                f"{source}: {field} = {path!r} is relative to the folder it was sent from, which this server cannot "
                "know; give an absolute path on the server's machine, or a URL"
            )
        return spec

    return refuse


@dataclass(frozen=True)
class LocalJobs:
    store: JobStore
    start_jobs: bool = True  # False on a paused server: submissions are queued, none is started
    checks: SubmissionChecks | None = None  # a server's; None: submissions of this machine's own user, checked here
    max_queued_per_owner: int | None = None  # a server's bound on the queue (each job is a row and a spec)

    def submit(self, spec_file: Path, overrides: list[str] | None = None) -> dict[str, Any]:
        """A job file of this machine, queued for the user running the command; its relative paths are read
        from the current folder, as `clusterfit run` reads them."""
        spec = checked_spec(lambda: load_spec(spec_file, overrides), lambda spec: anchored(spec, Path.cwd()))
        return self.enqueue(spec, owner=local_user())

    def submit_text(
        self, text: str, overrides: list[str], source: str, owner: str, *, commands: bool = True
    ) -> dict[str, Any]:
        """A job file's text as a client sent it (its paths are this machine's), queued for `owner`;
        `commands`: whether this submitter may run a command job (its own program) here."""

        self._refuse_past_queue_limit(owner)  # before anything is read or checked

        def placed(spec: JobSpec) -> JobSpec:
            spec = without_relative_paths(source)(spec)
            if spec.command is not None and not commands:  # refused before its data is looked at
                raise Refused(
                    f"{source}: command: jobs need an admin token on this server, or the server started with "
                    "--allow-command-jobs; use the built-in trainer (trainer:), or ask its operator",
                    403,
                )
            return spec

        spec = checked_spec(lambda: load_spec_text(text, overrides, source=source), placed, self.checks, owner)
        return self.enqueue(spec, owner)

    def _refuse_past_queue_limit(self, owner: str) -> None:
        limit = self.max_queued_per_owner
        if limit is not None and (queued := self.store.count_queued(owner)) >= limit:
            who = f"owner {owner!r}" if owner else "submitters without a token"
            raise Refused(
                f"{who} already has {queued} jobs waiting in the queue, this server's limit "
                "(--max-queued-per-owner); wait for some to start, or cancel some",
                429,
            )

    def enqueue(self, spec: JobSpec, owner: str) -> dict[str, Any]:
        job = record_job(self.store, spec, owner=owner)
        if self.start_jobs:
            schedule(self.store)
        return job_row(self.store.get(job.id))

    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self._find(job_id)
        if job.job_state.is_terminal:
            raise Refused(f"job {job.id} already ended {job.state}; nothing to cancel", 409)
        self.store.request_cancel(job.id)
        if job.job_state is JobState.QUEUED:
            # If it was started meanwhile, its supervisor sees the request instead.
            with contextlib.suppress(StateConflict, IllegalTransition):
                self.store.transition(
                    job.id, JobState.CANCELLED, "cancelled by user while queued", cause=FailureCause.CANCELLED.value
                )
                forget_secrets(job.id)
        return job_status(self.store, self.store.get(job.id))

    def list_jobs(self, state: JobState | None = None, limit: int = 200) -> list[dict[str, Any]]:
        self._settle()
        return [job_row(job) for job in self.store.list_jobs(state, limit)]

    def status(self, job_id: str) -> dict[str, Any]:
        return job_status(self.store, self._readable(job_id))

    def details(self, job_id: str) -> dict[str, Any]:
        return job_details(self.store, self._readable(job_id))

    def logs(self, job_id: str, cursor: str | None = None, rank: int | None = None) -> dict[str, Any]:
        job = self._readable(job_id)
        outputs = JobOutputs.at(job.outputs_dir)
        beats = read_heartbeats(outputs, job.ranks)
        ended = job.job_state.is_terminal  # read before the files: whatever the job wrote last is in them
        chunk = read_logs(
            outputs.logs,
            cursor,
            job.ranks,
            ranks=None if rank is None else {rank},
            node_of=lambda number: beats[number].host if number in beats else None,
            final=ended,
        )
        return {"lines": chunk.lines, "cursor": chunk.cursor, "more": chunk.more, "ended": ended, "state": job.state}

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return metrics_series(self._readable(job_id))

    def _readable(self, job_id: str) -> Job:
        """The job, with its outputs here: a job whose outputs went to a URL and whose local copy is gone (another
        machine, a cleared cache) has its logs, metrics and summary fetched from the store first."""
        job = self._find(job_id)
        url = outputs_url(job)
        if url is not None and not Path(job.outputs_dir).exists():
            try:
                spec = spec_of(job)
                OutputsMirror(JobOutputs.at(job.outputs_dir), url, job_credentials(spec)).pull(checkpoints=False)
            except ClusterfitError as exc:
                raise ServiceError(str(exc), exit_code=1) from None
        return job

    def _find(self, job_id: str) -> Job:
        self._settle()
        try:
            return self.store.get(job_id)
        except JobNotFound as exc:
            raise Refused(str(exc), 404) from None

    def _settle(self) -> None:
        """Before every read: a job whose supervisor is gone is never shown running, and the room it held goes
        to the queue at once (there is no scheduler daemon to notice)."""
        if reconcile(self.store) and self.start_jobs:
            schedule(self.store)
