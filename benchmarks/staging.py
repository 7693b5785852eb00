"""Staging throughput from a real Azure Blob Storage emulator (Azurite): many small files vs one large file.

Starts Azurite on 127.0.0.1 as the tests do (their helper installs it with npm on first use), uploads
FILES objects of FILE_KB each (incompressible bytes, like JPEGs) and one object of the same total size, then
times `clusterfit.data.staging.stage` on each: the copy a job's workers make with `mode: download`
(parallel transfers, sha256 of every file, journal, manifest). Uploads are not timed.

    python benchmarks/staging.py --files 2000 --file-kb 110 --workers 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from azure.storage.blob import BlobServiceClient  # noqa: E402
from azurite import Azurite  # noqa: E402 - the tests' helper: one way to start the emulator

from clusterfit.bench.data import machine_description  # noqa: E402
from clusterfit.data.staging import Credentials, StageReport, stage  # noqa: E402

CONTAINER = "bench"


def upload(service: BlobServiceClient, files: int, file_kb: int) -> None:
    container = service.get_container_client(CONTAINER)
    for index in range(files):
        container.upload_blob(f"small/c{index % 10}/{index:06d}.jpg", os.urandom(file_kb * 1000), overwrite=True)
    container.upload_blob("large/one.bin", os.urandom(files * file_kb * 1000), overwrite=True, max_concurrency=4)


def row(name: str, report: StageReport) -> str:
    return (
        f"| {name} | {report.copied_files} | {report.copied_bytes / 1e6:.1f} | {report.seconds:.2f} | "
        f"{report.mb_per_s:.1f} | {report.copied_files / max(report.seconds, 1e-9):.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000, help="number of small files")
    parser.add_argument("--file-kb", type=int, default=110, help="size of each small file (ImageNet's mean JPEG)")
    parser.add_argument("--workers", type=int, default=8, help="parallel transfers (trainer.data.stage_workers)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="clusterfit-staging-bench-") as tmp:
        server = Azurite(Path(tmp) / "azurite")
        server.start()
        try:
            service = BlobServiceClient.from_connection_string(server.connection_string())
            service.create_container(CONTAINER)
            upload(service, args.files, args.file_kb)
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string()
            small = stage(f"az://{CONTAINER}/small", Path(tmp) / "cache", Credentials(), workers=args.workers)
            large = stage(f"az://{CONTAINER}/large", Path(tmp) / "cache", Credentials(), workers=args.workers)
        finally:
            server.stop()
    print(f"machine: {machine_description()}")
    print(f"Azurite on 127.0.0.1, {args.workers} parallel transfers, sha256 of every file\n")
    print("| source | files | MB | seconds | MB/s | files/s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(row(f"{args.files} files of {args.file_kb} KB", small))
    print(row(f"1 file of {args.files * args.file_kb / 1000:.1f} MB", large))
    return 0


if __name__ == "__main__":
    sys.exit(main())
