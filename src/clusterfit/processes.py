"""Processes found again by pid, safely: a pid is reused by the kernel, so every pid clusterfit keeps is paired
with the process's start time, and a process is only signalled while that pair still matches.

Linux /proc is read directly (no psutil in the base install): the launcher, the job service and every engine's
agent host use these helpers. Processes that imported torch end here too, without the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn


@contextlib.contextmanager
def long_lived_imports() -> Iterator[None]:
    """Around imports whose objects live as long as the process (torch and torchvision make some 300,000):
    no collection runs while they are made, since each would walk every object made so far (a fifth of the
    import's CPU time, measured), and they are frozen after, so that later collections never walk them either
    nor dirty the memory pages a forked child shares."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first); the command name in field 2 may contain spaces or ')'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if it is gone."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def is_running(pid: int, start_time: str | None = None) -> bool:
    """Whether `pid` exists and is not a zombie (exited, not yet reaped); with `start_time`, also that it is the
    same process, not a later one that got the pid."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return False
    return start_time is None or fields[19] == start_time


def descendants(*roots: int) -> dict[int, str]:
    """pid -> start time of every process below any of `roots` (read from /proc once)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = fields[19]
    found: dict[int, str] = {}
    pending = [child for root in roots for child in children.get(root, [])]
    while pending:
        child = pending.pop()
        found[child] = starts[child]
        pending += children.get(child, [])
    return found


def kill_if_same(pid: int, start_time: str, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal `pid` only if it is still the process that started at `start_time`."""
    if process_start_time(pid) == start_time:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_with_parent() -> None:
    """A `preexec_fn`: the kernel sends the child SIGTERM when the process that started it dies.

    torchrun's agent stops its workers on SIGTERM, so a launcher or Ray actor killed outright (SIGKILL, the
    OOM killer) leaves no training processes behind."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def finish_cleanly() -> None:
    """What a normal exit does that matters, in its order, as multiprocessing's own children do: non-daemon
    threads are joined, exit handlers run (DataLoader workers stopped, logging flushed), then the streams are
    flushed. The interpreter's teardown of torch's modules is left out: it took a second per rank on 2 CPU cores
    (0.8 s alone, 1.3 s with its peer) while the job's end waited for it."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_without_teardown(code: int) -> NoReturn:
    """Ends a program that imported torch and finished: `finish_cleanly`, then the exit code, at once."""
    finish_cleanly()
    os._exit(code)


def exit_code_of(program: Callable[[], object]) -> int:
    """Runs a program's main as the interpreter runs a script: the code of its SystemExit, or 1 with the
    traceback printed for any other exception."""
    try:
        program()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0
