"""A request to checkpoint and stop, by signal: Slurm sends SIGUSR1 before a job's time limit (the batch script
forwards it to the workers and requeues the job), and the requeued job resumes from that checkpoint."""

from __future__ import annotations

import signal

import torch

from clusterfit.worker.dist import DistEnv, all_reduce_sum

STOP_SIGNAL = signal.SIGUSR1


class StoppedForRequeue(Exception):  # noqa: N818 - a planned stop, not an error
    """Training stopped at a checkpoint because a stop was requested; the job resumes there when rerun."""


class StopSignal:
    """Notes the signal in a handler; `agreed()` is a collective, so every rank stops at the same step even
    when the signal reaches the ranks at different steps."""

    def __init__(self, env: DistEnv, device: torch.device) -> None:
        self.env, self.device = env, device
        self.received = False
        # NOTE: set explicitly: the Slurm batch script starts torchrun's agent with the signal ignored (its
        # default action would kill the agent), and the workers inherit that.
        signal.signal(STOP_SIGNAL, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True

    def agreed(self) -> bool:
        return all_reduce_sum([1.0 if self.received else 0.0], self.env, self.device)[0] > 0
