"""The job service over HTTP: a FastAPI app over one JobStore, with token auth, and the web dashboard.

Every job endpoint is one call of `LocalJobs`, the same object the CLI uses without `--server`, so nothing is
decided twice and the CLI prints the same thing from a server as from the local store; its refusals become
HTTP errors in one exception handler. Handlers are plain `def`s: FastAPI runs them in its thread pool, where
blocking database calls belong.
`clusterfit server` serves the app with uvicorn; `serve` below is that, with a background thread that keeps
the store true (`reconcile`) and starts queued jobs when room frees (`schedule`).

Hostile requests meet pure-ASGI layers before any route (outermost first): security headers on every answer,
the body size limit, and, without tokens, the Host and Origin checks; failed authentications are counted per
client address and answered 429 past a limit (docs/security.md)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from clusterfit import __version__
from clusterfit.service.addresses import is_loopback, url_host
from clusterfit.service.auth import (
    SCOPES,
    TokenError,
    Verdict,
    acts_for,
    acts_for_everyone,
    authorize,
    issue_token,
    parse_ttl,
)
from clusterfit.service.jobs import Refused, ServiceError, parse_state
from clusterfit.service.local_jobs import LocalJobs, SubmissionChecks
from clusterfit.service.records import forget_secrets_of_ended_jobs
from clusterfit.service.scheduler import reconcile, schedule
from clusterfit.service.store import ApiToken, JobStore
from clusterfit.storage.filesystems import drop_store_credentials

if TYPE_CHECKING:
    import uvicorn  # imported where a server runs: the CLI's other commands need not load it

log = logging.getLogger("clusterfit.server")
DASHBOARD = files("clusterfit.service") / "dashboard"


DEFAULT_MAX_BODY_BYTES = 1024 * 1024  # a job spec is a few kB


@dataclass(frozen=True)
class ServerSettings:
    auth: bool = True  # off only for a server bound to loopback (`clusterfit server --no-auth`)
    paused: bool = False  # accept and queue submissions, start none (maintenance, load tests)
    maintenance_every_s: float = 3.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Failed authentications one client address may make per window before it is answered 429 until the
    # window ends: a token has 256 random bits, so this bounds the noise and the database reads, not the odds.
    auth_failures_allowed: int = 30
    auth_failure_window_s: float = 60.0
    # A proxy in front serves HTTPS (`--tls-terminated-elsewhere`): only then is the client address it forwards
    # (X-Forwarded-For) believed; otherwise any local process could name another address to each request.
    behind_proxy: bool = False
    # A command job runs any program the submitter writes, as the job user, on this machine: a submit token
    # may ask for one only when the operator says so (`--allow-command-jobs`); admin tokens always may.
    allow_command_jobs: bool = False
    # Longest a submitted job's data check may take (its helper is then killed and the answer is 503).
    check_timeout_s: float = 30.0
    # Jobs one owner may have waiting in the queue: each is a database row holding its spec (up to the body limit).
    max_queued_per_owner: int = 1000


def exposure_refusal(host: str, *, auth: bool, tls: bool, tls_elsewhere: bool) -> str | None:
    """Why serving on `host` with these settings would expose tokens or the service, or None if it is safe:
    off loopback, requests must need a token, and tokens must travel encrypted, by this server's TLS or by a
    proxy in front of it that the operator names (`--tls-terminated-elsewhere`)."""
    if is_loopback(host):
        return None
    if not auth:
        return f"--no-auth with --host {host}: anyone on the network could run jobs; use a token, or --host 127.0.0.1"
    if not tls and not tls_elsewhere:
        return (
            f"--host {host} without TLS: tokens would cross the network in clear; give --tls-cert and --tls-key, "
            "or --tls-terminated-elsewhere if a proxy in front of this server serves HTTPS"
        )
    return None


# Every answer says what a browser may do with it: load scripts, styles and data from this server only (the
# dashboard has no inline script and no third-party asset, so a script injected elsewhere cannot run or reach
# the token in localStorage), never be framed (no clickjacking of the cancel button), never guess a content
# type, never pass this server's addresses on as a referrer.
SECURITY_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response, refusals of the layers inside it included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


class LoopbackOnly:
    """Without tokens, answers only requests addressed to a loopback name from a page of this same server.
    Nothing else stops a web page elsewhere: it can post to http://127.0.0.1:PORT from the user's browser (its
    Origin header names it), or point its own name at 127.0.0.1 (DNS rebinding: then the Host header names it)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if not is_loopback(url_host(host)):
            detail = f"Host {host[:100]!r} is not a loopback name; with --no-auth use http://127.0.0.1 or localhost"
            await _answer(send, 400, detail)
        elif origin is not None and urlsplit(origin.decode("latin-1")).netloc.lower() != host.lower():
            shown = origin.decode("latin-1")[:100]
            await _answer(send, 403, f"Origin {shown!r} is not this server; with --no-auth only its own pages call it")
        else:
            await self.app(scope, receive, send)


class FailedAuthentications:
    """Failed authentications per client address within a window, for the `auth_failures_allowed` limit.
    Memory is bounded: past `max_addresses` the address seen longest ago is forgotten."""

    def __init__(
        self, allowed: int, window_s: float, max_addresses: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.allowed, self.window_s, self.max_addresses, self.clock = allowed, window_s, max_addresses, clock
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (window start, failures)
        self._lock = threading.Lock()

    def wait_s(self, address: str) -> float:
        """How long `address` must wait before it may authenticate again; 0 if it may now."""
        with self._lock:
            started, failures = self._windows.get(address, (0.0, 0))
            left = started + self.window_s - self.clock()
            return left if failures >= self.allowed and left > 0 else 0.0

    def record(self, address: str) -> int:
        """Counts one failure of `address`; returns its failures in the current window."""
        now = self.clock()
        with self._lock:
            started, failures = self._windows.pop(address, (now, 0))
            if now - started >= self.window_s:
                started, failures = now, 0
            self._windows[address] = (started, failures + 1)
            while len(self._windows) > self.max_addresses:
                self._windows.popitem(last=False)
            return failures + 1


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413 before routing, authentication or parsing: a declared
    Content-Length is checked from the headers alone, and a chunked body is counted as it arrives and cut off
    at the limit (the app then sees the client gone), so no more than the limit is ever read. Pure ASGI, so
    nothing buffers the body before it."""

    def __init__(
        self, app: Any, max_bytes: int, hint: str = "a job spec is a few kB (server --max-body-bytes)"
    ) -> None:
        self.app, self.max_bytes, self.hint = app, max_bytes, hint

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        received, started, refused = 0, False, False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes and not started:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 has been sent; what the app answers to the cut-off body is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, watched_send)

    async def _refuse(self, send: Callable) -> None:
        detail = f"request body over {self.max_bytes} bytes; {self.hint}"
        await _answer(send, 413, detail)


async def _answer(send: Callable, status: int, detail: str) -> None:
    """A refusal from a layer before routing, shaped like every other refusal of the API."""
    await JSONResponse({"detail": detail}, status_code=status)({"type": "http"}, _no_body, send)


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


class SubmitRequest(BaseModel):
    spec: str = Field(description="the job's YAML text")
    overrides: list[str] = Field(default_factory=list, description="like --set: trainer.epochs=2")
    source: str = Field("job.yaml", max_length=200, description="the file name, for error messages")


class TokenRequest(BaseModel):
    scope: str
    ttl: str | None = Field("1h", max_length=32, description="90s, 15m, 1h, 7d, 2w or never")
    name: str = Field("", max_length=64)
    owner: str = Field("", max_length=64, description="who its jobs belong to; default: the name")


def _needs(scope: str) -> Callable[..., ApiToken | None]:
    def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> ApiToken | None:
        if not request.app.state.settings.auth:
            return None
        address = request.client.host if request.client else "unknown"
        failures: FailedAuthentications = request.app.state.failed_authentications
        wait_s = math.ceil(failures.wait_s(address))
        if wait_s:
            detail = f"too many failed authentications from {address}; try again in {wait_s} s"
            raise HTTPException(429, detail, headers={"Retry-After": str(wait_s)})
        scheme, _, bearer = (authorization or "").partition(" ")
        offered = bearer.strip() if scheme.lower() == "bearer" else None
        decision = authorize(request.app.state.store, offered, scope)
        if decision.verdict is Verdict.UNAUTHENTICATED:
            if offered:  # a request without a token guesses nothing: only offered tokens count and are logged
                count = failures.record(address)
                log.warning(
                    "failed authentication %d from %s on %s: %s", count, address, request.url.path, decision.reason
                )
            raise HTTPException(401, decision.reason, headers={"WWW-Authenticate": "Bearer"})
        if decision.verdict is Verdict.FORBIDDEN:
            raise HTTPException(403, decision.reason)
        return decision.token

    return check


# Who may call an endpoint: read for looking, submit for submitting and cancelling, admin for tokens.
Reader = Annotated[ApiToken | None, Depends(_needs("read"))]
Submitter = Annotated[ApiToken | None, Depends(_needs("submit"))]
Admin = Annotated[ApiToken | None, Depends(_needs("admin"))]


def create_app(store: JobStore, settings: ServerSettings = ServerSettings()) -> FastAPI:
    # NOTE: no interactive docs page: FastAPI's loads its script from a CDN into the dashboard's origin, where
    # it could read the token in localStorage. The schema itself is served, for any OpenAPI viewer.
    app = FastAPI(
        title="clusterfit", version=__version__, docs_url=None, redoc_url=None, openapi_url="/api/openapi.json"
    )
    app.state.store, app.state.settings = store, settings
    app.state.failed_authentications = FailedAuthentications(
        settings.auth_failures_allowed, settings.auth_failure_window_s
    )
    jobs = LocalJobs(
        store,
        start_jobs=not settings.paused,
        checks=SubmissionChecks(settings.check_timeout_s),
        max_queued_per_owner=settings.max_queued_per_owner,
    )

    # The last added runs first: headers on every answer, then the body limit, then (without tokens) Host/Origin.
    if not settings.auth:
        app.add_middleware(LoopbackOnly)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(SecurityHeaders)

    @app.exception_handler(ServiceError)
    async def service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        # A refusal names its status; anything else the service could not do now may work later.
        return JSONResponse({"detail": str(exc)}, status_code=exc.status if isinstance(exc, Refused) else 503)

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "auth": settings.auth, "paused": settings.paused}

    @app.post("/api/jobs", status_code=201)
    def submit(request: SubmitRequest, token: Submitter) -> dict[str, Any]:
        commands = token is None or settings.allow_command_jobs or acts_for_everyone(token)
        return jobs.submit_text(
            request.spec, request.overrides, request.source, owner=token.owner if token else "", commands=commands
        )

    @app.get("/api/jobs")
    def list_jobs(
        _: Reader,
        state: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 200,
    ) -> list[dict[str, Any]]:
        return jobs.list_jobs(parse_state(state or None, "state"), limit)

    @app.get("/api/jobs/{job_id}")
    def status(job_id: str, _: Reader) -> dict[str, Any]:
        return jobs.status(job_id)

    @app.get("/api/jobs/{job_id}/details")
    def details(job_id: str, _: Reader) -> dict[str, Any]:
        return jobs.details(job_id)

    @app.get("/api/jobs/{job_id}/metrics")
    def metrics(job_id: str, _: Reader) -> list[dict[str, Any]]:
        return jobs.metrics(job_id)

    @app.get("/api/sweeps")
    def list_sweeps(_: Reader) -> list[dict[str, Any]]:
        from clusterfit.sweep.driver import sweep_list  # Optuna only when a sweep is asked for

        return sweep_list()

    @app.get("/api/sweeps/{name}")
    def sweep(name: str, _: Reader) -> dict[str, Any]:
        from clusterfit.sweep.driver import sweep_view

        return sweep_view(name, jobs)

    @app.get("/api/jobs/{job_id}/logs")
    def logs(
        job_id: str,
        _: Reader,
        rank: Annotated[int | None, Query(ge=0)] = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        return jobs.logs(job_id, cursor, rank)

    @app.post("/api/jobs/{job_id}/cancel")
    def cancel(job_id: str, token: Submitter) -> dict[str, Any]:
        if token is not None:
            job = jobs.status(job_id)
            if not acts_for(token, job["owner"]):
                raise HTTPException(
                    403,
                    f"job {job['id']} belongs to {job['owner']!r}; token {token.name!r} of {token.owner!r} cancels "
                    "only its owner's jobs (an admin token cancels any)",
                )
        return jobs.cancel(job_id)

    @app.post("/api/tokens", status_code=201)
    def create_token(request: TokenRequest, _: Admin) -> dict[str, Any]:
        try:
            issued = issue_token(store, request.scope, parse_ttl(request.ttl), request.name, request.owner)
        except TokenError as exc:
            raise HTTPException(422, str(exc)) from None
        return {**_token_row(store.token_by_id(issued.id)), "token": issued.secret}

    @app.get("/api/tokens")
    def list_tokens(_: Admin) -> list[dict[str, Any]]:
        return [_token_row(token) for token in store.list_tokens()]

    @app.post("/api/tokens/{token_id}/revoke")
    def revoke_token(token_id: int, _: Admin) -> dict[str, Any]:
        token = store.revoke_token(token_id)
        if token is None:
            raise HTTPException(404, f"no token {token_id}")
        return _token_row(token)

    @app.get("/api/whoami")
    def whoami(token: Reader) -> dict[str, Any]:
        return _token_row(token) if token else {"name": "", "owner": "", "scopes": ",".join(SCOPES), "auth": False}

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(str(DASHBOARD / "index.html"))

    app.mount("/ui", StaticFiles(directory=str(DASHBOARD)), name="ui")
    return app


def _token_row(token: ApiToken) -> dict[str, Any]:
    return {
        "id": token.id,
        "name": token.name,
        "owner": token.owner,
        "scopes": token.scopes,
        "created_at": token.created_at.isoformat(),
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
        "revoked_at": token.revoked_at.isoformat() if token.revoked_at else None,
    }


class Maintenance:
    """Every few seconds: settle jobs whose supervisors died, start queued jobs when room frees."""

    def __init__(self, store: JobStore, every_s: float, start_jobs: bool) -> None:
        self.store, self.every_s, self.start_jobs = store, every_s, start_jobs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="clusterfit-maintenance", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if self.start_jobs:
                    schedule(self.store)
                else:
                    reconcile(self.store)
            except Exception:  # noqa: BLE001 - a database hiccup must not end the loop; the next round retries
                log.exception("maintenance round failed")

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join(timeout=30)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the server can say which port it got."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def stop_gracefully_on_signals(server: uvicorn.Server) -> None:
    """SIGTERM and SIGINT make `server` drain (uvicorn's graceful shutdown) and return, so the caller's own
    cleanup runs and the process exits 0; call it before announcing the address."""

    # NOTE: uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the handlers it
    # found; these make that second delivery a no-op instead of killing the process. A signal that comes before
    # uvicorn has put in its own handlers (just after "listening") lands here: it asks uvicorn to stop as soon
    # as it runs, instead of being lost.
    def stop_soon(_number: int, _frame: object) -> None:
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_soon)


def serve(
    store: JobStore,
    sock: socket.socket,
    settings: ServerSettings,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    import uvicorn

    os.umask(0o077)  # the database, secrets and logs it writes are for its user only
    forget_secrets_of_ended_jobs(store)  # those a crashed server or supervisor left behind
    dropped = drop_store_credentials(os.environ)  # for this process and the supervisors it starts
    if dropped:
        announce(
            f"not used: the store credentials in this environment ({', '.join(dropped)}); each job reaches its "
            "store with its own (its spec's storage: and environment_variables:)"
        )
    config = uvicorn.Config(
        create_app(store, settings),
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        log_level="warning",
        proxy_headers=settings.behind_proxy,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    stop_gracefully_on_signals(server)  # so the maintenance thread is stopped too
    with Maintenance(store, settings.maintenance_every_s, start_jobs=not settings.paused).running():
        announce(f"clusterfit server listening on {scheme}://{shown}:{port} (dashboard: {scheme}://{shown}:{port}/)")
        server.run(sockets=[sock])
    announce("clusterfit server stopped")
