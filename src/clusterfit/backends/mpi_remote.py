"""How an mpi job's mpirun on Ray node 0 starts its daemons on the other nodes, where there is no ssh.

Open MPI starts a daemon (`prted`) on every other host of the job by running its remote-shell agent as
`AGENT HOST COMMAND...`, like ssh. On Ray that agent is `send` below: it leaves COMMAND in the job's outputs
folder (which every node sees) for HOST, the alias `clusterfit-node-N` of the job's node N, whose actor already
runs `receive`: it takes the command and becomes it. So the daemon runs inside the node's actor, as the job's
account, and stops with it; Ray places nothing itself and there is no listening port of ours.
This is what the Kubeflow MPI operator did with `kubectl exec` as the agent, on Ray's placement instead.

Both sides run as the job's own account: the folder is the job's, and nothing in it runs with more rights than
the job already has. Neither imports torch: `receive` is each other node's whole agent until the daemon starts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from clusterfit.files import write_atomically
from clusterfit.outputs.env import MPI_LAUNCHES_ENV

HOST_ALIAS = "clusterfit-node-"
_POLL_S = 0.05
# mpirun asks each node once, right after it starts; a node's actor starts `receive` before mpirun exists.
TAKE_TIMEOUT_S = 120.0


def host_alias(node: int) -> str:
    return f"{HOST_ALIAS}{node}"


def request_file(launches: Path, node: int) -> Path:
    """`launches`: one run's prefix (JobOutputs.mpi_launches)."""
    return launches.with_name(f"{launches.name}.node-{node}.sh")


def agent_command(python: str) -> str:
    """mpirun's remote-shell agent (`plm_ssh_agent`), which Open MPI splits at spaces."""
    return f"{python} -m clusterfit.backends.mpi_remote send"


def send(launches: Path, host: str, command: str, timeout: float = TAKE_TIMEOUT_S) -> int:
    """Leaves `command` for `host`'s node and returns once that node has taken it: 0, or 1 with a line on
    stderr, which mpirun reports as a daemon that did not start."""
    if not host.startswith(HOST_ALIAS) or not host[len(HOST_ALIAS) :].isdigit():
        print(f"clusterfit: mpirun asked for host {host!r}, which is none of this job's Ray nodes", file=sys.stderr)
        return 1
    request = request_file(launches, int(host[len(HOST_ALIAS) :]))
    write_atomically(request, command)
    deadline = time.monotonic() + timeout
    while request.exists():
        if time.monotonic() > deadline:
            print(f"clusterfit: Ray node {host} did not take mpirun's daemon within {timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(_POLL_S)
    return 0


def receive(launches: Path, node: int) -> None:
    """Waits for node 0's mpirun to ask for this node's daemon, then becomes that command (never returns)."""
    request = request_file(launches, node)
    while not request.exists():
        time.sleep(_POLL_S)
    command = request.read_text()
    request.unlink()  # the sender's sign that this node took it
    sys.stdout.flush()
    os.execv("/bin/sh", ["/bin/sh", "-c", command])


def main(argv: list[str]) -> int:
    if argv[:1] == ["send"] and len(argv) >= 3:  # as ssh: the remote command is the rest, joined by spaces
        return send(Path(os.environ[MPI_LAUNCHES_ENV]), argv[1], " ".join(argv[2:]))
    if argv[:1] == ["receive"] and len(argv) == 3:
        receive(Path(argv[1]), int(argv[2]))
    print("usage: python -m clusterfit.backends.mpi_remote send HOST COMMAND... | receive PREFIX NODE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
