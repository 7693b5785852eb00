"""Each rank's sign of life for the job service, and its own stack dump when it stops making progress.

`outputs.dir/heartbeats/rank-N.json` is rewritten at most once a second (step, phase, time, images/s, pid,
host): the service reads these files, so it works the same for every engine whose outputs folder it sees.
Every write re-arms a faulthandler timer: if no write follows for `hang_timeout` seconds, the interpreter
itself dumps the Python stack of every thread into the rank's log, even when the main thread is stuck in C
code (a collective, a DataLoader queue) where no Python-level watchdog could run."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time
from pathlib import Path

HEARTBEAT_DIR = "heartbeats"
TRAINING = "training"  # the one phase whose silence counts as a hang
ATTEMPT_ENV = "CLUSTERFIT_ATTEMPT"  # set by the job service: which run of the job this is, from 1


def heartbeat_path(outputs_dir: Path, rank: int) -> Path:
    return outputs_dir / HEARTBEAT_DIR / f"rank-{rank}.json"


class Heartbeat:
    def __init__(self, outputs_dir: Path, rank: int, hang_timeout: float, images_per_step: int, interval: float = 1.0):
        self.path = heartbeat_path(outputs_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.hang_timeout = hang_timeout
        self.images_per_step = images_per_step
        self.interval = interval
        self.host = socket.gethostname()
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "1"))
        self._written_at = 0.0
        self._written_step: int | None = None

    def beat(self, phase: str, step: int, *, force: bool = False) -> None:
        """Cheap enough for every step: it only writes when a second has passed (or when forced)."""
        now = time.monotonic()
        if not force and now - self._written_at < self.interval:
            return
        elapsed = now - self._written_at
        rate = None
        if self._written_step is not None and step > self._written_step and elapsed > 0:
            rate = (step - self._written_step) * self.images_per_step / elapsed
        record = {
            "phase": phase,
            "step": step,
            "time": time.time(),
            "images_per_s": rate,
            "pid": os.getpid(),
            "host": self.host,
            "attempt": self.attempt,
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)
        self._written_at, self._written_step = now, step
        if phase == TRAINING:  # staging a large dataset or a long validation is not a hang
            # The dump goes to stderr, which the worker points at its rank log.
            faulthandler.dump_traceback_later(self.hang_timeout + self.interval, repeat=False, file=sys.stderr)
        else:
            faulthandler.cancel_dump_traceback_later()
