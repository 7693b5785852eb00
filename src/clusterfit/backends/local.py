"""This machine: torchrun's elastic agent starts and supervises `process_count_per_instance` workers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from clusterfit.backends.base import Rendered
from clusterfit.monitoring.logtail import AGENT_LOG, LOG_DIR
from clusterfit.spec.model import JobSpec

RESOLVED_SPEC = "job.yaml"
STORAGE_SAS_TOKEN_ENV = "CLUSTERFIT_STORAGE_SAS_TOKEN"  # read by clusterfit.data.staging in the workers
_CANCEL_GRACE_S = 20.0


def threads_per_worker(processes: int, cores: int | None = None) -> int:
    """CPU threads per rank so that ranks never oversubscribe the cores."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // processes)


def resolved_spec_text(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


def storage_secret_env(spec: JobSpec) -> dict[str, str]:
    token = spec.storage.sas_token
    return {STORAGE_SAS_TOKEN_ENV: token.get_secret_value()} if token else {}


def torchrun_command(spec: JobSpec, *, python: str = sys.executable) -> list[str]:
    out = Path(spec.outputs.dir)
    dist = spec.distribution
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on a free local port; no port to pick or collide on
        "--nnodes=1",
        f"--nproc-per-node={dist.process_count_per_instance}",
        f"--max-restarts={dist.max_restarts}",
        "--logs-specs=clusterfit",
        f"--log-dir={out / LOG_DIR}",
        "-m",
        "clusterfit.worker",
        "--spec",
        str(out / RESOLVED_SPEC),
    ]


class LocalBackend:
    name = "local"

    def dry_run(self, spec: JobSpec) -> Rendered:
        threads = threads_per_worker(spec.distribution.process_count_per_instance)
        return Rendered(
            backend=self.name,
            command=torchrun_command(spec),
            env={
                "OMP_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1",
                # NOTE: with the agent's TCPStore shared across restarts, restarted workers can read the
                # previous attempt's gloo/NCCL addresses and fail with "Connection refused". A store per
                # rendezvous round (hosted by rank 0 on a fresh port) makes restarts reliable.
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            },
            files={str(Path(spec.outputs.dir) / RESOLVED_SPEC): resolved_spec_text(spec)},
            secret_env=storage_secret_env(spec),
        )

    def submit(self, spec: JobSpec) -> LocalRun:
        rendered = self.dry_run(spec)
        for path, content in rendered.files.items():
            _write_atomically(Path(path), content)
        log_dir = Path(spec.outputs.dir) / LOG_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: the agent writes to a file, never to a pipe: a pipe whose reader died breaks torchrun's
        # log tailing threads and leaves the agent hanging at exit.
        with open(log_dir / AGENT_LOG, "a") as agent_log:
            process = subprocess.Popen(
                rendered.command,
                env={**os.environ, **rendered.env, **rendered.secret_env},
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: cancel reaches the agent and every worker
                preexec_fn=_stop_when_launcher_dies,
            )
        return LocalRun(process)


class LocalRun:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def cancel(self) -> None:
        """SIGTERM to the agent's group (torchrun forwards it to the workers), SIGKILL after a grace period."""
        if self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(_CANCEL_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # also reaps workers that outlived the agent
        self.process.wait()


def _stop_when_launcher_dies() -> None:
    # NOTE: runs in the child before exec. If the launcher is killed outright (SIGKILL, OOM killer), the
    # kernel sends the agent SIGTERM, and the agent stops its workers: a dead launcher leaves no orphans.
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _write_atomically(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(content)
    os.replace(tmp, path)
