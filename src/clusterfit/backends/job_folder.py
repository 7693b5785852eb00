"""A job that runs as another account than its launcher (a root job service's job user) gets its files from a
process of that account: its code is read with the account's rights (never root's, which would copy what the
account may not read), and what lands in its outputs folder is written where the account's own rights allow
(never steered by a link the account made). Run as the account by `prepare_as`:

    python -m clusterfit.backends.job_folder OUTPUTS_DIR [--code FOLDER] < {"path": "text", ...}

Standard library and the outputs layout only: it starts once per attempt, before the job."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterfit.backends.job_env import job_base_env
from clusterfit.errors import SpecError
from clusterfit.files import open_beneath, write_atomically
from clusterfit.outputs.layout import CODE_DIR, LOG_DIR


@dataclass(frozen=True)
class JobAccount:
    name: str
    uid: int
    gid: int

    @classmethod
    def named(cls, name: str) -> JobAccount:
        """KeyError when this machine has no such account."""
        entry = pwd.getpwnam(name)
        return cls(name, entry.pw_uid, entry.pw_gid)

    def process_options(self) -> dict[str, Any]:
        """subprocess arguments that start a process as this account, without the starter's groups."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def helper_options(self, env: Mapping[str, str]) -> dict[str, Any]:
        """Those of a short helper of the launcher's run as this account, from /, with `env`: the job's own
        (backends/job_env.py), never the launcher's, which another process of the account could read from it
        (a server's database URL). Its messages in plain ASCII."""
        return {**self.process_options(), "cwd": "/", "env": {**env, "LC_ALL": "C", "PYTHONUTF8": "1"}}


def account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a container's uid without an entry
        return f"uid {uid}"


def copy_code(code: Path, outputs_dir: Path) -> None:
    """`code` into outputs_dir/code, replacing an earlier copy whole: the job runs its code as it was at
    submission, and engines whose outputs.dir is on a shared filesystem find it on every node."""
    outputs = outputs_dir.resolve()
    target = outputs / CODE_DIR
    staging = target.with_name(f".{CODE_DIR}.tmp")
    skipped_names = shutil.ignore_patterns(".git", "__pycache__", ".venv")

    def skipped(folder: str, names: list[str]) -> set[str]:
        # `code: .` with outputs.dir inside it must not copy the outputs (and the copy) into itself.
        return set(skipped_names(folder, names)) | {name for name in names if Path(folder, name).resolve() == outputs}

    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(code, staging, ignore=skipped, symlinks=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)


def put_job_files(outputs_dir: Path, code: str | None, files: Mapping[str, str], account: JobAccount | None) -> None:
    """The job's code (a copy), its rendered files and its logs folder, in its outputs folder: written by this
    process, or, with `account`, by a process of that account's (SpecError naming what it could not do)."""
    if account is not None:
        prepare_as(account, code and Path(code), outputs_dir, files)
        return
    if code is not None:
        copy_code(Path(code), outputs_dir)
    _write_rendered(outputs_dir, files)


def _write_rendered(outputs_dir: Path, files: Mapping[str, str]) -> None:
    for path, content in files.items():
        write_atomically(Path(path), content)
    (outputs_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)


def open_agent_log(outputs_dir: Path, log: Path, account: JobAccount | None) -> int:
    """The agent's log file for appending, opened without following a link anywhere below `outputs_dir`, only
    as a regular file, and (with `account`) only in a folder of that account's; SpecError naming it."""
    name = log.relative_to(outputs_dir).as_posix()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    try:
        return open_beneath(outputs_dir, name, flags, 0o666, owner=account.uid if account else None)
    except OSError as exc:
        raise SpecError(
            f"outputs.dir {outputs_dir}: cannot write its {name} ({exc.strerror or exc}; a link or another kind of "
            "file is refused); remove it, or give another folder"
        ) from None


def prepare_as(account: JobAccount, code: Path | None, outputs_dir: Path, files: Mapping[str, str]) -> None:
    """Copy the job's code into its outputs, write its rendered files and make its logs folder, all as
    `account`; SpecError naming what the account could not do."""
    command = [sys.executable, "-m", "clusterfit.backends.job_folder", str(outputs_dir)]
    if code is not None:
        command += ["--code", str(code)]
    env = job_base_env(outputs_dir)
    done = subprocess.run(
        command, input=json.dumps(dict(files)), capture_output=True, text=True, **account.helper_options(env)
    )
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SpecError(f"{why} (this job runs as the account {account.name})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterfit.backends.job_folder")
    parser.add_argument("outputs_dir", type=Path)
    parser.add_argument("--code", type=Path)
    args = parser.parse_args(argv)
    files: dict[str, str] = json.load(sys.stdin)
    try:
        if args.code is not None:
            copy_code(args.code, args.outputs_dir)
    except OSError as exc:
        print(f"code: {_reason(exc)}", file=sys.stderr)
        return 2
    try:
        _write_rendered(args.outputs_dir, files)
    except OSError as exc:
        print(f"outputs.dir {args.outputs_dir}: {_reason(exc)}", file=sys.stderr)
        return 2
    return 0


def _reason(exc: OSError) -> str:
    if isinstance(exc, shutil.Error) and exc.args and exc.args[0]:  # copytree: (source, target, why) per file
        source, _, why = exc.args[0][0]
        return f"{source}: {why}"
    return f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)


if __name__ == "__main__":
    sys.exit(main())
