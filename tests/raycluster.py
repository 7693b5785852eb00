"""A real two-node Ray cluster on 127.0.0.1 for tests: a head and a second node, each its own `ray start
--block` process group with free ports, a temp folder, one CPU and one logical GPU, token authentication on,
the second node under a host name of its own, each with a `clusterfit warm-start` of its own; stopped after."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from azurite import free_port

from clusterfit.backends.warm_start import WARM_START_ENV

RAY = str(Path(sys.executable).with_name("ray"))  # the venv's ray, so Ray's workers run the venv's python
_MEMORY = str(2 * 1024**3)  # Ray would count the host's memory once per node and overcommit it
_OBJECT_STORE = str(200 * 1024**2)
_ANSWER = b"answer: "
# A Ray driver answering the tests' questions, one line each, for as long as the tests ask.
_PROBE = f"""
import json, sys, ray
ray.init()
for question in sys.stdin:
    if question.strip() == "nodes":
        answer = sum(node["Alive"] for node in ray.nodes())
    else:
        answer = {{g["name"]: g["state"] for g in ray.util.placement_group_table().values()}}
    print("{_ANSWER.decode()}" + json.dumps(answer), flush=True)
"""


def _unshare() -> str | None:
    """What gives a node a host name of its own: `unshare`, as root."""
    return shutil.which("unshare") if os.geteuid() == 0 else None


def _with_own_host_name(command: list[str]) -> list[str]:
    """`command` under a host name of its own, as a node on another machine has: Open MPI tells its daemons
    apart by host name, and two on one name do not finish a job. `localhost`, which resolves everywhere (as
    other nodes' names do on a real cluster), in a UTS namespace of its own (root); as it is elsewhere."""
    unshare = _unshare()
    if unshare is None:
        return command
    return [unshare, "--uts", "/bin/sh", "-c", 'hostname localhost && exec "$@"', "node", *command]


def _with_warm_start(command: list[str], python: str, socket_path: Path) -> list[str]:
    """`command` beside `clusterfit warm-start` at `socket_path`, as a user starts one with each node: in the
    node's process group and namespaces, so its forked agents are confined as the node's actors are, and gone
    with the node."""
    warm_start = shlex.join([python, "-m", "clusterfit", "warm-start", "--socket", str(socket_path)])
    return ["/bin/sh", "-c", f'{warm_start} & exec "$@"', "node", *command]


class RayCluster:
    def __init__(self, python: str | None = None, *, warm_starts: bool = True) -> None:
        # The interpreter Ray's nodes start their workers with (and the tests' driver, whose Python must be the
        # same version): by default this environment's.
        self.python = python
        # NOTE: a short folder under /tmp: Ray's Unix socket paths must stay under 108 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="cfray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._probe: subprocess.Popen[bytes] | None = None  # the connected driver that _ask() asks
        self._probe_output = b""  # what it printed that is not read yet
        self.own_host_names = _unshare() is not None  # every node but the head under a host name of its own
        # Each node's agents fork from a warm-start process of its own (backends/warm_start.py).
        self.warm_starts = warm_starts
        self.warm_start_sockets: list[Path] = []

    def client_env(self, **extra: str) -> dict[str, str]:
        """The current environment plus what a launcher needs to join this cluster: the address and the token."""
        return {**os.environ, **self.auth, "RAY_ADDRESS": self.address, "COLUMNS": "200", **extra}

    def start(self, nodes: int = 2) -> None:
        self._start_node("head", self._head_args())
        self._wait_for_nodes(1)
        for _ in range(nodes - 1):
            self.add_node()
        self._wait_for_warm_starts()

    def add_node(self) -> subprocess.Popen[bytes]:
        """One more node (as a replaced spot VM would join), once Ray counts it alive."""
        count = len(self.nodes) + 1
        self._start_node(f"node{count}", [f"--address={self.address}", "--node-ip-address=127.0.0.1", *self._common()])
        self._wait_for_nodes(count)
        self._wait_for_warm_starts()
        return self.nodes[-1]

    def remove_node(self, node: subprocess.Popen[bytes]) -> None:
        """Stops a node that add_node() started, as `stop` does."""
        self.nodes.remove(node)
        node.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    def _common(self) -> list[str]:
        return [
            "--num-cpus=1",
            # A logical GPU per node (Ray's resource accounting; no device): GPU bundles are placed for real, and
            # Ray sets CUDA_VISIBLE_DEVICES for the actor as it would on a GPU node.
            "--num-gpus=1",
            f"--memory={_MEMORY}",
            f"--object-store-memory={_OBJECT_STORE}",
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}",
            "--block",
        ]

    def _head_args(self) -> list[str]:
        return [
            "--head",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            *self._common(),
        ]

    def alive_nodes(self) -> int:
        answer = self._ask("nodes")
        return answer if isinstance(answer, int) else 0

    def placement_groups(self) -> dict[str, str]:
        """Name -> state of every placement group the cluster knows."""
        answer = self._ask("placement groups")
        assert isinstance(answer, dict), "the Ray driver that the tests ask could not connect"
        return answer

    def _ask(self, question: str) -> Any:
        """One answer from a Ray driver that stays connected between questions: a new driver per question cost
        about 2.5 s of CPU each (interpreter, ray, ray.init). A driver that died or could not connect yet (the
        head still starting) is started again next time; None when it does not answer."""
        if self._probe is None or self._probe.poll() is not None:
            self._probe = subprocess.Popen(
                [self.python or sys.executable, "-c", _PROBE],
                env={**self.client_env(), "RAY_LOG_TO_STDERR": "0"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            self._probe_output = b""
        probe = self._probe
        assert probe.stdin is not None and probe.stdout is not None
        try:
            probe.stdin.write(question.encode() + b"\n")
            probe.stdin.flush()
        except OSError:  # it died (could not connect)
            probe.wait()
            return None
        deadline = time.monotonic() + 120
        while (left := deadline - time.monotonic()) > 0:
            line, newline, rest = self._probe_output.partition(b"\n")
            if newline:
                self._probe_output = rest
                if line.startswith(_ANSWER):
                    return json.loads(line[len(_ANSWER) :])
                continue  # something Ray printed
            readable, _, _ = select.select([probe.stdout], [], [], left)
            chunk = os.read(probe.stdout.fileno(), 65536) if readable else b""
            if not chunk:  # the driver ended, or never answered: a new one next time
                break
            self._probe_output += chunk
        probe.kill()
        probe.wait()
        return None

    def stop(self) -> None:
        """Every process of both nodes: SIGTERM to each `ray start --block`, which stops its node's daemons
        (a SIGTERM to their whole group makes it wait half a minute for them instead), SIGKILL to what
        remains of its group, then to anything left that runs from the cluster's temp folder."""
        if self._probe is not None:
            self._probe.kill()
            self._probe.wait()
        for node in reversed(self.nodes):
            node.terminate()
        for node in self.nodes:
            # NOTE: after a Ray Train run the head's `ray start` took 31 s to exit (measured); what it waits for
            # is a cluster about to be deleted, so a few seconds are enough before SIGKILL.
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        for process in self.leftover_processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def leftover_processes(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(str(self.temp_dir) in part for part in process.info["cmdline"] or []):
                    found.append(process)
        return found

    def _start_node(self, label: str, args: list[str]) -> None:
        log = open(self.temp_dir / f"ray-start-{label}.log", "wb")  # noqa: SIM115 - kept open by the child
        command = [self.python, "-m", "ray.scripts.scripts", "start", *args] if self.python else [RAY, "start", *args]
        env = {**os.environ, **self.auth, "RAY_ADDRESS": ""}  # never join a cluster someone else started
        env.pop(WARM_START_ENV, None)  # the tests' own, in another process group
        if self.warm_starts:
            self.warm_start_sockets.append(self.temp_dir / f"warm-start-{label}" / "agents.sock")
            env[WARM_START_ENV] = str(self.warm_start_sockets[-1])
            command = _with_warm_start(command, self.python or sys.executable, self.warm_start_sockets[-1])
        self.nodes.append(
            subprocess.Popen(
                command if label == "head" else _with_own_host_name(command),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _wait_for_warm_starts(self) -> None:
        """Until each node's warm-start process listens: a job that came before would start cold."""
        if self.warm_starts:
            deadline = time.monotonic() + 120
            while not all(path.is_socket() for path in self.warm_start_sockets):
                assert time.monotonic() < deadline, "a node's clusterfit warm-start did not start"
                time.sleep(0.2)

    def _wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + 180
        while self.alive_nodes() < count:
            if any(node.poll() is not None for node in self.nodes) or time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-2000:] for p in self.temp_dir.glob("ray-start-*.log"))
                raise RuntimeError(f"the Ray test cluster did not reach {count} node(s):\n{logs}")
            time.sleep(1)
