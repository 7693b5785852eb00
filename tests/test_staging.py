"""Staging inputs from object storage, against a real Azure Blob Storage emulator (Azurite)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import torch
from azure.storage.blob import (
    BlobClient,
    BlobServiceClient,
    ContainerClient,
    ContainerSasPermissions,
    generate_container_sas,
)
from azurite import ACCOUNT, KEY, Azurite, free_port, silent_store
from conftest import cli_command, one_image_per_class, tiny_job, wait_for, write_job
from fsspec.asyn import sync
from safetensors.torch import save_file
from services import skip_reason
from torch.utils.data import DataLoader

from clusterfit.data import staging
from clusterfit.data.shardreader import ShardTrainSamples, as_is
from clusterfit.data.shards import PackedIndex, pack_folder, read_index, read_remote_index
from clusterfit.data.staging import (
    JOURNAL,
    MANIFEST,
    WHOLE_FILE_MAX,
    Credentials,
    StagingError,
    cache_folder,
    open_filesystem,
    stage,
)
from clusterfit.data.transforms import TrainCrop
from clusterfit.models import build_model
from clusterfit.spec.model import StorageSpec
from clusterfit.storage import blob_gets
from clusterfit.storage.blob_gets import BlobReader, BlobReadError, plain_blob_reader
from clusterfit.storage.filesystems import diagnose, list_file_pages, list_files, whole_file_reader

CONTAINER = "data"


# One worker runs them all: each worker would otherwise compute one Azurite server (a module fixture) again.
pytestmark = pytest.mark.xdist_group("staging")


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory):
    reason = skip_reason("azurite")
    if reason is not None:
        pytest.skip(reason)
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    BlobServiceClient.from_connection_string(server.connection_string()).create_container(CONTAINER)
    yield server
    server.stop()


def _upload(azurite: Azurite, folder: Path, prefix: str) -> dict[str, bytes]:
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    uploaded = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        container.upload_blob(f"{prefix}/{rel}", path.read_bytes(), overwrite=True)
        uploaded[rel] = path.read_bytes()
    return uploaded


def _env(azurite: Azurite, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_STORAGE_")}
    return {**env, "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string(), "COLUMNS": "200", **extra}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(*args), env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("requests", ["plain GETs", "the SDK's, a proxy variable set"])
def test_the_azure_listing_reads_what_adlfs_finds_in_pages(
    azurite: Azurite, requests: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names and sizes only, from Azure's listing: the files adlfs's find gives, folder markers (of Azure's tools,
    of adlfs) left out, a sibling folder with a longer name left out, a file's URL answered with that file, and a
    listing of several pages. An empty blob whose name ends in "/" marks a folder too (as object stores' consoles
    write them); adlfs's find alone takes it for an empty file. The same through plain GETs under a SAS and
    through the SDK's requests (where a proxy is set)."""
    if requests != "plain GETs":
        monkeypatch.setenv("NO_PROXY", "example.invalid")
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    blobs = {"listed/a/1.jpg": b"1", "listed/a/2.jpg": b"22", "listed/b/3.jpg": b"", "listed/c.jpg": b"4444"}
    markers = {"listed/a": {"hdi_isfolder": "true"}, "listed/d": {"is_directory": "true"}, "listed/e/": {}}
    for name, body in [*blobs.items(), ("listed-not/x.jpg", b"5")]:
        container.upload_blob(name, body, overwrite=True)
    for name, metadata in markers.items():
        container.upload_blob(name, b"", metadata=metadata, overwrite=True)
    connection = (("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string()),)
    fs, root = open_filesystem(f"az://{CONTAINER}/listed", Credentials(variables=connection))
    expected = {f"{CONTAINER}/{name}": len(body) for name, body in blobs.items()}
    found = fs.find(root, detail=True)
    assert {path: info["size"] for path, info in found.items() if info["type"] == "file"} == {
        **expected,
        f"{CONTAINER}/listed/e": 0,
    }
    assert list_files(fs, root) == expected
    assert list_files(fs, root, page_size=2) == expected
    assert list_files(fs, f"{root}/c.jpg") == {f"{CONTAINER}/listed/c.jpg": 4}
    assert list_files(fs, f"{root}/nothing") == {}

    async def pages(path: str) -> list[dict[str, int]]:  # a first request of one name, then two a request
        return [page async for page in list_file_pages(fs, path, first_page_size=1, page_size=2)]

    # listed-not/x.jpg (another folder) | listed/a (a marker) a/1.jpg | a/2.jpg b/3.jpg | c.jpg d (a marker) | e/
    assert [len(page) for page in sync(fs.loop, pages, root)] == [0, 1, 2, 1, 0]
    assert {path: size for page in sync(fs.loop, pages, root) for path, size in page.items()} == expected
    assert sync(fs.loop, pages, f"{root}/c.jpg") == [{f"{CONTAINER}/listed/c.jpg": 4}]


def test_stage_an_imagenet_tree_then_reuse_and_repair(azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path) -> None:
    files = _upload(azurite, tiny_imagefolder / "train", "tiny/train")
    url = f"az://{CONTAINER}/tiny/train"
    result = _cli("data", "stage", url, str(tmp_path / "cache"), env=_env(azurite))
    assert result.returncode == 0, result.stderr
    assert f"staged {url} -> " in result.stdout and "48 files" in result.stdout and "MB/s" in result.stdout
    local = cache_folder(url, tmp_path / "cache") / "data"
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()} == files
    manifest = json.loads((local.parent / MANIFEST).read_text())
    assert set(manifest["files"]) == set(files) and all(len(e["sha256"]) == 64 for e in manifest["files"].values())

    again = _cli("data", "stage", url, str(tmp_path / "cache"), env=_env(azurite))
    assert "reused the verified copy" in again.stdout

    # A cached file damaged since: found by the verification, copied again, nothing else moves.
    (local / "class_1" / "0003.jpg").write_bytes(b"damaged")
    report = _stage_in_process(azurite, url, tmp_path / "cache")
    assert report.recopied == ["class_1/0003.jpg"] and report.copied_files == 1
    assert (local / "class_1" / "0003.jpg").read_bytes() == files["class_1/0003.jpg"]


def _stage_in_process(azurite: Azurite, url: str, cache: Path, **kw):
    saved = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = azurite.connection_string()
    try:
        return stage(url, cache, Credentials(), **kw)
    finally:
        if saved is None:
            os.environ.pop("AZURE_STORAGE_CONNECTION_STRING")
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = saved


def test_interrupted_staging_resumes_after_the_service_restarts(azurite: Azurite, tmp_path: Path) -> None:
    """Stop the emulator mid-transfer and lose the copying process with it; start both again: the copy goes
    on from where it stopped and ends verified."""
    source = tmp_path / "many"
    for index in range(120):
        (source / f"c{index % 3}").mkdir(parents=True, exist_ok=True)
        (source / f"c{index % 3}" / f"{index:04d}.jpg").write_bytes(os.urandom(3000 + index))
    files = _upload(azurite, source, "many")
    url = f"az://{CONTAINER}/many"
    target = cache_folder(url, tmp_path / "cache")
    copier = subprocess.Popen(
        cli_command("data", "stage", url, str(tmp_path / "cache"), "--workers", "1"),
        env=_env(azurite),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not ((target / JOURNAL).exists() and len((target / JOURNAL).read_text().splitlines()) >= 10):
        assert copier.poll() is None, copier.communicate()
        time.sleep(0.01)
    copier.send_signal(signal.SIGSTOP)  # frozen mid-transfer ...
    azurite.stop()  # ... while the service goes away ...
    copier.kill()  # ... and the node loses the copying process
    copier.communicate()
    journaled = len((target / JOURNAL).read_text().splitlines())
    assert not (target / MANIFEST).exists()

    azurite.start()
    result = _cli("data", "stage", url, str(tmp_path / "cache"), env=_env(azurite))
    assert result.returncode == 0, result.stderr
    resumed = int(result.stdout.split(" already there")[0].rsplit(", ", 1)[-1])
    assert resumed >= journaled >= 10
    local = target / "data"
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("disk", ["fast", "slow"])
def test_small_files_in_one_request_each_and_a_large_one_streamed(
    azurite: Azurite, tmp_path: Path, disk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images come whole, many in flight; a file past the whole-file size streams in ranged reads; both verified.
    On a slow disk (here: any write counts as slow) the writes go to threads after a few."""
    if disk == "slow":
        monkeypatch.setattr(staging, "_SLOW_WRITE_S", -1.0)
    written_by: dict[str, str] = {}
    source = tmp_path / "mixed"
    for index in range(40):
        (source / f"c{index % 4}").mkdir(parents=True, exist_ok=True)
        (source / f"c{index % 4}" / f"{index:03d}.jpg").write_bytes(os.urandom(1000 + 97 * index))
    (source / "big.bin").write_bytes(os.urandom(WHOLE_FILE_MAX + 12345))
    (source / "empty.txt").write_bytes(b"")  # stores refuse a byte range of an empty object
    files = _upload(azurite, source, "mixed")
    url = f"az://{CONTAINER}/mixed"

    def written(rel: str) -> None:
        written_by[rel] = threading.current_thread().name

    report = _stage_in_process(azurite, url, tmp_path / "cache", workers=8, on_file=written)
    assert (report.copied_files, report.copied_bytes) == (42, sum(len(b) for b in files.values()))
    if disk == "slow":  # after the first few, on writer threads; the large file streamed on the copy's threads
        on_writers = {rel for rel, thread in written_by.items() if thread.startswith("staging-write")}
        assert len(on_writers) >= 40 - staging._SLOW_WRITES_IN_A_ROW and "big.bin" not in on_writers, written_by
    local = report.local
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()} == files
    manifest = json.loads((local.parent / MANIFEST).read_text())["files"]
    assert {rel: entry["sha256"] for rel, entry in manifest.items()} == {
        rel: hashlib.sha256(body).hexdigest() for rel, body in files.items()
    }


@pytest.mark.parametrize("requests", ["plain GETs", "the SDK's, a proxy variable set"])
def test_a_file_that_grew_after_it_was_listed_is_one_retryable_line(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: str
) -> None:
    """The copy holds no more of a file than its listed size and a byte: one that grew since is named, and a run
    again copies the new one."""
    if requests != "plain GETs":
        monkeypatch.setenv("NO_PROXY", "example.invalid")
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    container.upload_blob("grown/a.jpg", b"x" * 100, overwrite=True)

    async def grown_once_listed(fs: Any, root: str, **sizes: int | None) -> AsyncIterator[dict[str, int]]:
        async for page in list_file_pages(fs, root, **sizes):
            await asyncio.to_thread(container.upload_blob, "grown/a.jpg", b"y" * 5000, overwrite=True)
            yield page

    monkeypatch.setattr(staging, "list_file_pages", grown_once_listed)
    with pytest.raises(StagingError, match=r"grown/a.jpg has 101 bytes, the listing said 100; run again") as grown:
        _stage_in_process(azurite, f"az://{CONTAINER}/grown", tmp_path / "cache")
    assert grown.value.retryable
    monkeypatch.undo()
    report = _stage_in_process(azurite, f"az://{CONTAINER}/grown", tmp_path / "cache")
    assert (report.local / "a.jpg").read_bytes() == b"y" * 5000


def test_copying_starts_after_the_listings_first_request(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are fetched while the rest of the folder is listed: here the listing's second page is held back until a
    file of the first (two names) is in the cache, and would be held in vain if the copy waited for the listing."""
    source = tmp_path / "paged"
    for index in range(12):
        (source / f"c{index % 3}").mkdir(parents=True, exist_ok=True)
        (source / f"c{index % 3}" / f"{index:02d}.jpg").write_bytes(os.urandom(500 + index))
    files = _upload(azurite, source, "paged")
    monkeypatch.setattr(staging, "FIRST_PAGE_SIZE", 2)
    events: list[str] = []
    copied = threading.Event()

    async def watched_pages(fs: Any, root: str, **sizes: int | None) -> AsyncIterator[dict[str, int]]:
        async for page in list_file_pages(fs, root, **sizes):
            if events:  # not the first page
                assert await asyncio.to_thread(copied.wait, 10), "no file was copied before the second request"
            events.append(f"page of {len(page)}")
            yield page

    def arrived(rel: str) -> None:
        events.append("file")
        copied.set()

    monkeypatch.setattr(staging, "list_file_pages", watched_pages)
    report = _stage_in_process(azurite, f"az://{CONTAINER}/paged", tmp_path / "cache", workers=4, on_file=arrived)
    assert report.copied_files == len(files) == 12
    assert events[:2] == ["page of 2", "file"] and events.count("page of 10") == 1
    local = report.local
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()} == files


def test_the_listing_runs_only_a_bounded_number_of_files_ahead_of_the_copy(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket's names are not all held at once: with room for one listed file and one transfer, the listing's
    last page is only done when all but a few of its files are copied. Unbounded, it is done at once."""
    source = tmp_path / "bounded"
    (source / "c0").mkdir(parents=True)
    for index in range(12):
        (source / "c0" / f"{index:02d}.jpg").write_bytes(os.urandom(500 + index))
    _upload(azurite, source, "bounded")
    monkeypatch.setattr(staging, "FIRST_PAGE_SIZE", 2)
    monkeypatch.setattr(staging, "_LISTED_AHEAD", 1)
    copied: list[str] = []
    copied_when_listed: list[int] = []

    async def watched_pages(fs: Any, root: str, **sizes: int | None) -> AsyncIterator[dict[str, int]]:
        async for page in list_file_pages(fs, root, **sizes):
            yield page
        copied_when_listed.append(len(copied))  # the last page's files are all queued by now

    monkeypatch.setattr(staging, "list_file_pages", watched_pages)
    report = _stage_in_process(
        azurite, f"az://{CONTAINER}/bounded", tmp_path / "cache", workers=1, on_file=copied.append
    )
    assert report.copied_files == len(copied) == 12
    # At most one file queued, one in flight and one being written when the last file is queued.
    assert copied_when_listed[0] >= 12 - 3, copied_when_listed


def test_an_object_gone_mid_copy_is_one_line_and_the_finished_files_stay(azurite: Azurite, tmp_path: Path) -> None:
    source = tmp_path / "vanishing"
    for index in range(6):
        (source / "c0").mkdir(parents=True, exist_ok=True)
        (source / "c0" / f"{index}.jpg").write_bytes(os.urandom(2000))
    _upload(azurite, source, "vanishing")
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    url = f"az://{CONTAINER}/vanishing"

    def delete_the_last_once(rel: str) -> None:  # after the listing, before the last file's turn (one transfer)
        if rel == "c0/0.jpg":
            container.delete_blob("vanishing/c0/5.jpg")

    with pytest.raises(StagingError) as raised:
        _stage_in_process(azurite, url, tmp_path / "cache", workers=1, on_file=delete_the_last_once)
    assert (
        str(raised.value)
        == f"{url}: copying 5.jpg stopped: not found; check the container and path; run again to resume"
    )
    assert not raised.value.retryable
    journaled = (cache_folder(url, tmp_path / "cache") / JOURNAL).read_text().splitlines()
    assert [json.loads(line)["file"] for line in journaled] == [f"c0/{index}.jpg" for index in range(5)]


def test_part_file_continues_from_its_length(tmp_path: Path) -> None:
    """A half-copied large file is continued by a ranged read, not fetched again (local file:// source)."""
    source = tmp_path / "src"
    source.mkdir()
    blob = os.urandom(9 << 20)
    (source / "big.bin").write_bytes(blob)
    url = f"file://{source}"
    target = cache_folder(url, tmp_path / "cache") / "data"
    target.mkdir(parents=True)
    (target / "big.bin.part").write_bytes(blob[: 5 << 20])
    report = stage(url, tmp_path / "cache")
    assert report.copied_bytes == (9 << 20) - (5 << 20)
    assert (target / "big.bin").read_bytes() == blob and not (target / "big.bin.part").exists()


def test_read_only_sas_token_reads_but_cannot_write(azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path) -> None:
    _upload(azurite, tiny_imagefolder / "val", "tiny/val")
    sas = generate_container_sas(
        ACCOUNT,
        CONTAINER,
        account_key=KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    env = {**_env(azurite), "CLUSTERFIT_STORAGE_SAS_TOKEN": sas}
    env.pop("AZURE_STORAGE_CONNECTION_STRING")
    url = f"az://{CONTAINER}/tiny/val"
    result = _cli("data", "stage", url, str(tmp_path / "cache"), "--endpoint", azurite.endpoint, env=env)
    assert result.returncode == 0, result.stderr
    assert "15 files" in result.stdout

    fs, _ = open_filesystem(url, Credentials(endpoint=azurite.endpoint, sas_token=sas))
    with pytest.raises(Exception, match="AuthorizationPermissionMismatch|not authorized|403"):
        fs.pipe_file(f"{CONTAINER}/outputs/model.safetensors", b"weights")
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    assert not container.get_blob_client("outputs/model.safetensors").exists()

    # A SAS that may read but not list: one line, without the signature, and nothing retried.
    cannot_list = generate_container_sas(
        ACCOUNT, CONTAINER, account_key=KEY, permission=ContainerSasPermissions(read=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )  # fmt: skip
    with pytest.raises(StagingError) as refused:
        stage(url, tmp_path / "refused", Credentials(endpoint=azurite.endpoint, sas_token=cannot_list))
    assert "access denied" in str(refused.value) and not refused.value.retryable
    assert parse_qs(cannot_list)["sig"][0] not in str(refused.value)


def test_small_files_come_by_plain_gets_under_a_sas_that_reads_and_lists_their_container_only(
    azurite: Azurite,
) -> None:
    """With the account's key, staging's GETs carry a SAS it made itself: it reads and lists that container and
    nothing else, writes nothing, and never shows up in an error."""
    service = BlobServiceClient.from_connection_string(azurite.connection_string())
    body = os.urandom(3000)
    service.get_container_client(CONTAINER).upload_blob("plain/a.bin", body, overwrite=True)
    other = service.get_container_client("other-container")
    if not other.exists():
        other.create_container()
    other.upload_blob("secret.bin", b"not yours", overwrite=True)
    key = (("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string()),)
    fs, _ = open_filesystem(f"az://{CONTAINER}/plain", Credentials(variables=key))
    reader = plain_blob_reader(fs.service_client, 5, 5)
    assert reader is not None
    sas = reader.sas_for(CONTAINER)
    assert parse_qs(sas)["sp"] == ["rl"] and parse_qs(sas)["sr"] == ["c"]  # read and list, one container

    async def reads() -> tuple[bytes, bytes, str]:
        async with reader.session() as read:
            whole, head = await read(f"{CONTAINER}/plain/a.bin", None), await read(f"{CONTAINER}/plain/a.bin", 10)
            with pytest.raises(BlobReadError) as missing:
                await read(f"{CONTAINER}/plain/absent.bin", None)
            return whole, head, str(missing.value)

    whole, head, missing = sync(fs.loop, reads)
    assert whole == body and head == body[:10]
    assert "HTTP 404" in missing and "BlobNotFound" in missing and parse_qs(sas)["sig"][0] not in missing
    assert diagnose(BlobReadError(missing), Credentials()).text == "not found; check the container and path"
    with pytest.raises(Exception, match="AuthorizationPermissionMismatch|AuthorizationFailure|403"):
        BlobClient.from_blob_url(f"{azurite.endpoint}/{CONTAINER}/plain/written.bin?{sas}").upload_blob(b"x")
    with pytest.raises(Exception, match="AuthenticationFailed|AuthorizationFailure|403"):
        BlobClient.from_blob_url(f"{azurite.endpoint}/other-container/secret.bin?{sas}").download_blob().readall()
    with pytest.raises(Exception, match="AuthenticationFailed|AuthorizationFailure|403"):
        list(ContainerClient.from_container_url(f"{azurite.endpoint}/other-container?{sas}").list_blob_names())
    assert list(ContainerClient.from_container_url(f"{azurite.endpoint}/{CONTAINER}?{sas}").list_blob_names())


def test_plain_gets_need_a_key_or_a_sas_and_no_proxy(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SAS the job gives is used as it is; a token credential signs each request, and a proxy is the SDK's to
    honour: both keep the SDK's path."""
    sas = generate_container_sas(
        ACCOUNT, CONTAINER, account_key=KEY, permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )  # fmt: skip
    fs, _ = open_filesystem(f"az://{CONTAINER}/x", Credentials(endpoint=azurite.endpoint, sas_token=sas))
    given = plain_blob_reader(fs.service_client, 5, 5)
    assert given is not None and parse_qs(given.sas_for(CONTAINER)) == parse_qs(sas)  # as given (re-quoted)

    class EntraToken:  # what azure-identity's credentials offer the SDK
        def get_token(self, *scopes: str, **options: Any) -> Any:
            raise AssertionError("not asked: nothing is requested here")

    from azure.storage.blob.aio import BlobServiceClient as AsyncService

    # Tokens go over HTTPS only; the client makes no request until asked.
    assert plain_blob_reader(AsyncService(f"https://{ACCOUNT}.invalid", credential=EntraToken()), 5, 5) is None

    async def reader_name(fs: Any) -> str:
        async with whole_file_reader(fs) as read:
            return read.__qualname__

    key = (("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string()),)
    fs, _ = open_filesystem(f"az://{CONTAINER}/x", Credentials(variables=key))
    assert sync(fs.loop, reader_name, fs) == "BlobReader.session.<locals>.read"
    monkeypatch.setenv("NO_PROXY", "example.invalid")
    fs, _ = open_filesystem(f"az://{CONTAINER}/x", Credentials(variables=key))
    assert sync(fs.loop, reader_name, fs) == "whole_file_reader.<locals>.read_blob"


def test_a_store_that_refuses_connections_is_retried_then_one_line_without_the_sas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blob_gets, "FIRST_PAUSE_S", 0.01)
    reader = BlobReader(f"http://127.0.0.1:{free_port()}/acct", lambda _c: "sv=x&sig=SECRET", "2021-08-06", 2, 2)

    async def read_one() -> None:
        async with reader.session() as read:
            await read("data/a.bin", None)

    with pytest.raises(BlobReadError) as failed:
        asyncio.run(read_one())
    assert "SECRET" not in str(failed.value) and f"failed {blob_gets.ATTEMPTS} times" in str(failed.value)
    assert diagnose(failed.value, Credentials()).unreachable  # retryable: running again resumes


def test_a_store_answer_without_a_length_is_read_no_further_than_the_listed_size() -> None:
    """A GET's answer in chunks of no stated length, and far longer than listed: the read stops after `end` bytes
    (the listed size and a byte) instead of holding whatever the store sends."""
    outcome: list[str] = []

    def long_answer(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                for _ in range(2000):  # 131 MB
                    connection.sendall(b"10000\r\n" + b"z" * 0x10000 + b"\r\n")
                connection.sendall(b"0\r\n\r\n")
                outcome.append("sent whole")
            except OSError:
                outcome.append("cut off")

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        threading.Thread(target=lambda: long_answer(server.accept()[0]), daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}/{ACCOUNT}"
        reader = blob_gets.BlobReader(endpoint, lambda _container: "", "2021-08-06", 5, 5)

        async def first_bytes() -> bytes:
            async with reader.session() as read:
                return await read("c/big.jpg", 101)

        assert asyncio.run(first_bytes()) == b"z" * 101
        assert wait_for(lambda: outcome, 30, "the store's answer to end") == ["cut off"]


def test_a_listing_page_is_read_once_with_encoded_names_markers_and_the_next_page() -> None:
    """Azure percent-encodes a name that XML cannot carry and flags it Encoded="true"."""
    body = b"""<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="http://x/" ContainerName="c">
    <Blobs>
      <Blob><Name>d/a.jpg</Name><Properties><Content-Length>12</Content-Length></Properties></Blob>
      <Blob><Name Encoded="true">d/b%01.jpg</Name><Properties><Content-Length>3</Content-Length></Properties></Blob>
      <Blob><Name>d/e</Name><Properties><Content-Length>0</Content-Length></Properties>
        <Metadata><hdi_isfolder>true</hdi_isfolder></Metadata></Blob>
    </Blobs><NextMarker>2!48!MDAwMDA1</NextMarker></EnumerationResults>"""
    page = blob_gets.listed_page(body)
    assert page.sizes == {"d/a.jpg": 12, "d/b\x01.jpg": 3, "d/e": 0}
    assert page.folders == {"d/e"} and page.next_marker == "2!48!MDAwMDA1"
    last = body.replace(b"<NextMarker>2!48!MDAwMDA1</NextMarker>", b"<NextMarker/>")
    assert blob_gets.listed_page(last).next_marker == ""


def test_a_request_id_or_time_with_403_in_it_is_not_access_denied() -> None:
    """Azure's messages carry a request id and a time; "403" among their digits once made a missing blob
    "access denied" in a run of the tests (the id is random: about one error in a hundred)."""
    missing = (
        "The specified blob does not exist. RequestId:8a403b1c-0f2e-4033-9403-a1b2c3d4e5f6 "
        "Time:2026-11-29T13:28:41.403Z ErrorCode:BlobNotFound"
    )
    assert diagnose(FileNotFoundError(missing), Credentials()).text == "not found; check the container and path"
    refusals = ("Operation returned an invalid status 'Forbidden' (403)", "HTTP 403: Forbidden", "Server said 403.")
    for refused in refusals:
        assert diagnose(OSError(refused), Credentials()).text.startswith("access denied: these credentials may not")


def test_wrong_key_is_one_clear_line(azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path) -> None:
    _upload(azurite, tiny_imagefolder / "val", "tiny/val")
    wrong = KEY.replace("Eby8", "Xby8")
    env = _env(azurite, AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string(wrong))
    url = f"az://{CONTAINER}/tiny/val"
    result = _cli("data", "stage", url, str(tmp_path / "cache"), env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {url}: access denied: the credentials were refused (authentication failed); check "
        "storage.sas_token or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_ACCOUNT_KEY"
    ]
    assert wrong not in result.stderr + result.stdout

    job = write_job(
        tmp_path / "job.yaml",
        tiny_job(
            tmp_path / "out",
            data={"train": url, "image_size": 32, "num_classes": None, "cache_dir": str(tmp_path / "cache")},
        ),
    )
    launched = _cli("run", str(job), env=env)
    assert launched.returncode == 2
    assert launched.stderr.strip().splitlines() == [
        f"error: trainer.data.train = '{url}': access denied: the credentials were refused (authentication failed); "
        "check storage.sas_token or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_ACCOUNT_KEY"
    ]


def test_data_and_weights_at_a_store_that_never_answers_are_one_line_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's other checks of a store (the data's classes, trainer.init.weights) have the same deadline as
    that of outputs.dir (tests/test_outputs_mirror.py), here cut from 60 s to 1. A SAS token in the URL is not
    said."""
    monkeypatch.setattr(staging, "PREFLIGHT_DEADLINE_S", 1)
    url = f"az://{CONTAINER}/tiny"
    checks = {
        "trainer.data.train": staging.remote_summary,
        "trainer.init.weights": staging.check_remote_file,
    }
    with silent_store() as connection_string:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string)
        for field_name, check in checks.items():
            with pytest.raises(StagingError) as unanswered:
                check(f"{url}?sv=2024-01-01&sig=not-for-the-console", StorageSpec(), field_name)
            assert str(unanswered.value) == (
                f"{field_name} = '{url}': the storage service did not answer in 1 s; check the endpoint and the "
                "network, or run the job again later"
            )
            assert unanswered.value.retryable


def test_job_trains_on_data_staged_with_a_sas_token_it_never_writes_down(
    azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path
) -> None:
    _upload(azurite, tiny_imagefolder, "job")
    # Starting weights at a URL too, staged like the data and read with the same token.
    weights = tmp_path / "start" / "model.safetensors"
    weights.parent.mkdir()
    save_file(build_model("resnet_tiny", 3).state_dict(), str(weights))
    _upload(azurite, weights.parent, "start")
    sas = generate_container_sas(
        ACCOUNT,
        CONTAINER,
        account_key=KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    spec = tiny_job(
        tmp_path / "out",
        steps_per_epoch=None,
        batch_size=8,
        data={
            "train": f"az://{CONTAINER}/job/train",
            "val": f"az://{CONTAINER}/job/val",
            "image_size": 32,
            "num_classes": None,
            "loader_workers": 1,
            "cache_dir": str(tmp_path / "cache"),
        },
        init={"weights": f"az://{CONTAINER}/start/model.safetensors"},
    )
    spec["storage"] = {"endpoint": azurite.endpoint, "sas_token": sas}
    env = _env(azurite)
    env.pop("AZURE_STORAGE_CONNECTION_STRING")
    result = _cli("run", str(write_job(tmp_path / "job.yaml", spec)), env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final"]["val_images"] == 15 and summary["steps"] == 48 // 16
    started = summary["starting_weights"]
    assert started["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest() and started["replaced"] == []
    logs = (tmp_path / "out" / "logs" / "rank-0.log").read_text() + (
        tmp_path / "out" / "logs" / "rank-1.log"
    ).read_text()
    assert logs.count("reused the verified copy") + logs.count(" -> ") >= 2
    signature = sas.split("sig=")[1].split("&")[0]
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert signature.encode() not in path.read_bytes(), f"the SAS token leaked into {path}"


def test_direct_mode_streams_every_sample_once_per_epoch(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards read straight from the emulator (2 ranks x 2 DataLoader worker processes) give every sample
    once per epoch, and exactly the batches the same shards give from a local folder."""
    src = one_image_per_class(tmp_path / "src", 40)
    pack_folder(str(src), str(tmp_path / "packed"), shard_size=9_000, workers=1)
    _upload(azurite, tmp_path / "packed", "direct40")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    remote = read_remote_index(f"az://{CONTAINER}/direct40", Credentials())
    assert len(remote.shards) > 3
    settings = {"seed": 3, "world_size": 2, "batch_size": 4, "steps_per_epoch": 5, "block_steps": 2}

    def epoch(index: PackedIndex, rank: int, number: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dataset = ShardTrainSamples(index, TrainCrop(16), rank=rank, **settings)
        dataset.set_position(number, 0)
        loader = DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=as_is)
        return [(images, labels) for images, labels, _, _ in loader]

    local = read_index(tmp_path / "packed")
    for number in (0, 1):
        streamed = [epoch(remote, rank, number) for rank in (0, 1)]
        labels = [label for batches in streamed for _, batch in batches for label in batch.tolist()]
        assert sorted(labels) == list(range(40)), "2 ranks x 5 steps x 4 = 40 samples, each exactly once"
        copied = [epoch(local, rank, number) for rank in (0, 1)]
        for (images, labels), (want_images, want_labels) in zip(sum(streamed, []), sum(copied, []), strict=True):
            assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_two_workers_train_on_shards_streamed_from_storage(
    azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path
) -> None:
    """`mode: direct` through the CLI: 2 ranks train 2 epochs and validate on shards read from the emulator;
    nothing is copied to the node, and every sample is read once per epoch."""
    for split in ("train", "val"):
        pack = ("data", "pack", str(tiny_imagefolder / split), str(tmp_path / split), "--shard-size", "20KB")
        result = _cli(*pack, env=_env(azurite))
        assert result.returncode == 0, result.stderr
        _upload(azurite, tmp_path / split, f"direct/{split}")
    job = tiny_job(
        tmp_path / "out",
        epochs=2,
        steps_per_epoch=None,
        batch_size=8,
        data={
            "train": f"az://{CONTAINER}/direct/train",
            "val": f"az://{CONTAINER}/direct/val",
            "mode": "direct",
            "cache_dir": str(tmp_path / "cache"),
            "image_size": 32,
            "num_classes": None,
            "loader_workers": 2,
            "shuffle_buffer": 16,
        },
    )
    result = _cli("run", str(write_job(tmp_path / "job.yaml", job)), env=_env(azurite))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 * (48 // 16) and summary["final"]["val_images"] == 15
    # Each epoch reads the 48 training images; the validation share is read once and then replayed from memory.
    assert summary["inputs"]["reads"] == 2 * 48 + 15 and summary["inputs"]["skipped_files"] == 0
    assert not (tmp_path / "cache").exists(), "mode direct copies nothing to the node"


def test_direct_mode_refuses_a_folder_of_loose_files(azurite: Azurite, tiny_imagefolder: Path, tmp_path: Path) -> None:
    _upload(azurite, tiny_imagefolder / "train", "loose/train")
    url = f"az://{CONTAINER}/loose/train"
    job = tiny_job(tmp_path / "out", data={"train": url, "mode": "direct", "image_size": 32, "num_classes": None})
    result = _cli("validate", str(write_job(tmp_path / "job.yaml", job)), env=_env(azurite))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: trainer.data.train = '{url}': mode direct streams packed shards only, and this is a folder of "
        "loose files; use mode: download, or pack it first (clusterfit data pack)"
    ]


def test_a_netrc_entry_for_the_store_breaks_nothing_and_a_proxy_variable_is_honoured(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's client skips aiohttp's per-request reading of .netrc and the proxy variables when no proxy
    variable is set: with them, a .netrc entry for the store's host made every request fail ("Cannot combine
    AUTHORIZATION header with AUTH argument"). A proxy variable keeps them: the request goes through the proxy."""
    import socketserver
    import threading

    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    container.upload_blob("netrc/one.txt", b"one", overwrite=True)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    for name in [n for n in os.environ if n.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "netrc")]:
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine 127.0.0.1 login someone password elsewhere\n")
    (home / ".netrc").chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    fs, _ = open_filesystem(f"az://{CONTAINER}/netrc", Credentials())
    assert fs.cat_file(f"{CONTAINER}/netrc/one.txt") == b"one"

    requests: list[str] = []

    class RefusingProxy(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            requests.append(self.rfile.readline().decode().strip())
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    (home / ".netrc").unlink()
    with socketserver.TCPServer(("127.0.0.1", 0), RefusingProxy) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        fs, _ = open_filesystem(f"az://{CONTAINER}/netrc", Credentials())
        with pytest.raises(Exception):  # noqa: B017, PT011 - the proxy's refusal, in whichever type the SDK uses
            fs.cat_file(f"{CONTAINER}/netrc/one.txt")
        proxy.shutdown()
    assert requests and requests[0].startswith("GET http://127.0.0.1:") and "/netrc/one.txt" in requests[0]


def test_a_shard_that_differs_from_its_index_is_named_removed_and_copied_again(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard whose sha256 is not its index's is named in one line and never kept; once the store is right
    again, a rerun copies it (and what the failed run had not copied yet) and keeps the rest."""
    src = one_image_per_class(tmp_path / "src", 40)
    pack_folder(str(src), str(tmp_path / "packed"), shard_size=9_000, workers=1)
    uploaded = _upload(azurite, tmp_path / "packed", "corrupt40")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    shard = sorted(name for name in uploaded if name != "index.json")[1]
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    damaged = bytes(b ^ 0xFF for b in uploaded[shard][:64]) + uploaded[shard][64:]  # same size, other bytes
    container.upload_blob(f"corrupt40/{shard}", damaged, overwrite=True)
    url, cache = f"az://{CONTAINER}/corrupt40", tmp_path / "cache"
    with pytest.raises(StagingError, match=rf"corrupt40/{shard}: sha256 \w+… differs from the index's \w+…; "):
        stage(url, cache, Credentials(), workers=4)
    data = cache_folder(url, cache) / "data"
    assert not (data / shard).exists() and (data / "index.json").is_file()
    container.upload_blob(f"corrupt40/{shard}", uploaded[shard], overwrite=True)
    arrived: list[str] = []
    report = stage(url, cache, Credentials(), workers=4, on_file=arrived.append)
    assert shard in arrived and report.copied_files + report.resumed_files == len(uploaded)
    assert (data / shard).read_bytes() == uploaded[shard]
