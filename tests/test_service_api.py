"""The job service's HTTP API and the CLI's --server mode, against a real `clusterfit server` process, over
real HTTP, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import json
import re
import selectors
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import run_cli, shared_by_threads, tiny_job, write_job
from service_server import ServerProcess, client, expired_token, make_token

from clusterfit.service.auth import TokenError, Verdict, decide, hash_token, parse_ttl
from clusterfit.service.migrate import open_store
from clusterfit.service.states import IllegalTransition, JobState
from clusterfit.service.store import ApiToken


# --- pure rules ------------------------------------------------------------------------------------------
def _record(scopes: str, expires_in: float | None = 3600, revoked: bool = False) -> ApiToken:
    now = datetime.now(timezone.utc)
    return ApiToken(
        name="t",
        token_hash="x",
        scopes=scopes,
        created_at=now,
        expires_at=now + timedelta(seconds=expires_in) if expires_in is not None else None,
        revoked_at=now if revoked else None,
    )


@pytest.mark.parametrize(
    ("scopes", "expires_in", "revoked", "needed", "verdict"),
    [
        ("read", 3600, False, "read", Verdict.ALLOWED),
        ("read", 3600, False, "submit", Verdict.FORBIDDEN),
        ("submit", 3600, False, "read", Verdict.ALLOWED),
        ("submit", 3600, False, "admin", Verdict.FORBIDDEN),
        ("admin", None, False, "submit", Verdict.ALLOWED),
        ("admin", -1, False, "read", Verdict.UNAUTHENTICATED),
        ("admin", 3600, True, "read", Verdict.UNAUTHENTICATED),
        ("bogus", 3600, False, "read", Verdict.FORBIDDEN),
    ],
)
def test_token_decisions(scopes: str, expires_in: float | None, revoked: bool, needed: str, verdict: Verdict) -> None:
    assert decide(_record(scopes, expires_in, revoked), needed).verdict is verdict


def test_no_record_is_unauthenticated() -> None:
    assert decide(None, "read").verdict is Verdict.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("15m", 900), ("1h", 3600), ("7d", 604800), ("2w", 1209600)]
)
def test_ttl(text: str, seconds: int) -> None:
    assert parse_ttl(text) == timedelta(seconds=seconds)
    assert parse_ttl("never") is None


@pytest.mark.parametrize("text", ["0h", "1y", "h", "-1h", "1.5h"])
def test_bad_ttl(text: str) -> None:
    with pytest.raises(TokenError, match="is not a lifetime"):
        parse_ttl(text)


def test_a_ttl_no_date_can_hold_is_a_one_line_refusal_not_a_crash() -> None:
    with pytest.raises(TokenError, match=r"--ttl '99999999999w' is longer than 3650 days"):
        parse_ttl("99999999999w")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("127.evil.example", False), ("0.0.0.0", False), ("10.0.0.1", False), ("::", False)],
)  # fmt: skip
def test_loopback_is_decided_by_parsing_the_address(host: str, loopback: bool) -> None:
    from clusterfit.service.api import is_loopback

    assert is_loopback(host) is loopback


# --- the store on both databases --------------------------------------------------------------------------
def test_store_on_both_databases(database_url: str) -> None:
    store = open_store(database_url)
    open_store(database_url)  # migrating an up-to-date store is a no-op
    job = store.add_job(name="j", backend="local", ranks=2, outputs_dir="/tmp/x", spec_yaml="name: j\n")
    store.transition(job.id, JobState.STAGING, "start")
    with pytest.raises(IllegalTransition):
        store.transition(job.id, JobState.QUEUED, "back")
    store.request_cancel(job.id)
    assert store.get(job.id[:6]).cancel_requested_at is not None  # a unique prefix finds the job
    token = store.add_token("n", hash_token("secret"), ["read"], timedelta(hours=1))
    assert store.token_by_hash(hash_token("secret")).id == token.id
    assert store.revoke_token(token.id).revoked_at is not None
    assert [event.state for event in store.events(job.id)] == ["QUEUED", "STAGING"]
    assert store.count_jobs() == 1


# --- a server on both databases ---------------------------------------------------------------------------
@pytest.fixture
def paused_server(database_url: str):  # noqa: ANN201
    """A server that queues submissions but starts none, so many jobs cost nothing but records."""
    with ServerProcess("--paused") as server:
        yield server


def _spec_text(tmp_path: Path, **overrides: object) -> str:
    return yaml.safe_dump(tiny_job(tmp_path / "out", **overrides), sort_keys=False)


def _counts() -> tuple[int, int, int]:
    store = open_store()
    with store.session() as session:
        from sqlalchemy import func, select

        from clusterfit.service.store import JobEvent

        events = session.scalar(select(func.count()).select_from(JobEvent))
    return store.count_jobs(), len(store.list_tokens()), events


def test_auth_matrix(paused_server: ServerProcess, tmp_path: Path) -> None:
    url = paused_server.url
    read, submit, admin = make_token("read"), make_token("submit"), make_token("admin")
    revoked = make_token("admin", name="to-revoke")
    with client(url, admin) as http:
        revoked_id = next(t["id"] for t in http.get("/api/tokens").json() if t["name"] == "to-revoke")
        assert http.post(f"/api/tokens/{revoked_id}/revoke").status_code == 200
    expired = expired_token()
    body = {"spec": _spec_text(tmp_path), "overrides": []}
    with client(url, admin) as http:  # one job exists, to be refused cancelling it
        queued = http.post("/api/jobs", json=body).json()["id"]
    before = _counts()

    refused = {
        "no token": (None, 401),
        "garbage": ("cf_not-a-token", 401),
        "expired": (expired, 401),
        "revoked": (revoked, 401),
    }
    for what, (token, code) in refused.items():
        with client(url, token) as http:
            for method, path, json in [
                ("GET", "/api/jobs", None),
                ("GET", f"/api/jobs/{queued}", None),
                ("GET", f"/api/jobs/{queued}/logs", None),
                ("POST", "/api/jobs", body),
                ("POST", f"/api/jobs/{queued}/cancel", None),
                ("POST", "/api/tokens", {"scope": "admin"}),
            ]:
                response = http.request(method, path, json=json)
                assert response.status_code == code, (what, method, path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
    for token, method, path, json in [
        (read, "POST", "/api/jobs", body),
        (read, "POST", f"/api/jobs/{queued}/cancel", None),
        (read, "POST", "/api/tokens", {"scope": "admin"}),
        (submit, "POST", "/api/tokens", {"scope": "admin"}),
        (submit, "GET", "/api/tokens", None),
    ]:
        with client(url, token) as http:
            response = http.request(method, path, json=json)
            assert response.status_code == 403, (method, path, response.text)
            assert "this needs" in response.json()["detail"]
    assert _counts() == before  # nothing refused changed anything
    assert open_store().get(queued).state == "QUEUED"

    with client(url) as http:
        assert http.get("/api/health").json()["status"] == "ok"  # no token needed
    with client(url, read) as http:
        assert http.get(f"/api/jobs/{queued}").json()["state"] == "QUEUED"
    with client(url, submit) as http:  # submit includes read, and cancels its owner's jobs only
        own = http.post("/api/jobs", json=body).json()["id"]
        assert http.get("/api/jobs").status_code == 200
        assert http.post(f"/api/jobs/{queued}/cancel").status_code == 403
        assert http.post(f"/api/jobs/{own}/cancel").json()["state"] == "CANCELLED"
    with client(url, admin) as http:  # admin cancels any job
        assert http.post(f"/api/jobs/{queued}/cancel").json()["state"] == "CANCELLED"
        made = http.post("/api/tokens", json={"scope": "read", "ttl": "15m", "name": "made"}).json()
    assert made["token"].startswith("cf_") and open_store().token_by_hash(hash_token(made["token"])).name == "made"
    assert made["token"] not in {t.token_hash for t in open_store().list_tokens()}  # only its hash is stored
    assert _counts()[0] == before[0] + 1


def test_bad_spec_is_refused_with_one_line(paused_server: ServerProcess, tmp_path: Path) -> None:
    with client(paused_server.url, make_token("submit")) as http:
        before = _counts()
        response = http.post(
            "/api/jobs", json={"spec": _spec_text(tmp_path), "overrides": ["trainer.epochs=0"], "source": "job.yaml"}
        )
        assert response.status_code == 422
        assert response.json()["detail"] == "job.yaml: trainer.epochs = 0: Input should be greater than or equal to 1"
        missing = tiny_job(tmp_path / "out", data={"train": str(tmp_path / "nowhere")})
        response = http.post("/api/jobs", json={"spec": yaml.safe_dump(missing)})
        assert response.status_code == 422 and "nowhere" in response.json()["detail"]
        assert "\n" not in response.json()["detail"]
        assert http.get("/api/jobs/ffffffffff").status_code == 404
        assert http.get("/api/jobs", params={"state": "sleeping"}).status_code == 422
        assert _counts() == before


def test_200_concurrent_submissions_survive_a_restart(database_url: str, tmp_path: Path) -> None:
    token = make_token("submit")
    body = {"spec": _spec_text(tmp_path), "overrides": []}
    threads = 40
    with ServerProcess("--paused") as server, client(server.url, token, limits=shared_by_threads(threads)) as http:

        def submit(_: int) -> httpx.Response:
            return http.post("/api/jobs", json=body)

        with ThreadPoolExecutor(max_workers=threads) as pool:
            responses = list(pool.map(submit, range(200)))
        assert [r.status_code for r in responses] == [201] * 200
        ids = {r.json()["id"] for r in responses}
        assert len(ids) == 200
        cancelled = sorted(ids)[:5]
        for job_id in cancelled:
            assert http.post(f"/api/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    assert server.process.returncode == 0 and "clusterfit server stopped" in "".join(server.output)  # SIGTERM
    assert open_store().count_jobs() == 200

    with ServerProcess("--paused") as server, client(server.url, token) as http:
        rows = http.get("/api/jobs", params={"limit": 1000}).json()
    assert {row["id"] for row in rows} == ids
    states = {row["id"]: row["state"] for row in rows}
    assert {states[job_id] for job_id in cancelled} == {"CANCELLED"}
    assert {state for job_id, state in states.items() if job_id not in cancelled} == {"QUEUED"}


# --- the CLI as a client ----------------------------------------------------------------------------------
_AGE = re.compile(r"\b\d+ (s|min|h|d)\b")


def _same_output(local: str, remote: str) -> None:
    """Equal but for ages, which tick between the two calls (and may widen a table column by one space)."""

    def normal(text: str) -> list[str]:
        return [" ".join(_AGE.sub("AGE", line).split()) for line in text.splitlines()]

    assert normal(local) == normal(remote)


def test_cli_prints_the_same_through_a_server(paused_server: ServerProcess, tmp_path: Path) -> None:
    token = make_token("submit")
    remote = ["--server", paused_server.url, "--token", token]
    job_file = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out"))
    submitted = run_cli("submit", str(job_file), "--set", "trainer.epochs=2", *remote)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert open_store().get(job_id).state == "QUEUED"
    assert yaml.safe_load(open_store().get(job_id).spec_yaml)["trainer"]["epochs"] == 2

    # Logs as a job's ranks would have left them (with a last line still without its newline).
    logs = tmp_path / "out" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank-0.log").write_text("step 1\n\nstep 2\n")
    (logs / "rank-1.log").write_text("hello from 1\nunfinished")
    (logs / "agent.log").write_text("agent started\n")
    cancelled = run_cli("cancel", job_id, *remote)
    assert cancelled.stdout.strip() == f"job {job_id} CANCELLED"

    for command in (["list"], ["list", "--state", "cancelled"], ["status", job_id], ["show", job_id], ["logs", job_id]):
        here, there = run_cli(*command), run_cli(*command, *remote)
        assert here.returncode == there.returncode == 0, (command, here.stderr, there.stderr)
        _same_output(here.stdout, there.stdout)
    for command in (["list"], ["status", job_id], ["show", job_id]):  # --json: the API's own fields, for scripts
        here, there = run_cli(*command, "--json"), run_cli(*command, "--json", *remote)
        assert json.loads(here.stdout) == json.loads(there.stdout), command
    [listed] = json.loads(run_cli("list", "--json").stdout)
    assert (listed["id"], listed["name"], listed["state"]) == (job_id, "tiny", "CANCELLED")
    assert json.loads(run_cli("status", job_id, "--json").stdout)["cause"] == "CANCELLED"
    shown = run_cli("logs", job_id, *remote).stdout.splitlines()
    assert shown == [
        "[torchrun] agent started",
        "[rank0] step 1",
        "[rank0] ",
        "[rank0] step 2",
        "[rank1] hello from 1",
        "[rank1] unfinished",
    ]
    assert run_cli("logs", job_id, "--rank", "1", *remote).stdout.splitlines() == shown[-2:]


def _line(process: subprocess.Popen[str], timeout: float = 60) -> str:
    """The next line a process prints; fails instead of hanging when none comes."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout), f"no output within {timeout} s"
    return process.stdout.readline()


def test_logs_follow_through_a_server(paused_server: ServerProcess, tmp_path: Path) -> None:
    token = make_token("submit")
    with client(paused_server.url, token) as http:
        job_id = http.post("/api/jobs", json={"spec": _spec_text(tmp_path)}).json()["id"]
        logs = tmp_path / "out" / "logs"
        logs.mkdir(parents=True)
        rank0 = logs / "rank-0.log"
        rank0.write_text("first\n")
        follower = subprocess.Popen(
            [sys.executable, "-m", "clusterfit", "logs", job_id, "-f", "--server", paused_server.url, "--token", token],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert _line(follower) == "[rank0] first\n"  # printed while the job is still queued
            with rank0.open("a") as f:
                f.write("second, written in two")
                f.flush()
                time.sleep(1.5)  # the follower polls meanwhile and must not print half a line
                f.write(" parts\nlast without newline")
            assert _line(follower) == "[rank0] second, written in two parts\n"
            http.post(f"/api/jobs/{job_id}/cancel")
            out, err = follower.communicate(timeout=60)  # the job ended: the follower prints the rest and exits
        finally:
            follower.kill()
    assert follower.returncode == 0, err
    assert out == "[rank0] last without newline\n"


def test_cli_errors_are_one_line(paused_server: ServerProcess, tmp_path: Path) -> None:
    job_file = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out"))
    cases = [
        (["list", "--server", paused_server.url], 2, "server refused (401)"),
        (["list", "--server", paused_server.url, "--token", "cf_wrong"], 2, "unknown token"),
        (["submit", str(job_file), "--server", paused_server.url, "--token", make_token("read")], 2, "(403)"),
        (["status", "ffffff", "--server", paused_server.url, "--token", make_token("read")], 2, "no job 'ffffff'"),
        (["list", "--server", "http://127.0.0.1:9"], 1, "cannot reach the clusterfit server"),
    ]
    for args, code, words in cases:
        result = run_cli(*args)
        assert result.returncode == code, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr, result.stderr
    assert open_store().count_jobs() == 0


def test_token_commands() -> None:
    # A name with brackets, shown as it is: never taken for rich markup.
    created = run_cli("token", "create", "--scope", "submit", "--ttl", "2h", "--name", "ci[bold]")
    assert created.returncode == 0, created.stderr
    assert "(ci[bold] of " in created.stderr
    secret = created.stdout.strip()
    record = open_store().token_by_hash(hash_token(secret))
    assert record.name == "ci[bold]" and record.scopes == "submit"
    assert timedelta(minutes=119) < record.expires_at - record.created_at <= timedelta(hours=2)
    listed = run_cli("token", "list").stdout.splitlines()[1].split()
    assert (listed[1], listed[3], listed[-1]) == ("ci[bold]", "submit", "valid"), listed
    assert run_cli("token", "revoke", str(record.id)).returncode == 0
    assert "revoked" in run_cli("token", "list").stdout
    for args, words in [
        (["--scope", "root"], "scope 'root' is unknown; use one of: read, submit, admin"),
        (["--ttl", "5 years"], "--ttl '5 years' is not a lifetime"),
    ]:
        result = run_cli("token", "create", *args)
        assert result.returncode == 2 and words in result.stderr and len(result.stderr.splitlines()) == 1


def test_server_refuses_unsafe_or_broken_settings(tmp_path: Path) -> None:
    open_to_all = run_cli("server", "--host", "0.0.0.0", "--no-auth", "--port", "0")
    assert open_to_all.returncode == 2 and "--no-auth with --host 0.0.0.0" in open_to_all.stderr
    half_tls = run_cli("server", "--tls-cert", str(tmp_path / "cert.pem"), "--port", "0")
    assert half_tls.returncode == 2 and "go together" in half_tls.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("server", "--port", str(taken.getsockname()[1]))
    assert busy.returncode == 2 and "cannot listen on 127.0.0.1" in busy.stderr


def _self_signed(folder: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    token = make_token("read")
    with ServerProcess("--paused", "--tls-cert", str(cert), "--tls-key", str(key)) as server:
        assert server.url.startswith("https://127.0.0.1:")
        with client(server.url, token, verify=ssl.create_default_context(cafile=str(cert))) as http:
            assert http.get("/api/jobs").json() == []
        with client(server.url, token) as http, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            http.get("/api/jobs")  # a client that does not trust the certificate gets nothing
        untrusted = run_cli("list", "--server", server.url, "--token", token)
        assert untrusted.returncode == 1 and "certificate verify failed" in untrusted.stderr.lower()
        monkeypatch.setenv("CLUSTERFIT_CA_CERT", str(cert))
        trusted = run_cli("list", "--server", server.url, "--token", token)
        assert trusted.returncode == 0 and "state" in trusted.stdout
        with client(server.url.replace("https://", "http://")) as http, pytest.raises(httpx.HTTPError):
            http.get("/api/health")  # no plain HTTP on a TLS port


def test_hostile_requests_are_bounded_before_anything_reads_them(paused_server: ServerProcess, tmp_path: Path) -> None:
    """A body over the limit is refused before authentication (no token needed to be refused, none to get
    through); a YAML alias bomb, a deep nesting and LIKE wildcards in a job id are refused in one short line;
    the server stays quick and nothing is recorded."""
    import time

    url, before = paused_server.url, _counts()
    with client(url) as anonymous:
        big = anonymous.post(
            "/api/jobs", content=b"x" * (5 * 1024 * 1024), headers={"Content-Type": "application/json"}
        )
        assert big.status_code == 413 and "request body over 1048576 bytes" in big.json()["detail"]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b" " * 65536

        chunked = anonymous.post("/api/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
    submit = make_token("submit")
    with client(url, submit) as http:
        deep = http.post(
            "/api/jobs", content=b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"}
        )
        assert deep.status_code == 400  # json.loads runs out of stack: a bad body, never a 500
        levels = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" for i in range(1, 8))
        started = time.monotonic()
        bomb = http.post("/api/jobs", json={"spec": "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + levels})
        assert bomb.status_code == 422 and time.monotonic() - started < 5
        assert bomb.json()["detail"] == (
            "job.yaml: more than 20000 values once its aliases are expanded; a job spec is a few hundred values, "
            "write it out plainly"
        )
        nested = http.post("/api/jobs", json={"spec": "name: " + "[" * 20_000 + "]" * 20_000})
        assert nested.status_code == 422 and "nested more than 32 levels deep" in nested.json()["detail"]
        queued = http.post("/api/jobs", json={"spec": _spec_text(tmp_path)})
        assert queued.status_code == 201
        assert http.post("/api/jobs/%25%25%25%25/cancel").status_code == 404  # `%` is a character, not a wildcard
        assert http.get(f"/api/jobs/{queued.json()['id']}").json()["state"] == "QUEUED"
        started = time.monotonic()
        assert http.get("/api/health").status_code == 200 and time.monotonic() - started < 1
    assert _counts()[0] == before[0] + 1  # only the well-formed job
