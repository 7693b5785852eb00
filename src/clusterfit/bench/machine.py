"""What a benchmark ran on, so its numbers can be read and compared."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_precision(name: str) -> str:
    """`--precision` as the concrete dtype every system in a benchmark gets (auto resolved once, here)."""
    import torch

    from clusterfit.spec.errors import SpecError
    from clusterfit.worker.precision import resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return resolve_precision(name, device).name
    except ValueError as exc:
        raise SpecError(f"--precision {name}: {exc}") from None
