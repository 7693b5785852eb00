"""The job service's HTTP boundary under attack, replayed against real `clusterfit server` processes on
loopback: owners and their jobs, failed authentications, hostile Host and Origin headers without tokens, the
headers every answer carries, and where tokens may travel over plain HTTP (docs/security.md)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, tiny_job, wait_for
from service_server import ServerProcess, client

from clusterfit.errors import DataError
from clusterfit.service.api import SECURITY_HEADERS, FailedAuthentications, exposure_refusal
from clusterfit.service.auth import issue_token
from clusterfit.service.client import ServiceClient
from clusterfit.service.jobs import ServiceError
from clusterfit.service.local_jobs import SubmissionChecks
from clusterfit.service.migrate import open_store
from clusterfit.spec import load_spec_text


class Served:
    """A paused server over its own SQLite store, shared by a module's tests (starting one takes seconds)."""

    def __init__(self, home: Path, *args: str) -> None:
        self.store_url = f"sqlite:///{home / 'jobs.db'}"
        self.server = ServerProcess(
            "--paused", *args, env={"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": self.store_url}
        )

    def token(self, scope: str, name: str, owner: str = "") -> str:
        return issue_token(open_store(self.store_url), scope, timedelta(hours=1), name, owner).secret

    def job_state(self, job_id: str) -> str:
        return open_store(self.store_url).get(job_id).state

    def count_jobs(self) -> int:
        return open_store(self.store_url).count_jobs()


CHECK_TIMEOUT_S = 8  # the guarded server's: a check takes about a second here, a hostile one forever
QUEUE_LIMIT = 3  # jobs one owner may have waiting on the guarded server (paused: every job waits)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(
        tmp_path_factory.mktemp("guarded-home"),
        *("--check-timeout", str(CHECK_TIMEOUT_S), "--max-queued-per-owner", str(QUEUE_LIMIT)),
    )
    with served.server:
        yield served


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("tokenless-home"), "--no-auth")
    with served.server:
        yield served


def _job(tmp_path: Path) -> dict[str, str]:
    return {"spec": yaml.safe_dump(tiny_job(tmp_path / "out"), sort_keys=False)}


# --- owners ---------------------------------------------------------------------------------------------
def test_a_submit_token_cancels_only_its_owners_jobs(guarded: Served, tmp_path: Path) -> None:
    alice_laptop = guarded.token("submit", "alice-laptop", owner="alice")
    alice_ci = guarded.token("submit", "alice-ci", owner="alice")
    bob = guarded.token("submit", "bob")
    admin = guarded.token("admin", "ops")
    with client(guarded.server.url, alice_laptop) as http:
        first, second = (http.post("/api/jobs", json=_job(tmp_path)).json() for _ in range(2))
    assert first["owner"] == second["owner"] == "alice"  # the token's owner, not its name

    with client(guarded.server.url, bob) as http:
        refused = http.post(f"/api/jobs/{first['id']}/cancel")
        assert refused.status_code == 403
        assert refused.json()["detail"] == (
            f"job {first['id']} belongs to 'alice'; token 'bob' of 'bob' cancels only its owner's jobs "
            "(an admin token cancels any)"
        )
        assert http.get(f"/api/jobs/{first['id']}").json()["state"] == "QUEUED"  # bob still sees it
    assert guarded.job_state(first["id"]) == "QUEUED"
    with client(guarded.server.url, alice_ci) as http:  # another token of the same owner
        assert http.post(f"/api/jobs/{first['id']}/cancel").json()["state"] == "CANCELLED"
    with client(guarded.server.url, admin) as http:
        assert http.post(f"/api/jobs/{second['id']}/cancel").json()["state"] == "CANCELLED"
        made = http.post("/api/tokens", json={"scope": "submit", "name": "carol-ci", "owner": "carol"}).json()
        assert (made["name"], made["owner"]) == ("carol-ci", "carol")


def test_an_owner_s_queue_is_bounded_and_other_owners_are_not_held_by_it(guarded: Served, tmp_path: Path) -> None:
    carol, dave = guarded.token("submit", "carol-ci", owner="carol"), guarded.token("submit", "dave")
    with client(guarded.server.url, carol) as http:
        queued = [http.post("/api/jobs", json=_job(tmp_path)).json()["id"] for _ in range(QUEUE_LIMIT)]
        before = guarded.count_jobs()
        refused = http.post("/api/jobs", json=_job(tmp_path))
        assert refused.status_code == 429
        assert refused.json()["detail"] == (
            f"owner 'carol' already has {QUEUE_LIMIT} jobs waiting in the queue, this server's limit "
            "(--max-queued-per-owner); wait for some to start, or cancel some"
        )
        assert guarded.count_jobs() == before
    with client(guarded.server.url, dave) as http:
        assert http.post("/api/jobs", json=_job(tmp_path)).status_code == 201
    with client(guarded.server.url, carol) as http:
        assert http.post(f"/api/jobs/{queued[0]}/cancel").json()["state"] == "CANCELLED"
        assert http.post("/api/jobs", json=_job(tmp_path)).status_code == 201


def test_a_token_lifetime_past_ten_years_is_a_one_line_refusal(guarded: Served) -> None:
    with client(guarded.server.url, guarded.token("admin", "ops")) as http:
        for ttl in ("9999999w", "99999999999w"):  # the first fits a timedelta but no expiry date
            response = http.post("/api/tokens", json={"scope": "read", "ttl": ttl})
            assert response.status_code == 422
            assert (
                response.json()["detail"] == f"--ttl {ttl!r} is longer than 3650 days; use a shorter lifetime, or never"
            )
        assert http.post("/api/tokens", json={"scope": "read", "ttl": "9" * 5000 + "h"}).status_code == 422
        assert http.post("/api/tokens", json={"scope": "read", "ttl": "520w"}).status_code == 201


# --- submissions whose check would never end ------------------------------------------------------------
@contextmanager
def silent_store() -> Iterator[tuple[int, list[socket.socket]]]:
    """A loopback port that accepts connections and never answers, as a store behind a broken proxy does
    (fsspec waited 5 minutes on it); the connections it accepted."""
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)

        def accept() -> None:
            while listener.fileno() != -1:
                with contextlib.suppress(OSError):
                    accepted.append(listener.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        yield listener.getsockname()[1], accepted
    for connection in accepted:
        connection.close()


def test_a_data_check_that_never_ends_is_cut_off_and_holds_no_request(guarded: Served, tmp_path: Path) -> None:
    before = guarded.count_jobs()
    with silent_store() as (port, accepted), client(guarded.server.url, guarded.token("submit", "mallory")) as http:
        job = tiny_job(tmp_path / "out")
        job["trainer"]["data"] = {"train": f"http://127.0.0.1:{port}/imagenet/train", "image_size": 32}
        spec = {"spec": yaml.safe_dump(job, sort_keys=False)}
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(http.post, "/api/jobs", json=spec) for _ in range(2)]
            wait_for(lambda: len(accepted) >= 2, 30, "both checks to reach the silent store")
            health_started = time.monotonic()
            assert http.get("/api/health").status_code == 200
            assert time.monotonic() - health_started < 2  # the checks hold none of the request threads
            answered = [answer.result() for answer in answers]
        took = time.monotonic() - started
        for answer in answered:
            assert answer.status_code == 503, answer.text
            assert answer.json()["detail"] == (
                f"checking the job's data did not end within {CHECK_TIMEOUT_S} s (a store or file system that "
                "does not answer?); submit again once it answers"
            )
        assert took < 2 * CHECK_TIMEOUT_S + 10, took  # cut off at the timeout, not fsspec's 5 minutes
        # The checks' processes are gone: the store sees each connection closed.
        for connection in accepted:
            connection.settimeout(10)  # socket.timeout fails the test: that process still holds it
            while connection.recv(4096):  # the request the check sent, then the end of the connection
                pass
    assert guarded.count_jobs() == before


def test_submissions_wait_for_a_free_check_no_longer_than_a_check_lasts(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["outputs"] = {"dir": f"file://{tmp_path}/store", "cache_dir": str(tmp_path / "cache")}
    spec = load_spec_text(yaml.safe_dump(job), source="job.yaml")
    # A real check of the store, in a process of its own, frees its slot once it ends. It has the default
    # timeout: starting that process alone took over a second beside the rest of the suite.
    checked = SubmissionChecks(at_once=1)
    checked.check(spec, owner="alice")
    assert checked.slots.acquire(blocking=False)
    checks = SubmissionChecks(timeout_s=1, at_once=1)
    assert checks.slots.acquire(blocking=False)  # as a check that hangs holds it
    try:
        started = time.monotonic()
        with pytest.raises(DataError, match=r"already checking 1 other submissions' data; submit again in a moment"):
            checks.check(spec, owner="bob")
        assert 1 <= time.monotonic() - started < 5
    finally:
        checks.slots.release()


def test_one_owner_s_hanging_checks_do_not_hold_another_owner_s(tmp_path: Path) -> None:
    checks = SubmissionChecks(timeout_s=10, at_once=4, per_owner=1)  # alice's real check ends well within it
    fine = tiny_job(tmp_path / "out")
    fine["outputs"] = {"dir": f"file://{tmp_path}/store", "cache_dir": str(tmp_path / "cache")}
    with silent_store() as (port, accepted), ThreadPoolExecutor(1) as pool:
        hostile = tiny_job(tmp_path / "mallory")
        hostile["trainer"]["data"] = {"train": f"http://127.0.0.1:{port}/train", "image_size": 32}
        hanging = pool.submit(checks.check, load_spec_text(yaml.safe_dump(hostile), source="job.yaml"), "mallory")
        wait_for(lambda: accepted, 30, "the check to reach the silent store")
        started = time.monotonic()
        with pytest.raises(DataError, match=r"already checking 1 of this owner's submissions; submit again once"):
            checks.check(load_spec_text(yaml.safe_dump(hostile), source="job.yaml"), "mallory")
        checks.check(load_spec_text(yaml.safe_dump(fine), source="job.yaml"), "alice")  # not held by mallory's
        assert time.monotonic() - started < 10 and not hanging.done()
        with pytest.raises(DataError, match="did not end within 10 s"):
            hanging.result()


def test_failed_authentications_are_logged_and_limited_per_address(tmp_path: Path) -> None:
    """Its own server: once limited, 127.0.0.1 (every test's address) is refused for a minute."""
    served = Served(tmp_path)
    valid = served.token("read", "reader")
    guesses = [f"cf_guess-{number}" for number in range(31)]
    with served.server as server:
        for guess in guesses[:30]:
            with client(server.url, guess) as http:
                assert http.get("/api/jobs").status_code == 401
        with client(server.url, guesses[30]) as http:
            limited = http.get("/api/jobs", headers={"X-Forwarded-For": "10.9.9.9"})  # not believed without a proxy
        with client(server.url, valid) as http:
            also_limited = http.get("/api/jobs")  # the address is limited, whatever it sends next
        with client(server.url) as http:
            assert http.get("/api/health").status_code == 200  # no token needed, none checked
    assert limited.status_code == 429 and also_limited.status_code == 429
    assert 55 <= int(limited.headers["retry-after"]) <= 60
    assert limited.json()["detail"].startswith("too many failed authentications from 127.0.0.1; try again in")
    log = "".join(server.output)
    assert "failed authentication 1 from 127.0.0.1 on /api/jobs: unknown token" in log
    assert "failed authentication 30 from 127.0.0.1" in log
    assert not any(guess in log for guess in guesses)  # what was offered is never written down


def test_failed_authentications_are_counted_in_bounded_memory() -> None:
    now = [0.0]
    failures = FailedAuthentications(allowed=2, window_s=60, max_addresses=3, clock=lambda: now[0])
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"):
        failures.record(address)
    assert failures.record("10.0.0.4") == 2 and failures.wait_s("10.0.0.4") == 60
    assert failures.wait_s("10.0.0.3") == 0  # one failure: not yet limited
    assert failures.record("10.0.0.1") == 1  # forgotten: only the 3 addresses seen last are kept
    now[0] = 60.0
    assert failures.wait_s("10.0.0.4") == 0 and failures.record("10.0.0.4") == 1  # a new window


# --- without tokens: Host and Origin --------------------------------------------------------------------
def test_without_tokens_only_loopback_hosts_and_this_servers_pages_are_answered(
    tokenless: Served, tmp_path: Path
) -> None:
    url = tokenless.server.url
    own_origin = url.rstrip("/")
    port = url.rsplit(":", 1)[1].strip("/")
    before = tokenless.count_jobs()
    with client(url) as http:
        rebound = http.post("/api/jobs", json=_job(tmp_path), headers={"Host": f"attacker.example:{port}"})
        assert rebound.status_code == 400
        assert rebound.json()["detail"].startswith("Host 'attacker.example:")
        assert http.get("/api/jobs", headers={"Host": f"127.evil.example:{port}"}).status_code == 400
        for origin in ("http://attacker.example", "null", f"http://localhost:{port}", "http://127.0.0.1:1"):
            cross = http.post("/api/jobs", json=_job(tmp_path), headers={"Origin": origin})
            assert cross.status_code == 403, origin
        assert tokenless.count_jobs() == before  # nothing refused was recorded
        same = http.post("/api/jobs", json=_job(tmp_path), headers={"Origin": own_origin})  # the dashboard
        assert same.status_code == 201
        assert http.post(f"/api/jobs/{same.json()['id']}/cancel", headers={"Origin": own_origin}).status_code == 200
        assert http.get("/api/health", headers={"Host": f"localhost:{port}"}).status_code == 200
        assert http.get("/api/health", headers={"Host": f"[::1]:{port}"}).status_code == 200


# --- what every answer says to a browser ----------------------------------------------------------------
def test_every_answer_carries_the_security_headers_and_no_third_party_script(guarded: Served) -> None:
    expected = {name.decode(): value.decode() for name, value in SECURITY_HEADERS}
    assert "frame-ancestors 'none'" in expected["content-security-policy"]
    with client(guarded.server.url) as http:
        answers = {
            "dashboard": http.get("/"),
            "script": http.get("/ui/app.js"),
            "health": http.get("/api/health"),
            "401": http.get("/api/jobs"),
            "404": http.get("/nowhere"),
            "413": http.post("/api/jobs", content=b"x" * (2 * 1024 * 1024)),
            "docs page": http.get("/api/docs"),
        }
        assert answers["401"].status_code == 401 and answers["413"].status_code == 413
        assert answers["docs page"].status_code == 404  # FastAPI's page loads its script from a CDN
        assert http.get("/api/openapi.json").json()["info"]["title"] == "clusterfit"
        for what, answer in answers.items():
            assert {name: answer.headers.get(name) for name in expected} == expected, what
    assert '<script src="/ui/app.js">' in answers["dashboard"].text and "//" not in answers["dashboard"].text


# --- TLS: where a token may travel in clear -------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "auth", "tls", "tls_elsewhere", "refused"),
    [
        ("127.0.0.1", True, False, False, None),
        ("::1", False, False, False, None),
        ("0.0.0.0", True, False, False, "--host 0.0.0.0 without TLS"),
        ("127.evil.example", True, False, False, "--host 127.evil.example without TLS"),
        ("0.0.0.0", True, True, False, None),
        ("0.0.0.0", True, False, True, None),
        ("10.0.0.5", False, True, False, "--no-auth with --host 10.0.0.5"),
    ],
)
def test_a_network_address_needs_tokens_and_tls(
    host: str, auth: bool, tls: bool, tls_elsewhere: bool, refused: str | None
) -> None:
    refusal = exposure_refusal(host, auth=auth, tls=tls, tls_elsewhere=tls_elsewhere)
    assert refusal is None if refused is None else refusal.startswith(refused)


def test_the_server_refuses_a_network_address_without_tls() -> None:
    refused = run_cli("server", "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "--host 0.0.0.0 without TLS: tokens would cross the network in clear" in refused.stderr
    with socket.socket() as taken:  # bound, never listening: nothing is reachable, the port is just taken
        taken.bind(("0.0.0.0", 0))
        elsewhere = run_cli("server", "--host", "0.0.0.0", "--port", str(taken.getsockname()[1]),
                            "--tls-terminated-elsewhere")  # fmt: skip
    assert elsewhere.returncode == 2 and "cannot listen on 0.0.0.0" in elsewhere.stderr  # past the check


@pytest.mark.parametrize(
    ("url", "token", "allowed", "refused"),
    [
        ("http://10.0.0.5:8080", "cf_x", False, True),
        ("http://127.evil.example:8080", "cf_x", False, True),
        ("http://server.example", "cf_x", False, True),
        ("http://10.0.0.5:8080", "cf_x", True, False),
        ("http://10.0.0.5:8080", None, False, False),
        ("https://10.0.0.5:8080", "cf_x", False, False),
        ("http://127.0.0.1:8080", "cf_x", False, False),
        ("http://[::1]:8080", "cf_x", False, False),
        ("http://localhost:8080", "cf_x", False, False),
    ],
)
def test_the_client_sends_a_token_over_plain_http_only_to_loopback(
    url: str, token: str | None, allowed: bool, refused: bool
) -> None:
    if refused:
        with pytest.raises(ServiceError, match=r"would send the token in clear; use https://, or set") as caught:
            ServiceClient(url, token, allow_plain_http=allowed)
        assert caught.value.exit_code == 2
    else:
        ServiceClient(url, token, allow_plain_http=allowed).close()


def test_the_cli_refuses_a_plain_http_server_elsewhere_before_connecting() -> None:
    refused = run_cli("list", "--server", "http://192.0.2.1:8080", "--token", "cf_x", timeout=30)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "plain http to 192.0.2.1 would send the token in clear" in refused.stderr


def test_tokens_made_before_owners_existed_own_what_they_submitted(tmp_path: Path) -> None:
    """Jobs of a store made before owners existed carry their token's name: after the upgrade, that token
    (and only tokens of that owner) still cancels them."""
    from alembic import command
    from sqlalchemy import text

    from clusterfit.service.migrate import alembic_config
    from clusterfit.service.store import make_engine

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = make_engine(url)
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        connection.execute(
            text("INSERT INTO api_tokens (name, token_hash, scopes, created_at) VALUES ('ci', 'h', 'submit', :now)"),
            {"now": "2026-11-01 00:00:00"},
        )
    assert [(token.name, token.owner) for token in open_store(url).list_tokens()] == [("ci", "ci")]
