"""A request to checkpoint and stop, by signal: Slurm sends SIGUSR1 before a job's time limit (the batch script
forwards it to the workers and requeues the job), and the requeued job resumes from that checkpoint.

Torch-free at import: a user's script of any framework notes the same signals through `StopRequest`
(clusterfit.session.should_stop); only the trainer's `StopSignal.agreed()` needs torch, for its collective."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from clusterfit.worker.dist import DistEnv

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


class StopSignal(StopRequest):
    """`agreed()` is a collective, so every rank stops at the same step even when the signal reaches the ranks
    at different steps."""

    def __init__(self, env: DistEnv, device: torch.device) -> None:
        super().__init__()
        self.env, self.device = env, device

    def agreed(self) -> bool:
        from clusterfit.worker.dist import all_reduce_sum

        return all_reduce_sum([1.0 if self.received else 0.0], self.env, self.device)[0] > 0
