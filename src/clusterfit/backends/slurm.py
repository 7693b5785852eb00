"""Slurm: one sbatch job of `instance_count` nodes; `srun` starts torchrun's agent once per node, and the
agents meet in a c10d rendezvous on the first node of the allocation. An mpi job's ranks are started by one
Open MPI `mpirun` instead, which reads the allocation from Slurm and starts its daemons on the other nodes
through srun.

outputs.dir must be on a filesystem every node shares (each rank writes logs/rank-N.log there, rank 0 the
checkpoints and the model), and so must `code` of a command job, which is copied into outputs.dir; or the
outputs are at a URL, and each node then works in a folder of its own (`outputs.cache_dir/nodes/...-node-N`)
that its agent's node copy (backends/node_copy.py) fills from the store and copies back, as on Ray."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from clusterfit.backends.base import EngineRef, EngineStatus, Rendered
from clusterfit.backends.job_env import job_env
from clusterfit.backends.job_folder import JobAccount, put_job_files
from clusterfit.backends.mpi import find_mpirun, launched_by_mpirun, mpirun_command, refuse_outputs_at_url
from clusterfit.backends.node_copy import node_copy_command
from clusterfit.backends.polled import PolledRun
from clusterfit.backends.torchrun import (
    as_launched,
    resolved_spec_file,
    storage_secret_env,
    torchrun_command,
    worker_env,
)
from clusterfit.errors import EngineError, SpecError
from clusterfit.outputs import JobOutputs
from clusterfit.spec.model import JobSpec
from clusterfit.storage.filesystems import Credentials, credentials, job_credentials, public
from clusterfit.storage.outputs_mirror import MirrorRole, OutputsMirror

SCRIPT = "slurm/job.sbatch"  # under outputs.dir
CHECKPOINT_SIGNAL = "USR1"
_HEAD = "__HEAD_NODE__"  # placeholders the script fills in on the first node at run time
_PORT = "__RDZV_PORT__"
_NODE_OUTPUTS = "__NODE_OUTPUTS__"  # ... and that each node's task fills in with its own folder and agent log
_NODE_AGENT_LOG = "__NODE_AGENT_LOG__"
# With outputs at a URL no folder of the launcher is on the nodes: the batch shell's own lines go here, on the
# first node (the agents' go to their node's logs/, and so to the store).
BATCH_OUTPUT_WITHOUT_SHARED_FOLDER = "/tmp/clusterfit-slurm-%j.out"
_STATUS_EVERY_S = 1.0
_CANCEL_WAIT_S = 60.0
# Slurm's job states that will still change; anything else is final.
_ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "SPECIAL_EXIT",
    "PREEMPTED",
    "UNKNOWN_CONTROLLER_UNREACHABLE",
}
# What sbatch says when the controller could not take any job just then (down, restarting, overloaded): the same
# script may be accepted a moment later. Any other refusal is about this job and would be repeated.
_CONTROLLER_BUSY_OR_DOWN = (
    "unable to contact slurm controller",
    "socket timed out",
    "temporarily unable to accept job",
    "zero bytes were transmitted or received",
    "communication connection failure",
)
_SUBMISSION_FAILED = "Batch job submission failed: "


def sbatch_script(spec: JobSpec, *, python: str, workdir: str, outputs_store: str | None = None) -> str:
    """The batch script: what `sbatch` runs on the first node of the allocation. `outputs_store`: the URL of the
    job's outputs, whose launcher's copy `spec.outputs.dir` is; each node then works in a folder of its own."""
    out = Path(spec.outputs.dir).resolve()
    res, slurm = spec.resources, spec.resources.slurm
    nproc = spec.distribution.process_count_per_instance
    directives = [
        f"--job-name={spec.name}",
        f"--nodes={res.max_nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the node's workers
        "--exclusive",  # the agent's workers share the node's cores (OMP threads = cores / workers)
        f"--chdir={workdir}",
        f"--output={BATCH_OUTPUT_WITHOUT_SHARED_FOLDER if outputs_store else JobOutputs.at(out).agent_log}",
        "--open-mode=append",  # a requeued run adds to the log instead of replacing it
        "--requeue",
        # NOTE: B: = only the batch shell; it forwards the signal to the workers and requeues the job after.
        f"--signal=B:{CHECKPOINT_SIGNAL}@{slurm.checkpoint_signal_seconds}",
    ]
    if res.gpus_per_instance:
        directives.append(f"--gpus-per-node={res.gpus_per_instance}")
    if slurm.time_limit_minutes:
        directives.append(f"--time={slurm.time_limit_minutes}")
    if slurm.partition:
        directives.append(f"--partition={slurm.partition}")
    directives += slurm.extra_sbatch_args
    env = {key: value for key, value in worker_env(1).items() if key != "OMP_NUM_THREADS"}
    env.update(spec.environment_variables)
    launch = _mpirun_lines(spec, python) if launched_by_mpirun(spec) else _agent_lines(spec, python, outputs_store)
    lines = [
        "#!/bin/bash",
        f"# clusterfit job {spec.name}: {res.max_nodes} node(s) x {nproc} process(es), written by clusterfit run",
        *[f"#SBATCH {directive}" for directive in directives],
        "set -uo pipefail",
        *[f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())],
        f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} > 0 ? "
        f"${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} : 1 ))",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port=$({shlex.quote(python)} -m clusterfit.network)",
        "# Before the time limit Slurm signals this shell: the workers checkpoint and stop,",
        "# and the job is requeued to resume from that checkpoint.",
        "stop_requested=0",
        *launch,
        "# A trapped signal interrupts `wait` (status > 128) while the agent still runs: wait again.",
        'while true; do wait "$agent_pid"; code=$?; kill -0 "$agent_pid" 2>/dev/null || break; done',
        'if [ "$stop_requested" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def _agent_lines(spec: JobSpec, python: str, outputs_store: str | None = None) -> list[str]:
    """One torchrun agent per node through srun; the signal reaches the workers as a signal to every step. With
    outputs at a URL each agent runs under its node's copy of them, in a folder named after its node."""
    node_spec = spec
    if outputs_store is not None:
        node_spec = spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"dir": _NODE_OUTPUTS})})
    command = torchrun_command(node_spec, python=python, rdzv_endpoint=f"{_HEAD}:{_PORT}", run_id="__JOB_ID__")
    # The agent ignores the signal (its default would kill it); the workers it starts set their own handler.
    task = f'trap "" {CHECKPOINT_SIGNAL}; exec "$@"'
    if outputs_store is not None:
        creds = credentials(spec.storage)
        command = node_copy_command(
            outputs_store,
            _NODE_OUTPUTS,
            spec.outputs.upload_every_s,
            Credentials(creds.account_name, creds.endpoint),  # a SAS token comes in the environment
            command,
            python=python,
            node_spec=True,
            agent_log=_NODE_AGENT_LOG,
        )
        # The task's first argument: where the nodes' folders go, each named after the launcher's copy and the
        # node (`outputs.cache_dir/nodes/<copy>-node-N`).
        command = [str(Path(spec.outputs.cache_dir).expanduser() / "nodes" / Path(spec.outputs.dir).name), *command]
        task = (
            f'trap "" {CHECKPOINT_SIGNAL}; folder=$1-node-$SLURM_NODEID; shift; log=agent.node-$SLURM_NODEID.log; '
            f'[ "$SLURM_NODEID" = 0 ] && log=agent.log; set -- "${{@//{_NODE_OUTPUTS}/$folder}}"; '
            f'exec "${{@//{_NODE_AGENT_LOG}/$log}}"'
        )
    agent = shlex.join(command).replace(f"{_HEAD}:{_PORT}", '"$head_node:$rdzv_port"')
    agent = agent.replace("__JOB_ID__", '"$SLURM_JOB_ID"')
    return [
        f"trap 'stop_requested=1; scancel --signal={CHECKPOINT_SIGNAL} \"$SLURM_JOB_ID\"' {CHECKPOINT_SIGNAL}",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote(task)} agent \\",
        f"    {agent} &",
        "agent_pid=$!",
    ]


def _mpirun_lines(spec: JobSpec, python: str) -> list[str]:
    """One mpirun in the batch shell for every rank of the allocation. It forwards SIGUSR1 to the ranks itself
    (the ranks on this node are its children, not a job step that scancel could signal)."""
    # NOTE: the mpirun beside the interpreter (the mpi extra, on the shared filesystem), else the nodes' own.
    mpirun = find_mpirun(python, path="") or "mpirun"
    command = shlex.join(mpirun_command(spec, mpirun=mpirun, python=python))
    return [
        'export MASTER_ADDR="$head_node" MASTER_PORT="$rdzv_port"  # for torch.distributed in the ranks',
        f"trap 'stop_requested=1; kill -{CHECKPOINT_SIGNAL} \"$agent_pid\"' {CHECKPOINT_SIGNAL}",
        f"{command} &",
        "agent_pid=$!",
    ]


def slurm_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """What sbatch itself reads from its caller's environment: the cluster's configuration and the operator's
    sbatch defaults."""
    return {key: value for key, value in environ.items() if key == "SLURM_CONF" or key.startswith("SBATCH_")}


class SlurmBackend:
    name = "slurm"

    def dry_run(self, spec: JobSpec, outputs_store: str | None = None, workdir: str | None = None) -> Rendered:
        spec, url = as_launched(spec)  # `clusterfit run --dry-run` of a spec whose outputs.dir is a URL
        outputs_store = outputs_store or url
        refuse_outputs_at_url(spec, outputs_store)
        out = Path(spec.outputs.dir)
        script = out / SCRIPT
        text = sbatch_script(spec, python=sys.executable, workdir=workdir or os.getcwd(), outputs_store=outputs_store)
        return Rendered(
            backend=self.name,
            command=["sbatch", "--parsable", str(script.resolve())],
            files={**resolved_spec_file(spec), str(script): text},
            secret_env=storage_secret_env(spec),
        )

    def submit(
        self,
        spec: JobSpec,
        *,
        confined: bool = False,
        account: JobAccount | None = None,
        outputs_store: str | None = None,
    ) -> PolledRun:
        """`confined`: a job of the job service, whose sbatch (which exports its environment to the job) gets the
        allow-listed job environment and the operator's Slurm settings, never the supervisor's own, and which
        starts in its outputs folder. `account`: the unprivileged account a root server runs the job as
        (`sbatch --uid`), whose outputs folder it already is; what goes there is then written by a process of
        that account's, and the batch script reaches sbatch from memory. `outputs_store`: the URL of the job's
        outputs, whose launcher's copy `spec.outputs.dir` is; each node then works in a folder of its own,
        filled from the store."""
        if account is not None and outputs_store is not None:
            # NOTE: the launcher's copy, which this root process reads the nodes' files back into, would be the
            # account's: a link the job made there would take those writes anywhere.
            raise SpecError(
                f"outputs.dir = {public(outputs_store)!r}: this job service runs Slurm jobs with outputs at a URL "
                f"only as its own user, not as {account.name}; give outputs.dir a folder on the cluster's shared "
                "filesystem"
            )
        if shutil.which("sbatch") is None:
            raise EngineError(
                "resources.backend = 'slurm' but sbatch is not on PATH; run on a Slurm login node", retryable=False
            )
        rendered = self.dry_run(spec, outputs_store, workdir=spec.outputs.dir if confined else None)
        launcher_copy = JobOutputs.at(Path(spec.outputs.dir).resolve())
        command, script = rendered.command, None
        put_job_files(launcher_copy.root, spec.code, rendered.files, account)
        if account is not None:
            # NOTE: root reads nothing back that the account wrote (the script could now be a link to any file).
            script = rendered.files[str(Path(spec.outputs.dir) / SCRIPT)]
            command = [*command[:-1], f"--uid={account.uid}", f"--gid={account.gid}"]
        if outputs_store is not None:  # before any node starts: each fills its folder from the store
            creds = job_credentials(spec)
            OutputsMirror(launcher_copy, outputs_store, creds, role=MirrorRole.LAUNCHER).push(read_back=False)
        # sbatch exports the submitting environment to the job (--export=ALL): the secret travels that way.
        if confined:
            env = job_env(spec.outputs.dir, slurm_settings(os.environ), rendered.secret_env)
        else:
            env = {**os.environ, **rendered.secret_env}
        result = subprocess.run(command, input=script, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise sbatch_refusal(result.stderr or result.stdout, spec)
        job_id = result.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
        return PolledRun(EngineRef(self.name, job_id), self, _STATUS_EVERY_S)

    def status(self, ref: EngineRef) -> EngineStatus:
        state, exit_code = job_state(ref.id)
        if state is None:
            return EngineStatus("gone")
        if state in _ACTIVE_STATES:
            return EngineStatus("running")
        return EngineStatus("exited", exit_code)

    def cancel(self, ref: EngineRef) -> None:
        subprocess.run(["scancel", "--full", ref.id], capture_output=True, text=True)
        deadline = time.monotonic() + _CANCEL_WAIT_S
        # COMPLETING means processes may still be exiting: wait for the final state.
        while self.status(ref).state == "running" and time.monotonic() < deadline:
            time.sleep(0.5)


def sbatch_refusal(output: str, spec: JobSpec) -> EngineError:
    """sbatch's complaint as one line with its fix; retryable when the controller could not take any job then."""
    lines = [line.strip().removeprefix("sbatch: error: ") for line in output.splitlines() if line.strip()]
    failed = [line.removeprefix(_SUBMISSION_FAILED) for line in lines if line.startswith(_SUBMISSION_FAILED)]
    reason = (failed or lines or ["no message"])[-1]
    if any(words in reason.lower() for words in _CONTROLLER_BUSY_OR_DOWN):
        return EngineError(
            f"sbatch could not hand the job to the Slurm controller ({reason}); check that slurmctld is up "
            "(scontrol ping); with limits.max_retries the job is submitted again after a pause",
            retryable=True,
        )
    if "partition" in reason.lower():
        return EngineError(
            f"resources.slurm.partition = {spec.resources.slurm.partition!r}: sbatch refused it ({reason}); "
            "give a partition that sinfo lists, or null for the cluster's default",
            retryable=False,
        )
    return EngineError(
        f"sbatch refused the job ({reason}); check resources.slurm (partition, time_limit_minutes, "
        "extra_sbatch_args) against sinfo and your account",
        retryable=False,
    )


def job_state(job_id: str) -> tuple[str | None, int | None]:
    """(state, exit code) from `scontrol show job` (the controller keeps finished jobs for MinJobAge), else
    from `sacct` (only with accounting); (None, None) when neither knows the job."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if shown.returncode == 0 and shown.stdout.strip():
        fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
        return fields.get("JobState"), _exit_code(fields.get("ExitCode", ""), fields.get("JobState", ""))
    if "invalid job id" not in shown.stderr.lower():
        # The controller did not answer (restarting, network): the job is not known to be over.
        return "UNKNOWN_CONTROLLER_UNREACHABLE", None
    accounted = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], capture_output=True, text=True
    )
    line = accounted.stdout.strip().splitlines()[:1] if accounted.returncode == 0 else []
    if not line:
        return None, None
    state, _, code = line[0].partition("|")
    state = state.split()[0]  # "CANCELLED by 0"
    return state, _exit_code(code, state)


def _exit_code(code: str, state: str) -> int | None:
    """Slurm's `EXIT:SIGNAL` as a shell would report it; a cancelled job counts as interrupted (130)."""
    exit_status, _, signal_number = code.partition(":")
    if state == "CANCELLED":
        return 130
    if signal_number and signal_number != "0":
        return 128 + int(signal_number)
    return int(exit_status) if exit_status.isdigit() else None
