"""Azure's Get Blob as plain HTTP GETs, for staging many small files.

Each request through azure-storage-blob's pipeline (its policies, its response objects) cost the client 0.69 ms of
CPU per file of 110 KB, against 0.16 ms for the same GET through aiohttp alone (benchmarks/RESULTS.md): on two
cores beside the store, that CPU, not the store, capped staging. azcopy likewise sends its own GETs, authorized by
a SAS. Here the SDK still does what needs it: the listing, and the SAS itself, made with the account's key by
`generate_container_sas` (read only, one container, held in memory only). Requests the SDK must sign itself (an
Entra ID token) and stores behind a proxy keep the SDK's path (`plain_blob_reader` returns None).

What azure-core retries is retried here too (connection errors, timeouts, 408, 429 and 5xx), three times, after
pauses that double from half a second: a staging that fails resumes where it stopped when run again, so a store
that stays down is reported within seconds rather than the SDK's minute. No exception raised here carries the
SAS: aiohttp's own messages may contain the URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

# A SAS made here outlives any staging (ImageNet's 1.28M files take minutes) and starts a little in the past, so
# that a store whose clock is behind this machine's accepts it at once.
SAS_LIFETIME = timedelta(hours=24)
SAS_CLOCK_SKEW = timedelta(minutes=15)
ATTEMPTS = 4
FIRST_PAUSE_S = 0.5
_RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class BlobReadError(Exception):
    """A Get Blob the store refused or that failed after its retries; its text names the status or error and
    the error code (as the SDK's errors do), never the SAS."""


def plain_blob_reader(service: Any, connect_timeout_s: float, read_timeout_s: float) -> BlobReader | None:
    """GETs for the blobs of `service` (azure.storage.blob.aio.BlobServiceClient), or None where they would need
    the SDK: a token credential signs each request itself."""
    endpoint, _, query = service.url.rstrip("/").partition("?")
    credential = service.credential
    if credential is None:  # a SAS in the URL, or a public container
        return BlobReader(endpoint.rstrip("/"), lambda _container: query, service.api_version,
                          connect_timeout_s, read_timeout_s)  # fmt: skip
    if getattr(credential, "account_key", None):
        return BlobReader(
            endpoint.rstrip("/"), _container_sas(credential.account_name, credential.account_key),
            service.api_version, connect_timeout_s, read_timeout_s,
        )  # fmt: skip
    return None


def _container_sas(account_name: str, account_key: str) -> Callable[[str], str]:
    """A read-only SAS per container, made once."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    made: dict[str, str] = {}

    def sas(container: str) -> str:
        if container not in made:
            now = datetime.now(timezone.utc)
            made[container] = generate_container_sas(
                account_name,
                container,
                account_key=account_key,
                permission=ContainerSasPermissions(read=True),
                start=now - SAS_CLOCK_SKEW,
                expiry=now + SAS_LIFETIME,
            )
        return made[container]

    return sas


@dataclass(frozen=True)
class BlobReader:
    endpoint: str  # the account's blob endpoint, without a query
    sas_for: Callable[[str], str]  # container -> the SAS query for its blobs ("" for a public container)
    api_version: str  # the SDK's x-ms-version, so the store answers as it answers the SDK
    connect_timeout_s: float
    read_timeout_s: float

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str, int | None], Awaitable[bytes]]]:
        """`read(path, end)`: the blob at `container/name`, only its first `end` bytes when `end` is given; one
        connection pool for every read, closed on leaving."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)
        # trust_env off: aiohttp would look up proxies and .netrc for every request (callers keep the SDK's path
        # where a proxy is set).
        async with aiohttp.ClientSession(
            timeout=timeout, trust_env=False, connector=aiohttp.TCPConnector(limit=0)
        ) as http:

            async def read(path: str, end: int | None) -> bytes:
                container, _, blob = path.strip("/").partition("/")
                sas = self.sas_for(container)
                url = f"{self.endpoint}/{container}/{quote(blob, safe='~/')}" + (f"?{sas}" if sas else "")
                headers = {"x-ms-version": self.api_version}
                if end:
                    headers["Range"] = f"bytes=0-{end - 1}"
                return await self._get(http, url, headers, sas)

            yield read

    async def _get(self, http: Any, url: str, headers: dict[str, str], sas: str) -> bytes:
        import aiohttp

        pause = FIRST_PAUSE_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                async with http.get(url, headers=headers) as response:
                    if response.status in (200, 206):
                        return await response.read()
                    if response.status == 416:  # a range past the end: the blob is empty now
                        return b""
                    code = response.headers.get("x-ms-error-code", "")
                    failure = BlobReadError(f"HTTP {response.status}: {response.reason} {code}".strip())
                    if response.status not in _RETRIED_STATUSES:
                        raise failure
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                text = str(exc).replace(sas, "<SAS>") if sas else str(exc)
                failure = BlobReadError(f"{type(exc).__name__}: {text}; the connection failed {attempt} times")
            if attempt < ATTEMPTS:
                await asyncio.sleep(pause)
                pause *= 2
        raise failure
