"""Stateless, incremental reading of a job's logs for the HTTP API: the client keeps a cursor (byte offsets per
file) and asks for what came after it. Lines are labelled like `clusterfit logs` labels them locally."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clusterfit.monitoring.logtail import AGENT_LOG

_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_CHUNK_BYTES = 256 * 1024  # per file and request: a huge log arrives in pieces instead of one giant response


@dataclass
class LogChunk:
    lines: list[str]
    cursor: str  # opaque to clients: "name:offset,name:offset"
    more: bool  # some file has unread bytes past this chunk; ask again at once
    ended: bool = False
    files: list[str] = field(default_factory=list)


def parse_cursor(cursor: str | None) -> dict[str, int]:
    offsets: dict[str, int] = {}
    for part in (cursor or "").split(","):
        name, _, offset = part.rpartition(":")
        if name and offset.isdigit():
            offsets[name] = int(offset)
    return offsets


def _order(name: str) -> int:
    match = _RANK_LOG.match(name)
    return int(match.group(1)) if match else -1


def read_logs(
    log_dir: Path,
    cursor: str | None,
    *,
    ranks: set[int] | None = None,
    node_of: Callable[[int], str | None] | None = None,
    final: bool = False,
) -> LogChunk:
    """New complete lines of every wanted log after `cursor`; with `final` (the job ended) a last line without
    a newline is included too. A file that shrank was rotated by a restart: it is read again from its start."""
    offsets = parse_cursor(cursor)
    names = []
    if log_dir.is_dir():
        for path in log_dir.iterdir():
            match = _RANK_LOG.match(path.name)
            wanted = (
                (bool(match) or path.name == AGENT_LOG)
                if ranks is None
                else bool(match) and int(match.group(1)) in ranks
            )
            if wanted:
                names.append(path.name)
    lines: list[str] = []
    more = False
    for name in sorted(names, key=_order):
        path = log_dir / name
        start = offsets.get(name, 0)
        try:
            size = path.stat().st_size
            if size < start:
                start = 0
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(_CHUNK_BYTES)
        except OSError:
            continue
        complete_up_to = data.rfind(b"\n") + 1
        at_end = start + len(data) >= size
        if final and at_end:
            complete_up_to = len(data)
        elif complete_up_to == 0 and len(data) == _CHUNK_BYTES:
            complete_up_to = len(data)  # one enormous line: hand it over in pieces rather than never
        text = data[:complete_up_to].decode("utf-8", errors="replace")
        offsets[name] = start + complete_up_to
        more = more or start + complete_up_to < size and not (final and at_end)
        label = f"[{_label(name, node_of)}] "
        pieces = text.split("\n") if text else []
        if pieces and pieces[-1] == "":
            pieces.pop()  # the text ended with a newline: nothing follows it yet
        lines += [label + line for line in pieces]
    cursor_text = ",".join(f"{name}:{offset}" for name, offset in sorted(offsets.items()))
    return LogChunk(lines=lines, cursor=cursor_text, more=more, files=sorted(names, key=_order))


def _label(name: str, node_of: Callable[[int], str | None] | None) -> str:
    match = _RANK_LOG.match(name)
    if not match:
        return "torchrun"
    node = node_of(int(match.group(1))) if node_of else None
    return f"rank{match.group(1)}@{node}" if node else f"rank{match.group(1)}"
