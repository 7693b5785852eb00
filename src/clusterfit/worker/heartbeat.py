"""Each rank's sign of life for the job service, and its own stack dump when it stops making progress.

`heartbeats/rank-N.json` in the outputs folder is rewritten at most once a second (step, phase, the time of that step,
images/s, pid, host): the service reads these files, so it works the same for every engine whose outputs folder
it sees. A beat that comes too soon after the last write is written when the second is up, so the file always
ends at the rank's true last step, also when the rank hangs right after it. Every write re-arms a faulthandler
timer: if no step follows for `hang_timeout` seconds, the interpreter itself dumps the Python stack of every
thread into the rank's log, even when the main thread is stuck in C code (a collective, a DataLoader queue)
where no Python-level watchdog could run."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from clusterfit.outputs import ATTEMPT_ENV, JobOutputs, Phase, RankBeat, write_heartbeat


@dataclass(frozen=True)
class _Beat:
    phase: Phase
    step: int
    monotonic: float
    wall: float
    metrics: dict[str, float] | None = None


class Heartbeat:
    def __init__(
        self,
        outputs: JobOutputs,
        rank: int,
        hang_timeout: float,
        images_per_step: int | None,
        interval: float = 1.0,
    ) -> None:
        self.outputs = outputs
        self.rank = rank
        self.hang_timeout = hang_timeout
        self.images_per_step = images_per_step
        self.interval = interval
        self.host = socket.gethostname()
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "1"))
        self._lock = threading.Lock()
        self._written: _Beat | None = None
        self._pending: _Beat | None = None
        self._flush_timer: threading.Timer | None = None

    def beat(self, phase: Phase, step: int, *, force: bool = False, metrics: dict[str, float] | None = None) -> None:
        """Cheap enough for every step: it writes at most once a second (or at once when forced).
        `images_per_step` None: the rate is not known here (a user script reports its own, in `metrics`)."""
        with self._lock:
            self._pending = _Beat(phase, step, time.monotonic(), time.time(), metrics)
            wait = 0.0 if self._written is None else self.interval - (self._pending.monotonic - self._written.monotonic)
            if force or wait <= 0:
                self._write_pending()
            elif self._flush_timer is None:
                self._flush_timer = threading.Timer(wait, self.flush)
                self._flush_timer.daemon = True
                self._flush_timer.start()

    def flush(self) -> None:
        """Writes a beat still held back by the once-a-second limit (before the process ends)."""
        with self._lock:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
            self._flush_timer = None
            if self._pending is not None:
                self._write_pending()

    def _write_pending(self) -> None:
        beat, last = self._pending, self._written
        assert beat is not None
        self._pending = None
        rate = (beat.metrics or {}).get("images_per_s")
        measurable = last is not None and beat.step > last.step and beat.monotonic > last.monotonic
        if self.images_per_step is not None and measurable:
            rate = (beat.step - last.step) * self.images_per_step / (beat.monotonic - last.monotonic)
        record = RankBeat(
            rank=self.rank,
            phase=beat.phase.value,
            step=beat.step,
            time=beat.wall,
            images_per_s=rate,
            pid=os.getpid(),
            host=self.host,
            attempt=self.attempt,
            metrics=beat.metrics,
        )
        write_heartbeat(self.outputs, record)
        self._written = beat
        if beat.phase.watched:  # staging a large dataset or a long validation is not a hang
            # Counted from the step, not from this write, which may come up to a second later.
            timeout = self.hang_timeout + self.interval - (time.monotonic() - beat.monotonic)
            # The dump goes to stderr, which the worker points at its rank log.
            faulthandler.dump_traceback_later(max(timeout, 0.001), repeat=False, file=sys.stderr)
        else:
            faulthandler.cancel_dump_traceback_later()
