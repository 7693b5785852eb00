"""Your own training script, first-class: `import clusterfit.session as cf` inside a command job.

    ctx = cf.context()                              # rank, local_rank, world_size, node_rank, job_name, attempt, ...
    start = cf.latest_checkpoint()                  # None on a fresh job; else .step and .folder (this rank's part)
    for step in range(start.step + 1 if start else 0, steps):
        loss = train_step()
        cf.report(step=step, loss=loss, images_per_s=rate)   # never waits for other ranks
        if step % 100 == 0 or cf.should_stop():
            with cf.checkpoint(step) as folder:               # this rank's part; published once all ranks wrote
                torch.save(state, folder / "state.pt")
        if cf.should_stop():                                  # SIGTERM (cancel) or Slurm's USR1 (time limit)
            break

Framework-neutral: nothing here imports torch, TensorFlow or JAX (see `clusterfit.session.keras` and
`clusterfit.session.torch` for thin helpers). Outside a clusterfit job the calls still work: the context is
rank 0 of 1, reports and checkpoints are not written (`context().in_job` is False).

One session per process: the job's context does not change while the process lives, so it is read once."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from clusterfit.outputs import JobOutputs
from clusterfit.session.checkpoints import Checkpoint, CheckpointWriter
from clusterfit.session.checkpoints import latest_checkpoint as _latest_in
from clusterfit.session.context import JobContext, read_context
from clusterfit.session.errors import SessionError
from clusterfit.session.reporting import Reporter, checked_record

__all__ = [
    "Checkpoint",
    "JobContext",
    "Session",
    "SessionError",
    "checkpoint",
    "context",
    "latest_checkpoint",
    "report",
    "should_stop",
    "wait_for_checkpoints",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # cancel (with a grace period); Slurm's time-limit warning


class Session:
    """What one process of a job reports and saves. Use the module's functions; this is their state."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.context = read_context(environ)
        self._reporter = Reporter(self.context, environ) if self.context.in_job else None
        self._writer = CheckpointWriter(self.context) if self.context.in_job else None
        self._stop = None

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._reporter is None:
            checked_record(step, metrics)  # the same mistakes are refused outside a job
            return
        self._reporter.report(step, metrics)

    def latest_checkpoint(self) -> Checkpoint | None:
        if self.context.outputs_dir is None:
            return None
        return _latest_in(JobOutputs.at(self.context.outputs_dir).checkpoints, self.context.rank)

    def checkpoint(self, step: int, keep: int) -> contextlib.AbstractContextManager[Path]:
        if self._writer is None:
            raise SessionError(
                "checkpoint(): not inside a clusterfit job (no outputs folder); run the script as a command job"
            )
        return self._writer.save(step, keep)

    def should_stop(self) -> bool:
        if self._stop is None:
            from clusterfit.worker.stop_signal import StopRequest

            # Installed on the first question only: a script that never asks keeps the default (SIGTERM ends it).
            self._stop = StopRequest(STOP_SIGNALS)
        return self._stop.received

    def wait_for_checkpoints(self) -> None:
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        self.wait_for_checkpoints()
        if self._reporter is not None:
            self._reporter.close()


@functools.cache
def _session() -> Session:
    session = Session()
    atexit.register(session.close)  # the last checkpoint is published before the process ends
    return session


def context() -> JobContext:
    """rank, local_rank, world_size, local_world_size, node_rank, job_name, attempt, outputs_dir, hang_timeout."""
    return _session().context


def report(metrics: Mapping[str, float] | None = None, /, *, step: int, **more: float) -> None:
    """Records `step` and numeric metrics (a dict, keywords, or both). Rank 0's become the job's metrics
    (metrics.jsonl, TensorBoard, status, dashboard); every rank's go into its heartbeat. Reporting opts the job
    into hang detection: no report for limits.hang_timeout on every rank is a HANG, with every rank's stacks in
    its log. Never waits for other ranks."""
    _session().report(step, {**(metrics or {}), **more})


def latest_checkpoint() -> Checkpoint | None:
    """The newest checkpoint every rank finished (and that verifies), to resume from; None on a fresh job."""
    return _session().latest_checkpoint()


def checkpoint(step: int, *, keep: int = 2) -> contextlib.AbstractContextManager[Path]:
    """`with checkpoint(step) as folder:` write this rank's part into `folder`. Published (and the oldest beyond
    `keep` removed) once every rank's part is written; a part from a failed `with` block is discarded."""
    return _session().checkpoint(step, keep)


def should_stop() -> bool:
    """True once the engine asked the job to stop (SIGTERM on cancel, SIGUSR1 before Slurm's time limit): save a
    checkpoint and return; a requeued or retried job resumes from it."""
    return _session().should_stop()


def wait_for_checkpoints() -> None:
    """Until rank 0's last checkpoint is published (done at exit anyway)."""
    _session().wait_for_checkpoints()
