"""The run handle of a job an engine keeps by itself (Slurm, Kubernetes): its state is whatever
`backend.status(ref)` says, asked at most once per interval so following a job never loads the engine."""

from __future__ import annotations

import time
from collections.abc import Callable

from clusterfit.backends.base import Backend, EngineRef


def wait_for_exit(poll: Callable[[], int | None], timeout: float | None, what: str, every_s: float = 0.2) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while (code := poll()) is None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} still running after {timeout} s")
        time.sleep(every_s)
    return code


class PolledRun:
    def __init__(self, ref: EngineRef, backend: Backend, every_s: float) -> None:
        self.ref = ref
        self._backend = backend
        self._every_s = every_s
        self._checked_at = 0.0
        self._code: int | None = None

    def poll(self) -> int | None:
        now = time.monotonic()
        if self._code is None and now - self._checked_at >= self._every_s:
            self._checked_at = now
            status = self._backend.status(self.ref)
            if status.state != "running":  # gone without an exit code counts as a failure
                self._code = status.exit_code if status.exit_code is not None else 1
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        return wait_for_exit(self.poll, timeout, f"{self.ref.backend} job {self.ref.id}")

    def cancel(self) -> None:
        self._backend.cancel(self.ref)
