"""Writing files that other processes read while they change: a reader sees the old content or the new, never
half of it. Heartbeats, summaries, manifests and rendered job files all go through here. Also opening a file
in a folder that another, unprivileged account controls, without being steered out of it."""

from __future__ import annotations

import contextlib
import os
import stat
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


def folder_beneath(folder: Path, relative: str, *, make: bool = False, owner: int | None = None) -> int:
    """A descriptor of the folder `folder/relative` (`.` for `folder`), reached without following a symbolic link
    below `folder`; with `make`, the missing folders on the way are made.

    For a privileged process in a folder an unprivileged account can change (a root job service's job folder):
    a link the account planted (`logs -> /etc`) would steer a plain open() to a file the account may not touch.
    `owner`: the uid `folder` must belong to (checked on the folder actually opened, not on its name)."""
    relative_path = Path(relative)
    if relative_path.is_absolute() or ".." in relative_path.parts:
        raise ValueError(f"{relative!r}: not a plain path inside a folder")
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if owner is not None and os.fstat(dir_fd).st_uid != owner:
            raise PermissionError(f"{folder} does not belong to uid {owner}")
        for part in relative_path.parts:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=dir_fd)
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def open_beneath(folder: Path, relative: str, flags: int, mode: int = 0o600, *, owner: int | None = None) -> int:
    """A descriptor of `folder/relative`, reached as `folder_beneath` reaches a folder, and only if it is a
    regular file (or a folder, with os.O_DIRECTORY in `flags`)."""
    parent, name = os.path.split(relative)
    if name in ("", ".", ".."):
        raise ValueError(f"{relative!r}: not a plain path inside a folder")
    dir_fd = folder_beneath(folder, parent or ".", owner=owner)
    try:
        # NOTE: O_NONBLOCK: a FIFO in place of the file must not block this process for ever.
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    kind = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(kind) if flags & os.O_DIRECTORY else stat.S_ISREG(kind)):
        os.close(fd)
        raise PermissionError(f"{folder / relative}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, start: int = 0, limit: int = -1) -> tuple[bytes, int]:
    """Up to `limit` bytes of `path` from `start` (negative: from its end) and its size, if it is a regular file
    and not a link: the job service reads the files of jobs that run as other accounts (their logs, their error
    files), and a job's link in their place (`rank-0.log -> /etc/shadow`) must not be read through."""
    fd = open_beneath(path.parent, path.name, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        f.seek(max(0, size + start) if start < 0 else start)
        return f.read(limit), size


def read_whole_regular(path: Path, max_bytes: int) -> bytes:
    """All of `path` as `read_regular` reads it, or ValueError when it holds more than `max_bytes`: a small
    file a job writes (a heartbeat, its summary) that a server reads whole, whatever size the job made it."""
    data, size = read_regular(path, 0, max_bytes)
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes, more than the {max_bytes} such a file holds")
    return data
