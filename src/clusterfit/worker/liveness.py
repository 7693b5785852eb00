"""A command job's sign of life: until the user's script reports its own steps (clusterfit.session), a small
process beside it rewrites the rank's heartbeat as RUNNING every second while the script lives, so the job
service sees progress of time, names the rank's host and pid, and never takes a script that does not report
for a hung one (only silence in TRAINING is a hang)."""

from __future__ import annotations

import os
import socket
import time

from clusterfit.outputs import JobOutputs, Phase, RankBeat, write_heartbeat
from clusterfit.processes import process_start_time, stop_with_parent

INTERVAL_S = 1.0


def start_liveness(outputs: JobOutputs, rank: int, attempt: int) -> str:
    """Forks the liveness process for this process (about to exec the user's command, keeping its pid);
    returns its `PID:START_TIME`, which clusterfit.session uses to stop it once the script reports."""
    watched = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            stop_with_parent()
            _beat_while_alive(outputs, rank, attempt, watched)
        finally:
            os._exit(0)  # never run the parent's cleanup or flush its buffers twice
    return f"{child}:{process_start_time(child) or ''}"


def _beat_while_alive(outputs: JobOutputs, rank: int, attempt: int, watched: int) -> None:
    host = socket.gethostname()
    while os.getppid() == watched:
        beat = RankBeat(rank, Phase.RUNNING.value, 0, time.time(), None, watched, host, attempt)
        write_heartbeat(outputs, beat)
        time.sleep(INTERVAL_S)
