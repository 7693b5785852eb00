"""Follow the log files of a job as they grow: every rank's `rank-N.log` and the agent's log, labelled.

Reading files (not pipes) means a launcher that dies or detaches never stalls or breaks the job, and the
same follower works for any engine whose logs land in the outputs folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from clusterfit.outputs.logs import followed_logs, log_label


@dataclass
class _OpenLog:
    file: IO[str]
    inode: int
    partial: str = ""


class LogFollower:
    """Yields complete new lines of `<log_dir>/rank-N.log` (reopened when a restart rotates it) and agent.log."""

    def __init__(
        self,
        log_dir: Path,
        world_size: int,
        from_start: bool = False,
        *,
        ranks: set[int] | None = None,
        agent: bool = True,
        node_of: Callable[[int], str | None] | None = None,
    ) -> None:
        self.log_dir, self.world_size = log_dir, world_size
        self.ranks = ranks  # None: every rank (and the agent, with `agent`); else only these ranks
        self.agent = agent
        self.node_of = node_of  # rank -> host, to label lines "rank1@host" when known
        self._open: dict[str, _OpenLog] = {}
        if not from_start:  # skip what earlier runs wrote; rotation gives new files anyway
            for name, path in self._current_files().items():
                self._open[name] = self._open_at(path, end=True)

    def poll(self) -> list[str]:
        lines: list[str] = []
        for name, path in self._current_files().items():
            label = f"[{self._label(name)}] "
            entry = self._open.get(name)
            if entry is not None and _inode(path) != entry.inode:  # rotated: finish the old file first
                lines += [label + line for line in self._read(entry, final=True)]
                entry.file.close()
                del self._open[name]
                entry = None
            if entry is None:
                try:
                    entry = self._open[name] = self._open_at(path, end=False)
                except FileNotFoundError:  # rotated away since it was listed, its successor not made yet
                    continue
            lines += [label + line for line in self._read(entry, final=False)]
        return lines

    def drain(self) -> list[str]:
        """Everything left, including a last line without a newline; then close the files."""
        lines = self.poll()
        for name, entry in self._open.items():
            lines += [f"[{self._label(name)}] {line}" for line in self._read(entry, final=True)]
            entry.file.close()
        self._open.clear()
        return lines

    def _current_files(self) -> dict[str, Path]:
        names = followed_logs(self.log_dir, self.world_size, self.ranks, agent=self.agent)
        return {name: self.log_dir / name for name in names}

    def _label(self, name: str) -> str:
        return log_label(name, self.node_of)

    @staticmethod
    def _open_at(path: Path, end: bool) -> _OpenLog:
        file = open(path, errors="replace")  # noqa: SIM115 - kept open while following
        if end:
            file.seek(0, os.SEEK_END)
        return _OpenLog(file, os.fstat(file.fileno()).st_ino)

    @staticmethod
    def _read(entry: _OpenLog, final: bool) -> list[str]:
        text = entry.partial + entry.file.read()
        parts = text.split("\n")
        entry.partial = "" if final else parts.pop()
        return [part for part in parts if part or not final]


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None
