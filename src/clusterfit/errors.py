"""The errors clusterfit shows its users, as types that say whether running the job again can help.

Each is one line naming what is wrong (the field, the value) and the fix. `retryable` carries the decision the
job service takes on it: a mistake in the spec fails the same way on every attempt, while an engine or a data
store that could not be reached may answer a little later. Torch-free: the launcher, the job service, the
engines and the workers all raise these."""

from __future__ import annotations

from typing import Any


class ClusterfitError(Exception):
    """A user-facing error. `retryable`: the same job, run again later, may succeed."""

    retryable: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: errors cross processes pickled (a Ray actor's error reaches the launcher); the default rebuilds
        # an exception by calling its class with the message alone, which would lose `retryable`.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[ClusterfitError], args: tuple[Any, ...], state: dict[str, Any]) -> ClusterfitError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class SpecError(ClusterfitError, ValueError):
    """A mistake in the user's job spec: another attempt would meet it again, so it is never retried.

    Also a ValueError, as it always was: callers that catch ValueError keep catching it."""


class OutputsInUse(SpecError):  # noqa: N818 - reads as the condition it reports
    """Another job writes the outputs folder (or the store's copy of it) this job was given: two jobs there would
    destroy each other's checkpoints and logs. Not retried: the user waits for the other, cancels it, or gives
    another outputs.dir."""


class EngineError(ClusterfitError):
    """The engine (Slurm, Kubernetes, Ray) refused the job or could not be reached.

    `retryable=True` when it may take the same job a little later (a controller restarting, an API server
    overloaded, a cluster unreachable); False when it said no to this job (a partition that does not exist,
    a manifest it rejects, permissions it lacks)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class DataError(ClusterfitError):
    """The job's input data is missing or unreadable.

    `retryable=True` when the store holding it did not answer (it may later); False when the data is not
    there or not usable as it is (a missing path, a folder without images, a corrupt packed dataset)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
