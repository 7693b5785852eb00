"""Real resource limits for failure tests, as a command prefix: a memory cgroup, so the kernel's own OOM killer
acts on the job, and a private mount namespace with a small /dev/shm, so DataLoader workers really run out of
shared memory. Both need root; callers skip with the reason these functions give when they cannot be had."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
_CGROUP_V2 = Path("/sys/fs/cgroup")


def _memory_hierarchy() -> tuple[Path, dict[str, str]] | None:
    """Where to create a memory cgroup and the limit files to write (no swap, so the limit means OOM)."""
    if os.geteuid() != 0:
        return None
    if (_CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
        return _CGROUP_V1_MEMORY, {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes"}
    controllers = _CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        (_CGROUP_V2 / "cgroup.subtree_control").write_text("+memory")
        return _CGROUP_V2, {"limit": "memory.max", "swap": "memory.swap.max"}
    return None


def memory_limit_missing() -> str | None:
    if os.geteuid() != 0:
        return "a memory cgroup needs root"
    return None if _memory_hierarchy() else "no writable cgroup memory controller (v1 or v2) on this machine"


@contextmanager
def memory_limited(limit_bytes: int) -> Iterator[list[str]]:
    """A command prefix that runs the command, and every process it starts, in a new memory cgroup of
    `limit_bytes`; the cgroup is removed after its processes are gone."""
    found = _memory_hierarchy()
    assert found is not None, memory_limit_missing()
    hierarchy, files = found
    group = hierarchy / f"clusterfit-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / files["limit"]).write_text(str(limit_bytes))
        if (group / files["swap"]).exists():  # v1: memory + swap; v2: swap alone
            (group / files["swap"]).write_text(str(limit_bytes) if hierarchy == _CGROUP_V1_MEMORY else "0")
        yield ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs")]
    finally:
        deadline = time.monotonic() + 60
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.2)
        group.rmdir()


def small_shm_missing() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a private /dev/shm needs root and util-linux's unshare"
    probe = subprocess.run(small_shm(64 << 10) + ["true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a private /dev/shm: {probe.stderr.strip()}"


def small_shm(size_bytes: int) -> list[str]:
    """A command prefix that runs the command in a mount namespace of its own whose /dev/shm holds `size_bytes`."""
    mount = f"mount -t tmpfs -o size={size_bytes} tmpfs /dev/shm"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mount} && exec "$@"', "sh"]
