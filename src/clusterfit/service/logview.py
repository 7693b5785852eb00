"""Stateless, incremental reading of a job's logs for the HTTP API: the client keeps a cursor (byte offsets per
file) and asks for what came after it. Lines are labelled like `clusterfit logs` labels them locally."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clusterfit.files import read_regular
from clusterfit.outputs.logs import followed_logs, log_label

_CHUNK_BYTES = 256 * 1024  # per file and request: a huge log arrives in pieces instead of one giant response
# All files of one answer together, and how many files one answer reads: a job with thousands of logs (or one
# that made thousands of files) is answered in pieces, the files taking turns from one answer to the next.
_ANSWER_BYTES = 4 * 1024 * 1024
_FILES_PER_ANSWER = 256
_TURN = "^"  # the cursor's entry for the file the next answer starts with, when they take turns
# Line ends as Python's text files know them: a progress bar's lone \r ends a line too, not only \n and \r\n.
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass
class LogChunk:
    lines: list[str]
    cursor: str  # opaque to clients: "name:offset,name:offset"
    more: bool  # some file has unread bytes past this chunk; ask again at once
    ended: bool = False
    files: list[str] = field(default_factory=list)


def parse_cursor(cursor: str | None) -> dict[str, int]:
    """A client's cursor, as far as it can be one: an offset past what a file can hold (over 18 digits, which
    int() and seek() refuse with an error) is no offset, and the file is read from its start."""
    offsets: dict[str, int] = {}
    for part in (cursor or "").split(","):
        name, _, offset = part.rpartition(":")
        if name and offset.isdigit() and len(offset) <= 18:
            offsets[name] = int(offset)
    return offsets


def read_logs(
    log_dir: Path,
    cursor: str | None,
    world_size: int,
    *,
    ranks: set[int] | None = None,
    node_of: Callable[[int], str | None] | None = None,
    final: bool = False,
) -> LogChunk:
    """New complete lines of every wanted log after `cursor`; with `final` (the job ended) a last line without
    a newline is included too. A file that shrank was rotated by a restart: it is read again from its start."""
    offsets = parse_cursor(cursor)
    ordered = followed_logs(log_dir, world_size, ranks)
    turn = offsets.pop(_TURN, 0) % len(ordered) if ordered else 0
    served = (ordered[turn:] + ordered[:turn])[:_FILES_PER_ANSWER]
    if len(ordered) > len(served):
        offsets[_TURN] = (turn + len(served)) % len(ordered)
    piece = min(_CHUNK_BYTES, _ANSWER_BYTES // max(1, len(served)))
    lines: list[str] = []
    more = False
    for name in served:
        path = log_dir / name
        start = offsets.get(name, 0)
        try:
            data, size = read_regular(path, start, piece)
            if size < start:
                start = 0
                data, size = read_regular(path, 0, piece)
        except OSError:
            continue
        complete_up_to = _whole_lines(data)
        at_end = start + len(data) >= size
        if final and at_end:
            complete_up_to = len(data)
        elif complete_up_to == 0 and len(data) == piece:
            complete_up_to = len(data)  # one enormous line: hand it over in pieces rather than never
        text = data[:complete_up_to].decode("utf-8", errors="replace")
        offsets[name] = start + complete_up_to
        more = more or not at_end  # a last line still without its newline is not more: it waits for the writer
        label = f"[{log_label(name, node_of)}] "
        pieces = _LINE_END.split(text) if text else []
        if pieces and pieces[-1] == "":
            pieces.pop()  # the text ended with a line end: nothing follows it yet
        lines += [label + line for line in pieces]
    kept = set(ordered) | {_TURN}  # what the client made up of its own is not echoed back
    cursor_text = ",".join(f"{name}:{offset}" for name, offset in sorted(offsets.items()) if name in kept)
    return LogChunk(lines=lines, cursor=cursor_text, more=more, files=ordered)


def _whole_lines(data: bytes) -> int:
    """How many bytes of `data` are complete lines. A \r at its very end is no line end yet: a \n may follow it,
    and \r\n must end one line, not two."""
    body = data[:-1] if data.endswith(b"\r") else data
    return max(body.rfind(b"\n"), body.rfind(b"\r")) + 1
