"""Which operating-system account a job of the job service runs as, and how its outputs folder comes into that
account's hands without root writing anything the account could steer.

A server started as root never runs a job as root (docs/security.md). Each job runs as its owner's account
(`clusterfit server --job-user-of OWNER=ACCOUNT`: Slurm runs a job as the user who submitted it, Determined links
its users to agent users) or else as `--job-user`. The account makes its outputs folder itself, with its own
rights; a folder that exists must already be the account's (root never hands over a tree it did not make: an
`outputs.dir: /etc` would have given /etc away); what the job puts there (its code, its job file, its logs) is
written by a process of the account's; the supervisor's own files there are opened without following links."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path

from clusterfit.backends.job_env import job_base_env
from clusterfit.backends.job_folder import JobAccount, account_name
from clusterfit.errors import EngineError, SpecError
from clusterfit.outputs.layout import LOG_DIR
from clusterfit.service.home import JOB_USER_ENV, JOB_USERS_ENV


def accounts_env(default: str, by_owner: Mapping[str, str]) -> dict[str, str]:
    """What a root server passes its supervisors (they inherit its environment; jobs never see it)."""
    return {JOB_USER_ENV: default, JOB_USERS_ENV: json.dumps(dict(by_owner), sort_keys=True)}


# The engines whose job a root supervisor starts as its account: from its own process (local), through
# `sbatch --uid` (Slurm), through the node's actor where Ray's daemons run as root (Ray). Kubernetes' pods run as
# `kubernetes.run_as_user`.
RUNS_AS_ACCOUNT = ("local", "slurm", "ray")


def job_account(owner: str, backend: str, environ: Mapping[str, str] = os.environ) -> JobAccount | None:
    """The account `owner`'s jobs on `backend` run as; None when they run as this process's own user (it is not
    root, or its server was told `--job-user root`), or as the engine's."""
    return owner_account(owner, environ) if backend in RUNS_AS_ACCOUNT else None


def owner_account(owner: str, environ: Mapping[str, str] = os.environ) -> JobAccount | None:
    """The unprivileged account this root server runs `owner`'s jobs as where it starts them itself; None when
    it runs them as its own user (it is not root, or it was told `--job-user root`)."""
    if os.geteuid() != 0:
        return None
    by_owner: dict[str, str] = json.loads(environ.get(JOB_USERS_ENV) or "{}")
    name = by_owner.get(owner) or environ.get(JOB_USER_ENV)
    if not name:
        return None
    try:
        return JobAccount.named(name)
    except KeyError:
        raise EngineError(
            f"the account {name} that this server runs this job as is gone from this machine; ask its operator to "
            "create it again, or to restart the server without it",
            retryable=False,
        ) from None


def make_outputs_folder(folder: Path, account: JobAccount) -> None:
    """`folder` and its logs folder, made by `account` itself where they do not exist yet; SpecError when
    `folder` exists and is not the account's, or when the account may not make it."""
    folder = folder.absolute()
    if folder.exists():
        _refuse_unless_owned(folder, account)
    made = subprocess.run(
        ["mkdir", "-p", "--", str(folder), str(folder / LOG_DIR)],
        capture_output=True,
        text=True,
        **account.helper_options(job_base_env(folder)),
    )
    if made.returncode != 0:
        why = (made.stderr.strip().splitlines() or ["mkdir failed"])[-1].removeprefix("mkdir: ")
        raise SpecError(
            f"outputs.dir {folder}: the account {account.name} this job runs as cannot make it ({why}); "
            "give a folder that account may create"
        )
    _refuse_unless_owned(folder, account)  # a link the account swapped in meanwhile leads somewhere it owns


def _refuse_unless_owned(folder: Path, account: JobAccount) -> None:
    holder = folder.stat().st_uid
    if holder != account.uid:
        raise SpecError(
            f"outputs.dir {folder} belongs to {account_name(holder)}, not to {account.name}, the account this job "
            "runs as; give a new folder, or one of that account's"
        )


def refuse_links(folder: Path) -> None:
    """SpecError naming a symbolic link inside `folder`: this process is about to write there (a checkpoint
    from the store), and a link a job planted (`checkpoints -> /etc/cron.d`) would take its writes elsewhere."""
    for parent, dirs, files, dir_fd in os.fwalk(folder, follow_symlinks=False):
        for name in dirs + files:
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise SpecError(
                    f"outputs.dir {folder}: {Path(parent, name).relative_to(folder)} is a symbolic link, which "
                    "the job service does not write through; remove it, or give another folder"
                )


def hand_over(folder: Path, account: JobAccount) -> None:
    """What this process wrote into the account's folder (a checkpoint from the store) becomes the account's;
    nothing else: never a link, a file with another name elsewhere (a hard link) or another account's file.
    Walked by descriptors: a folder swapped for a link meanwhile is not followed."""
    me = os.geteuid()
    for _, dirs, files, dir_fd in os.fwalk(folder, follow_symlinks=False):
        for name in dirs + files:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            single = stat.S_ISDIR(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink == 1)
            if info.st_uid == me and single:
                os.chown(name, account.uid, account.gid, dir_fd=dir_fd, follow_symlinks=False)
