"""What every engine places on each node: torchrun's elastic agent (backends/agent.py), with the same worker and
environment.

Engines differ only in how they start this command on each node; the workers always see the standard
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT environment that torchrun sets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from clusterfit.backends.agent import AGENT_MODULE, TRAINER_MODULE
from clusterfit.backends.job_folder import copy_code
from clusterfit.outputs import ATTEMPT_ENV, STORAGE_SAS_TOKEN_ENV, JobOutputs
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.spec.model import JobSpec, is_url
from clusterfit.storage.filesystems import cache_folder

RDZV_PORT = 29400  # torchrun's default c10d port on the first node
ELASTIC_LAST_CALL_S = 5
ELASTIC_KEEP_ALIVE_S = 2
ELASTIC_KEEP_ALIVE_ATTEMPTS = 4


THREADS_ENV = "OMP_NUM_THREADS"  # torch's intra-op threads per rank


def threads_per_worker(processes: int, cores: int | None = None) -> int:
    """CPU threads per rank of a job that has this machine to itself, so that its ranks never oversubscribe the
    cores. Jobs of the job service share the machine: they get their slots' share (service/home.py)."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // processes)


def with_shipped_code(spec: JobSpec) -> JobSpec:
    """The spec the workers read: a command job's `code` is its copy in outputs.dir, on every node."""
    if spec.code is None:
        return spec
    return spec.model_copy(update={"code": str(JobOutputs.at(Path(spec.outputs.dir).resolve()).code)})


def as_launched(spec: JobSpec) -> tuple[JobSpec, str | None]:
    """A spec as the launcher runs it, for what an engine renders: with outputs.dir at a URL, the launcher's copy
    in outputs.cache_dir is where the job works here (the URL, returned beside it, is where its outputs go)."""
    if not is_url(spec.outputs.dir):
        return spec, None
    local = str(cache_folder(spec.outputs.dir, spec.outputs.cache_dir).resolve())
    return spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"dir": local})}), spec.outputs.dir


def resolved_spec_file(spec: JobSpec) -> dict[str, str]:
    """job.yaml in outputs.dir, as `Rendered.files` holds it: the spec every worker reads, on every engine."""
    # NOTE: the attempt number travels in the workers' environment only: it is no part of the spec, and a
    # spec may not set CLUSTERFIT_ variables (the workers validate job.yaml again).
    env = {name: value for name, value in spec.environment_variables.items() if name != ATTEMPT_ENV}
    written = with_shipped_code(spec).model_copy(update={"environment_variables": env})
    return {str(JobOutputs.at(spec.outputs.dir).resolved_spec): resolved_spec_text(written)}


def ship_code(spec: JobSpec) -> None:
    """A command job's `code` folder into outputs.dir/code (see copy_code)."""
    if spec.code is not None:
        copy_code(Path(spec.code), Path(spec.outputs.dir))


def storage_secret_env(spec: JobSpec) -> dict[str, str]:
    token = spec.storage.sas_token
    return {STORAGE_SAS_TOKEN_ENV: token.get_secret_value()} if token else {}


def worker_env(threads: int) -> dict[str, str]:
    """Variables every engine sets for the agent and its workers."""
    return {
        THREADS_ENV: str(threads),
        "PYTHONUNBUFFERED": "1",
        # NOTE: with the agent's TCPStore shared across restarts, restarted workers can read the previous
        # attempt's gloo/NCCL addresses and fail with "Connection refused". A store per rendezvous round
        # (hosted by rank 0 on a fresh port) makes restarts reliable.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def worker_argv(spec: JobSpec, spec_path: str | None = None) -> list[str]:
    """The program torchrun starts in each worker process: the built-in trainer, or the command-job wrapper.
    The resolved spec is read from outputs.dir unless the engine puts it elsewhere (`spec_path`)."""
    module = TRAINER_MODULE if spec.command is None else "clusterfit.worker.command"
    return ["-m", module, "--spec", spec_path or str(JobOutputs.at(spec.outputs.dir).resolved_spec)]


def torchrun_command(
    spec: JobSpec,
    *,
    python: str = sys.executable,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    spec_path: str | None = None,
    rdzv_is_host: bool | None = None,
    local_addr: str | None = None,
) -> list[str]:
    """The agent command for one node. Without `rdzv_endpoint` it is a single-node `--standalone` run
    (c10d on a free local port); with it, every node joins the c10d rendezvous hosted at that address.

    `rdzv_is_host` says whether this node's agent hosts the rendezvous store (torchrun guesses it from the
    host name otherwise, which is ambiguous when several nodes share one host); `local_addr` is the address
    other nodes reach this one at (torchrun uses its host name otherwise, which may not resolve elsewhere)."""
    dist, res = spec.distribution, spec.resources
    if rdzv_endpoint is None:
        placement = ["--standalone", "--nnodes=1"]
    else:
        placement = [
            f"--nnodes={res.min_nodes}:{res.max_nodes}" if res.elastic else f"--nnodes={res.max_nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={run_id or spec.name}",
        ]
        conf = [] if rdzv_is_host is None else [f"is_host={int(rdzv_is_host)}"]
        if res.elastic:
            # NOTE: once MIN nodes have joined, a round waits this long for more; torchrun's 30 s would add
            # half a minute to every start and every recovery from a lost node. And a lost node is known dead
            # after KEEP_ALIVE x ATTEMPTS without its heartbeat (torchrun's 5 s x 3 made a recovery take 20 s).
            conf += [
                f"last_call_timeout={ELASTIC_LAST_CALL_S}",
                f"keep_alive_interval={ELASTIC_KEEP_ALIVE_S}",
                f"keep_alive_max_attempt={ELASTIC_KEEP_ALIVE_ATTEMPTS}",
            ]
        if conf:
            placement.append(f"--rdzv-conf={','.join(conf)}")
        if local_addr is not None:
            placement.append(f"--local-addr={local_addr}")
    return [
        python,
        "-m",
        AGENT_MODULE,
        *placement,
        f"--nproc-per-node={dist.process_count_per_instance}",
        f"--max-restarts={dist.max_restarts}",
        "--logs-specs=clusterfit",
        f"--log-dir={JobOutputs.at(spec.outputs.dir).logs}",
        *worker_argv(spec, spec_path),
    ]
