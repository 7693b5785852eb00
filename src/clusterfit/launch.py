"""What the launcher checks before any worker starts. Imports no torch: submitting a job stays fast.

A job service checks a submitted job's data in a process of its own (`preflight_apart`, which runs
`python -m clusterfit.launch`), killed after a timeout: a request never waits on a store that does not answer.
A root job service runs it as the account the job runs as: with root's rights, its answers would tell a
submitter what is in folders only root may read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from clusterfit.backends.job_env import job_env
from clusterfit.backends.job_folder import JobAccount
from clusterfit.backends.local import local_gpu_count
from clusterfit.backends.mpi import launched_by_mpirun, refuse_outputs_at_url, require_mpirun
from clusterfit.backends.torchrun import storage_secret_env
from clusterfit.data.folders import inspect_data, list_score_inputs, steps_per_epoch
from clusterfit.data.staging import check_remote_file
from clusterfit.errors import ClusterfitError, DataError, SpecError
from clusterfit.outputs import JobOutputs
from clusterfit.outputs.checkpoints import published, read_manifest
from clusterfit.outputs.layout import WEIGHTS_FILE, model_card_file
from clusterfit.outputs.model_card import read_model_card
from clusterfit.outputs.predictions import ScorePlan, check_plan, plan_chunk_size, require_pyarrow
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.spec.model import JobSpec, is_url
from clusterfit.storage.filesystems import job_credentials
from clusterfit.storage.outputs_mirror import check_store


def preflight(spec: JobSpec) -> None:
    """Raise DataError for data that is missing or unusable, SpecError for too little data for one step and for
    outputs holding another job's checkpoints, and for devices the workers will not have."""
    _check_devices(spec)
    if is_url(spec.outputs.dir):
        refuse_outputs_at_url(spec, spec.outputs.dir)  # before the store is reached
        check_store(spec.outputs.dir, job_credentials(spec))
    if spec.resources.backend == "kubernetes":
        return  # paths name places inside the pods (image, mounted claims), not on this machine
    if spec.scorer is not None:
        _check_scoring_job(spec)
        return
    if spec.trainer is None:
        _check_command_job(spec)
        return
    init = spec.trainer.init
    if init is not None and is_url(init.weights):
        check_remote_file(init.weights, spec.storage, "trainer.init.weights")
    elif init is not None and not Path(init.weights).is_file():
        raise DataError(
            f"trainer.init.weights = {init.weights!r}: no such file; give an earlier job's model/model.safetensors",
            retryable=False,
        )
    try:
        facts = inspect_data(spec.trainer.data, spec.storage)
    except PermissionError as exc:  # a root job service checks as the job's account
        raise DataError(
            f"trainer.data: {exc.filename}: permission denied; give data that the job (its user) may read",
            retryable=False,
        ) from None
    if facts.train_images is not None:  # data at a URL is counted by the workers, once staged
        steps_per_epoch(spec.trainer, facts, spec.world_size)
    latest = published(JobOutputs.at(spec.outputs.dir).checkpoints)
    if latest:
        saved = read_manifest(latest[0])
        wanted = {"model": spec.trainer.model, "num_classes": len(facts.classes), "norm_layer": spec.trainer.norm_layer}
        clashes = [f"{key} {saved.get(key)!r} vs {value!r}" for key, value in wanted.items() if saved.get(key) != value]
        if clashes:
            raise SpecError(
                f"outputs.dir = {spec.outputs.dir!r} holds checkpoints of another model ({'; '.join(clashes)}); "
                "choose a new outputs.dir, or move the old one away to start over"
            )


def preflight_apart(spec: JobSpec, account: JobAccount | None, timeout_s: float) -> None:
    """`preflight` in a process of its own, as `account` if given, killed after `timeout_s`: raises what it
    raised there, or a retryable DataError when it did not end in time (a store that accepts connections and
    never answers held fsspec's calls for 5 minutes)."""
    env = job_env(spec.outputs.dir, storage_secret_env(spec))
    options = account.helper_options(env) if account is not None else {"cwd": "/", "env": env}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "clusterfit.launch"],
            input=resolved_spec_text(spec),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            **options,
        )
    except subprocess.TimeoutExpired:
        raise DataError(
            f"checking the job's data did not end within {timeout_s:g} s (a store or file system that does not "
            "answer?); submit again once it answers",
            retryable=True,
        ) from None
    if done.returncode == 0:
        return
    try:
        said = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        who = f"as the account {account.name}" if account is not None else "in a process of its own"
        raise SpecError(f"checking the job's data {who} failed: {last}") from None
    if said["retryable"] or said["kind"] != "SpecError":
        raise DataError(said["message"], retryable=said["retryable"])
    raise SpecError(said["message"])


def main() -> int:
    """`python -m clusterfit.launch` < a resolved job.yaml: `preflight` as this process's user; its error as one
    JSON line on standard output."""
    from clusterfit.spec import load_spec_text

    try:
        preflight(load_spec_text(sys.stdin.read(), source="job.yaml"))
    except ClusterfitError as exc:
        kind = "SpecError" if isinstance(exc, SpecError) else "DataError"
        print(json.dumps({"kind": kind, "retryable": exc.retryable, "message": str(exc)}))
        return 1
    return 0


def _check_devices(spec: JobSpec) -> None:
    """Only what is knowable here: the local engine's workers get this machine's GPUs, whatever the spec says;
    another engine's nodes have the GPUs the spec asks for (which this machine may well lack), and none else."""
    asked = spec.resources.gpus_per_instance
    if spec.resources.backend == "local":
        here = local_gpu_count()
        if asked > here:
            raise SpecError(
                f"resources.gpus_per_instance = {asked}: the local engine runs on this machine, which has {here} "
                f"GPU(s); set it to {here}, or choose an engine whose nodes have GPUs (resources.backend)"
            )
        on_gpus, why, fix = here > 0, "this machine has no GPU", ""
    else:
        on_gpus, why = asked > 0, "resources.gpus_per_instance is 0"
        fix = ", or give the workers GPUs with resources.gpus_per_instance"
    if spec.trainer is not None and spec.trainer.precision == "fp16" and not on_gpus:
        raise SpecError(
            f"trainer.precision = 'fp16': the workers will run on CPUs ({why}) and fp16 needs a CUDA GPU; "
            f"use bf16, fp32 or auto{fix}"
        )


def _check_command_job(spec: JobSpec) -> None:
    if spec.code is not None and not Path(spec.code).is_dir():
        raise SpecError(f"code = {spec.code!r}: no such folder; give the folder holding your script (or remove code)")
    if launched_by_mpirun(spec) and spec.resources.backend == "local":  # Slurm's nodes bring their own
        require_mpirun()


def _check_scoring_job(spec: JobSpec) -> None:
    """The model folder has its card, the input has images, and the outputs hold no other run's predictions."""
    scorer = spec.scorer
    assert scorer is not None
    require_pyarrow()
    if not model_card_file(scorer.model_dir).is_file():
        raise SpecError(
            f"scorer.model_dir = {scorer.model_dir!r}: no model_card.json there; pass the model/ folder of a "
            "finished training job"
        )
    if is_url(scorer.input):
        return  # listed by the workers, once staged
    card = read_model_card(Path(scorer.model_dir))
    inputs = list_score_inputs(scorer.input, "scorer.input")
    outputs = JobOutputs.at(spec.outputs.dir)
    chunk = plan_chunk_size(outputs, inputs.files, spec.world_size, scorer.chunk_images)
    plan = ScorePlan(inputs.files, inputs.labels, chunk)
    check_plan(outputs, plan.record(card.files.get(WEIGHTS_FILE, "")), write=False)


if __name__ == "__main__":
    sys.exit(main())
