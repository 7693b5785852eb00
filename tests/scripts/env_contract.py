"""A user script of a command job: checks the environment its `distribution.type` promises, prints it,
and for tensorflow connects to every other rank's advertised TF_CONFIG address. Exits 1 on any mismatch."""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def expect(name: str, value: object) -> None:
    actual = os.environ.get(name)
    if actual != str(value):
        print(f"env mismatch: {name}={actual!r}, expected {value!r}", flush=True)
        sys.exit(1)


def check_tensorflow(rank: int, world_size: int) -> None:
    config = json.loads(os.environ["TF_CONFIG"])
    workers = config["cluster"]["worker"]
    if (
        len(workers) != world_size
        or len(set(workers)) != world_size
        or config["task"]
        != {
            "type": "worker",
            "index": rank,
        }
    ):
        print(f"bad TF_CONFIG {config}", flush=True)
        sys.exit(1)
    # Each rank serves its advertised port; every rank must reach every other one there.
    host, port = workers[rank].rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    server.listen(world_size)
    for other, address in enumerate(workers):
        peer_host, peer_port = address.rsplit(":", 1)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection((peer_host, int(peer_port)), timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"cannot reach worker {other} at {address}", flush=True)
                    sys.exit(1)
                time.sleep(0.1)
    for _ in range(world_size):
        server.accept()[0].close()


def main() -> None:
    kind = sys.argv[1]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            print(f"env mismatch: {name} missing", flush=True)
            sys.exit(1)
    expect("FROM_SPEC", "yes")
    leaked = sorted(set(os.environ) & {"RAY_AUTH_TOKEN"})
    if leaked:  # the Ray cluster's key: a job holding it could run anything on the cluster
        print(f"env leaked to the job: {', '.join(leaked)}", flush=True)
        sys.exit(1)
    if kind == "mpi":
        expect("OMPI_COMM_WORLD_RANK", rank)
        expect("OMPI_COMM_WORLD_SIZE", world_size)
        expect("OMPI_COMM_WORLD_LOCAL_RANK", os.environ["LOCAL_RANK"])
        expect("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])
        expect("PMI_RANK", rank)
        expect("PMI_SIZE", world_size)
    elif kind == "tensorflow":
        check_tensorflow(rank, world_size)
    print(f"env ok: {kind} rank {rank}/{world_size} in {os.path.basename(os.getcwd())}", flush=True)


if __name__ == "__main__":
    main()
