"""Azure's Get Blob and List Blobs as plain HTTP GETs, for staging many small files.

Each request through azure-storage-blob's pipeline (its policies, its response objects) cost the client 0.69 ms of
CPU per file of 110 KB, against 0.16 ms for the same GET through aiohttp alone (benchmarks/RESULTS.md): on two
cores beside the store, that CPU, not the store, capped staging. azcopy likewise sends its own GETs, authorized by
a SAS. The listing's pages come the same way, each answer parsed once (the SDK parsed each page, then staging read
the sizes and folder markers from the same XML again). Here the SDK still makes the SAS, with the account's key
(`generate_container_sas`: read and list, one container, held in memory only). Requests the SDK must sign itself
(an Entra ID token) and stores behind a proxy keep the SDK's path (`plain_blob_reader` returns None), whose pages
are read by `listed_page` too.

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
from urllib.parse import quote, unquote, urlencode

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
    """A SAS per container that reads and lists it, made once."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    made: dict[str, str] = {}

    def sas(container: str) -> str:
        if container not in made:
            now = datetime.now(timezone.utc)
            made[container] = generate_container_sas(
                account_name,
                container,
                account_key=account_key,
                permission=ContainerSasPermissions(read=True, list=True),
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
        connection pool for every read, closed on leaving. Whole GETs, no range: a ranged one cost the store 9 %
        more time (Azurite, 110 KB, benchmarks/RESULTS.md); a longer blob's answer is cut off after `end` bytes."""
        async with self._http() as http:

            async def read(path: str, end: int | None) -> bytes:
                container, _, blob = path.strip("/").partition("/")
                sas = self.sas_for(container)
                url = f"{self.endpoint}/{container}/{quote(blob, safe='~/')}" + (f"?{sas}" if sas else "")
                return await self._get(http, url, {"x-ms-version": self.api_version}, sas, end)

            yield read

    async def pages(
        self, container: str, prefix: str, first_page_size: int | None, page_size: int | None
    ) -> AsyncIterator[ListedPage]:
        """The blobs of `container` whose names start with `prefix`, a page at a time (the first of
        `first_page_size` names, then `page_size`; the service's 5,000 where None), with their metadata."""
        sas = self.sas_for(container)
        async with self._http() as http:
            marker, size = "", first_page_size
            while True:
                query = {"restype": "container", "comp": "list", "include": "metadata", "prefix": prefix}
                query.update({"maxresults": str(size)} if size else {})
                query.update({"marker": marker} if marker else {})
                url = f"{self.endpoint}/{container}?{urlencode(query)}" + (f"&{sas}" if sas else "")
                page = listed_page(await self._get(http, url, {"x-ms-version": self.api_version}, sas))
                yield page
                marker, size = page.next_marker, page_size
                if not marker:
                    return

    @asynccontextmanager
    async def _http(self) -> AsyncIterator[Any]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)
        # trust_env off: aiohttp would look up proxies and .netrc for every request (callers keep the SDK's path
        # where a proxy is set).
        async with aiohttp.ClientSession(
            timeout=timeout, trust_env=False, connector=aiohttp.TCPConnector(limit=0)
        ) as http:
            yield http

    async def _get(self, http: Any, url: str, headers: dict[str, str], sas: str, end: int | None = None) -> bytes:
        """The answer's body, its first `end` bytes at most."""
        import aiohttp

        pause = FIRST_PAUSE_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                async with http.get(url, headers=headers) as response:
                    if response.status == 200:
                        if end is None or (response.content_length is not None and response.content_length <= end):
                            return await response.read()
                        return await _first_bytes(response.content, end)  # longer, or of no stated length
                    code = response.headers.get("x-ms-error-code", "")
                    failure = BlobReadError(f"HTTP {response.status}: {response.reason} {code}".strip())
                    if response.status not in _RETRIED_STATUSES:
                        raise failure
            except (aiohttp.ClientError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                text = str(exc).replace(sas, "<SAS>") if sas else str(exc)
                failure = BlobReadError(f"{type(exc).__name__}: {text}; the connection failed {attempt} times")
            if attempt < ATTEMPTS:
                await asyncio.sleep(pause)
                pause *= 2
        raise failure


async def _first_bytes(stream: Any, end: int) -> bytes:
    """At most `end` bytes of an answer's body: the rest of a longer one is neither read nor held."""
    body = bytearray()
    while len(body) < end and (chunk := await stream.read(end - len(body))):
        body += chunk
    return bytes(body)


@dataclass(frozen=True)
class ListedPage:
    sizes: dict[str, int]  # each blob the page names, in the store's order, folder markers included
    folders: frozenset[str]  # those of them that stand for a folder
    next_marker: str  # where the next page starts; "" after the last


def listed_page(body: bytes) -> ListedPage:
    """A List Blobs answer (its XML), read once: names, sizes, folder markers and the next page's marker."""
    from xml.etree import ElementTree

    answer = ElementTree.fromstring(body)
    sizes: dict[str, int] = {}
    folders = set()
    for blob in answer.iterfind("Blobs/Blob"):
        named = blob.find("Name")
        name = "" if named is None else named.text or ""
        if named is not None and named.get("Encoded") == "true":  # a name with characters XML cannot carry
            name = unquote(name)
        sizes[name] = int(blob.findtext("Properties/Content-Length") or 0)
        if _is_folder(name, blob):
            folders.add(name)
    return ListedPage(sizes, frozenset(folders), answer.findtext("NextMarker") or "")


def _is_folder(name: str, blob: Any) -> bool:
    """A listed blob that stands for a folder: a hierarchical namespace's folder, a name ending in "/", or an
    empty blob whose metadata marks it (hdi_isfolder, written by Azure's own tools; adlfs's is_directory)."""
    if name.endswith("/") or blob.findtext("Properties/ResourceType") == "directory":
        return True
    marks = {element.tag.lower(): element.text for element in blob.iterfind("Metadata/*")}
    return marks.get("is_directory") == "true" or (
        marks.get("is_directory") != "false" and marks.get("hdi_isfolder") == "true"
    )
