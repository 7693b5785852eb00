"""The interface every engine implements: render what it would start, start it, find it again later."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Literal, Protocol

from clusterfit.spec.model import JobSpec


@dataclass(frozen=True)
class Rendered:
    """What a backend will submit, as a value: tests compare it, `--dry-run` prints it."""

    backend: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # only the variables clusterfit sets
    files: dict[str, str] = field(default_factory=dict)  # path -> content written before launch
    # Passed to the workers but never printed or written (storage.sas_token).
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    # How the engine places `command` when that is more than running it here (Ray: the placement group).
    placement: str = ""

    def as_text(self) -> str:
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        command = f"{env} {shlex.join(self.command)}".strip()
        return f"{self.placement}\n{command}" if self.placement else command


@dataclass(frozen=True)
class EngineRef:
    """How to find a submitted job's processes again from another process; the job store keeps it.

    `id` is the engine's own name for the job (local: the agent's pid; Slurm: the job id; Ray: the
    placement group name); `extra` holds what else that engine needs (local: the pid's start time, so a
    reused pid is never mistaken for the job)."""

    backend: str
    id: str
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStatus:
    """What the engine says of a job: still running, exited with a code, or gone without one."""

    state: Literal["running", "exited", "gone"]
    exit_code: int | None = None


class RunHandle(Protocol):
    """A started job. Its output is not here: every engine leaves per-rank logs in `outputs.dir/logs`."""

    ref: EngineRef

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def cancel(self) -> None:
        """Stop every process of the job; returns once they are gone."""
        ...


class Backend(Protocol):
    name: str

    def dry_run(self, spec: JobSpec) -> Rendered: ...

    def submit(self, spec: JobSpec) -> RunHandle: ...

    def status(self, ref: EngineRef) -> EngineStatus:
        """The job's state from the engine itself, from any process (not only the one that submitted it)."""
        ...

    def cancel(self, ref: EngineRef) -> None:
        """Stop every process of the job from any process; returns once they are gone."""
        ...
