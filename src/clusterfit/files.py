"""Writing files that other processes read while they change: a reader sees the old content or the new, never
half of it. Heartbeats, summaries, manifests and rendered job files all go through here."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Write `data` to a hidden temp file beside `path`, then rename it over `path`.

    `durable` also fsyncs the file before the rename, for what must survive a power loss (checkpoints); a
    rename alone only protects against readers and crashed writers. The temp name carries the pid and thread,
    so two writers of one path (two nodes' agents on a shared folder) never write into each other's temp."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_durably(path: Path, data: bytes) -> None:
    """Write and fsync in place, for files inside a folder that is itself published by one rename."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the names in `path` (files created or renamed there) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_text_or_none(path: Path) -> str | None:
    """The file's text, or None when it cannot be read (missing, a folder, no permission)."""
    try:
        return path.read_text()
    except OSError:
        return None
