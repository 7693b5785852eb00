"""A real Azure Blob Storage emulator (Azurite, from npm) for tests: installed once into a cache folder,
started on 127.0.0.1 with a free port and a temp folder, stopped after."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

ACCOUNT = "devstoreaccount1"
# Azurite's published development key; it opens nothing but a local emulator.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CACHE = Path(os.environ.get("CLUSTERFIT_TEST_CACHE", Path.home() / ".cache" / "clusterfit-tests"))


def azurite_binary() -> Path:
    folder = CACHE / "azurite"
    binary = folder / "node_modules" / ".bin" / "azurite-blob"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not binary.exists():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError("the storage tests need Node.js and npm (apt-get install nodejs npm)")
            subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), "azurite@3"],
                check=True,
                timeout=600,
                capture_output=True,
            )
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Azurite:
    def __init__(self, location: Path, other_accounts: dict[str, str] | None = None) -> None:
        self.binary = azurite_binary()
        self.location = location
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.other_accounts = other_accounts or {}  # name: key, served beside devstoreaccount1

    def account_endpoint(self, account: str = ACCOUNT) -> str:
        return f"http://127.0.0.1:{self.port}/{account}"

    @property
    def endpoint(self) -> str:
        return self.account_endpoint()

    def connection_string(self, key: str = KEY, account: str = ACCOUNT) -> str:
        endpoint = self.account_endpoint(account)
        return f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};BlobEndpoint={endpoint};"

    def start(self) -> None:
        env = None
        if self.other_accounts:  # Azurite then serves only the accounts it is given
            accounts = {ACCOUNT: KEY, **self.other_accounts}
            env = {**os.environ, "AZURITE_ACCOUNTS": ";".join(f"{name}:{key}" for name, key in accounts.items())}
        self.process = subprocess.Popen(
            [
                str(self.binary),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(self.port),
                "--location",
                str(self.location),
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--silent",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Azurite did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def serving(location: Path, container: str) -> Iterator[Azurite]:
    """For a fixture: a running Azurite with `container`, its connection string in AZURE_STORAGE_CONNECTION_STRING
    meanwhile; the test is skipped where Azurite cannot run."""
    import pytest
    from azure.storage.blob import BlobServiceClient
    from services import skip_reason

    reason = skip_reason("azurite")
    if reason is not None:
        pytest.skip(reason)
    server = Azurite(location)
    server.start()
    BlobServiceClient.from_connection_string(server.connection_string()).create_container(container)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())
        yield server
    server.stop()
