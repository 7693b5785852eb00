"""A request to checkpoint and stop, by signal: Slurm sends SIGUSR1 before a job's time limit (the batch script
forwards it to the workers and requeues the job), and the requeued job resumes from that checkpoint.

Torch-free: a user's script of any framework notes the same signals through `StopRequest`
(clusterfit.session.should_stop); the trainer agrees on it over every rank at each log step."""

from __future__ import annotations

import signal
from collections.abc import Iterable

STOP_SIGNAL = signal.SIGUSR1


class StoppedForRequeue(Exception):  # noqa: N818 - a planned stop, not an error
    """Training stopped at a checkpoint because a stop was requested; the job resumes there when rerun."""


class StopRequest:
    """Notes the signals in a handler; `received` says whether one came."""

    def __init__(self, signals: Iterable[signal.Signals] = (STOP_SIGNAL,)) -> None:
        self.received = False
        # NOTE: set explicitly: the Slurm batch script starts torchrun's agent with the signal ignored (its
        # default action would kill the agent), and the workers inherit that.
        for signum in signals:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True
