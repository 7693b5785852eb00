"""The interface every engine implements: render what it would start, then start it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Protocol

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

    def as_text(self) -> str:
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"{env} {shlex.join(self.command)}".strip()


class RunHandle(Protocol):
    """A started job. Its output is not here: every engine leaves per-rank logs in `outputs.dir/logs`."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def cancel(self) -> None:
        """Stop every process of the job; returns once they are gone."""
        ...


class Backend(Protocol):
    name: str

    def dry_run(self, spec: JobSpec) -> Rendered: ...

    def submit(self, spec: JobSpec) -> RunHandle: ...
