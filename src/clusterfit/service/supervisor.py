"""One process per running job: submits it to its engine, keeps its record truthful from what the engine
and the ranks' heartbeats say, stops it on request or when it hangs, and retries it when the spec allows.

`clusterfit run` supervises in the foreground (with a live view); the scheduler starts
`python -m clusterfit.service.supervisor JOB_ID` as a detached process for submitted jobs."""

from __future__ import annotations

import enum
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clusterfit.backends import RunHandle, get_backend
from clusterfit.backends.job_folder import JobAccount
from clusterfit.backends.torchrun import THREADS_ENV
from clusterfit.backends.warm_start import cold_start_reasons
from clusterfit.errors import ClusterfitError
from clusterfit.files import open_beneath
from clusterfit.launch import preflight, preflight_apart
from clusterfit.outputs import (
    ATTEMPT_ENV,
    JobOutputs,
    MetricsTail,
    Phase,
    RankBeat,
    RecordKind,
    clear_heartbeats,
    read_heartbeats,
)
from clusterfit.outputs.layout import CHECKPOINT_DIR, LOG_DIR, SUPERVISOR_LOG, rank_log_name
from clusterfit.processes import process_start_time
from clusterfit.service.accounts import (
    RUNS_AS_ACCOUNT,
    hand_over,
    job_account,
    make_outputs_folder,
    refuse_links,
)
from clusterfit.service.causes import (
    Failure,
    classify,
    failure_for_error,
    fatal_in_logs,
    gather_evidence,
    lines_since,
    oom_kill_count,
)
from clusterfit.service.home import threads_per_slot
from clusterfit.service.outputs_claim import OutputsClaim, claim_outputs
from clusterfit.service.records import forget_secrets, outputs_url, spec_of
from clusterfit.service.states import Decision, FailureCause, JobState, decide_after_failure
from clusterfit.service.store import Job, JobStore, dump_json
from clusterfit.spec import JobSpec
from clusterfit.storage.filesystems import job_credentials, public
from clusterfit.storage.outputs_mirror import MirrorRole, OutputsMirror, Uploader, writer_ttl_s

_RECORD_EVERY_S = 2.0  # progress written to the store at most this often; also the supervisor's liveness
_HANG_GRACE_S = 3.0  # after a hang is seen, time for every rank's stack dump to reach its log


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    HUNG = "hung"
    FAILED = "failed"


# Engines whose nodes each work in a folder of their own when the outputs are at a URL (Ray's actors, Kubernetes
# pods); on the others (local, Slurm) the workers write the folder this process sees.
_OWN_FOLDERS = ("ray", "kubernetes", "slurm")
# An attempt's check of its data, as the job's account, waits as long as a store's own timeouts (fsspec's 5
# minutes) and a little more: only the job waits on it, and a store that did not answer may at the next attempt.
_ATTEMPT_CHECK_TIMEOUT_S = 330.0


def this_supervisor() -> dict[str, str]:
    return {"host": socket.gethostname(), "pid": str(os.getpid()), "start_time": process_start_time(os.getpid()) or ""}


class Supervisor:
    def __init__(
        self,
        store: JobStore,
        job_id: str,
        *,
        poll_s: float = 1.0,
        on_tick: Callable[[], None] | None = None,
        log: Callable[[str], None] = print,
        confined: bool = False,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        # confined: a job of the job service, whose processes get an allow-listed environment (job_env),
        # never this process's (which holds the server's home, database URL and capacity).
        # interrupted: whether Ctrl-C or SIGTERM reached a foreground run; it cancels the job at the next tick.
        self.store, self.job_id = store, job_id
        self.interrupted = interrupted
        self.confined = confined
        # A root server's job runs as an unprivileged account (service/accounts.py); known at each attempt.
        self.account: JobAccount | None = None
        self.poll_s, self.on_tick, self.log = poll_s, on_tick, log
        self._outputs_claim: OutputsClaim | None = None

    def run(self) -> Job:
        """Run attempts until the job ends; returns its final record."""
        if not self.store.claim_supervision(self.job_id, dump_json(this_supervisor())):
            # A process that started slower than the scheduler waits for finds its job queued again (another
            # supervisor will take it), or a second process was started for one job: not this one's to run.
            job = self.store.get(self.job_id)
            if job.job_state is JobState.QUEUED:
                self.log(f"job {job.id} was queued again before this process began; leaving it to the scheduler")
            elif job.job_state.is_terminal:
                self.log(f"job {job.id} has ended {job.state}; nothing to supervise")
            else:
                self.log(f"job {job.id} is {job.state} and supervised by another process; leaving it alone")
            return job
        job = self.store.get(self.job_id)
        try:
            while True:
                attempt = job.attempt + 1
                self.store.update(job.id, attempt=attempt, cause=None, cause_detail=None, engine_ref=None)
                outcome, failure = self._attempt(job, attempt)
                job = self._settle(job.id, attempt, outcome, failure)
                if job.job_state.is_terminal:
                    return job
                job = self.store.transition(job.id, JobState.STAGING, f"attempt {attempt + 1}")
        finally:
            if self._outputs_claim is not None:
                self._outputs_claim.release()
            if self.store.get(self.job_id).job_state.is_terminal:
                forget_secrets(self.job_id)

    def _attempt(self, job: Job, attempt: int) -> tuple[Outcome, Failure | None]:
        mirror = None
        try:
            spec = spec_of(job)
            url = outputs_url(job)
            self.account = account = job_account(job.owner, spec.resources.backend) if self.confined else None
            if account is not None:
                make_outputs_folder(Path(spec.outputs.dir), account)
            # On Kubernetes a folder outputs.dir is the cluster's volume, not here.
            if self._outputs_claim is None and (spec.resources.backend != "kubernetes" or url is not None):
                self._outputs_claim = claim_outputs(Path(spec.outputs.dir), job.id, account)
            if url is not None:
                # Where the nodes share no folder with this one, they write the store and this copy reads it back.
                role = MirrorRole.LAUNCHER if spec.resources.backend in _OWN_FOLDERS else MirrorRole.FOLDER
                mirror = OutputsMirror(JobOutputs.at(spec.outputs.dir), url, job_credentials(spec), role=role)
                mirror.claim(job.id, writer_ttl_s(spec.outputs.upload_every_s))  # one job per store copy
                if account is not None:
                    refuse_links(Path(spec.outputs.dir))  # what this process writes there must stay there
                self._restore(mirror)  # a fresh machine resumes where the store's copy ends
                if account is not None:
                    hand_over(Path(spec.outputs.dir), account)
            # Again: data can vanish while a job waits in the queue.
            if account is None:
                preflight(spec)
            else:
                preflight_apart(spec, account, _ATTEMPT_CHECK_TIMEOUT_S)
        except ClusterfitError as exc:
            if mirror is not None:
                mirror.release()
            return Outcome.FAILED, failure_for_error(exc)
        if mirror is None:
            return self._run_attempt(job, attempt, spec)
        with Uploader(mirror, spec.outputs.upload_every_s, self.log) as uploader:
            store = url if mirror.role is MirrorRole.LAUNCHER else None
            # The nodes' last words (logs, the summary) are read back before they are weighed.
            outcome, failure = self._run_attempt(job, attempt, spec, store, ended=uploader.push_now)
            try:
                pushed = uploader.finish()
            except ClusterfitError as exc:
                self.log(f"job {job.id}: {exc}; the local copy is in {spec.outputs.dir}")
                return (Outcome.FAILED, failure_for_error(exc)) if outcome is Outcome.SUCCEEDED else (outcome, failure)
            finally:
                mirror.release()  # a retry claims it again
        self.log(
            f"job {job.id}: outputs in {public(url)}: {pushed.files} files uploaded during attempt {attempt}, "
            f"{pushed.bytes / 1e6:.1f} MB at {pushed.mb_per_s:.1f} MB/s"
        )
        return outcome, failure

    def _restore(self, mirror: OutputsMirror) -> None:
        pulled = mirror.pull()
        for skipped in pulled.skipped:
            self.log(f"outputs: not resuming from {public(mirror.url)}/{CHECKPOINT_DIR}/{skipped}")
        if pulled.files:
            restored = f", checkpoint {pulled.checkpoints[0]}" if pulled.checkpoints else ""
            self.log(
                f"outputs: {pulled.files} files from {public(mirror.url)}{restored} ({pulled.bytes / 1e6:.1f} MB in "
                f"{pulled.seconds:.1f} s)"
            )

    def _run_attempt(
        self,
        job: Job,
        attempt: int,
        spec: JobSpec,
        outputs_store: str | None = None,
        ended: Callable[[], None] | None = None,
    ) -> tuple[Outcome, Failure | None]:
        """`outputs_store`: the nodes work in folders of their own and share this URL (Ray); `ended` is called
        once the job's processes are gone."""
        env = {**spec.environment_variables, ATTEMPT_ENV: str(attempt)}
        if self.confined and spec.resources.backend == "local":  # it shares this machine with the other jobs
            env.setdefault(THREADS_ENV, str(threads_per_slot(spec.distribution.process_count_per_instance)))
        spec = spec.model_copy(update={"environment_variables": env})
        outputs = JobOutputs.at(spec.outputs.dir)
        clear_heartbeats(outputs, spec.world_size)
        backend = get_backend(spec.resources.backend)
        ooms_before = oom_kill_count()
        agent_log = outputs.agent_log
        agent_log_start = agent_log.stat().st_size if agent_log.exists() else 0
        if self._cancel_requested(job.id):  # while its data was checked: nothing of it has started
            return Outcome.CANCELLED, Failure(FailureCause.CANCELLED, "cancelled by user before it started")
        self.log(f"job {job.id} attempt {attempt}: submitting to the {backend.name} engine")
        try:
            options: dict[str, Any] = {} if outputs_store is None else {"outputs_store": outputs_store}
            if self.confined and backend.name in RUNS_AS_ACCOUNT:
                options.update(confined=True, account=self.account)
            handle = backend.submit(spec, **options)  # type: ignore[call-arg]
        except (ClusterfitError, OSError, RuntimeError, ValueError) as exc:  # the others: what no backend foresaw
            return Outcome.FAILED, failure_for_error(exc, backend.name)
        self.store.update(job.id, engine_ref=dump_json(asdict(handle.ref)))
        for reason in cold_start_reasons(lines_since(agent_log, agent_log_start)):  # CLUSTERFIT_WARM_START is set
            self.log(f"job {job.id} attempt {attempt}: its agent started cold: {reason}")
        outcome, detail = self._watch(job.id, spec, attempt, handle, ended)
        code = handle.poll()
        if ended is not None:
            ended()
        if outcome is Outcome.CANCELLED:
            return outcome, Failure(FailureCause.CANCELLED, f"cancelled by user: {detail}")
        if outcome is Outcome.HUNG:
            return outcome, Failure(FailureCause.HANG, detail)
        if code == 0:
            return Outcome.SUCCEEDED, None
        evidence = gather_evidence(outputs, spec.world_size, code, oom_kill_count() - ooms_before, agent_log_start)
        return Outcome.FAILED, classify(evidence)

    def _watch(
        self, job_id: str, spec: JobSpec, attempt: int, handle: RunHandle, ended: Callable[[], None] | None = None
    ) -> tuple[Outcome, str]:
        outputs = JobOutputs.at(spec.outputs.dir)
        metrics = MetricsTail(outputs.metrics)
        progress: dict[str, object] = {}
        running = False
        recorded_at = 0.0
        while True:
            code = handle.poll()
            if code is not None and ended is not None:
                ended()  # what the ranks wrote last, before it is read: a short job may have ended unseen
            beats = read_heartbeats(outputs, spec.world_size, attempt)
            for record in metrics.read_new():
                progress.update(_progress_fields(record))
            # A command job writes no heartbeats: it runs as soon as its engine has it.
            staged = any(beat.phase != Phase.STAGING for beat in beats.values())
            if not running and (spec.command is not None or staged):
                started = "command" if spec.command is not None else "scoring" if spec.scorer else "training"
                started += " started"
                self.store.transition(job_id, JobState.RUNNING, f"attempt {attempt}: {started}")
                running = True
            now = time.time()
            doomed = None
            if code is not None or now - recorded_at >= _RECORD_EVERY_S:
                self._record_progress(job_id, progress, beats)
                recorded_at = now
                # Command jobs are left alone: a user's program may survive what would stop the trainer.
                doomed = fatal_in_logs(outputs, spec.world_size) if spec.trainer is not None and code is None else None
            if self.on_tick:
                self.on_tick()
            if code is not None:
                return Outcome.SUCCEEDED if code == 0 else Outcome.FAILED, ""
            if self._cancel_requested(job_id):
                self.log(f"job {job_id}: cancel requested; stopping every process")
                handle.cancel()
                step = self._record_last_progress(job_id, progress, metrics, outputs, attempt, spec.world_size)
                return Outcome.CANCELLED, f"at step {step}"
            if doomed:  # the cause is read again from the logs once every process is stopped
                self.log(f"job {job_id}: {doomed.summary}; stopping every process")
                handle.cancel()
                self._record_last_progress(job_id, progress, metrics, outputs, attempt, spec.world_size)
                return Outcome.FAILED, doomed.summary
            hung = _hang(beats, spec.limits.hang_timeout, now) if running else None
            if hung:
                time.sleep(_HANG_GRACE_S)
                self.log(f"job {job_id}: {hung}; stopping every process")
                handle.cancel()
                self._record_last_progress(job_id, progress, metrics, outputs, attempt, spec.world_size)
                return Outcome.HUNG, hung
            time.sleep(self.poll_s)

    def _cancel_requested(self, job_id: str) -> bool:
        """A request in the store, or Ctrl-C of the foreground run, which is stored as one: `status` says so."""
        if self.interrupted():
            self.store.request_cancel(job_id)
            return True
        return self.store.get(job_id).cancel_requested_at is not None

    def _record_last_progress(
        self,
        job_id: str,
        progress: dict[str, object],
        metrics: MetricsTail,
        outputs: JobOutputs,
        attempt: int,
        world_size: int,
    ) -> int:
        """What the stopped ranks wrote last, so that status, the cancel note and the ranks' health agree."""
        for record in metrics.read_new():
            progress.update(_progress_fields(record))
        return self._record_progress(job_id, progress, read_heartbeats(outputs, world_size, attempt))

    def _record_progress(self, job_id: str, progress: dict[str, object], beats: dict[int, RankBeat]) -> int:
        """Stores the job's progress; returns its step."""
        newest = max((beat.time for beat in beats.values()), default=None)
        fields = dict(progress)
        # Heartbeats arrive every second, metrics only every log_every_steps: the step is the newer of both.
        beat_step = max((beat.step for beat in beats.values()), default=None)
        if beat_step is not None and beat_step > int(fields.get("step") or 0):  # type: ignore[call-overload]
            fields["step"] = beat_step
        if newest is not None:
            fields["heartbeat_at"] = datetime.fromtimestamp(newest, timezone.utc)
        self.store.update(job_id, **fields)
        return int(fields.get("step") or 0)  # type: ignore[call-overload]

    def _settle(self, job_id: str, attempt: int, outcome: Outcome, failure: Failure | None) -> Job:
        if outcome is Outcome.SUCCEEDED:
            return self.store.transition(job_id, JobState.SUCCEEDED, f"attempt {attempt} succeeded")
        assert failure is not None
        fields = {"cause": failure.cause.value, "cause_detail": failure.text()}
        if outcome is Outcome.CANCELLED:
            return self.store.transition(job_id, JobState.CANCELLED, failure.summary, **fields)
        job = self.store.get(job_id)
        decision = decide_after_failure(failure.cause, attempt, job.max_retries)
        self.log(f"job {job_id} attempt {attempt} failed: {failure.cause.words}: {failure.summary}. {decision.reason}")
        if decision.decision is Decision.RETRY and not self._cancel_requested(job_id):
            job = self.store.transition(job_id, JobState.RETRYING, f"{failure.summary}; {decision.reason}", **fields)
            return self._pause_before_retry(job, decision.pause_s)
        return self.store.transition(job_id, JobState.FAILED, failure.summary, **fields)

    def _pause_before_retry(self, job: Job, seconds: float) -> Job:
        """Waits before the next attempt; a cancel request (or Ctrl-C in the foreground) ends the job instead."""
        deadline = time.monotonic() + seconds
        while not self._cancel_requested(job.id):
            if (left := deadline - time.monotonic()) <= 0:
                return job
            time.sleep(min(self.poll_s, left))
        summary = "cancelled by user while waiting to retry"
        return self.store.transition(
            job.id, JobState.CANCELLED, summary, cause=FailureCause.CANCELLED.value, cause_detail=summary
        )


def _progress_fields(record: dict) -> dict[str, object]:
    kind = record.get("kind")
    if kind == RecordKind.START:
        return {"total_steps": record.get("total_steps"), "step": record.get("step")}
    if kind == RecordKind.TRAIN:
        return {
            "step": record["step"],
            "epoch": record.get("epoch"),
            "total_steps": record.get("total_steps"),
            "images_per_s": record.get("images_per_s"),
            "loss": record.get("loss"),
        }
    if kind == RecordKind.END:
        return {"step": record["step"]}
    return {}


def _hang(beats: dict[int, RankBeat], hang_timeout: float, now: float) -> str | None:
    """A hang: every rank is in the training phase and none has written a heartbeat for hang_timeout."""
    if not beats or not all(beat.training for beat in beats.values()):
        return None
    newest = max(beat.time for beat in beats.values())
    # The ranks' own faulthandler timers fire at hang_timeout + 1 s after their last beat.
    if now - newest < hang_timeout + 1.0:
        return None
    steps = {beat.step for beat in beats.values()}
    if len(steps) > 1:
        stalest = min(beats.values(), key=lambda beat: (beat.step, beat.time))
        where = f"rank {stalest.rank} is furthest behind at step {stalest.step}"
    else:
        where = f"every rank last reported step {steps.pop()}"
    logs = ", ".join(f"{LOG_DIR}/{rank_log_name(rank)}" for rank in sorted(beats))
    return (
        f"no training step on any rank for {now - newest:.0f} s (limits.hang_timeout = {hang_timeout:g} s); "
        f"{where}; the Python stacks of every thread of every rank are in {logs}"
    )


def main(argv: list[str] | None = None) -> int:
    """Detached supervisor started by the scheduler: `python -m clusterfit.service.supervisor JOB_ID`."""
    from clusterfit.service.migrate import open_store
    from clusterfit.service.scheduler import schedule

    job_id = (argv or sys.argv[1:])[0]
    os.umask(0o077)  # what it and its job write (logs, the SAS file it reads) is for the job's owner only
    if os.fork() > 0:  # detach: the starter reaps this parent at once and never leaves a zombie
        os._exit(0)
    os.setsid()
    store = open_store()
    job = store.get(job_id)
    with open(_open_log(job), "a", buffering=1) as out:
        os.dup2(out.fileno(), sys.stdout.fileno())
        os.dup2(out.fileno(), sys.stderr.fileno())

        def stamped(message: str) -> None:
            print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

        try:
            final = Supervisor(store, job_id, log=stamped, confined=True).run()
            if final.job_state.is_terminal:
                stamped(f"job {job_id} ended {final.state}")
        finally:
            schedule(store)  # this job's slots are free: start whatever waits for them
    return 0


def _open_log(job: Job) -> int:
    """The supervisor's log in the job's folder, opened without following a link a job could have planted
    there (such a link is removed); /dev/null when the folder is refused (the first attempt then fails with
    the reason)."""
    outputs = JobOutputs.at(job.outputs_dir)
    account = job_account(job.owner, job.backend)
    try:
        if account is not None:
            make_outputs_folder(outputs.root, account)
        else:
            outputs.logs.mkdir(parents=True, exist_ok=True)
        flags, owner = os.O_WRONLY | os.O_CREAT | os.O_APPEND, account.uid if account else None
        try:
            return open_beneath(outputs.root, f"{LOG_DIR}/{SUPERVISOR_LOG}", flags, owner=owner)
        except OSError:  # a link in its place, which a job made: the log is the supervisor's, made anew
            logs = open_beneath(outputs.root, LOG_DIR, os.O_RDONLY | os.O_DIRECTORY, owner=owner)
            try:
                os.unlink(SUPERVISOR_LOG, dir_fd=logs)
            finally:
                os.close(logs)
            return open_beneath(outputs.root, f"{LOG_DIR}/{SUPERVISOR_LOG}", flags, owner=owner)
    except (ClusterfitError, OSError):
        return os.open(os.devnull, os.O_WRONLY)


if __name__ == "__main__":
    sys.exit(main())
