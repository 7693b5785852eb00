"""Unprivileged accounts for the tests of a root job service that runs jobs as other users: a Python they can
run, and a throw-away account of the test's own.

The environment's interpreter may sit in a folder only root can enter (pyenv under /root): then another
account cannot start it, and the jobs of a root server that runs them as `nobody` could not be tested. The
system's python3 of the same minor version runs the same packages, so a virtual environment made from it,
whose site loads this environment's packages and this checkout's clusterfit, is one that every account can run
where those folders are readable. It is made once per test module in a world-readable temporary folder."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import clusterfit
from clusterfit.backends.job_env import job_base_env
from clusterfit.backends.job_folder import JobAccount


def runs_python(python: str, account: str) -> bool:
    try:
        subprocess.run(
            [python, "-c", "import clusterfit, torch"],
            capture_output=True,
            check=True,
            timeout=120,
            **JobAccount.named(account).helper_options(job_base_env("/")),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def submit_as_root_service(python: str, job_file: Path, env: dict[str, str], timeout: float = 300) -> str:
    """`clusterfit submit` with `python`, which the job's account can run too (its supervisor runs on it, and so
    do the helpers it starts as the account), and `env` (`CLUSTERFIT_JOB_USER`, as a root server sets it for its
    supervisors); the job's id."""
    submitted = subprocess.run(
        [python, "-m", "clusterfit", "submit", str(job_file)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip()


@contextlib.contextmanager
def python_for(account: str) -> Iterator[str | None]:
    """An interpreter `account` can run with clusterfit and this environment's packages, or None."""
    if os.geteuid() != 0:
        yield None
        return
    if runs_python(sys.executable, account):
        yield sys.executable
        return
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    if (
        system is None
        or subprocess.run(
            [system, "-c", "import sys; print(sys.version[:4])"], capture_output=True, text=True
        ).stdout.strip()
        != minor
    ):
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="clusterfit-python-"))
    try:
        folder.chmod(0o755)
        venv = folder / "venv"
        if subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], capture_output=True).returncode != 0:
            yield None
            return
        site = venv / "lib" / f"python{minor}" / "site-packages"
        source = Path(clusterfit.__file__).resolve().parents[1]  # this checkout's, ahead of the installed one
        packages = sysconfig.get_paths()["purelib"]
        (site / "clusterfit-tests.pth").write_text(f"{source}\nimport site; site.addsitedir({packages!r})\n")
        subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
        python = str(venv / "bin" / "python")
        yield python if runs_python(python, account) else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def throwaway_account(name: str) -> Iterator[str | None]:
    """A system account `name` (no home, no login) for the test's life, or None where it cannot be made."""
    try:
        pwd.getpwnam(name)
        existed = True
    except KeyError:
        existed = False
        useradd = shutil.which("useradd", path="/usr/sbin:/sbin:/usr/bin")
        if os.geteuid() != 0 or useradd is None:
            yield None
            return
        made = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True
        )
        if made.returncode != 0:
            yield None
            return
    try:
        yield name
    finally:
        if not existed:
            subprocess.run(
                [shutil.which("userdel", path="/usr/sbin:/sbin:/usr/bin") or "userdel", name], capture_output=True
            )
