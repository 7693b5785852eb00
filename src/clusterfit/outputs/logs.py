"""The logs folder: one `rank-N.log` per global rank (stdout and stderr; older attempts kept as `.1`, `.2`...),
torchrun's `rank-N.error.json` and `agent.log`, and the job service's `supervisor.log`."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from clusterfit.outputs.layout import AGENT_LOG

_CURRENT_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_RANK_ERROR_FILE = re.compile(r"^rank-(\d+)\.error\.json$")


def rank_of_log(name: str) -> int | None:
    """The rank whose current log is called `name`; None for anything else (rotated logs, agent.log)."""
    match = _CURRENT_RANK_LOG.match(name)
    return int(match.group(1)) if match else None


def rank_of_error_file(name: str) -> int | None:
    match = _RANK_ERROR_FILE.match(name)
    return int(match.group(1)) if match else None


def is_followed_log(name: str, ranks: set[int] | None, *, agent: bool = True) -> bool:
    """Whether a follower shows this file: with `ranks` None every rank's current log (and the agent's, with
    `agent`); else only those ranks' logs."""
    rank = rank_of_log(name)
    if ranks is None:
        return rank is not None or (agent and name == AGENT_LOG)
    return rank is not None and rank in ranks


def log_order(name: str) -> int:
    """Sort key: the agent's log first, then ranks in order."""
    rank = rank_of_log(name)
    return -1 if rank is None else rank


def log_label(name: str, node_of: Callable[[int], str | None] | None = None) -> str:
    """How a log's lines are labelled: `rank1@host` (`rank1` while the host is unknown), `torchrun` for the agent."""
    rank = rank_of_log(name)
    if rank is None:
        return "torchrun"
    node = node_of(rank) if node_of else None
    return f"rank{rank}@{node}" if node else f"rank{rank}"


def rank_logs(log_dir: Path) -> dict[int, Path]:
    """rank -> its current log file."""
    if not log_dir.is_dir():
        return {}
    return {rank: path for path in log_dir.iterdir() if (rank := rank_of_log(path.name)) is not None}


def rotate(path: Path) -> None:
    """rank-0.log -> rank-0.log.1 -> rank-0.log.2 ...: a restart never overwrites the log of a failure."""
    if not path.exists():
        return
    generation = 1
    while path.with_name(f"{path.name}.{generation}").exists():
        generation += 1
    for older in range(generation, 1, -1):
        os.replace(path.with_name(f"{path.name}.{older - 1}"), path.with_name(f"{path.name}.{older}"))
    os.replace(path, path.with_name(f"{path.name}.1"))
