"""What a job of the job service can reach on the server's machine, replayed against a real `clusterfit
server` on loopback with real supervisors and workers (docs/security.md): the environment it starts with,
that nothing of the server's own reaches it, its files and the service's, and who may run a command job."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import tiny_job
from job_accounts import python_for, runs_python, throwaway_account
from service_server import ServerProcess, client

from clusterfit.backends.job_folder import JobAccount
from clusterfit.errors import EngineError, SpecError
from clusterfit.files import open_beneath
from clusterfit.service.accounts import accounts_env, hand_over, job_account, refuse_links
from clusterfit.service.auth import issue_token
from clusterfit.service.migrate import open_store

# One server, and one throw-away account, for the whole module: its tests run on one worker.
pytestmark = pytest.mark.xdist_group("confinement")

_SERVER_ONLY = {"CLUSTERFIT_CAPACITY": "4", "OPERATOR_SECRET": "operator-only-value"}


class Served:
    """A running server over its own SQLite store, shared by this module's tests."""

    def __init__(self, home: Path, *args: str, python: str = sys.executable) -> None:
        self.home = home
        home.mkdir(exist_ok=True)
        home.chmod(0o755)  # as an older version left it: the server makes it private
        self.store_url = f"sqlite:///{home / 'jobs.db'}"
        env = {"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": self.store_url, **_SERVER_ONLY}
        self.server = ServerProcess(*args, env=env, python=python)

    def token(self, scope: str, name: str) -> str:
        return issue_token(open_store(self.store_url), scope, timedelta(hours=1), name).secret

    def wait_final(self, job_id: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = open_store(self.store_url).get(job_id)
            if job.job_state.is_terminal:
                return job.state
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} still {job.state} after {timeout} s")

    def failure(self, job_id: str) -> str:
        job = open_store(self.store_url).get(job_id)
        return f"{job.cause}: {job.cause_detail}"


ALICE = "clusterfit-test-alice"  # alice's jobs run as this account; everyone else's as nobody


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[str | None, str | None]]:
    """(a Python that nobody and alice's account can run, alice's account): each None where it cannot be had."""
    with python_for("nobody") as python, throwaway_account(ALICE) as alice:
        yield python, alice if alice and python and runs_python(python, alice) else None


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, accounts: tuple[str | None, str | None]) -> Iterator[Served]:
    python, alice = accounts
    users = ["--job-user", "nobody", *(["--job-user-of", f"alice={alice}"] if alice else [])] if python else []
    home = tmp_path_factory.mktemp("confined-home")
    served = Served(home, *(users or ["--job-user", "root"]), python=python or sys.executable)
    with served.server:
        yield served


@pytest.fixture
def as_nobody(accounts: tuple[str | None, str | None]) -> None:
    if accounts[0] is None:
        pytest.skip("nobody can run no Python with clusterfit here (as root, with a python3 of this version)")


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A folder where the job accounts make their outputs folders (pytest's own are private to root): shared and
    sticky, as /tmp is."""
    folder = Path(tempfile.mkdtemp(prefix="clusterfit-confined-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _command_job(out_dir: Path, command: str) -> dict[str, Any]:
    return {
        "name": "probe",
        "command": command,
        "environment_variables": {"FROM_SPEC": "yes"},
        "distribution": {"type": "pytorch", "process_count_per_instance": 1},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out_dir)},
    }


def _spec(job: dict[str, Any]) -> dict[str, str]:
    return {"spec": yaml.safe_dump(job, sort_keys=False)}


def _rank_log(out_dir: Path) -> str:
    return "\n".join(path.read_text() for path in sorted((out_dir / "logs").glob("rank-*.log")))


def test_a_job_sees_none_of_the_servers_variables(served: Served, reachable: Path) -> None:
    out = reachable / "out"
    with client(served.server.url, served.token("admin", "ops")) as http:
        job = http.post("/api/jobs", json=_spec(_command_job(out, "env | sort"))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED", served.failure(job["id"])
    seen = dict(line.split("=", 1) for line in _rank_log(out).splitlines() if "=" in line and line[:1].isupper())
    assert seen["FROM_SPEC"] == "yes" and seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1"
    assert seen["HOME"] == str(out)
    assert seen["OMP_WAIT_POLICY"] == os.environ["OMP_WAIT_POLICY"] == "PASSIVE", "the operator's tuning is kept"
    # its slot's share of the cores (capacity 4), not the cores of a machine of its own (cores / 1 rank)
    assert seen["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 4))
    for name in ("CLUSTERFIT_HOME", "CLUSTERFIT_DATABASE_URL", *_SERVER_ONLY):
        assert name not in seen, f"{name} reached the job"
    assert str(served.home) not in _rank_log(out)


def test_the_service_home_and_what_the_server_writes_are_their_owners_only(served: Served, reachable: Path) -> None:
    out = reachable / "out"
    with client(served.server.url, served.token("admin", "ops")) as http:
        job = http.post("/api/jobs", json=_spec(_command_job(out, "echo private > private.txt"))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED", served.failure(job["id"])
    assert served.home.stat().st_mode & 0o777 == 0o700
    for path in served.home.glob("jobs.db*"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert (out / "private.txt").exists()  # its working folder is its outputs, not the server's
    for path in [*(out / "logs").iterdir(), out / "job.yaml", out / "private.txt"]:
        assert path.stat().st_mode & 0o077 == 0, path


def test_a_command_job_cannot_read_or_write_the_service_home(served: Served, reachable: Path, as_nobody: None) -> None:
    out = reachable / "out"
    home = served.home
    probe = (
        f"id -un; cat {home}/jobs.db > /dev/null; ls {home}/secrets; echo x >> {home}/jobs.db; "
        f"sqlite3 {home}/jobs.db 'delete from api_tokens' 2>&1 | head -1; true"
    )
    store = open_store(served.store_url)
    with client(served.server.url, served.token("admin", "ops")) as http:
        tokens_before, jobs_before = len(store.list_tokens()), store.count_jobs()
        job = http.post("/api/jobs", json=_spec(_command_job(out, probe))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED", served.failure(job["id"])
    log = _rank_log(out)
    assert "nobody" in log
    assert f"cat: {home}/jobs.db: Permission denied" in log
    assert f"ls: cannot access '{home}/secrets': Permission denied" in log
    assert f"{home}/jobs.db: Permission denied" in log.split("cannot access", 1)[1]
    assert (len(store.list_tokens()), store.count_jobs()) == (tokens_before, jobs_before + 1)
    assert (out / "logs").stat().st_uid == pwd.getpwnam("nobody").pw_uid


def test_a_submit_token_runs_command_jobs_only_on_a_server_that_allows_them(served: Served, tmp_path: Path) -> None:
    probe = _spec(_command_job(tmp_path / "out", "true"))
    with client(served.server.url, served.token("submit", "ci")) as http:
        refused = http.post("/api/jobs", json=probe)
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        "job.yaml: command: jobs need an admin token on this server, or the server started with "
        "--allow-command-jobs; use the built-in trainer (trainer:), or ask its operator"
    )
    allowing = Served(tmp_path / "home", "--paused", "--allow-command-jobs")
    with allowing.server, client(allowing.server.url, allowing.token("submit", "ci")) as http:
        assert http.post("/api/jobs", json=probe).status_code == 201


def test_a_job_user_that_cannot_run_jobs_is_refused_at_start(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("--job-user applies to a server that runs as root")
    env = {**os.environ, "CLUSTERFIT_HOME": str(tmp_path / "home")}
    refused = subprocess.run(
        [sys.executable, "-m", "clusterfit", "server", "--port", "0", "--job-user", "no-such-account"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode != 0
    assert refused.stderr.strip() == (
        "error: --job-user 'no-such-account': no such account on this machine; create it or name another"
    )


def test_a_job_is_never_handed_a_folder_it_does_not_own(served: Served, reachable: Path, as_nobody: None) -> None:
    """Replayed: a `submit` token's trainer job with `outputs.dir` at a folder of root's. The server used to give
    the job account the whole folder (`chown -R`), root's secret in it too; with `/etc`, all of /etc."""
    victim = reachable / "victim"
    victim.mkdir(mode=0o755)
    secret = victim / "secret"
    secret.write_text("root's only\n")
    secret.chmod(0o600)
    with client(served.server.url, served.token("submit", "mallory")) as http:
        taken = http.post("/api/jobs", json=_spec(tiny_job(victim))).json()
        below = http.post("/api/jobs", json=_spec(tiny_job(victim / "below"))).json()
    assert served.wait_final(taken["id"]) == "FAILED"
    assert served.failure(taken["id"]) == (
        f"BAD_SPEC: outputs.dir {victim} belongs to root, not to nobody, the account this job runs as; give a new "
        "folder, or one of that account's"
    )
    assert served.wait_final(below["id"]) == "FAILED"
    assert served.failure(below["id"]) == (
        f"BAD_SPEC: outputs.dir {victim / 'below'}: the account nobody this job runs as cannot make it (cannot "
        f"create directory '{victim / 'below'}': Permission denied); give a folder that account may create"
    )
    assert [(p.name, p.stat().st_uid) for p in [victim, *victim.iterdir()]] == [("victim", 0), ("secret", 0)]
    assert secret.read_text() == "root's only\n" and secret.stat().st_mode & 0o777 == 0o600


def test_a_command_job_reads_its_code_with_its_own_rights(served: Served, reachable: Path, as_nobody: None) -> None:
    """Replayed: `code:` naming a folder only root may read; the server (root) copied it into the job's outputs
    and gave it to the job."""
    private = reachable / "private"
    private.mkdir(mode=0o700)
    (private / "train.py").write_text("KEY = 'root only'\n")
    out = reachable / "out"
    with client(served.server.url, served.token("admin", "ops")) as http:
        job = http.post("/api/jobs", json=_spec({**_command_job(out, "cat train.py"), "code": str(private)})).json()
    assert served.wait_final(job["id"]) == "FAILED"
    assert served.failure(job["id"]) == (
        f"BAD_SPEC: code: {private}: Permission denied (this job runs as the account nobody)"
    )
    assert not (out / "code").exists()  # nothing was copied, and no job process ran to print it
    assert "root only" not in _rank_log(out)


def test_links_a_job_plants_in_its_folder_do_not_steer_the_server(
    served: Served, reachable: Path, as_nobody: None
) -> None:
    """Replayed: a job replaces its folder's lock file and logs with links to a file of root's; the next job in
    that folder had the server (root) truncate and write that file, and append to it."""
    target = reachable / "root-file"
    target.write_text("root's\n")
    out = reachable / "out"
    plant = f"ln -sf {target} .planted && mv -f .planted .clusterfit-lock && ln -sf {target} logs/supervisor.log"
    with client(served.server.url, served.token("admin", "ops")) as http:
        planting = http.post("/api/jobs", json=_spec(_command_job(out, plant))).json()
        assert served.wait_final(planting["id"]) == "SUCCEEDED", served.failure(planting["id"])
        assert (out / ".clusterfit-lock").is_symlink()
        steered = http.post("/api/jobs", json=_spec(_command_job(out, "true"))).json()
    assert served.wait_final(steered["id"]) == "FAILED"
    assert served.failure(steered["id"]) == (
        f"BAD_SPEC: outputs.dir {out}: cannot take its .clusterfit-lock (Too many levels of symbolic links; a link "
        "or another kind of file is refused); remove it, or give another folder"
    )
    assert target.read_text() == "root's\n" and target.stat().st_uid == 0
    supervisor_log = out / "logs" / "supervisor.log"  # the planted link gave way to the supervisor's own log
    assert not supervisor_log.is_symlink() and f"job {steered['id']} ended FAILED" in supervisor_log.read_text()


def test_each_owner_s_jobs_run_as_the_owner_s_account(
    served: Served, reachable: Path, accounts: tuple[str | None, str | None]
) -> None:
    """`--job-user-of alice=ACCOUNT`: alice's jobs run as her account and keep their outputs from everyone
    else's jobs (which run as nobody), as Slurm runs each job as its submitter."""
    if accounts[1] is None:
        pytest.skip("no account of alice's could be made here (needs root, useradd and a Python it can run)")
    alice_out, bob_out = reachable / "alice", reachable / "bob"
    with client(served.server.url, served.token("admin", "alice")) as http:
        job = http.post("/api/jobs", json=_spec(_command_job(alice_out, "id -un; echo hers > secret.txt"))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED", served.failure(job["id"])
    with client(served.server.url, served.token("admin", "bob")) as http:
        probe = f"id -un; cat {alice_out}/secret.txt; ls {alice_out}/logs; true"
        job = http.post("/api/jobs", json=_spec(_command_job(bob_out, probe))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED", served.failure(job["id"])
    assert _rank_log(alice_out).splitlines()[0] == ALICE
    alice = pwd.getpwnam(ALICE).pw_uid
    assert {p.stat().st_uid for p in [alice_out, alice_out / "secret.txt", *(alice_out / "logs").glob("rank-*")]} == {
        alice
    }
    seen_by_bob = _rank_log(bob_out)
    assert seen_by_bob.splitlines()[0] == "nobody"
    assert f"cat: {alice_out}/secret.txt: Permission denied" in seen_by_bob
    assert f"ls: cannot access '{alice_out}/logs': Permission denied" in seen_by_bob
    assert "hers" not in seen_by_bob


def test_open_beneath_follows_no_link_and_opens_only_regular_files(tmp_path: Path) -> None:
    folder, outside = tmp_path / "job", tmp_path / "outside"
    (folder / "logs").mkdir(parents=True)
    outside.write_text("root's\n")
    (folder / "link").symlink_to(outside)
    (folder / "linked-logs").symlink_to(folder / "logs", target_is_directory=True)
    os.mkfifo(folder / "fifo")
    appending = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    for relative in ("link", "linked-logs/new.log", "fifo"):
        with pytest.raises(OSError):
            open_beneath(folder, relative, appending)
    with pytest.raises(PermissionError):
        open_beneath(folder, "fifo", os.O_RDONLY)  # opened without blocking, then refused: not a regular file
    with pytest.raises(PermissionError):
        open_beneath(folder, "logs/new.log", appending, owner=os.geteuid() + 1)
    with pytest.raises(ValueError):
        open_beneath(folder, "../outside", os.O_RDONLY)
    assert outside.read_text() == "root's\n" and not (folder / "logs" / "new.log").exists()
    fd = open_beneath(folder, "logs/new.log", appending, owner=os.geteuid())
    os.write(fd, b"written\n")
    os.close(fd)
    assert (folder / "logs" / "new.log").read_text() == "written\n"


def test_what_root_wrote_in_a_job_folder_is_handed_over_and_nothing_else(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("handing files to another account needs root")
    nobody = JobAccount.named("nobody")
    folder, outside = tmp_path / "job", tmp_path / "outside"
    (folder / "checkpoints" / "step-1").mkdir(parents=True)
    os.chown(folder, nobody.uid, nobody.gid)
    pulled = folder / "checkpoints" / "step-1" / "state.pt"
    pulled.write_bytes(b"from the store")
    outside.write_text("root's\n")
    os.link(outside, folder / "hard")  # as a job could, where the kernel allows links to others' files
    (folder / "soft").symlink_to(outside)
    hand_over(folder, nobody)
    assert {p.stat().st_uid for p in [folder / "checkpoints", pulled.parent, pulled]} == {nobody.uid}
    assert outside.stat().st_uid == 0 and (folder / "soft").lstat().st_uid == 0
    with pytest.raises(SpecError, match=r"outputs.dir .*/job: soft is a symbolic link, which the job service does"):
        refuse_links(folder)
    (folder / "soft").unlink()
    (folder / "checkpoints" / "latest").symlink_to(pulled.parent, target_is_directory=True)
    with pytest.raises(SpecError, match="checkpoints/latest is a symbolic link"):
        refuse_links(folder)


def test_the_account_of_each_owner() -> None:
    if os.geteuid() != 0:
        assert job_account("alice", "local") is None  # an unprivileged server's jobs run as its own user
        return
    environ = accounts_env("nobody", {"alice": "daemon"})
    assert job_account("alice", "local", environ) == JobAccount.named("daemon")
    assert job_account("bob", "slurm", environ) == JobAccount.named("nobody")
    assert job_account("bob", "ray", environ) == JobAccount.named("nobody")  # where Ray's daemons are root
    assert job_account("bob", "kubernetes", environ) is None  # the pods run as kubernetes.run_as_user
    assert job_account("bob", "local", accounts_env("", {"alice": "daemon"})) is None  # --job-user root
    with pytest.raises(EngineError, match="the account no-such-account that this server runs this job as is gone") as e:
        job_account("alice", "local", accounts_env("nobody", {"alice": "no-such-account"}))
    assert not e.value.retryable


def test_a_job_s_data_is_checked_with_its_account_s_rights(served: Served, reachable: Path, as_nobody: None) -> None:
    """Replayed: the server (root) checked a submitted job's data with root's rights, so its one-line answer
    told a `submit` token what a folder only root may read holds: `no such folder` for a name that is not there,
    another answer for one that is. Checked as the job's account, both answers are the same."""
    private = reachable / "private-data"
    (private / "cats" / "tabby").mkdir(parents=True)
    private.chmod(0o700)
    answers = {}
    with client(served.server.url, served.token("submit", "mallory")) as http:
        for name in ("cats", "dogs"):
            job = tiny_job(reachable / "out", data={"train": str(private / name), "num_classes": None})
            answers[name] = http.post("/api/jobs", json=_spec(job))
    assert [answer.status_code for answer in answers.values()] == [422, 422]
    said = {name: answer.json()["detail"].replace(name, "NAME") for name, answer in answers.items()}
    expected = f"trainer.data: {private}/NAME/index.json: permission denied; give data that the job (its user) may read"
    assert said == {"cats": expected, "dogs": expected}
