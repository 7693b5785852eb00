"""heartbeats/rank-N.json: each rank's newest sign of life, rewritten about once a second by the worker and read
by the job service (progress, RUNNING, hang detection, per-rank health) for any engine whose outputs it sees."""

from __future__ import annotations

import contextlib
import enum
import json
import os
from dataclasses import asdict, dataclass

from clusterfit.files import open_beneath, read_whole_regular, write_atomically
from clusterfit.outputs.layout import JobOutputs, heartbeat_name, rank_files

_LARGEST_BEAT = 64 * 1024  # a rank's heartbeat is a few hundred bytes; a job writes the file


class Phase(str, enum.Enum):
    """What a rank is doing. Only silence in TRAINING (or SCORING) counts as a hang: staging a large dataset or a
    long validation is not one."""

    STAGING = "staging"
    RUNNING = "running"  # a command job's process is alive and has not reported a step: never a hang
    TRAINING = "training"
    VALIDATING = "validating"
    EXPORTING = "exporting"
    SCORING = "scoring"  # a scoring job's ranks (clusterfit score): each batch is a step, silence a hang

    @property
    def watched(self) -> bool:
        """Whether silence in this phase is a hang (hang_timeout): training steps and scored batches."""
        return self in (Phase.TRAINING, Phase.SCORING)

    DONE = "done"


@dataclass(frozen=True)
class RankBeat:
    rank: int
    phase: str
    step: int
    time: float  # wall-clock time of that step (not of the write, which may come up to a second later)
    images_per_s: float | None
    pid: int
    host: str
    attempt: int
    metrics: dict[str, float] | None = None  # a user script's last report on this rank (clusterfit.session)

    @property
    def training(self) -> bool:
        """Making steps whose silence is a hang: training, or scoring images."""
        return self.phase in {phase.value for phase in Phase if phase.watched}


def write_heartbeat(outputs: JobOutputs, beat: RankBeat) -> None:
    record = asdict(beat)
    del record["rank"]  # the file name says it
    if record["metrics"] is None:
        del record["metrics"]
    write_atomically(outputs.heartbeat(beat.rank), json.dumps(record))


def read_heartbeats(outputs: JobOutputs, world_size: int, attempt: int | None = None) -> dict[int, RankBeat]:
    """rank -> its newest heartbeat, for ranks 0..world_size-1 (of `attempt` only, when given); unreadable
    files are skipped."""
    beats: dict[int, RankBeat] = {}
    for rank, path in rank_files(outputs.heartbeats, heartbeat_name, world_size).items():
        try:
            beat = RankBeat(rank=rank, **json.loads(read_whole_regular(path, _LARGEST_BEAT)))
        except (OSError, ValueError, TypeError):
            continue
        if attempt is None or beat.attempt == attempt:
            beats[beat.rank] = beat
    return beats


def clear_heartbeats(outputs: JobOutputs, world_size: int) -> None:
    """Before an attempt: the last attempt's heartbeats go. The folder is opened without following a link (a
    root job service clears the folders of jobs that run as other accounts)."""
    try:
        folder = open_beneath(outputs.root, outputs.heartbeats.name, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # none yet, or not a folder of the job's
    try:
        for rank in range(world_size):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(heartbeat_name(rank), dir_fd=folder)
    finally:
        os.close(folder)
