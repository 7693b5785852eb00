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
    """Notes the signals in a handler; `received` says whether one came. With `second_interrupts`, a second
    signal raises KeyboardInterrupt: for a user who will not wait for the orderly stop the first one asked for.

    NOTE: the first signal only sets the flag, which the caller reads where it is safe to stop. An exception raised
    by the handler lands wherever the main thread is, inside a database write or holding a lock."""

    def __init__(self, signals: Iterable[signal.Signals] = (STOP_SIGNAL,), *, second_interrupts: bool = False) -> None:
        self.received = False
        self._second_interrupts = second_interrupts
        # NOTE: set explicitly: the Slurm batch script starts torchrun's agent with the signal ignored (its
        # default action would kill the agent), and the workers inherit that.
        for signum in signals:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if self.received and self._second_interrupts:
            raise KeyboardInterrupt
        self.received = True
