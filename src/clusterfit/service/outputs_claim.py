"""One job at a time per outputs folder: two runs writing the same checkpoints, logs and model would destroy
each other's work, so a job's supervisor holds an exclusive lock on `<outputs.dir>/.clusterfit-lock` for the
job's whole life (every attempt). The kernel drops the lock when the holder dies, so it never goes stale."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from clusterfit.backends.job_folder import JobAccount
from clusterfit.errors import OutputsInUse, SpecError
from clusterfit.files import open_beneath
from clusterfit.outputs import JobOutputs

__all__ = ["OutputsClaim", "OutputsInUse", "claim_outputs"]


class OutputsClaim:
    def __init__(self, handle: IO[str]) -> None:
        self._handle = handle

    def release(self) -> None:
        self._handle.close()  # closing the descriptor drops the lock


def claim_outputs(outputs_dir: Path, job_id: str, account: JobAccount | None = None) -> OutputsClaim:
    """The outputs folder for `job_id` alone, or OutputsInUse naming the job that holds it. The lock file is
    opened without following a link; with `account` (whose job it is), only in a folder of that account's."""
    outputs_dir.mkdir(parents=True, exist_ok=True)
    lock = JobOutputs.at(outputs_dir).lock.name
    try:
        fd = open_beneath(outputs_dir, lock, os.O_RDWR | os.O_CREAT, 0o666, owner=account.uid if account else None)
    except OSError as exc:
        raise SpecError(
            f"outputs.dir {outputs_dir}: cannot take its {lock} ({exc.strerror or exc}; a link or another kind of "
            "file is refused); remove it, or give another folder"
        ) from None
    handle = open(fd, "r+")  # noqa: SIM115 - held open for the job's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = _holder(handle.read())
        handle.close()
        raise OutputsInUse(
            f"outputs.dir {outputs_dir} is in use by {holder}; wait for it to end or cancel it, "
            "or give this job another outputs.dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"job": job_id, "pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    handle.flush()
    return OutputsClaim(handle)


def _holder(text: str) -> str:
    try:
        owner = json.loads(text)
        return f"job {owner['job']} (pid {owner['pid']} on {owner['host']})"
    except (ValueError, KeyError, TypeError):
        return "another run"
