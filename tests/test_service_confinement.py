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
from service_server import ServerProcess, client

from clusterfit.service.auth import issue_token
from clusterfit.service.migrate import open_store

_SERVER_ONLY = {"CLUSTERFIT_CAPACITY": "4", "OPERATOR_SECRET": "operator-only-value"}


class Served:
    """A running server over its own SQLite store, shared by this module's tests."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        home.mkdir(exist_ok=True)
        home.chmod(0o755)  # as an older version left it: the server makes it private
        self.store_url = f"sqlite:///{home / 'jobs.db'}"
        env = {"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": self.store_url, **_SERVER_ONLY}
        self.server = ServerProcess(*args, env=env)

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


def _nobody_cannot_run_python() -> str | None:
    """Why jobs cannot run as nobody here (as non-root, or with an interpreter in a private folder), or None."""
    if os.geteuid() != 0:
        return "jobs run as another user only when the server runs as root"
    nobody = pwd.getpwnam("nobody")
    try:
        subprocess.run([sys.executable, "-c", ""], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], check=True)
    except (OSError, subprocess.CalledProcessError):
        return f"nobody cannot run {sys.executable} on this machine"
    return None


_NOBODY_MISSING = _nobody_cannot_run_python()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("confined-home"), "--job-user", "root" if _NOBODY_MISSING else "nobody")
    with served.server:
        yield served


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A folder the job user can reach (pytest's own are private to root), for a job's outputs."""
    folder = Path(tempfile.mkdtemp(prefix="clusterfit-confined-"))
    folder.chmod(0o711)
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
    assert served.wait_final(job["id"]) == "SUCCEEDED"
    seen = dict(line.split("=", 1) for line in _rank_log(out).splitlines() if "=" in line and line[:1].isupper())
    assert seen["FROM_SPEC"] == "yes" and seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1"
    assert seen["HOME"] == str(out)
    assert seen["OMP_WAIT_POLICY"] == os.environ["OMP_WAIT_POLICY"] == "PASSIVE", "the operator's tuning is kept"
    for name in ("CLUSTERFIT_HOME", "CLUSTERFIT_DATABASE_URL", *_SERVER_ONLY):
        assert name not in seen, f"{name} reached the job"
    assert str(served.home) not in _rank_log(out)


def test_the_service_home_and_what_the_server_writes_are_their_owners_only(served: Served, reachable: Path) -> None:
    out = reachable / "out"
    with client(served.server.url, served.token("admin", "ops")) as http:
        job = http.post("/api/jobs", json=_spec(_command_job(out, "echo private > private.txt"))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED"
    assert served.home.stat().st_mode & 0o777 == 0o700
    for path in served.home.glob("jobs.db*"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert (out / "private.txt").exists()  # its working folder is its outputs, not the server's
    for path in [*(out / "logs").iterdir(), out / "job.yaml", out / "private.txt"]:
        assert path.stat().st_mode & 0o077 == 0, path


@pytest.mark.skipif(_NOBODY_MISSING is not None, reason=str(_NOBODY_MISSING))
def test_a_command_job_cannot_read_or_write_the_service_home(served: Served, reachable: Path) -> None:
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
    assert served.wait_final(job["id"]) == "SUCCEEDED"
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
