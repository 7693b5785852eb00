"""metrics.jsonl: rank 0's records, one JSON object per line, appended and flushed at once so followers (the
CLI's progress bar, the job service, the dashboard) see them live. Every record has a `kind` and a `step`."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from clusterfit.files import read_regular

# What the job service reads of a metrics file, which the job writes and may make any size: its end only (about
# 40,000 records), and, when following it, a bounded piece per read and no record longer than a megabyte.
SERVED_TAIL_BYTES = 8 * 1024 * 1024
_FOLLOW_BYTES = 4 * 1024 * 1024
_LONGEST_RECORD = 1024 * 1024


class RecordKind(str, enum.Enum):
    START = "start"  # total_steps, the step a resumed run starts at
    TRAIN = "train"  # every log_every_steps: loss, lr, images/s, data wait
    VAL = "val"  # after each epoch's validation: top1, top5, loss
    CHECKPOINT = "checkpoint"  # how long the loop stood still for it
    END = "end"


# A train record's fields that are not a metric of the script's own: the record's, and the progress fields that
# status shows on its progress line. The rest is whatever a user script reported (clusterfit.session).
PROGRESS_FIELDS = frozenset({"kind", "step", "time", "epoch", "total_steps", "images_per_s", "loss", "lr", "data_wait"})


def own_metrics(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key not in PROGRESS_FIELDS}


def metrics_text(metrics: dict[str, Any], separator: str = ", ") -> str:
    """`name value` pairs as status and the progress bar print them."""
    pairs = (f"{key} {value:.6g}" if isinstance(value, float) else f"{key} {value}" for key, value in metrics.items())
    return separator.join(pairs)


@dataclass(frozen=True)
class MembershipChange:
    """An elastic job's rendezvous round that started with another node count than the round before."""

    step: int  # where training went on
    nodes_before: int
    nodes: int
    world_size: int
    time: float | None

    @property
    def text(self) -> str:
        return f"{self.nodes_before} -> {self.nodes} node(s) (world size {self.world_size}) at step {self.step}"


def membership_changes(starts: Iterable[dict[str, Any]]) -> list[MembershipChange]:
    """Every change of node count between consecutive start records (one per rendezvous round, written by
    rank 0): the nodes an elastic job lost or gained, and where it went on."""
    changes, before = [], None
    for start in starts:
        nodes = start.get("nodes")
        if before is not None and nodes is not None and nodes != before:
            changes.append(
                MembershipChange(start["step"], before, nodes, start.get("world_size", 0), start.get("time"))
            )
        before = nodes if nodes is not None else before
    return changes


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class MetricsTail:
    """Reads records appended since it was opened (or since the start); tolerates a half-written last line.

    A file replaced whole (a new inode: the launcher's copy of an elastic job whose rank 0 moved to another node,
    which writes its own copy) is read again from its start, past the records already read (by their time)."""

    def __init__(self, path: Path, *, from_start: bool = False) -> None:
        self.path = path
        self.offset = 0 if from_start or not path.exists() else path.stat().st_size
        self._inode = path.stat().st_ino if path.exists() else None
        self._partial = b""
        self._skipping = False  # inside a line too long to be a record, until its end
        self._last_time: float | None = None

    def read_new(self) -> list[dict[str, Any]]:
        try:
            inode = self.path.stat().st_ino
        except FileNotFoundError:
            return []
        replaced = self._inode is not None and inode != self._inode
        if replaced:
            self.offset, self._partial, self._skipping = 0, b"", False
        self._inode = inode
        try:
            chunk, _ = read_regular(self.path, self.offset, _FOLLOW_BYTES)  # the rest at the next read
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if self._skipping and lines:  # the rest of a line too long to be a record
            lines.pop(0)
            self._skipping = False
        if len(self._partial) > _LONGEST_RECORD:
            self._partial, self._skipping = b"", True
        records = list(_parse(line.decode(errors="replace") for line in lines))
        if replaced and self._last_time is not None:
            last = self._last_time
            records = [record for record in records if (_time(record) or 0.0) > last]
        times = [t for t in map(_time, records) if t is not None]
        if times:
            self._last_time = max(times + ([self._last_time] if self._last_time is not None else []))
        return records


def _time(record: dict[str, Any]) -> float | None:
    """A record's time, if it has a number there (the job writes this file: anything can be in it)."""
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_records(path: Path, kinds: Iterable[RecordKind] | None = None) -> list[dict[str, Any]]:
    """Every complete record in the file (of `kinds`, when given); a line cut short by a crash is skipped."""
    try:
        text = read_regular(path)[0].decode(errors="replace")
    except OSError:  # none yet, or not a file of the job's (a link)
        return []
    wanted = None if kinds is None else {kind.value for kind in kinds}
    return [record for record in _parse(text.splitlines()) if wanted is None or record.get("kind") in wanted]


def recent_records(
    path: Path, kinds: Iterable[RecordKind], limit: int | None = None, max_bytes: int = SERVED_TAIL_BYTES
) -> list[dict[str, Any]]:
    """The last `limit` (or all) complete records of `kinds` among the file's last `max_bytes`, oldest first:
    what a server reads of a file that a job writes, however large the job made it."""
    try:
        data, size = read_regular(path, -max_bytes)
    except OSError:
        return []
    if size > max_bytes:  # begins inside a line
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    wanted = {kind.value for kind in kinds}
    found: list[dict[str, Any]] = []
    for record in _parse(reversed(data.decode(errors="replace").splitlines())):
        if record.get("kind") in wanted:
            found.append(record)
            if limit is not None and len(found) == limit:
                break
    return found[::-1]


def last_record(path: Path, kind: RecordKind, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """The newest complete record of `kind`, read from the file's end only (a long job's file is large)."""
    try:
        lines = read_regular(path, -tail_bytes)[0].decode(errors="replace").splitlines()
    except OSError:
        return None
    for record in reversed(list(_parse(lines))):
        if record.get("kind") == kind.value:
            return record
    return None


def _parse(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):  # a job writes this file: a line of anything else is not a record
            yield record
