"""The logs folder: one `rank-N.log` per global rank (stdout and stderr; older attempts kept as `.1`, `.2`...),
torchrun's `rank-N.error.json` and `agent.log`, and the job service's `supervisor.log`."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from clusterfit.outputs.layout import AGENT_LOG, rank_files, rank_log_name

_CURRENT_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_RANK_PROCESS_EXIT = re.compile(r"^clusterfit agent: rank process (\d+) on (\S+) ended with exit code (-?\d+)$")


def rank_of_log(name: str) -> int | None:
    """The rank whose current log is called `name`; None for anything else (rotated logs, agent.log)."""
    match = _CURRENT_RANK_LOG.match(name)
    return int(match.group(1)) if match else None


def followed_logs(log_dir: Path, world_size: int, ranks: set[int] | None = None, *, agent: bool = True) -> list[str]:
    """The logs a follower shows, in order: with `ranks` None every rank's current log (after the agent's, with
    `agent`); else only those ranks' logs. Of ranks 0..world_size-1 only, found by name (`rank_files`)."""
    names = [path.name for rank, path in rank_logs(log_dir, world_size).items() if ranks is None or rank in ranks]
    return [AGENT_LOG, *names] if agent and ranks is None and (log_dir / AGENT_LOG).exists() else names


def log_label(name: str, node_of: Callable[[int], str | None] | None = None) -> str:
    """How a log's lines are labelled: `rank1@host` (`rank1` while the host is unknown), `torchrun` for the agent."""
    rank = rank_of_log(name)
    if rank is None:
        return "torchrun"
    node = node_of(rank) if node_of else None
    return f"rank{rank}@{node}" if node else f"rank{rank}"


def rank_logs(log_dir: Path, world_size: int) -> dict[int, Path]:
    """rank -> its current log file, for ranks 0..world_size-1."""
    return rank_files(log_dir, rank_log_name, world_size)


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


def rank_process_exit_line(pid: int, host: str, exit_code: int) -> str:
    """The agent's line in agent.log for one rank process's exit once the ranks failed, its pid told apart
    from other nodes' by its host: torchrun's own summary of forked ranks names only the first exit it saw."""
    return f"clusterfit agent: rank process {pid} on {host} ended with exit code {exit_code}"


def rank_process_exits(agent_lines: list[str]) -> dict[tuple[str, int], int]:
    """(host, pid) -> exit code, from the agent's lines written by `rank_process_exit_line`; a later line wins."""
    exits: dict[tuple[str, int], int] = {}
    for line in agent_lines:
        if match := _RANK_PROCESS_EXIT.match(line.strip()):
            exits[match.group(2), int(match.group(1))] = int(match.group(3))
    return exits
