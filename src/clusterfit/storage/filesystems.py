"""Object stores behind fsspec URLs (az://, s3://, file://, ...): opening one with a job's credentials, and what
an SDK's exception means, as one line without secrets. Torch-free; used by staging (inputs) and by the outputs
mirror (a job's outputs at a URL)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from clusterfit.errors import DataError
from clusterfit.outputs import STORAGE_SAS_TOKEN_ENV
from clusterfit.spec.model import JobSpec, StorageSpec
from clusterfit.storage.blob_gets import BlobReader, ListedPage, listed_page, plain_blob_reader
from clusterfit.storage.redact import redact


class StorageError(DataError):
    """A store refused or did not answer; one line naming the URL, what went wrong and what to do. Retryable when
    the service did not answer."""


@dataclass(frozen=True)
class Credentials:
    """What the spec says (its storage section, the store variables among its environment_variables), given to
    the store's client as options; anything else the client finds in this process's environment (AZURE_STORAGE_*,
    AWS_*), of which the job service's processes keep none (`drop_store_credentials`)."""

    account_name: str | None = None
    endpoint: str | None = None
    sas_token: str | None = field(default=None, repr=False)
    variables: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def secrets(self) -> list[str]:
        given = [value for name, value in self.variables if name in _SECRET_VARIABLES]
        return [s for s in (self.sas_token, os.environ.get("AZURE_STORAGE_ACCOUNT_KEY"), *given) if s]


# Store variables a job may give as values, and the client option each one is.
_AZURE_OPTIONS = {
    "AZURE_STORAGE_CONNECTION_STRING": "connection_string",
    "AZURE_STORAGE_ACCOUNT_NAME": "account_name",
    "AZURE_STORAGE_ACCOUNT_KEY": "account_key",
    "AZURE_STORAGE_SAS_TOKEN": "sas_token",
}
_S3_OPTIONS = {"AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "token"}
_SECRET_VARIABLES = frozenset(
    {"AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"}
    | {"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
)


def credentials(storage: StorageSpec, variables: Mapping[str, str] | None = None) -> Credentials:
    """The spec's storage section; a SAS token the launcher passed in the environment (never in job.yaml); the
    store variables among `variables` (a spec's environment_variables), which its workers have too."""
    token = storage.sas_token.get_secret_value() if storage.sas_token else os.environ.get(STORAGE_SAS_TOKEN_ENV)
    given = tuple(
        (name, value)
        for name, value in sorted((variables or {}).items())
        if name in _AZURE_OPTIONS or name in _S3_OPTIONS or name == "AWS_ENDPOINT_URL"
    )
    return Credentials(storage.account_name, storage.endpoint, token or None, given)


def job_credentials(spec: JobSpec) -> Credentials:
    return credentials(spec.storage, spec.environment_variables)


# What keeps a store's client from looking for credentials that no option gave it: Azure's identity chain (which
# asks the Azure CLI for its login), the AWS profiles in the account's home folder, the machine's instance metadata,
# and google-auth's (gcsfs's) gcloud login in the home folder and the machine's metadata server.
_LOOK_NOWHERE = {
    "AZURE_STORAGE_ANON": "true",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "CLOUDSDK_CONFIG": os.devnull,
    "NO_GCE_CHECK": "True",
}
# Where the clients find such credentials: values, files they name, identities to ask (not their other settings:
# a region, a CA bundle).
_AMBIENT_PREFIXES = ("AZURE_STORAGE_", "AWS_CONTAINER_", "AWS_ROLE_")
_AMBIENT_NAMES = frozenset(
    {"AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_CLIENT_CERTIFICATE_PATH"}
    | {"AZURE_CLIENT_CERTIFICATE_PASSWORD", "AZURE_FEDERATED_TOKEN_FILE", "AZURE_USERNAME", "AZURE_PASSWORD"}
    | {"IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET", "GOOGLE_APPLICATION_CREDENTIALS"}
    | {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"}
    | {"AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", *_LOOK_NOWHERE}
)


def drop_store_credentials(environ: MutableMapping[str, str]) -> list[str]:
    """Takes out of `environ` every way a store client finds credentials of its own, and returns the names it
    took out. For the job service's processes, which act for every owner's jobs: a job reaches its store with
    what its spec gives (`job_credentials`), never with the operator's credentials, which would let any owner read
    and write wherever the operator may."""
    found = sorted(name for name in environ if name.startswith(_AMBIENT_PREFIXES) or name in _AMBIENT_NAMES)
    dropped = [name for name in found if environ[name] != _LOOK_NOWHERE.get(name)]
    for name in found:
        del environ[name]
    environ.update(_LOOK_NOWHERE)
    return dropped


_AZURE_PROTOCOLS = frozenset({"az", "abfs", "abfss"})


def open_filesystem(url: str, creds: Credentials) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it). Filesystems are never shared between credentials."""
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    options: dict[str, Any] = {"skip_instance_cache": True}
    given = dict(creds.variables)
    if protocol in _AZURE_PROTOCOLS:
        if creds.endpoint and creds.sas_token:
            options["connection_string"] = f"BlobEndpoint={creds.endpoint};SharedAccessSignature={creds.sas_token}"
        else:
            if creds.account_name:
                options["account_name"] = creds.account_name
            if creds.sas_token:
                options["sas_token"] = creds.sas_token
        if not creds.sas_token:  # the spec's token is the credential, and no key or connection string beside it
            for name, option in _AZURE_OPTIONS.items():
                if name in given:
                    options.setdefault(option, given[name])
    elif protocol in ("s3", "s3a"):
        options.update((option, given[name]) for name, option in _S3_OPTIONS.items() if name in given)
        endpoint = creds.endpoint or given.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    elif protocol in ("file", "local"):
        options["auto_mkdir"] = True  # a folder store has folders: writing logs/rank-0.log needs logs/ first
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        package = {"az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "s3": "s3fs", "s3a": "s3fs"}.get(protocol, "")
        hint = f"pip install {package}" if package else "install the fsspec implementation for it"
        raise StorageError(f"{url}: no filesystem for {protocol}:// ({exc}); {hint}", retryable=False) from None
    except (ValueError, OSError) as exc:
        raise storage_error(url, exc, creds) from None
    if protocol in _AZURE_PROTOCOLS:
        fs.service_client = _azure_client(fs.service_client, with_environment=bool(_proxy_settings(os.environ)))
    return fs, path.rstrip("/")


# What aiohttp reads from the environment for each request when its session trusts the environment.
_PROXY_SETTINGS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "netrc"}


def _proxy_settings(environ: Mapping[str, str]) -> list[str]:
    return [name for name in environ if name.lower() in _PROXY_SETTINGS]


# NOTE: azure-storage-blob waits 20 s for a connection and 60 s for each answer, and tries 4 times with pauses of
# 15-24 s. A store that takes connections and never answers (a hung proxy or gateway) held the launcher's first
# check for 11 minutes without a word; a healthy store answers within these from loopback to another region.
AZURE_CONNECT_TIMEOUT_S = 10
AZURE_READ_TIMEOUT_S = 30


# Pre-flight checks of a store wait this long before they say it does not answer (a healthy one answers in well under
# a second); the SDKs' own waits and retries took 7-11 minutes against a store that took connections and never answered.
PREFLIGHT_DEADLINE_S = 60.0

Answer = TypeVar("Answer")


def answered_within(
    deadline_s: float, where: str, call: Callable[[], Answer], kind: type[StorageError] = StorageError
) -> Answer:
    """`call()`'s answer or exception, or a retryable `kind` naming `where` when it took longer than `deadline_s`.
    The call runs on a daemon thread, left behind if late: an SDK call cannot be cut short from outside."""
    outcome: list[tuple[bool, Any]] = []

    def answer() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            outcome.append((False, exc))

    asking = threading.Thread(target=answer, name="store-check", daemon=True)
    asking.start()
    asking.join(deadline_s)
    if not outcome:
        raise kind(
            f"{where}: the storage service did not answer in {deadline_s:g} s; check the endpoint and the network, "
            "or run the job again later",
            retryable=True,
        )
    answered, value = outcome[0]
    if not answered:
        raise value
    return value


def _azure_client(client: Any, *, with_environment: bool) -> Any:
    """adlfs's Azure client, made again with shorter waits (above) and, where the environment sets no proxy and no
    .netrc, without looking them up. With the lookups on (azure-core's default), aiohttp hands two of them (proxy
    variables, .netrc) to a thread for every request: a quarter of the client's CPU when staging 1,000 small
    files. Where a proxy is set they stay on, so proxies work as before. The new client has the same endpoint
    (with a SAS token, if any) and credential, from the client's public properties."""
    from azure.storage.blob.aio import BlobServiceClient

    return BlobServiceClient(
        account_url=client.url,
        credential=client.credential,
        use_env_settings=with_environment,
        connection_timeout=AZURE_CONNECT_TIMEOUT_S,
        read_timeout=AZURE_READ_TIMEOUT_S,
    )


def list_files(fs: Any, root: str, *, page_size: int | None = None) -> dict[str, int]:
    """path -> size of every file under the folder `root`, or of the one file `root` names, as fsspec's
    `find(detail=True)` gives them, folders left out. Paths start with `root` as the filesystem spells it.
    `page_size`: names per listing request on Azure (the service's maximum, 5,000, by default)."""
    if not getattr(fs, "async_impl", False):
        found = fs.find(root, detail=True)
        if not isinstance(found, dict):  # a file's URL: some filesystems answer with a list of its name alone
            found = {name: fs.info(name) for name in found}
        return _sizes(found)
    from fsspec.asyn import sync

    async def every_page() -> dict[str, int]:
        return {
            path: size async for page in list_file_pages(fs, root, page_size=page_size) for path, size in page.items()
        }

    return sync(fs.loop, every_page)


async def list_file_pages(
    fs: Any, root: str, *, first_page_size: int | None = None, page_size: int | None = None
) -> AsyncIterator[dict[str, int]]:
    """`list_files` of a filesystem with an event loop, iterated on that loop, a page at a time as the store answers:
    on Azure its listing's pages (the first of `first_page_size` names, so that a copy can start after one short
    request), elsewhere fsspec's whole find as one page."""
    if _AZURE_PROTOCOLS.intersection(_protocols(fs)):
        async for page in _azure_pages(fs, root, first_page_size or page_size, page_size):
            yield page
        return
    found = await fs._find(root, detail=True)
    if not isinstance(found, dict):  # a file's URL: some filesystems answer with a list of its name alone
        found = {name: await fs._info(name) for name in found}
    yield _sizes(found)


def _sizes(found: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {path: int(entry.get("size") or 0) for path, entry in found.items() if entry.get("type") != "directory"}


@asynccontextmanager
async def whole_file_reader(fs: Any) -> AsyncIterator[Callable[[str, int | None], Awaitable[bytes]]]:
    """`read(path, end)`, to be awaited on the filesystem's event loop: the file at `path` in one GET, only its
    first `end` bytes when `end` is given. On Azure as plain GETs authorized by a SAS where the credential allows
    (`storage/blob_gets.py`), else through one container client for every file: adlfs makes a blob client from
    the service client for each, which took 3 % more of the client's CPU per file of 110 KB
    (benchmarks/RESULTS.md)."""
    if not _AZURE_PROTOCOLS.intersection(_protocols(fs)):
        yield lambda path, end: fs._cat_file(path, start=0 if end else None, end=end)
        return
    plain = _plain_blob_reader(fs)
    if plain is not None:
        async with plain.session() as read:
            yield read
        return
    containers: dict[str, Any] = {}

    async def read_blob(path: str, end: int | None) -> bytes:
        container_name, _, blob = path.strip("/").partition("/")
        if container_name not in containers:
            containers[container_name] = fs.service_client.get_container_client(container_name)
        download = await containers[container_name].download_blob(blob, offset=0 if end else None, length=end)
        return await download.readall()

    yield read_blob


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


async def _azure_pages(
    fs: Any, root: str, first_page_size: int | None, page_size: int | None
) -> AsyncIterator[dict[str, int]]:
    """Azure's listing, page by page, with only the names, sizes and folder markers read from it, each page's XML
    once. azure-storage-blob turns each listed blob into a full properties object, which adlfs's find asks for:
    0.17 ms of CPU per blob, 3.6 minutes for ImageNet's 1.28M files before the first one is fetched, on every node
    that stages them; 0.017 ms by plain GETs, 0.034 through the SDK's names-only listing (20,000 blobs, one run,
    benchmarks/RESULTS.md). Folders are told apart as adlfs tells them."""
    container, _, prefix = root.strip("/").partition("/")
    plain = _plain_blob_reader(fs)
    answers = (
        plain.pages(container, prefix, first_page_size, page_size)
        if plain is not None
        else _sdk_pages(fs.service_client, container, prefix, first_page_size, page_size)
    )
    async with aclosing(answers) as pages:
        named_any = False
        async for page in pages:
            names = [name for name in page.sizes if not prefix or name == prefix or name.startswith(f"{prefix}/")]
            if not named_any and prefix in names and prefix not in page.folders:
                # a file's URL: that file, as fsspec's find answers it (its name sorts before any name under it)
                yield {f"{container}/{prefix}": page.sizes[prefix]}
                return
            named_any = named_any or bool(names)
            yield {f"{container}/{name}": page.sizes[name] for name in names if name not in page.folders}


async def _sdk_pages(
    service: Any, container: str, prefix: str, first_page_size: int | None, page_size: int | None
) -> AsyncIterator[ListedPage]:
    """`BlobReader.pages` through the SDK, for requests it must sign itself: its names-only listing, whose answers
    (the List Blobs XML) are read through azure-core's public per-request hook."""
    answers: list[bytes] = []

    def keep(response: Any) -> None:
        if response.http_response.status_code == 200:  # not an answer that is retried
            answers.append(response.http_response.body())

    async with service.get_container_client(container) as client:
        token, size = None, first_page_size
        while True:
            answers.clear()
            # NOTE: `include` goes on to the List Blobs request, as every keyword the names-only listing does not
            # take itself: the metadata that marks a folder (hdi_isfolder) is then in the answer.
            pages = client.list_blob_names(
                name_starts_with=prefix, results_per_page=size, include=["metadata"], raw_response_hook=keep
            ).by_page(continuation_token=token)
            async for _ in await anext(pages):
                pass
            yield listed_page(answers[-1])
            token, size = pages.continuation_token, page_size
            if not token:
                return


def _plain_blob_reader(fs: Any) -> BlobReader | None:
    """Plain GETs for an Azure filesystem's blobs, unless a proxy is set (the SDK honours it) or the credential
    signs each request."""
    if _proxy_settings(os.environ):
        return None
    return plain_blob_reader(fs.service_client, AZURE_CONNECT_TIMEOUT_S, AZURE_READ_TIMEOUT_S)


# An HTTP 403 named in a message; not the digits of a request id or a time, which Azure's messages carry (a
# missing blob's "RequestId:8a403…" read as access denied).
_STATUS_403 = re.compile(r"(?<![\w.:-])403(?![\w-]|[.:]\d)")  # "HTTP 403: Forbidden" and "status 403." count


@dataclass(frozen=True)
class StorageProblem:
    text: str  # one short line, without secrets, with the fix when known
    unreachable: bool  # the service did not answer (rather than answering no): it may answer later


def diagnose(exc: BaseException, creds: Credentials) -> StorageProblem:
    """What an exception from any storage SDK means."""
    name = type(exc).__name__
    text = redact(" ".join(str(exc).split()), creds.secrets())
    lowered = f"{name} {text}".lower()
    if "authenticat" in lowered or "signature" in lowered or "authorizationfailure" in lowered:
        return StorageProblem(
            "access denied: the credentials were refused (authentication failed); check storage.sas_token or "
            "AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_ACCOUNT_KEY",
            unreachable=False,
        )
    if "authorizationpermissionmismatch" in lowered or _STATUS_403.search(lowered) or "permission" in lowered:
        return StorageProblem("access denied: these credentials may not do this (a read-only SAS token?)", False)
    if "must provide" in lowered or "no credentials" in lowered or "unable to locate credentials" in lowered:
        return StorageProblem(
            "no credentials for this store: set storage.account_name with AZURE_STORAGE_ACCOUNT_KEY or "
            "storage.sas_token, or AZURE_STORAGE_CONNECTION_STRING (AWS_* for s3://)",
            unreachable=False,
        )
    if "connect" in lowered or "timeout" in lowered or "timed out" in lowered:
        return StorageProblem(f"cannot reach the storage service ({name})", unreachable=True)
    if isinstance(exc, FileNotFoundError) or "notfound" in lowered.replace(" ", "") or "does not exist" in lowered:
        return StorageProblem("not found; check the container and path", unreachable=False)
    return StorageProblem(f"{name}: {text[:200]}", unreachable=False)


def say(exc: BaseException, creds: Credentials) -> str:
    """An exception from any storage SDK as one short line, without secrets, with the fix when known."""
    return diagnose(exc, creds).text


def storage_error(
    where: str, exc: BaseException, creds: Credentials, then: str = "", kind: type[StorageError] = StorageError
) -> StorageError:
    """`where: <what went wrong>then`, retryable when the storage service could not be reached."""
    problem = diagnose(exc, creds)
    return kind(f"{where}: {problem.text}{then}", retryable=problem.unreachable)


def cache_folder(url: str, cache_dir: str | Path) -> Path:
    """The local folder of `url` under `cache_dir`: readable, and distinct for every URL."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").split("://")[-1])[-48:].strip("_")
    return Path(cache_dir).expanduser() / f"{name}-{digest}"


def public(url: str) -> str:
    """A URL without its query string (where a SAS token may ride along)."""
    return url.split("?", 1)[0]
