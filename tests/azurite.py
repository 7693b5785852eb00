"""A real Azure Blob Storage emulator (Azurite, from npm) for tests: installed once into a cache folder,
started on 127.0.0.1 with a free port and a temp folder, stopped after."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

ACCOUNT = "devstoreaccount1"
# Azurite's published development key; it opens nothing but a local emulator.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_WITHOUT_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the emulator is on loopback
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


def port_outside_ephemeral_range() -> int:
    """A free port of the kind the kernel never picks on its own: a store stopped and started again on its port
    (as one that goes down and comes back) cannot find it taken meanwhile by another test's listening socket."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # Ray's workers listen on 10002-19999 by default, so above that.
    for port in random.sample(range(20000, ephemeral_low), min(200, max(ephemeral_low - 20000, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


class Azurite:
    def __init__(self, location: Path, other_accounts: dict[str, str] | None = None) -> None:
        self.binary = azurite_binary()
        self.location = location
        self.port = port_outside_ephemeral_range()
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
        with self.log.open("ab") as log:
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
                stderr=log,
                start_new_session=True,
                env=env,
            )
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                said = self.log.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"Azurite did not start on port {self.port}: {' / '.join(said)}")
            time.sleep(0.1)

    @property
    def log(self) -> Path:
        return self.location.with_name(self.location.name + ".log")

    def _answers(self) -> bool:
        """This Azurite serves the port: an answer from another program listening there is not one."""
        try:
            with _WITHOUT_PROXY.open(f"{self.endpoint}?comp=list", timeout=2) as answer:
                server = answer.headers.get("Server", "")
        except urllib.error.HTTPError as refused:  # unsigned, so 403: still an answer
            server = refused.headers.get("Server", "")
        except OSError:
            return False
        return server.startswith("Azurite") and self.process is not None and self.process.poll() is None

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


@contextlib.contextmanager
def silent_store() -> Iterator[str]:
    """An Azure connection string whose endpoint takes connections and never answers, as a hung proxy or gateway."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}/{ACCOUNT}"
        yield f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={endpoint};"
