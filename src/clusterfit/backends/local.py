"""This machine: torchrun's elastic agent starts and supervises `process_count_per_instance` workers."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from clusterfit.backends.base import EngineRef, EngineStatus, Rendered
from clusterfit.backends.job_env import job_env
from clusterfit.backends.job_folder import JobAccount, open_agent_log, put_job_files
from clusterfit.backends.mpi import launched_by_mpirun, mpi_launch_env, mpirun_command, require_mpirun
from clusterfit.backends.torchrun import (
    as_launched,
    resolved_spec_file,
    storage_secret_env,
    threads_per_worker,
    torchrun_command,
    worker_env,
)
from clusterfit.backends.warm_start import WarmAgent, warm_started_agent
from clusterfit.outputs import JobOutputs
from clusterfit.processes import descendants, kill_if_same, process_start_time, stop_with_parent
from clusterfit.spec.model import JobSpec

_CANCEL_GRACE_S = 20.0


def local_gpu_count() -> int:
    """GPUs this machine's workers can use, known without importing torch: those CUDA_VISIBLE_DEVICES names
    when it is set, else every GPU the NVIDIA driver lists (none without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA reads the list up to its first invalid entry: "" and "-1" hide every GPU.
        names = [name.strip() for name in visible.split(",")]
        return len(list(itertools.takewhile(lambda name: name and not name.startswith("-"), names)))
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


class LocalBackend:
    name = "local"

    def dry_run(self, spec: JobSpec) -> Rendered:
        spec, _ = as_launched(spec)
        threads = threads_per_worker(spec.distribution.process_count_per_instance)
        command, launcher_env = torchrun_command(spec), {}
        if launched_by_mpirun(spec):
            command, launcher_env = mpirun_command(spec, mpirun=require_mpirun()), mpi_launch_env()
        return Rendered(
            backend=self.name,
            command=command,
            env={**worker_env(threads), **launcher_env, **spec.environment_variables},
            files=resolved_spec_file(spec),
            secret_env=storage_secret_env(spec),
        )

    def submit(self, spec: JobSpec, *, confined: bool = False, account: JobAccount | None = None) -> LocalRun:
        """`confined`: a job of the job service, started with `job_env` rather than this process's own
        environment (which `clusterfit run` passes on: the user's job in the user's shell). `account`: the
        unprivileged account it runs as (a root server's job user), whose outputs folder it already is; what
        goes there is then written by a process of that account's (backends/job_folder.py)."""
        rendered = self.dry_run(spec)
        outputs = JobOutputs.at(spec.outputs.dir)
        put_job_files(outputs.root, spec.code, rendered.files, account)
        if confined:
            env = job_env(outputs.root, rendered.env, rendered.secret_env)
        else:
            env = {**os.environ, **rendered.env, **rendered.secret_env}
        # NOTE: the agent writes to a file, never to a pipe: a pipe whose reader died breaks torchrun's
        # log tailing threads and leaves the agent hanging at exit.
        agent_log = open_agent_log(outputs.root, outputs.agent_log, account)
        with open(agent_log, "a") as agent_log_file:
            # NOTE: a job of another account (a root server's) always starts cold: it must not share our process.
            if account is None:
                warm = warm_started_agent(rendered.command, env, outputs.root if confined else None, agent_log_file)
                if warm is not None:
                    return LocalRun(warm)
            process = subprocess.Popen(
                rendered.command,
                env=env,
                stdout=agent_log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # A job of the service works in its outputs folder, never in the server's working folder.
                cwd=outputs.root if confined else None,
                start_new_session=True,  # its own process group: a cancel reaches the agent and its helpers
                preexec_fn=stop_with_parent,  # a launcher killed outright leaves no orphans
                # NOTE: no supplementary groups: root's (or the server's) must not come along.
                **(account.process_options() if account is not None else {}),
            )
        return LocalRun(process)

    def status(self, ref: EngineRef) -> EngineStatus:
        # Only the submitting process can read the agent's exit code; others see whether its group lives.
        return EngineStatus("running" if _group_alive(ref) else "gone")

    def cancel(self, ref: EngineRef) -> None:
        if _group_alive(ref):
            _stop_group(int(ref.id), lambda timeout: _wait_group_gone(ref, timeout))


class LocalRun:
    def __init__(self, process: subprocess.Popen[bytes] | WarmAgent) -> None:
        self.process = process
        # The agent leads its own session, so its pid names its process group.
        self.ref = EngineRef("local", str(process.pid), {"start_time": process_start_time(process.pid) or ""})

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def cancel(self) -> None:
        """SIGTERM to the agent's group (torchrun forwards it to the workers), SIGKILL after a grace period."""
        if self.process.poll() is not None:
            return
        _stop_group(self.process.pid, self._wait)
        self.process.wait()

    def _wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


def _stop_group(pgid: int, wait: Callable[[float], None]) -> None:
    # NOTE: torchrun starts a command job's workers in sessions of their own, so the agent's group holds the
    # agent (and the helpers it shares a group with: the trainer's fork server and the ranks forked from it)
    # but not those workers. SIGTERM to the agent makes it stop the workers; workers found beforehand are
    # killed too if they outlive the grace period.
    workers = descendants(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    wait(_CANCEL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for pid, start_time in workers.items():
        kill_if_same(pid, start_time)


def _group_alive(ref: EngineRef) -> bool:
    pgid = int(ref.id)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    leader_start = process_start_time(pgid)
    # The leader may be gone while workers of its group live on; a different start time means a reused pid.
    return leader_start is None or not ref.extra.get("start_time") or leader_start == ref.extra["start_time"]


def _wait_group_gone(ref: EngineRef, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_alive(ref) and time.monotonic() < deadline:
        time.sleep(0.1)
