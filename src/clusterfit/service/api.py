"""The job service over HTTP: a FastAPI app over one JobStore, with token auth, and the web dashboard.

Every job endpoint is one call of `LocalJobs`, the same object the CLI uses without `--server`, so nothing is
decided twice and the CLI prints the same thing from a server as from the local store; its refusals become
HTTP errors in one exception handler. Handlers are plain `def`s: FastAPI runs them in its thread pool, where
blocking database calls belong.
`clusterfit server` serves the app with uvicorn; `serve` below is that, with a background thread that keeps
the store true (`reconcile`) and starts queued jobs when room frees (`schedule`)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from clusterfit import __version__
from clusterfit.service.auth import SCOPES, TokenError, Verdict, authorize, issue_token, parse_ttl
from clusterfit.service.jobs import Refused, ServiceError, parse_state
from clusterfit.service.local_jobs import LocalJobs
from clusterfit.service.scheduler import reconcile, schedule
from clusterfit.service.store import ApiToken, JobStore

log = logging.getLogger("clusterfit.server")
DASHBOARD = files("clusterfit.service") / "dashboard"


DEFAULT_MAX_BODY_BYTES = 1024 * 1024  # a job spec is a few kB


@dataclass(frozen=True)
class ServerSettings:
    auth: bool = True  # off only for a server bound to loopback (`clusterfit server --no-auth`)
    paused: bool = False  # accept and queue submissions, start none (maintenance, load tests)
    maintenance_every_s: float = 3.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413 before routing, authentication or parsing: a declared
    Content-Length is checked from the headers alone, and a chunked body is counted as it arrives and cut off
    at the limit (the app then sees the client gone), so no more than the limit is ever read. Pure ASGI, so
    nothing buffers the body before it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

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
        detail = f"request body over {self.max_bytes} bytes; a job spec is a few kB (server --max-body-bytes)"
        await JSONResponse({"detail": detail}, status_code=413)({"type": "http"}, _no_body, send)


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


class SubmitRequest(BaseModel):
    spec: str = Field(description="the job's YAML text")
    overrides: list[str] = Field(default_factory=list, description="like --set: trainer.epochs=2")
    source: str = Field("job.yaml", max_length=200, description="the file name, for error messages")


class TokenRequest(BaseModel):
    scope: str
    ttl: str | None = Field("1h", description="90s, 15m, 1h, 7d, 2w or never")
    name: str = Field("", max_length=64)


def _needs(scope: str) -> Callable[..., ApiToken | None]:
    def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> ApiToken | None:
        if not request.app.state.settings.auth:
            return None
        scheme, _, bearer = (authorization or "").partition(" ")
        decision = authorize(request.app.state.store, bearer.strip() if scheme.lower() == "bearer" else None, scope)
        if decision.verdict is Verdict.UNAUTHENTICATED:
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
    app = FastAPI(title="clusterfit", version=__version__, docs_url="/api/docs", openapi_url="/api/openapi.json")
    app.state.store, app.state.settings = store, settings
    jobs = LocalJobs(store, start_jobs=not settings.paused)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(ServiceError)
    async def service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        # A refusal names its status; anything else the service could not do now may work later.
        return JSONResponse({"detail": str(exc)}, status_code=exc.status if isinstance(exc, Refused) else 503)

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "auth": settings.auth, "paused": settings.paused}

    @app.post("/api/jobs", status_code=201)
    def submit(request: SubmitRequest, token: Submitter) -> dict[str, Any]:
        return jobs.submit_text(request.spec, request.overrides, request.source, owner=token.name if token else "")

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

    @app.get("/api/jobs/{job_id}/logs")
    def logs(
        job_id: str,
        _: Reader,
        rank: Annotated[int | None, Query(ge=0)] = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        return jobs.logs(job_id, cursor, rank)

    @app.post("/api/jobs/{job_id}/cancel")
    def cancel(job_id: str, _: Submitter) -> dict[str, Any]:
        return jobs.cancel(job_id)

    @app.post("/api/tokens", status_code=201)
    def create_token(request: TokenRequest, _: Admin) -> dict[str, Any]:
        try:
            issued = issue_token(store, request.scope, parse_ttl(request.ttl), request.name)
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
        return _token_row(token) if token else {"name": "", "scopes": ",".join(SCOPES), "auth": False}

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(str(DASHBOARD / "index.html"))

    app.mount("/ui", StaticFiles(directory=str(DASHBOARD)), name="ui")
    return app


def _token_row(token: ApiToken) -> dict[str, Any]:
    return {
        "id": token.id,
        "name": token.name,
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


def is_loopback(host: str) -> bool:
    """Parsed, not matched as text: `127.evil.example` is a name anyone can point anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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

    config = uvicorn.Config(
        create_app(store, settings),
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    # NOTE: uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the handlers it
    # found; these make that second delivery a no-op, so the maintenance thread is stopped too and we exit 0.
    stopped_by: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stopped_by.append(number))
    with Maintenance(store, settings.maintenance_every_s, start_jobs=not settings.paused).running():
        announce(f"clusterfit server listening on {scheme}://{shown}:{port} (dashboard: {scheme}://{shown}:{port}/)")
        server.run(sockets=[sock])
    announce("clusterfit server stopped")
