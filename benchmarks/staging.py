"""Staging throughput from a real Azure Blob Storage emulator (Azurite), against what the store itself serves.

Starts Azurite on 127.0.0.1 as the tests do (their helper installs it with npm on first use), uploads FILES
objects of FILE_KB each (incompressible bytes, like JPEGs) and one object of the same total size. Uploads are not
timed. Then, in rotating order for `--rounds` rounds:

- the store's ceiling: raw concurrent GETs with the Azure SDK's async client, each object read into memory, at
  every concurrency of `--ceiling-concurrency` (each round starts with a different one);
  and once more at `--workers` in flight without the SDK's environment lookups (aiohttp reads the proxy
  variables and .netrc for every request unless told not to); and once with plain GETs through aiohttp alone,
  authorized by a SAS, without the SDK's request pipeline (what staging sends where the credential allows);
- the store's ceiling with its listing: the names listed (List Blobs by plain GETs), then those plain GETs, one
  after the other: what any copy asks of the store, which a copy that lists while it fetches may overlap;
- the same GETs written to plain files, with nothing else (what the node's disk adds), without those lookups;
- `clusterfit.data.staging.stage` of the small files and of the large file: the copy a job's workers make with
  `mode: download` (`--workers` transfers at a time, sha256 of every file, journal, manifest); and of the small
  files once more with a proxy variable set (`NO_PROXY`), where clusterfit keeps the SDK's lookups.

The benchmark's process freezes the objects of its imports, as the processes that stage in clusterfit do.
Prints the median and range of each, and staging against the best ceiling, the ceiling with the listing, plain
GETs into files and (with `--previous FILE`, another version of `clusterfit/data/staging.py` measured in the same
rotation, one that takes `whole_file_reader` as a context manager) the previous version: the ratio of medians,
and the median and range of the ratio within each round.

With `--listed N`, only the listing is measured instead, on N objects of one byte: fsspec's `find` through
adlfs (what staging once used), and `clusterfit.storage.filesystems.list_files` through the SDK's names-only
listing (where a proxy is set) and by plain GETs, in rotating order.

    python benchmarks/staging.py --files 1000 --file-kb 110 --workers 32 --rounds 3
    git show HEAD~5:src/clusterfit/data/staging.py > /tmp/old_staging.py
    python benchmarks/staging.py --cache-dir /dev/shm --previous /tmp/old_staging.py
    python benchmarks/staging.py --listed 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from azure.storage.blob import (  # noqa: E402
    BlobServiceClient,
    ContainerSasPermissions,
    generate_container_sas,
)
from azure.storage.blob.aio import ContainerClient  # noqa: E402
from azurite import Azurite  # noqa: E402 - the tests' helper: one way to start the emulator

from clusterfit.bench.data import machine_description  # noqa: E402
from clusterfit.data.staging import Credentials, stage  # noqa: E402
from clusterfit.storage.filesystems import list_files, open_filesystem  # noqa: E402

CONTAINER = "bench"

# The processes that stage in a job or by hand (a rank, forked from the agent; `clusterfit data stage`) run with
# their imports' objects frozen, out of the collector's walks (clusterfit/__main__.py, backends/agent.py): so does
# this one, for every measurement alike.
gc.freeze()


def upload(service: BlobServiceClient, names: list[str], file_kb: int) -> None:
    container = service.get_container_client(CONTAINER)
    for name in names:
        container.upload_blob(name, os.urandom(file_kb * 1000), overwrite=True)
    container.upload_blob("large/one.bin", os.urandom(len(names) * file_kb * 1000), overwrite=True, max_concurrency=4)


async def raw_gets(
    connection_string: str, names: list[str], concurrency: int, into: Path | None, *, env_lookups: bool = True
) -> None:
    """Every object by one GET, `concurrency` in flight; each written to a file under `into` when given.
    `env_lookups`: the SDK's default, aiohttp reading the proxy variables and .netrc for every request."""
    async with ContainerClient.from_connection_string(
        connection_string, CONTAINER, use_env_settings=env_lookups
    ) as container:
        pending = iter(names)

        async def getter() -> None:
            for name in pending:
                body = await (await container.download_blob(name)).readall()
                if into is not None:
                    (into / name).write_bytes(body)

        await asyncio.gather(*(getter() for _ in range(concurrency)))


async def plain_gets(endpoint: str, sas: str, names: list[str], concurrency: int) -> None:
    """Every object by one GET through aiohttp alone, authorized by a SAS: no SDK pipeline on the client."""
    import aiohttp

    async with aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(limit=0)) as http:
        pending = iter(names)

        async def getter() -> None:
            for name in pending:
                async with http.get(f"{endpoint}/{CONTAINER}/{name}?{sas}") as response:
                    response.raise_for_status()
                    await response.read()

        await asyncio.gather(*(getter() for _ in range(concurrency)))


async def listed_then_plain_gets(endpoint: str, sas: str, prefix: str, concurrency: int) -> None:
    """What any copy asks of the store: the names under `prefix` (List Blobs by plain GETs, 5,000 a page), then
    every object by one plain GET. Nothing overlaps: the store's time for both."""
    import aiohttp

    names: list[str] = []
    async with aiohttp.ClientSession(trust_env=False) as http:
        marker = ""
        while True:
            query = f"restype=container&comp=list&prefix={prefix}" + (f"&marker={marker}" if marker else "")
            async with http.get(f"{endpoint}/{CONTAINER}?{query}&{sas}") as response:
                response.raise_for_status()
                answer = ElementTree.fromstring(await response.read())
            names += [blob.findtext("Name") or "" for blob in answer.iterfind("Blobs/Blob")]
            marker = answer.findtext("NextMarker") or ""
            if not marker:
                break
    await plain_gets(endpoint, sas, names, concurrency)


async def upload_tiny(connection_string: str, names: list[str], concurrency: int = 32) -> None:
    async with ContainerClient.from_connection_string(connection_string, CONTAINER) as container:
        pending = iter(names)

        async def uploader() -> None:
            for name in pending:
                await container.upload_blob(name, b"x", overwrite=True)

        await asyncio.gather(*(uploader() for _ in range(concurrency)))


def measure_listing(connection_string: str, count: int, rounds: int) -> None:
    """Listing `count` objects: adlfs's find, list_files through the SDK and by plain GETs, in rotating order,
    `rounds` times each."""
    names = [f"listed/c{index % 100}/{index:07d}.jpg" for index in range(count)]
    asyncio.run(upload_tiny(connection_string, names))
    fs, root = open_filesystem(f"az://{CONTAINER}/listed", Credentials())

    def through_the_sdk() -> object:
        # A proxy variable keeps the SDK's requests (the client itself was made without the environment lookups,
        # as it is where none is set): the SDK's names-only listing, sizes read again from its answers.
        os.environ["NO_PROXY"] = "example.invalid"
        try:
            return list_files(fs, root)
        finally:
            del os.environ["NO_PROXY"]

    measures: dict[str, Callable[[], object]] = {
        "fsspec find (adlfs: the SDK's blob properties)": lambda: fs.find(root, detail=True),
        "clusterfit list_files through the SDK's names-only listing (where a proxy is set)": through_the_sdk,
        "clusterfit list_files by plain GETs under a SAS, each page parsed once": lambda: list_files(fs, root),
    }
    assert len(list_files(fs, root)) == count == len(through_the_sdk()) and len(fs.find(root)) == count
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in measures}
    for round_index in range(rounds):
        shift = round_index % len(measures)
        order = list(measures)[shift:] + list(measures)[:shift]
        for name in order:
            results[name].append(timed(measures[name]))
    print(f"machine: {machine_description()}")
    print(f"Azurite on 127.0.0.1 (sharing the cores), listing {count} objects, {rounds} rounds\n")
    print("| listing | wall s median | range | client CPU s per 1000 objects |")
    print("|---|---:|---:|---:|")
    for name, timings in results.items():
        walls = [wall for wall, _, _ in timings]
        cpu = statistics.median(c for _, c, _ in timings) * 1000 / count
        print(f"| {name} | {statistics.median(walls):.2f} | {min(walls):.2f}–{max(walls):.2f} | {cpu:.3f} |")


def load_module(path: Path) -> Any:
    """A Python file as a module of its own name, so that its dataclasses resolve."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def timed(run: Callable[[], object], store_pid: int | None = None) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, the store's CPU seconds) of one call."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    store_before = process_cpu_s(store_pid)
    started = time.perf_counter()
    run()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, process_cpu_s(store_pid) - store_before


def process_cpu_s(pid: int | None) -> float:
    """User and system CPU seconds of process `pid` (all its threads) so far, from /proc; 0 without one."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1000, help="number of small files")
    parser.add_argument("--file-kb", type=int, default=110, help="size of each small file (ImageNet's mean JPEG)")
    parser.add_argument("--workers", type=int, default=32, help="parallel transfers (trainer.data.stage_workers)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measurement, in rotating order")
    parser.add_argument(
        "--ceiling-concurrency", default="1,8,32,64", help="comma-separated GETs in flight for the ceiling"
    )
    parser.add_argument("--cache-dir", default=None, help="where the copies go (default: a temporary folder)")
    parser.add_argument(
        "--previous",
        type=Path,
        default=None,
        help="another version of clusterfit/data/staging.py to measure beside this one, e.g. from "
        "`git show COMMIT:src/clusterfit/data/staging.py > old_staging.py`",
    )
    parser.add_argument("--listed", type=int, default=0, help="measure only the listing of this many objects")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.ceiling_concurrency.split(",")]
    names = [f"small/c{index % 10}/{index:06d}.jpg" for index in range(args.files)]
    megabytes = args.files * args.file_kb / 1000
    results: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="clusterfit-staging-bench-") as tmp:
        cache = Path(args.cache_dir or tmp) / "bench-cache"
        server = Azurite(Path(tmp) / "azurite")
        server.start()
        try:
            connection = server.connection_string()
            service = BlobServiceClient.from_connection_string(connection)
            service.create_container(CONTAINER)
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection
            if args.listed:
                measure_listing(connection, args.listed, args.rounds)
                return 0
            upload(service, names, args.file_kb)

            def emptied(*folders: Path) -> None:
                for folder in folders:
                    shutil.rmtree(folder, ignore_errors=True)

            async def gets_into_files() -> None:
                folder = cache / "plain"
                for parent in {(folder / name).parent for name in names}:
                    parent.mkdir(parents=True, exist_ok=True)
                await raw_gets(connection, names, args.workers, folder, env_lookups=False)

            def staged_with_a_proxy_setting() -> object:
                # Any proxy variable keeps aiohttp's per-request lookups on, as the SDK has them by default.
                os.environ["NO_PROXY"] = "example.invalid"
                try:
                    return stage(f"az://{CONTAINER}/small", cache / "staged", Credentials(), workers=args.workers)
                finally:
                    del os.environ["NO_PROXY"]

            sas = generate_container_sas(
                service.account_name,
                CONTAINER,
                account_key=service.credential.account_key,
                permission=ContainerSasPermissions(read=True, list=True),
                expiry=datetime.now(timezone.utc) + timedelta(hours=2),
            )
            measures: dict[str, Callable[[], object]] = {
                **{
                    f"ceiling: GETs into memory, {c} in flight": (
                        lambda c=c: asyncio.run(raw_gets(connection, names, c, None))
                    )
                    for c in concurrencies
                },
                f"ceiling: GETs into memory, {args.workers} in flight, no environment lookups": lambda: asyncio.run(
                    raw_gets(connection, names, args.workers, None, env_lookups=False)
                ),
                f"ceiling: plain GETs with a SAS (aiohttp, no SDK pipeline) into memory, {args.workers} in flight": (
                    lambda: asyncio.run(plain_gets(server.endpoint, sas, names, args.workers))
                ),
                f"ceiling with the listing: the store's listing, then plain GETs into memory, {args.workers} "
                "in flight": lambda: asyncio.run(listed_then_plain_gets(server.endpoint, sas, "small/", args.workers)),
                f"GETs into files, {args.workers} in flight": lambda: asyncio.run(gets_into_files()),
                f"clusterfit staging, {args.workers} transfers": lambda: stage(
                    f"az://{CONTAINER}/small", cache / "staged", Credentials(), workers=args.workers
                ),
                f"clusterfit staging, {args.workers} transfers, a proxy variable set": staged_with_a_proxy_setting,
                f"clusterfit staging, 1 file of {megabytes:.0f} MB": lambda: stage(
                    f"az://{CONTAINER}/large", cache / "large", Credentials(), workers=args.workers
                ),
            }
            if args.previous is not None:
                previous = load_module(args.previous)
                measures[f"previous staging ({args.previous.name}), {args.workers} transfers"] = lambda: previous.stage(
                    f"az://{CONTAINER}/small", cache / "staged", previous.Credentials(), workers=args.workers
                )
            order = list(measures)
            for round_index in range(args.rounds):
                shift = round_index % len(order)
                for name in order[shift:] + order[:shift]:
                    emptied(cache / "plain", cache / "staged", cache / "large")  # not timed
                    results.setdefault(name, []).append(timed(measures[name], server.process.pid))
        finally:
            server.stop()
            shutil.rmtree(cache, ignore_errors=True)

    def mb_per_s(name: str) -> list[float]:
        return [megabytes / wall for wall, _, _ in results[name]]

    print(f"machine: {machine_description()}")
    print(f"Azurite on 127.0.0.1 (sharing the cores), {args.files} files of {args.file_kb} KB, {args.rounds} rounds\n")
    cores = os.cpu_count() or 1
    print(
        "| measurement | MB/s median | range | files/s | client CPU s per 1000 files | store CPU s per 1000 files "
        f"| both, share of the {cores} cores |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in results:
        speeds = mb_per_s(name)
        median = statistics.median(speeds)
        cpu = statistics.median(c for _, c, _ in results[name]) * 1000 / args.files
        store = statistics.median(s for _, _, s in results[name]) * 1000 / args.files
        busy = statistics.median((c + s) / wall / cores for wall, c, s in results[name])
        files_per_s = median / megabytes * (1 if "1 file" in name else args.files)
        print(
            f"| {name} | {median:.1f} | {min(speeds):.1f}–{max(speeds):.1f} | {files_per_s:.0f} | {cpu:.2f} "
            f"| {store:.2f} | {busy:.0%} |"
        )
    best = max((n for n in results if n.startswith("ceiling:")), key=lambda n: statistics.median(mb_per_s(n)))
    staging = f"clusterfit staging, {args.workers} transfers"
    against = {f"the best ceiling ({best})": best}
    against["the store's listing and plain GETs"] = next(n for n in results if n.startswith("ceiling with"))
    against["plain GETs into files"] = f"GETs into files, {args.workers} in flight"
    if args.previous is not None:
        against["the previous version"] = f"previous staging ({args.previous.name}), {args.workers} transfers"
    print()
    for label, name in against.items():
        # Each round measures both within seconds of each other: the ratio within a round is spared the machine's
        # drift between rounds, which the ratio of the two medians is not.
        per_round = sorted(ours / theirs for ours, theirs in zip(mb_per_s(staging), mb_per_s(name), strict=True))
        print(
            f"small-file staging: {statistics.median(mb_per_s(staging)) / statistics.median(mb_per_s(name)):.2f}x "
            f"{label} (medians); per round {statistics.median(per_round):.2f}x, "
            f"range {per_round[0]:.2f}-{per_round[-1]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
