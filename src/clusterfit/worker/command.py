"""Command-job worker, started by torchrun on every engine: `python -m clusterfit.worker.command --spec job.yaml`.

It turns torchrun's environment into the one `distribution.type` promises, starts the rank's liveness heartbeat
(worker/liveness.py), tells clusterfit.session where the job's spec is, then replaces itself with the user's
command (exec), so the command's exit code and the signals torchrun or the engine send reach it unchanged. A
plain command (a program and its arguments) is exec'd itself; one with shell syntax runs under /bin/sh, which
reports a program killed by signal N as exit code 128 + N.

- pytorch: torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT as is.
- mpi: on the local engine mpirun starts the ranks (one MPI world); the wrapper adds torchrun's names and
  PMI_RANK / PMI_SIZE and sends the rank's output to logs/rank-N.log. On other engines (torchrun still places
  the ranks) it sets OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}, PMI_RANK and PMI_SIZE only:
  names, not an MPI runtime.
- tensorflow: also TF_CONFIG, with one `host:port` per rank that each rank picked and published through a
  TCPStore at MASTER_ADDR:MASTER_PORT (the store torchrun's rendezvous hands rank 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

from clusterfit.network import free_port, reachable_address
from clusterfit.outputs import ATTEMPT_ENV, LIVENESS_ENV, RANK_LOG_ENV, SPEC_ENV, JobOutputs
from clusterfit.outputs.layout import rank_log_name
from clusterfit.outputs.logs import rotate
from clusterfit.spec import load_spec
from clusterfit.worker.dist_env import read_dist_env
from clusterfit.worker.liveness import start_liveness

_EXCHANGE_TIMEOUT = timedelta(minutes=10)


def mpi_env(env: Mapping[str, str]) -> dict[str, str]:
    """Open MPI's and PMI's names for the rank layout torchrun already chose (one process per slot)."""
    return {
        "OMPI_COMM_WORLD_RANK": env["RANK"],
        "OMPI_COMM_WORLD_SIZE": env["WORLD_SIZE"],
        "OMPI_COMM_WORLD_LOCAL_RANK": env["LOCAL_RANK"],
        "OMPI_COMM_WORLD_LOCAL_SIZE": env["LOCAL_WORLD_SIZE"],
        "OMPI_COMM_WORLD_NODE_RANK": env.get("GROUP_RANK", "0"),
        "PMI_RANK": env["RANK"],
        "PMI_SIZE": env["WORLD_SIZE"],
    }


def torchrun_names_under_mpirun(env: Mapping[str, str]) -> dict[str, str]:
    """Under mpirun (distribution.type: mpi on the local engine), torchrun's names for the layout Open MPI
    chose, so that the heartbeat, clusterfit.session and the user's script read one contract everywhere."""
    if "OMPI_COMM_WORLD_RANK" not in env or "RANK" in env:
        return {}
    return {
        "RANK": env["OMPI_COMM_WORLD_RANK"],
        "WORLD_SIZE": env["OMPI_COMM_WORLD_SIZE"],
        "LOCAL_RANK": env["OMPI_COMM_WORLD_LOCAL_RANK"],
        "LOCAL_WORLD_SIZE": env["OMPI_COMM_WORLD_LOCAL_SIZE"],
        "GROUP_RANK": env.get("OMPI_COMM_WORLD_NODE_RANK", "0"),
        "PMI_RANK": env["OMPI_COMM_WORLD_RANK"],
        "PMI_SIZE": env["OMPI_COMM_WORLD_SIZE"],
    }


def log_to_rank_file(outputs: JobOutputs, rank: int) -> str:
    """What torchrun's log spec does for its workers (backends/rank_logs.py): this rank's stdout and stderr
    go to logs/rank-N.log, the previous attempt's log kept as rank-N.log.1."""
    path = outputs.logs / rank_log_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rotate(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    sys.stdout.flush()
    os.dup2(fd, sys.stdout.fileno())
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)
    return str(path)


def tf_config(workers: list[str], index: int) -> str:
    """TF_CONFIG for MultiWorkerMirroredStrategy: every rank is a worker; rank 0 is the chief by convention."""
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def exchange_addresses(env: Mapping[str, str], mine: str) -> list[str]:
    """Every rank's `host:port`, in rank order, through the TCPStore rank 0 hosts at MASTER_ADDR:MASTER_PORT."""
    from torch.distributed import TCPStore

    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=rank == 0,
        timeout=_EXCHANGE_TIMEOUT,
        wait_for_workers=False,
    )
    store.set(f"clusterfit/tf/{rank}", mine)
    addresses = [store.get(f"clusterfit/tf/{other}").decode() for other in range(world_size)]
    store.add("clusterfit/tf/read", 1)
    # Rank 0's process hosts the store; it must outlive every other rank's reads, then frees the port.
    while rank == 0 and store.add("clusterfit/tf/read", 0) < world_size:
        time.sleep(0.05)
    return addresses


TENSORFLOW_HINT = "pip install 'clusterfit[tensorflow]' (or tensorflow) in the workers' environment"


def missing_framework(kind: str, command: str) -> str | None:
    """One line naming what a tensorflow job lacks, when its command runs clusterfit's own interpreter
    (`python ...`) and TensorFlow is not importable there; None when nothing is known to be missing."""
    words = shlex.split(command)
    runs_this_python = bool(words) and words[0] in {"python", "python3"}
    if kind != "tensorflow" or not runs_this_python or importlib.util.find_spec("tensorflow") is not None:
        return None
    return f"distribution.type = 'tensorflow': TensorFlow is not installed for {sys.executable}; {TENSORFLOW_HINT}"


def command_env(kind: str, env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    out = {**env, **extra}
    # NOTE: `python` in a command means the interpreter clusterfit runs on, whatever PATH the engine gave.
    out["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    if kind == "mpi" and "OMPI_COMM_WORLD_RANK" not in env:  # under torchrun: Open MPI's names, no MPI runtime
        out.update(mpi_env(env))
    elif kind == "tensorflow":
        host = reachable_address(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        workers = exchange_addresses(env, f"{host}:{free_port()}")
        out["TF_CONFIG"] = tf_config(workers, int(env["RANK"]))
    return out


# A shell's own words (no program of that name): exec'ing them would fail.
_SHELL_BUILTINS = frozenset({".", "alias", "cd", "eval", "exec", "exit", "export", "set", "source", "ulimit", "unset"})


def direct_argv(command: str) -> list[str] | None:
    """The program and its arguments when `command` needs no shell (no operators, expansions, quoting or variable
    assignments), so the program itself becomes the rank's process; else None. Debian's /bin/sh (dash) forks even
    a single command, and a SIGKILLed program then looks like a rank that exited with code 137."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    plain = bool(words) and "\n" not in command.strip() and shlex.join(words) == " ".join(command.split())
    if not plain or "=" in words[0] or words[0] in _SHELL_BUILTINS:
        return None
    return words


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clusterfit.worker.command")
    parser.add_argument("--spec", required=True, help="resolved job spec (YAML) written by the launcher")
    args = parser.parse_args(argv)
    if os.environ.get(RANK_LOG_ENV):
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())  # as the trainer: stderr into logs/rank-N.log too
    spec = load_spec(args.spec)
    assert spec.command is not None, "clusterfit.worker.command runs command jobs only"
    missing = missing_framework(spec.distribution.type, spec.command)
    if missing:
        sys.exit(f"error: {missing}")
    under_mpirun = torchrun_names_under_mpirun(os.environ)
    if under_mpirun:
        os.environ.update(under_mpirun)
        os.environ[RANK_LOG_ENV] = log_to_rank_file(JobOutputs.at(spec.outputs.dir), int(under_mpirun["RANK"]))
    # Forked first, while this process has no other threads (the tensorflow exchange below may start some).
    attempt = int({**os.environ, **spec.environment_variables}.get(ATTEMPT_ENV, "1"))
    liveness = start_liveness(JobOutputs.at(spec.outputs.dir), read_dist_env().rank, attempt)
    session = {SPEC_ENV: str(Path(args.spec).resolve()), LIVENESS_ENV: liveness}
    env = command_env(spec.distribution.type, os.environ, {**spec.environment_variables, **session})
    if spec.code is not None:
        os.chdir(spec.code)
    sys.stdout.flush()
    words = direct_argv(spec.command)
    if words is None:
        os.execve("/bin/sh", ["/bin/sh", "-c", spec.command], env)
    try:
        os.execvpe(words[0], words, env)
    except OSError as exc:  # as a shell would say it, with its exit code for "not found" or "not executable"
        print(f"clusterfit: command = {spec.command!r}: {words[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
