"""The system programs behind the tests' real services, found in one place.

`make services` (this file run as a script; `make test` runs it first) installs what is missing from Debian's
packages when it runs as root with apt-get; where it cannot, it prints one line naming what is missing and
which tests skip (and, when not root, the tests that need root). The tests ask `skip_reason` and skip with a
line naming the missing program.
Standard library only: it runs before the virtual environment exists, and costs milliseconds when all is there.

    python3 tests/services.py            # install what is missing (root + apt-get), else say what skips
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Service:
    programs: dict[str, str]  # program -> the Debian package that provides it
    skipped: str  # the tests that skip without it
    needs_root: str = ""  # why its tests need root, if they do


SERVICES = {
    "azurite": Service(
        {"node": "nodejs", "npm": "npm"},
        "tests/test_staging.py and the staging benchmark's test",
    ),
    "postgresql": Service(
        {"initdb": "postgresql"},
        "the PostgreSQL cases of tests/test_service_store.py and tests/test_service_api.py",
    ),
    "chromium": Service({"chromium": "chromium"}, "tests/test_dashboard.py"),
    "slurm": Service(
        {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm"},
        "the cluster tests of tests/test_slurm.py",
        needs_root="the Slurm daemons run as root and switch users for jobs",
    ),
    "confinement": Service(  # nothing to install: tests/confinement.py needs root only
        {},
        "the OOM-kill and full-/dev/shm tests of tests/test_service_jobs.py",
        needs_root="a memory cgroup and a private /dev/shm need root",
    ),
}


def find(program: str) -> str | None:
    """Where `program` is: on PATH; Debian keeps daemons in /usr/sbin (off a user's PATH) and PostgreSQL's
    server programs in /usr/lib/postgresql/<version>/bin (the newest version wins)."""
    if program == "initdb":
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
        return found[-1] if found else None
    path = shutil.which(program)
    if path is None and os.path.exists(f"/usr/sbin/{program}"):
        path = f"/usr/sbin/{program}"
    return path


def missing_programs(service: Service) -> list[str]:
    return [program for program in service.programs if find(program) is None]


def skip_reason(key: str) -> str | None:
    """One line saying why the tests of SERVICES[key] cannot run here, or None."""
    service = SERVICES[key]
    missing = missing_programs(service)
    if missing:
        packages = " ".join(dict.fromkeys(service.programs[p] for p in missing))
        return f"needs {', '.join(missing)}, not found (as root, `make services` installs {packages})"
    if service.needs_root and os.geteuid() != 0:
        return service.needs_root
    return None


def _can_install() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def _install(packages: list[str]) -> None:
    print(f"make services: installing {' '.join(packages)} from Debian's packages", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
            sys.exit(f"make services: {' '.join(command)} failed: {last[0]}")


def main() -> None:
    missing = {key: missing_programs(service) for key, service in SERVICES.items()}
    packages = list(dict.fromkeys(SERVICES[key].programs[p] for key, programs in missing.items() for p in programs))
    if packages and _can_install():
        _install(packages)
        missing = {key: missing_programs(service) for key, service in SERVICES.items()}
        packages = []  # installed, yet something is still not found: say so below, without advice
    programs = [program for programs in missing.values() for program in programs]
    skipped = [service.skipped for key, service in SERVICES.items() if missing[key]]
    parts = []
    if programs:
        advice = f" (as root: apt-get install {' '.join(packages)})" if packages else ""
        parts.append(f"{', '.join(programs)} missing{advice}")
    if os.geteuid() != 0:
        rooted = [s.skipped for key, s in SERVICES.items() if s.needs_root and not missing[key]]
        if rooted:
            parts.append("not root")
            skipped += rooted
    if parts:
        print(f"make services: {'; '.join(parts)}; skipping {', '.join(skipped)}")


if __name__ == "__main__":
    main()
