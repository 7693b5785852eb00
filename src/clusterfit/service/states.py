"""Job states, failure causes and the decisions between them: enums and pure functions, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class JobState(str, enum.Enum):
    QUEUED = "QUEUED"
    STAGING = "STAGING"  # the engine is placing the workers and they are staging data
    RUNNING = "RUNNING"  # at least one rank has started training
    RETRYING = "RETRYING"  # failed, and about to run again from its last checkpoint
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def is_active(self) -> bool:
        """Processes of the job may exist."""
        return self in (JobState.STAGING, JobState.RUNNING, JobState.RETRYING)


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STAGING, JobState.FAILED, JobState.CANCELLED}),
    JobState.STAGING: frozenset({JobState.RUNNING, JobState.RETRYING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.RETRYING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RETRYING: frozenset({JobState.STAGING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    pass


def check_transition(current: JobState, target: JobState) -> JobState:
    """Return `target` if a job in `current` may move there; raise IllegalTransition otherwise."""
    if target not in _ALLOWED[current]:
        raise IllegalTransition(f"a {current.value} job cannot become {target.value}")
    return target


class FailureCause(str, enum.Enum):
    EXCEPTION = "EXCEPTION"  # a Python exception in a rank
    OOM = "OOM"  # killed by the kernel's OOM killer
    SHM = "SHM"  # out of shared memory (/dev/shm), usually DataLoader workers
    COLLECTIVE_TIMEOUT = "COLLECTIVE_TIMEOUT"  # a gloo/NCCL collective waited past its timeout
    HANG = "HANG"  # no training step on any rank for limits.hang_timeout seconds
    NODE_LOST = "NODE_LOST"  # a node or the process supervising the job went away
    SIGNAL = "SIGNAL"  # killed by a signal from outside
    EXIT_CODE = "EXIT_CODE"  # a non-zero exit without anything more specific
    ENGINE = "ENGINE"  # the engine refused this job (no such partition, a manifest it rejects, ...)
    UNAVAILABLE = "UNAVAILABLE"  # the engine or the data store could not take or serve any job just then
    CANCELLED = "CANCELLED"  # cancelled by a user
    BAD_SPEC = "BAD_SPEC"  # the spec or its data was refused before any worker started

    @property
    def words(self) -> str:
        return _WORDS[self]

    @property
    def before_any_worker(self) -> bool:
        """The attempt ended before any worker started: there is no rank log to look at."""
        return self in _BEFORE_ANY_WORKER


_WORDS = {
    FailureCause.EXCEPTION: "Python exception",
    FailureCause.OOM: "killed by the OOM killer",
    FailureCause.SHM: "out of shared memory",
    FailureCause.COLLECTIVE_TIMEOUT: "collective timeout",
    FailureCause.HANG: "hang: no progress",
    FailureCause.NODE_LOST: "node lost",
    FailureCause.SIGNAL: "killed by a signal",
    FailureCause.EXIT_CODE: "exited with an error",
    FailureCause.ENGINE: "the engine refused the job",
    FailureCause.UNAVAILABLE: "the engine or data store was unavailable",
    FailureCause.CANCELLED: "cancelled by user",
    FailureCause.BAD_SPEC: "bad spec",
}

_BEFORE_ANY_WORKER = frozenset({FailureCause.BAD_SPEC, FailureCause.ENGINE, FailureCause.UNAVAILABLE})
# Causes that another attempt cannot cure: the same spec would fail the same way, the engine would refuse the
# job again, or a user asked to stop.
_NOT_RETRIED = frozenset({FailureCause.CANCELLED, FailureCause.BAD_SPEC, FailureCause.ENGINE})
# NOTE: an outage that refused an attempt (a controller restarting, an API server overloaded) usually lasts
# seconds: retrying at once would meet it again and spend every retry within that outage. The pause grows with
# each attempt so that a longer outage is waited out too, and stays well under the minute of silence after
# which the scheduler counts a supervisor on another host as gone.
_RETRIED_AFTER_A_PAUSE = frozenset({FailureCause.UNAVAILABLE})
_PAUSE_PER_ATTEMPT_S = 5.0
_LONGEST_PAUSE_S = 30.0


class Decision(str, enum.Enum):
    RETRY = "RETRY"
    FAIL = "FAIL"


@dataclass(frozen=True)
class FailureDecision:
    decision: Decision
    reason: str
    pause_s: float = 0.0  # how long to wait before the next attempt


def decide_after_failure(cause: FailureCause, attempt: int, max_retries: int) -> FailureDecision:
    """`attempt` counts from 1: attempt 1 failing with max_retries=1 is retried once."""
    if cause in _NOT_RETRIED:
        return FailureDecision(Decision.FAIL, f"{cause.words} is not retried")
    if attempt > max_retries:
        return FailureDecision(Decision.FAIL, f"attempt {attempt} of {max_retries + 1} failed; no retries left")
    pause_s = min(_PAUSE_PER_ATTEMPT_S * attempt, _LONGEST_PAUSE_S) if cause in _RETRIED_AFTER_A_PAUSE else 0.0
    when = f" in {pause_s:g} s" if pause_s else ""
    return FailureDecision(
        Decision.RETRY,
        f"attempt {attempt} of {max_retries + 1} failed; retrying from the last checkpoint{when}",
        pause_s,
    )
