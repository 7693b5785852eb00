"""Between a job spec and its record: what is stored (the resolved spec, never its secrets), and where the
secrets wait until the job runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from pydantic import SecretStr

from clusterfit.backends.torchrun import as_launched
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.service.home import service_home
from clusterfit.service.store import Job, JobNotFound, JobStore
from clusterfit.spec import JobSpec, validate_spec
from clusterfit.spec.model import is_url

_SECRETS_DIR = "secrets"


def record_job(store: JobStore, spec: JobSpec, owner: str = "", *, supervisor: str | None = None) -> Job:
    """A validated spec becomes a QUEUED job, or one already started by its `supervisor` (`clusterfit run`,
    see JobStore.add_job); its SAS token (if any) waits in a file only its owner can read."""
    job = store.add_job(
        name=spec.name,
        backend=spec.resources.backend,
        ranks=spec.world_size,
        outputs_dir=str(local_outputs_dir(spec)),
        spec_yaml=resolved_spec_text(spec),
        priority=spec.queue_settings.priority,
        max_retries=spec.limits.max_retries,
        owner=owner,
        supervisor=supervisor,
    )
    if spec.storage.sas_token is not None:
        path = _secret_path(job.id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"sas_token": spec.storage.sas_token.get_secret_value()}, f)
    return job


def local_outputs_dir(spec: JobSpec) -> Path:
    """Where the job works on this machine: outputs.dir, or with a URL its folder in outputs.cache_dir."""
    return Path(as_launched(spec)[0].outputs.dir).resolve()


def outputs_url(job: Job) -> str | None:
    """The store the job's outputs are copied to (outputs.dir as given), or None for a folder."""
    given = yaml.safe_load(job.spec_yaml)["outputs"]["dir"]
    return given if is_url(given) else None


def spec_of(job: Job) -> JobSpec:
    """The job's spec as recorded, with its secrets put back; outputs.dir is where it works on this machine (the
    absolute folder, or with a URL its local copy: `outputs_url` gives the URL)."""
    spec = validate_spec(yaml.safe_load(job.spec_yaml), source=f"job {job.id}")
    spec = spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"dir": job.outputs_dir})})
    secret = _secret_path(job.id)
    if secret.exists():
        token = json.loads(secret.read_text())["sas_token"]
        spec = spec.model_copy(update={"storage": spec.storage.model_copy(update={"sas_token": SecretStr(token)})})
    return spec


def forget_secrets(job_id: str) -> None:
    _secret_path(job_id).unlink(missing_ok=True)


def forget_secrets_of_ended_jobs(store: JobStore) -> list[str]:
    """A job's secrets live only while it may still run: delete those of jobs that ended (however they ended:
    cancelled while queued, settled by reconcile, a supervisor that died before its cleanup) or that the store
    does not know. Returns the job ids whose secrets were deleted."""
    folder = service_home() / _SECRETS_DIR
    if not folder.is_dir():
        return []
    deleted = []
    for path in folder.glob("*.json"):
        try:
            ended = store.get(path.stem).job_state.is_terminal
        except JobNotFound:
            ended = True
        if ended:
            path.unlink(missing_ok=True)
            deleted.append(path.stem)
    return deleted


def _secret_path(job_id: str) -> Path:
    return service_home() / _SECRETS_DIR / f"{job_id}.json"
