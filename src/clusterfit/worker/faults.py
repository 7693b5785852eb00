"""Deliberate failures, for testing how the job service reports and recovers from real ones.

`CLUSTERFIT_FAULT=KIND:rank=R:step=S[:attempt=A]` in a worker's environment (through the spec's
`environment_variables`) makes rank R, after training step S (of attempt A only, when given), do KIND:
`raise` an exception, `hang` forever (sleeping, as a deadlocked rank would), `exit` with code 3, `kill` itself with
SIGKILL (as another process would), or `oom`: take memory until the kernel's OOM killer stops the process (run
it under a memory limit, e.g. a container's). `slow:rank=R:step=S:seconds=T[:until=PATH]` makes rank R a straggler
instead: it sleeps T seconds (0.1 by default) after step S and every step after, which paces the whole job, since
the other ranks wait for it in each all-reduce; with `until`, only until a file exists at PATH (no colons), so a
test keeps a job running until it has seen what it waits for, and lets it finish at full speed."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from clusterfit.outputs import ATTEMPT_ENV, FAULT_ENV

_KINDS = ("raise", "hang", "exit", "kill", "oom", "slow")
_OOM_CHUNK_BYTES = 64 << 20


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int | None = None
    seconds: float = 0.1  # a straggler's delay per step
    until: str | None = None  # a straggler no more once this file exists

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, *fields = text.split(":")
        values = dict(field.split("=", 1) for field in fields)
        if kind not in _KINDS or not {"rank", "step"} <= values.keys():
            raise ValueError(f"{FAULT_ENV}={text!r}: expected KIND:rank=R:step=S[:attempt=A], KIND one of {_KINDS}")
        attempt, seconds = values.get("attempt"), values.get("seconds")
        return cls(
            kind,
            int(values["rank"]),
            int(values["step"]),
            int(attempt) if attempt else None,
            float(seconds) if seconds else cls.seconds,
            values.get("until"),
        )

    def trigger(self, rank: int, step: int) -> None:
        if rank != self.rank or step < self.step or (step > self.step and self.kind != "slow"):
            return
        if self.attempt is not None and int(os.environ.get(ATTEMPT_ENV, "1")) != self.attempt:
            return
        if self.kind == "slow":
            if not (self.until and os.path.exists(self.until)):
                time.sleep(self.seconds)
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected failure on rank {rank} after step {step}")
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "oom":
            held = []
            while True:  # filled bytes, so every page is really resident (zeroed allocations may not be)
                held.append(b"\x01" * _OOM_CHUNK_BYTES)
        while True:  # hang
            time.sleep(3600)


def fault_from_env() -> Fault | None:
    text = os.environ.get(FAULT_ENV)
    return Fault.parse(text) if text else None
