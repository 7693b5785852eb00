"""`clusterfit server` as a real process for tests: started on a free loopback port (it prints the URL it
got), reached over real HTTP, stopped with SIGTERM like a user's Ctrl-C."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from datetime import timedelta

import httpx

from clusterfit.service.auth import hash_token, issue_token
from clusterfit.service.migrate import open_store
from clusterfit.service.states import JobState


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        # NOTE: a root server runs its jobs as --job-user (default nobody), who cannot reach pytest's private
        # temporary folders; tests of that confinement name the user and a folder it can reach.
        self.args = args if "--job-user" in args else (*args, "--job-user", "root")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
        self.python = python  # the server's, and so its supervisors' and jobs' interpreter
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.output: list[str] = []

    def start(self, timeout: float = 60) -> ServerProcess:
        command = [self.python, "-m", "clusterfit", "server", "--port", "0", *self.args]
        self.process = subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not selector.select(timeout=1):
                continue
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {''.join(self.output)}")
            self.output.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                return self
        raise RuntimeError(f"server did not start in {timeout} s: {''.join(self.output)}")

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        rest = self.process.stdout.read() if self.process.stdout else ""
        self.output.append(rest)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def make_token(scope: str, ttl: timedelta | None = timedelta(hours=1), name: str = "") -> str:
    """A real token in the store the server uses (CLUSTERFIT_DATABASE_URL / CLUSTERFIT_HOME of this test)."""
    return issue_token(open_store(), scope, ttl, name or f"test-{scope}").secret


def expired_token() -> str:
    secret = "cf_expired_" + os.urandom(8).hex()
    open_store().add_token("expired", hash_token(secret), ["admin"], timedelta(seconds=-1))
    return secret


def client(url: str, token: str | None = None, **kwargs: object) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=120, **kwargs)


def cancel_active_jobs(timeout: float = 60) -> None:
    """Ask every job still active in this test's store to stop (their supervisors act on it), and wait:
    a failing test must not leave training processes behind on a shared machine."""
    store = open_store()
    for job in store.active_jobs() + store.list_jobs(JobState.QUEUED):
        store.request_cancel(job.id)
    deadline = time.monotonic() + timeout
    while store.active_jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
