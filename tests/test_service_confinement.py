"""What a job of the job service can reach on the server's machine, replayed against a real `clusterfit
server` on loopback with real supervisors and workers (docs/security.md): the environment it starts with,
and that nothing of the server's own reaches it."""

from __future__ import annotations

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
        self.store_url = f"sqlite:///{home / 'jobs.db'}"
        env = {"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": self.store_url, **_SERVER_ONLY}
        self.server = ServerProcess(*args, env=env)

    def token(self, scope: str, name: str) -> str:
        return issue_token(open_store(self.store_url), scope, timedelta(hours=1), name).secret

    def wait_final(self, job_id: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = open_store(self.store_url).get(job_id)
            if job.job_state.is_terminal:
                return job.state
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} still {job.state} after {timeout} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("confined-home"))
    with served.server:
        yield served


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


def test_a_job_sees_none_of_the_servers_variables(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with client(served.server.url, served.token("admin", "ops")) as http:
        job = http.post("/api/jobs", json=_spec(_command_job(out, "env | sort"))).json()
    assert served.wait_final(job["id"]) == "SUCCEEDED"
    seen = dict(line.split("=", 1) for line in _rank_log(out).splitlines() if "=" in line and line[:1].isupper())
    assert seen["FROM_SPEC"] == "yes" and seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1"
    assert seen["HOME"] == str(out)
    for name in ("CLUSTERFIT_HOME", "CLUSTERFIT_DATABASE_URL", *_SERVER_ONLY):
        assert name not in seen, f"{name} reached the job"
    assert str(served.home) not in _rank_log(out)
