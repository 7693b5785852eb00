"""Inputs given as URLs (az://, s3://, file://, any fsspec URL), copied once per node into a local cache.

`stage(url, cache_dir)` makes `cache_dir/<digest of url>/data` a verified copy of everything under `url`:

- one process per node does the copying: the others block on a file lock, then find it done;
- files are copied in parallel: from a store with an event loop (az://, s3://, gs://), a file of up to
  `WHOLE_FILE_MAX` in one GET, `workers` in flight (so at most that many held in memory), from the moment the
  listing's first short page is answered while the rest is listed (on Azure; other stores list in one go);
  any other file in ranged reads on `workers` threads once the listing is done. Each is written to
  `NAME.part`, checked against the listing's size and renamed; a journal records every finished file, so an
  interrupted copy resumes where it stopped (a large file's `.part` continues from its length by a ranged
  read; a small one is fetched again);
- the shards of a packed dataset are checked against its index's sha256 (one that differs is removed and named);
- `manifest.json` (size and sha256 per file) is written last; a later job reuses the copy after checking
  every file against it, and copies again what does not match.

No torch here: the launcher checks URLs, and `clusterfit data stage` runs it by hand.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from clusterfit.files import read_text_or_none, write_atomically
from clusterfit.spec.model import JobSpec, StorageSpec, is_url
from clusterfit.storage.checksums import sha256_of
from clusterfit.storage.filesystems import (
    PREFLIGHT_DEADLINE_S,
    Credentials,
    StorageError,
    answered_within,
    cache_folder,
    credentials,
    job_credentials,
    list_file_pages,
    list_files,
    open_filesystem,
    public,
    storage_error,
    whole_file_reader,
)

MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
VERIFIED = "verified-by"
DATA_DIR = "data"
_CHUNK = 4 << 20
# Files up to this size are fetched in one request and held in memory until written (at most `workers` of them
# at once); an interrupted one is fetched again, where a larger one resumes from its .part file.
WHOLE_FILE_MAX = 4 << 20
# Names in the listing's first request: copying starts once it is answered, and the rest is listed meanwhile.
FIRST_PAGE_SIZE = 100
# Listed files waiting for a fetcher, at most: two of Azure's listing pages.
_LISTED_AHEAD = 10_000


class StagingError(StorageError):
    """Staging failed; one line naming the URL, what went wrong and what to do. Nothing staged is lost.
    Retryable when the storage service did not answer, or the copy stopped halfway: running again resumes."""


@dataclass
class StageReport:
    url: str
    local: Path
    files: int = 0
    bytes: int = 0
    copied_files: int = 0
    copied_bytes: int = 0
    resumed_files: int = 0
    reused: bool = False
    seconds: float = 0.0
    recopied: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.copied_bytes / 1e6 / max(self.seconds, 1e-9)


def stage(
    url: str,
    cache_dir: str | Path,
    creds: Credentials = Credentials(),
    *,
    workers: int = 32,
    run_token: str | None = None,
    on_file: Callable[[str], None] | None = None,
) -> StageReport:
    """Copy `url` into the node's cache (or reuse a verified copy); returns where the data is.

    `run_token` names this job run: processes of the same run trust a copy another of them verified."""
    from filelock import FileLock

    started = time.perf_counter()
    target = cache_folder(url, cache_dir)
    target.mkdir(parents=True, exist_ok=True)
    report = StageReport(url=url, local=target / DATA_DIR)
    with FileLock(str(target) + ".lock"):
        if run_token and read_text_or_none(target / VERIFIED) == run_token and (target / MANIFEST).is_file():
            manifest = json.loads((target / MANIFEST).read_text())
            report.files, report.bytes, report.reused = len(manifest["files"]), _total(manifest), True
            return report
        _stage_locked(url, target, creds, workers, report, on_file)
        if run_token:
            write_atomically(target / VERIFIED, run_token)
    report.seconds = time.perf_counter() - started
    return report


def _stage_locked(
    url: str, target: Path, creds: Credentials, workers: int, report: StageReport, on_file: Callable[[str], None] | None
) -> None:
    data = target / DATA_DIR
    old = json.loads((target / MANIFEST).read_text()) if (target / MANIFEST).is_file() else None
    if old is not None:
        bad = _verify_all(data, old["files"], workers)
        if not bad:
            report.files, report.bytes, report.reused = len(old["files"]), _total(old), True
            return
        # Some files changed or vanished since: copy those again (the rest stays).
        report.recopied = sorted(bad)
        (target / MANIFEST).unlink()
        journal = {rel: entry for rel, entry in old["files"].items() if rel not in bad}
        _rewrite_journal(target / JOURNAL, journal)
    fs, root = open_filesystem(url, creds)
    journal = _read_journal(target / JOURNAL)
    lock = threading.Lock()
    # NOTE: the paths of the files in strings: a Path for each, on the event loop's thread, cost 1-2 % of its CPU.
    into = str(data)
    folder = root
    listing: dict[str, int] = {}  # every listed file's path in the folder, and its size
    streamed: list[tuple[str, int]] = []
    made: set[str] = set()
    whole_files = bool(getattr(fs, "async_impl", False))

    def take(page: dict[str, int]) -> list[tuple[str, str, int]]:
        """A page of the listing: notes its files, makes their folders; returns the small ones to fetch whole
        (path, path in the folder, size) and keeps the large ones for `streamed`. Files a stopped copy journaled
        are left as they are."""
        nonlocal folder
        if not listing and list(page) == [root]:  # a file's URL
            folder = root.rsplit("/", 1)[0]
        whole = []
        for rel, size in sorted(_relative(page, folder, url).items()):
            listing[rel] = size
            done = journal.get(rel)
            if done and done["bytes"] == size and (data / rel).is_file() and (data / rel).stat().st_size == size:
                report.resumed_files += 1
                continue
            parent = rel.rpartition("/")[0]
            if parent not in made:  # once per folder, not once per file
                (data / parent).mkdir(parents=True, exist_ok=True)
                made.add(parent)
            # Small files of an asynchronous store (az://, s3://, gs://) come whole, many requests in flight on
            # the store's own event loop; larger ones, and any store without one, stream in ranged reads that can
            # resume.
            if whole_files and size <= WHOLE_FILE_MAX:
                whole.append((f"{folder}/{rel}", rel, size))
            else:
                streamed.append((rel, size))
        return whole

    def finished(rel: str, digest: str, fresh: int, journal_file: IO[str]) -> None:
        local = f"{into}/{rel}"
        os.replace(_part(local), local)
        with lock:
            report.copied_files += 1
            report.copied_bytes += fresh
            journal_file.write(json.dumps({"file": rel, "bytes": listing[rel], "sha256": digest}) + "\n")
            journal_file.flush()  # a crash loses at most the file being copied
        if on_file:
            on_file(rel)

    with open(target / JOURNAL, "a") as journal_file:

        def keep(rel: str, body: bytes, digest: str | None) -> None:
            if len(body) != listing[rel]:
                _changed_while_copied(url, f"{folder}/{rel}", len(body), listing[rel])
            _write_part(f"{into}/{rel}", body)
            finished(rel, digest or _sha256(body), len(body), journal_file)

        if whole_files:
            _fetch_concurrently(fs, _pages(fs, root, url, creds), take, workers, url, creds, keep)
        else:
            take(_listed(fs, root, url, creds))

        def stream(item: tuple[str, int]) -> None:
            digest, fresh = _copy_one(fs, f"{folder}/{item[0]}", data / item[0], item[1], url, creds)
            finished(item[0], digest, fresh, journal_file)

        with ThreadPoolExecutor(max(1, workers)) as pool:
            for _ in pool.map(stream, streamed):
                pass
    if not listing:
        raise StagingError(
            f"{url}: no files there; check the URL (a folder of <class>/<image> or a packed dataset)", retryable=False
        )
    journal = _read_journal(target / JOURNAL)
    _check_against_index(url, data, journal, _expected_sha256(fs, folder, listing, data, creds))
    files = {rel: journal[rel] for rel in sorted(listing)}
    if any(rel not in journal for rel in listing):  # pragma: no cover - every copy either raised or journaled
        raise StagingError(f"{url}: some files were not copied; run again to resume", retryable=True)
    write_atomically(target / MANIFEST, json.dumps({"url": public(url), "files": files}, indent=1))
    (target / JOURNAL).unlink(missing_ok=True)
    report.files, report.bytes = len(files), sum(e["bytes"] for e in files.values())


def _listed(fs: Any, root: str, url: str, creds: Credentials) -> dict[str, int]:
    """Every file under `root` (or the one file it names) with its size, from a store without an event loop."""
    try:
        return list_files(fs, root)
    except Exception as exc:  # noqa: BLE001 - every backend raises its own types; all become one line
        raise storage_error(url, exc, creds, kind=StagingError) from None


async def _pages(fs: Any, root: str, url: str, creds: Credentials) -> AsyncIterator[dict[str, int]]:
    """`_listed` a page at a time, on the filesystem's event loop, the first page as small as one short request."""
    try:
        async for page in list_file_pages(fs, root, first_page_size=FIRST_PAGE_SIZE):
            yield page
    except Exception as exc:  # noqa: BLE001 - every backend raises its own types; all become one line
        raise storage_error(url, exc, creds, kind=StagingError) from None


def _relative(found: dict[str, int], folder: str, url: str) -> dict[str, int]:
    """Each listed file's path below `folder`, with its size; refuses one that would land outside the cache."""
    listing = {}
    for path, size in found.items():
        rel = path[len(folder) :].lstrip("/") if path.startswith(folder) else path.rsplit("/", 1)[-1]
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise StagingError(
                f"{url}: object {path!r} would land outside the cache folder; refusing to stage it", retryable=False
            )
        listing[rel] = size
    return listing


def _check_against_index(url: str, data: Path, journal: dict[str, dict[str, Any]], expected: dict[str, str]) -> None:
    """A copied shard whose sha256 is not the packed dataset's index's is removed and named in one line."""
    for rel, want in sorted(expected.items()):
        got = journal.get(rel, {}).get("sha256")
        if got and got != want:
            (data / rel).unlink(missing_ok=True)
            raise StagingError(
                f"{url}/{rel}: sha256 {got[:12]}… differs from the index's {want[:12]}…; "
                "the source changed or is corrupt; pack it again",
                retryable=False,
            )


def _expected_sha256(fs: Any, root: str, listing: dict[str, int], data: Path, creds: Credentials) -> dict[str, str]:
    """For a packed dataset, the index lists every shard's sha256: check each copy against it."""
    if "index.json" not in listing:
        return {}
    try:
        index = json.loads(fs.cat_file(f"{root}/index.json"))
        return {s["name"]: s["sha256"] for s in index.get("shards", []) if isinstance(s, dict)}
    except Exception:  # noqa: BLE001 - not a clusterfit index: sizes are checked all the same
        return {}


def _copy_one(fs: Any, remote: str, local: Path, size: int, url: str, creds: Credentials) -> tuple[str, int]:
    """Copy into local.part, continuing a partial copy; returns (sha256 of the whole file, bytes fetched now)."""
    part = Path(_part(local))
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    digest = hashlib.sha256()
    if have:
        with open(part, "rb") as f:
            for block in iter(lambda: f.read(_CHUNK), b""):
                digest.update(block)
    fetched = 0
    try:
        with fs.open(remote, "rb", block_size=_CHUNK) as src, open(part, "ab") as dst:
            if have:
                src.seek(have)
            while True:
                block = src.read(_CHUNK)
                if not block:
                    break
                dst.write(block)
                digest.update(block)
                fetched += len(block)
    except Exception as exc:  # noqa: BLE001 - connection errors of every backend; the .part file is kept
        raise _copy_stopped(url, remote, exc, creds) from None
    if have + fetched != size:
        _changed_while_copied(url, remote, have + fetched, size)
    return digest.hexdigest(), fetched


def _copy_stopped(url: str, path: str, exc: BaseException, creds: Credentials) -> StagingError:
    stopped = f"{url}: copying {path.rsplit('/', 1)[-1]} stopped"
    return storage_error(stopped, exc, creds, then="; run again to resume", kind=StagingError)


def _changed_while_copied(url: str, remote: str, got: int, listed: int) -> NoReturn:
    # The object changed while it was copied: the next run lists it again and copies the new one.
    raise StagingError(f"{url}: {remote} has {got} bytes, the listing said {listed}; run again", retryable=True)


# A file's write (and hash) that takes longer than this, on a network file system or a busy disk, would hold up
# every transfer on the event loop's thread: from then on the writes go to threads. Below it, handing each file
# to a thread and back cost more than the write: 0.13 s of CPU per 1,000 files of 110 KB (benchmarks/RESULTS.md).
_SLOW_WRITE_S = 0.002
# A slow disk is slow at every write; one slow write is the loop's thread preempted on busy cores (on tmpfs, one
# in two rounds of the benchmark handed its writes to threads after a single one).
_SLOW_WRITES_IN_A_ROW = 3


def _fetch_concurrently(
    fs: Any,
    pages: AsyncIterator[dict[str, int]],
    take: Callable[[dict[str, int]], list[tuple[str, str, int]]],
    concurrency: int,
    url: str,
    creds: Credentials,
    keep: Callable[[str, bytes, str | None], None],
) -> None:
    """The listing's `pages`, each given to `take` as the store answers; the small files `take` returns are
    fetched while later pages are listed, each in one GET, `concurrency` of them in flight on the filesystem's
    event loop, and given to `keep` (writing, with the file's sha256) as they arrive: each hashed on a thread and
    written on the loop's thread while writes are fast, both on threads once writes are slow (`_SLOW_WRITE_S`,
    several in a row). A thread per transfer through fsspec's blocking wrapper (and a HEAD request per file to
    open it) capped small files at a third of what the store serves. Returns, or raises the first error, only
    once no `keep` runs any more: the caller's journal and lock outlive every write into the cache."""
    from fsspec.asyn import sync

    fetchers = max(1, concurrency)

    async def fetch_with(read: Callable[[str, int | None], Awaitable[bytes]], writers: ThreadPoolExecutor) -> None:
        # Bounded: the listing runs at most a few pages ahead of the fetchers, not a whole bucket's names ahead.
        listed: asyncio.Queue[tuple[str, str, int] | None] = asyncio.Queue(maxsize=_LISTED_AHEAD)
        loop = asyncio.get_running_loop()
        slow_writes = 0  # in a row, on the loop's thread

        async def lister() -> None:
            async for page in pages:
                for item in take(page):
                    await listed.put(item)
            for _ in range(fetchers):
                await listed.put(None)  # the listing ended: each fetcher stops once the files before are taken

        async def fetcher() -> None:
            nonlocal slow_writes
            while (item := await listed.get()) is not None:  # each file is taken by one fetcher
                path, rel, size = item
                try:
                    # At most a byte more than listed: an object that grew since is caught, not held whole (an
                    # empty one is read plainly: stores refuse a range of an empty object).
                    body = await read(path, size + 1 if size else None)
                except Exception as exc:  # noqa: BLE001 - connection errors of every backend
                    raise _copy_stopped(url, rel, exc, creds) from None
                # hashlib lets go of the GIL, so the loop serves other answers meanwhile (1.17x on tmpfs); the files
                # are still created here: writes on threads side by side lost on an ext4 disk (RESULTS.md).
                digest = None
                if slow_writes < _SLOW_WRITES_IN_A_ROW:
                    digest = await loop.run_in_executor(writers, _sha256, body)
                if slow_writes >= _SLOW_WRITES_IN_A_ROW:  # (again: writes may have turned slow meanwhile)
                    await loop.run_in_executor(writers, keep, rel, body, digest)
                    continue
                started = time.perf_counter()
                keep(rel, body, digest)
                slow_writes = slow_writes + 1 if time.perf_counter() - started > _SLOW_WRITE_S else 0

        tasks = [asyncio.ensure_future(lister())] + [asyncio.ensure_future(fetcher()) for _ in range(fetchers)]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed: the others stop too, and are awaited before the error is raised
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def fetch_all(writers: ThreadPoolExecutor) -> None:
        async with whole_file_reader(fs) as read:  # its connections are closed before the loop moves on
            await fetch_with(read, writers)

    with ThreadPoolExecutor(thread_name_prefix="staging-write") as writers:  # exits once every write ended
        sync(fs.loop, fetch_all, writers)


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _write_part(local: str, body: bytes) -> None:
    """`body` as local's .part file. Written by the descriptor: a buffered file object for each file
    cost 1-2 % of the event loop thread's CPU (benchmarks/RESULTS.md)."""
    part = os.open(_part(local), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        unwritten = memoryview(body)
        while unwritten:
            unwritten = unwritten[os.write(part, unwritten) :]
    finally:
        os.close(part)


def _verify_all(data: Path, files: dict[str, dict[str, Any]], workers: int) -> set[str]:
    def bad(item: tuple[str, dict[str, Any]]) -> str | None:
        rel, entry = item
        path = data / rel
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_of(path) != entry["sha256"]:
            return rel
        return None

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return {rel for rel in pool.map(bad, files.items()) if rel}


def _part(path: str | Path) -> str:
    return f"{path}.part"


def _total(manifest: dict[str, Any]) -> int:
    return sum(int(e["bytes"]) for e in manifest["files"].values())


def _read_journal(path: Path) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash: that file is copied again
            entries[entry["file"]] = {"bytes": entry["bytes"], "sha256": entry["sha256"]}
    return entries


def _rewrite_journal(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    write_atomically(path, "".join(json.dumps({"file": k, **v}) + "\n" for k, v in entries.items()))


def stage_inputs(spec: JobSpec, run_token: str, log: Callable[[str], None] = print) -> JobSpec:
    """The spec with every URL in trainer.data replaced by its staged local copy (mode: download); with
    mode: direct the URLs stay, and the shards are streamed while training. A scoring job's input at a URL is
    staged the same way."""
    if spec.scorer is not None:
        scorer = spec.scorer
        if not is_url(scorer.input):
            return spec
        report = stage(
            scorer.input, scorer.cache_dir, job_credentials(spec), workers=scorer.stage_workers, run_token=run_token
        )
        log(describe(report))
        return spec.model_copy(update={"scorer": scorer.model_copy(update={"input": str(report.local)})})
    data, init = spec.trainer.data, spec.trainer.init
    creds = job_credentials(spec)
    changes: dict[str, Any] = {}
    if init is not None and is_url(init.weights):  # one file, staged (and verified) like a dataset
        report = stage(init.weights, data.cache_dir, creds, workers=1, run_token=run_token)
        log(describe(report))
        weights = str(report.local / init.weights.rstrip("/").rsplit("/", 1)[-1])
        changes["init"] = init.model_copy(update={"weights": weights})
    local: dict[str, str] = {}
    for name in ("train", "val") if data.mode == "download" else ():
        url = getattr(data, name)
        if url is None or not is_url(url):
            continue
        report = stage(url, data.cache_dir, creds, workers=data.stage_workers, run_token=run_token)
        log(describe(report))
        local[name] = str(report.local)
    if local:
        changes["data"] = data.model_copy(update=local)
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update=changes)}) if changes else spec


def check_remote_file(url: str, storage: StorageSpec, field_name: str) -> None:
    """One line before anything runs when `url` is not a file the store will give (missing, refused, down, silent)."""
    where = _where(url, field_name)
    answered_within(PREFLIGHT_DEADLINE_S, where, lambda: _check_remote_file(url, storage, where), StagingError)


def _where(url: str, field_name: str) -> str:
    """The field and its URL as messages name them: without a query string, where a SAS token may ride along."""
    return f"{field_name} = {public(url)!r}"


def _check_remote_file(url: str, storage: StorageSpec, where: str) -> None:
    creds = credentials(storage)
    fs, root = open_filesystem(url, creds)
    try:
        info = fs.info(root)
    except Exception as exc:  # noqa: BLE001 - every backend raises its own types
        raise storage_error(where, exc, creds, kind=StagingError) from None
    if info.get("type") != "file":
        raise StagingError(f"{where}: not a file; give the URL of a .safetensors file", retryable=False)


def describe(report: StageReport) -> str:
    if report.reused:
        return f"staged {report.url}: reused the verified copy in {report.local} ({report.files} files)"
    resumed = f", {report.resumed_files} already there from an interrupted copy" if report.resumed_files else ""
    return (
        f"staged {report.url} -> {report.local}: {report.copied_files} files, {report.copied_bytes / 1e6:.1f} MB in "
        f"{report.seconds:.1f} s ({report.mb_per_s:.1f} MB/s, {report.copied_files / max(report.seconds, 1e-9):.0f} "
        f"files/s){resumed}"
    )


def remote_summary(url: str, storage: StorageSpec, field_name: str) -> tuple[list[str], int | None]:
    """What the launcher can learn cheaply before staging: the classes (and the count, for packed data)."""
    where = _where(url, field_name)
    return answered_within(PREFLIGHT_DEADLINE_S, where, lambda: _remote_summary(url, storage, where), StagingError)


def _remote_summary(url: str, storage: StorageSpec, where: str) -> tuple[list[str], int | None]:
    creds = credentials(storage)
    fs, root = open_filesystem(url, creds)
    try:
        entries = fs.ls(root, detail=True)
        sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries if e.get("type") == "file"}
        if "index.json" in sizes:
            index = json.loads(fs.cat_file(f"{root}/index.json"))
            for shard in index["shards"]:
                if sizes.get(shard["name"]) != shard["bytes"]:
                    found = "is missing" if shard["name"] not in sizes else f"has {sizes[shard['name']]} bytes"
                    raise StagingError(
                        f"{where}: shard {shard['name']} {found}, the index says {shard['bytes']} "
                        "bytes; upload the packed dataset again",
                        retryable=False,
                    )
            return list(index["classes"]), int(index["samples"])
    except StagingError:
        raise
    except Exception as exc:  # noqa: BLE001 - every backend raises its own types
        raise storage_error(where, exc, creds, kind=StagingError) from None
    classes = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
    if not classes:
        raise StagingError(
            f"{where}: has no class folders; expected {public(url)}/<class>/<image>.jpg", retryable=False
        )
    return classes, None
