"""Why a job failed, in words: the exceptions torchrun recorded for each failed rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

_ERROR_FILE = re.compile(r"^rank-(\d+)\.error\.json$")
_MAX_CHARS = 400


def failure_causes(log_dir: Path) -> list[str]:
    """One line per failed rank of the last attempt, first failure first: that one is the root cause."""
    found: list[tuple[int, int, str]] = []
    for path in log_dir.glob("rank-*.error.json") if log_dir.is_dir() else []:
        match = _ERROR_FILE.match(path.name)
        if not match:
            continue
        try:
            record = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        message = record.get("message", "") if isinstance(record, dict) else str(record)
        timestamp = int(record.get("extraInfo", {}).get("timestamp", 0)) if isinstance(record, dict) else 0
        line = " ".join(message.split())
        if len(line) > _MAX_CHARS:
            line = line[: _MAX_CHARS - 3] + "..."
        found.append((timestamp, int(match.group(1)), line))
    return [f"rank {rank}: {line}" for _, rank, line in sorted(found)]
