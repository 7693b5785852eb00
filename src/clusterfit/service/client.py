"""The job service of a clusterfit server, over HTTP: the same `JobService` interface and dicts as the local
store gives, for the CLI's `--server`.

Every failure is a `ServiceError` with one line to show and the exit code to leave with: 1 when the server
cannot be reached or failed (try again later), 2 when it refused the request (`Refused`: fix the token or
the input)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from clusterfit.service.addresses import is_loopback
from clusterfit.service.jobs import Refused, ServiceError
from clusterfit.service.states import JobState

CA_CERT_ENV = "CLUSTERFIT_CA_CERT"  # a PEM file to trust, for a server with a self-signed certificate
PLAIN_HTTP_ENV = "CLUSTERFIT_ALLOW_PLAIN_HTTP"  # 1: send the token over http:// to another host anyway


def plain_http_refusal(url: str, allowed: bool) -> str | None:
    """Why a token must not be sent to `url`, or None: over plain HTTP anyone on the path reads it, so only
    to this machine (a loopback address, parsed) unless the user says the network is trusted."""
    parts = urlsplit(url)
    if parts.scheme != "http" or allowed or is_loopback(parts.hostname):
        return None
    return (
        f"--server {url}: plain http to {parts.hostname} would send the token in clear; use https://, "
        f"or set {PLAIN_HTTP_ENV}=1 if the network between you and the server is trusted"
    )


class ServiceClient:
    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        ca_cert: str | None = None,
        timeout: float = 60.0,
        allow_plain_http: bool | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if allow_plain_http is None:
            allow_plain_http = os.environ.get(PLAIN_HTTP_ENV, "") == "1"
        refusal = plain_http_refusal(self.url, allow_plain_http) if token else None
        if refusal:
            raise ServiceError(refusal, 2)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ca_cert = ca_cert or os.environ.get(CA_CERT_ENV)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceError(
                f"cannot reach the clusterfit server at {self.url}: {exc or type(exc).__name__}", 1
            ) from None
        if response.status_code >= 500:
            raise ServiceError(_refusal(response), 1)
        if response.status_code >= 400:
            raise Refused(_refusal(response), response.status_code)
        return response.json()

    # --- jobs -------------------------------------------------------------------------------------------
    def submit(self, spec_file: Path, overrides: list[str] | None = None) -> dict[str, Any]:
        try:
            text = spec_file.read_text()
        except OSError as exc:
            raise ServiceError(f"{spec_file}: cannot read the job file ({exc.strerror})", 2) from None
        body = {"spec": text, "overrides": overrides or [], "source": str(spec_file)}
        return self._call("POST", "/api/jobs", json=body)

    def list_jobs(self, state: JobState | None = None, limit: int = 200) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state is not None:
            params["state"] = state.value
        return self._call("GET", "/api/jobs", params=params)

    def status(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/jobs/{job_id}")

    def details(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/jobs/{job_id}/details")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/api/jobs/{job_id}/metrics")

    def logs(self, job_id: str, cursor: str | None = None, rank: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if cursor:
            params["cursor"] = cursor
        if rank is not None:
            params["rank"] = rank
        return self._call("GET", f"/api/jobs/{job_id}/logs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/api/jobs/{job_id}/cancel")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/api/health")


def _refusal(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    if isinstance(detail, list):  # request-shape errors from FastAPI: say where, briefly
        detail = "; ".join(f"{'.'.join(map(str, err.get('loc', [])))}: {err.get('msg')}" for err in detail)
    detail = detail or response.reason_phrase
    hint = {401: " (set CLUSTERFIT_TOKEN or --token)", 403: " (ask for a token with that scope)"}
    return f"server refused ({response.status_code}): {detail}{hint.get(response.status_code, '')}"
