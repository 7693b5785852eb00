"""What a job's rights and secrets are confined by, replayed for real: environment variables that would load a
job's code into clusterfit's processes are refused at submit, on the command line and over HTTP; a job's SAS
token file is gone whenever the job ends, however it ends, and a restarted server sweeps what a crash left;
the service home and its database are their owner's alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, tiny_job, write_job
from service_server import ServerProcess, client

from clusterfit.service.auth import issue_token
from clusterfit.service.local_jobs import LocalJobs
from clusterfit.service.migrate import open_store
from clusterfit.spec import validate_spec
from clusterfit.storage.redact import redact


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("PYTHONPATH", "changes how programs are loaded"),
        ("PYTHONSTARTUP", "changes how programs are loaded"),
        ("LD_PRELOAD", "changes how programs are loaded"),
        ("BASH_ENV", "changes how programs are loaded"),
        ("PATH", "changes how programs are loaded"),
        ("MASTER_ADDR", "set for every worker by torchrun"),
        ("TORCHELASTIC_RUN_ID", "set for every worker by torchrun"),
        ("CLUSTERFIT_HOME", "belongs to clusterfit"),
    ],
)
def test_a_variable_that_would_run_the_job_s_code_in_our_processes_is_refused_at_submit(
    tmp_path: Path, name: str, words: str
) -> None:
    job = tiny_job(tmp_path / "out")
    job["environment_variables"] = {name: "/tmp/attacker"}
    result = run_cli("submit", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode != 0
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and f"environment_variables: {name} " in line and words in line, line
    assert open_store().count_jobs() == 0


def test_the_variables_jobs_use_are_still_accepted(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["environment_variables"] = {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "WARN",
        "CLUSTERFIT_FAULT": "raise:rank=0:step=9",
    }
    validate_spec(job)


def test_over_http_the_refusal_is_the_same_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": f"sqlite:///{home / 'jobs.db'}"}
    job = tiny_job(tmp_path / "out")
    job["environment_variables"] = {"LD_PRELOAD": "/tmp/evil.so"}
    with ServerProcess("--paused", env=env) as server:
        token = issue_token(open_store(env["CLUSTERFIT_DATABASE_URL"]), "submit", timedelta(hours=1), "t").secret
        with client(server.url, token) as http:
            answer = http.post("/api/jobs", json={"spec": yaml.safe_dump(job)})
    assert answer.status_code == 422
    assert "environment_variables: LD_PRELOAD changes how programs are loaded" in answer.json()["detail"]


def _secret_files(home: Path) -> list[str]:
    folder = home / "secrets"
    return sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []


def test_a_sas_token_is_deleted_when_its_job_is_cancelled_while_queued(tmp_path: Path, service_home: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["storage"] = {"account_name": "acct", "sas_token": "sv=2024&sig=SECRETSIGNATURE"}
    jobs = LocalJobs(open_store(), start_jobs=False)  # queued, never started
    job_id = jobs.enqueue(validate_spec(job), owner="alice")["id"]
    assert _secret_files(service_home) == [f"{job_id}.json"]
    assert oct((service_home / "secrets" / f"{job_id}.json").stat().st_mode & 0o777) == "0o600"
    assert jobs.cancel(job_id)["state"] == "CANCELLED"
    assert _secret_files(service_home) == []


def test_a_restarted_server_sweeps_secrets_a_crash_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": f"sqlite:///{home / 'jobs.db'}"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # this process records the queued job into the server's home
    store = open_store(env["CLUSTERFIT_DATABASE_URL"])
    (home / "secrets").mkdir(mode=0o700)
    (home / "secrets" / "0123456789.json").write_text('{"sas_token": "sig=LEFTOVER"}')  # a job the store never had
    queued = validate_spec({**tiny_job(tmp_path / "out"), "storage": {"sas_token": "sig=STILLNEEDED"}})
    waiting = LocalJobs(store, start_jobs=False).enqueue(queued, owner="bob")["id"]
    with ServerProcess("--paused", env=env):
        pass
    assert _secret_files(home) == [f"{waiting}.json"]  # a queued job keeps its token until it ends


def test_the_service_home_and_its_database_are_the_owner_s_alone(tmp_path: Path) -> None:
    home = tmp_path / "wide-open"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    result = run_cli("list", env={**os.environ, "CLUSTERFIT_HOME": str(home), "CLUSTERFIT_DATABASE_URL": ""})
    assert result.returncode == 0, result.stderr
    assert oct(home.stat().st_mode & 0o777) == "0o700"
    assert oct((home / "jobs.db").stat().st_mode & 0o777) == "0o600"


SAS = "sv=2024-05-04&ss=b&srt=co&sp=rl&se=2030-01-01&sig=Zm9vYmFy%2BYmF6cXV4%3D"


@pytest.mark.parametrize(
    "shown",
    [
        SAS,
        "?" + SAS,  # pasted with its leading question mark
        "sig=Zm9vYmFy%2BYmF6cXV4%3D&sv=2024-05-04&se=2030-01-01",  # parameters in another order
        "signature Zm9vYmFy+YmF6cXV4= was refused",  # decoded, as an SDK may echo it
        "https://acct.blob.core.windows.net/data/train/x.jpg?se=2030-01-01&sig=Zm9vYmFy%2BYmF6cXV4%3D",
    ],
)
def test_a_sas_token_is_masked_in_any_form(shown: str) -> None:
    from clusterfit.storage.filesystems import Credentials, diagnose

    masked = redact(f"storage said: {shown}", [SAS])
    assert "Zm9vYmFy" not in masked and "***" in masked
    problem = diagnose(ValueError(f"storage said: {shown}"), Credentials(sas_token=SAS))
    assert "Zm9vYmFy" not in problem.text


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("postgresql+psycopg://clusterfit:hunter2secret@db:5432/jobs", "hunter2secret"),
        ("postgresql://clusterfit@db/jobs?password=hunter2secret&sslmode=require", "hunter2secret"),
        ("connect to db failed (password=hunter2secret)", "hunter2secret"),
        ("s3://bucket/key?X-Amz-Signature=abcdef0123456789&X-Amz-Credential=AKIA", "abcdef0123456789"),
    ],
)
def test_passwords_and_signed_urls_are_masked(text: str, hidden: str) -> None:
    assert hidden not in redact(text)


def test_an_unreachable_store_names_its_url_without_the_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://user@127.0.0.1:1/jobs?password=hunter2secret&connect_timeout=1"
    result = run_cli("list", env={**os.environ, "CLUSTERFIT_DATABASE_URL": url})
    assert result.returncode != 0 and "hunter2secret" not in result.stderr + result.stdout
    assert "127.0.0.1:1/jobs" in result.stderr


def _blobs(connection_string: str, container: str) -> dict[str, bytes]:
    from azure.storage.blob import ContainerClient

    blobs = ContainerClient.from_connection_string(connection_string, container)
    return {blob.name: blobs.download_blob(blob.name).readall() for blob in blobs.list_blobs()}


def test_a_job_reaches_its_store_with_its_own_credentials_never_the_servers(tmp_path: Path, service_home: Path) -> None:
    """The server's environment holds the operator's store credentials; a job names the same container in its own
    account. Its outputs go to its own account, and neither the supervisor (pushing and resuming) nor the server
    (reading a job whose local copy is gone) reaches the operator's: they used to, with the operator's rights."""
    import base64

    from azure.storage.blob import BlobServiceClient
    from azurite import Azurite
    from services import skip_reason

    if skip_reason("azurite"):
        pytest.skip(skip_reason("azurite"))
    operator_key = base64.b64encode(os.urandom(32)).decode()
    azurite = Azurite(tmp_path / "azurite", other_accounts={"operator": operator_key})
    azurite.start()
    try:
        operator, owner = azurite.connection_string(operator_key, "operator"), azurite.connection_string()
        for account in (operator, owner):
            BlobServiceClient.from_connection_string(account).create_container("runs")
        # The operator's own run at the path the job names: the job must neither resume from it nor overwrite it.
        operator_run = BlobServiceClient.from_connection_string(operator).get_container_client("runs")
        operator_run.upload_blob("shared/logs/rank-0.log", b"the operator's own log\n")
        before = _blobs(operator, "runs")
        job = {
            "name": "own-store",
            "command": "echo written-by-the-job",
            "environment_variables": {"AZURE_STORAGE_CONNECTION_STRING": owner},
            "distribution": {"type": "pytorch", "process_count_per_instance": 1},
            "resources": {"instance_count": 1, "backend": "local"},
            "outputs": {"dir": "az://runs/shared", "cache_dir": str(tmp_path / "cache"), "upload_every_s": 1},
        }
        server = ServerProcess(env={"AZURE_STORAGE_CONNECTION_STRING": operator})
        with server, client(server.url, issue_token(open_store(), "admin", timedelta(hours=1), "ops").secret) as http:
            answer = http.post("/api/jobs", json={"spec": yaml.safe_dump(job)})
            assert answer.status_code == 201, answer.text
            job_id = answer.json()["id"]
            assert _final(job_id) == "SUCCEEDED", open_store().get(job_id).cause_detail
            local_copy = Path(open_store().get(job_id).outputs_dir)
            assert "the operator's own log" not in (local_copy / "logs" / "rank-0.log").read_text()
            shutil.rmtree(local_copy)  # the server now reads the job's logs from the store
            lines = "\n".join(http.get(f"/api/jobs/{job_id}/logs").json()["lines"])
        assert "written-by-the-job" in lines and "the operator's own log" not in lines
        assert _blobs(operator, "runs") == before, "the job wrote in the operator's account"
        pushed = _blobs(owner, "runs")
        assert b"written-by-the-job" in pushed["shared/logs/rank-0.log"]
        said = "".join(server.output)
        assert "not used: the store credentials in this environment (AZURE_STORAGE_CONNECTION_STRING)" in said
        assert operator_key not in said
    finally:
        azurite.stop()


def _final(job_id: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = open_store().get(job_id)
        if job.job_state.is_terminal:
            return job.state
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still {job.state} after {timeout} s")


def test_a_job_s_store_variables_are_its_credentials_and_masked_like_its_sas_token() -> None:
    from clusterfit.spec.model import StorageSpec
    from clusterfit.storage.filesystems import credentials, drop_store_credentials

    key = "c2VjcmV0LWFjY291bnQta2V5"
    given = {"AZURE_STORAGE_ACCOUNT_KEY": key, "AZURE_STORAGE_ACCOUNT_NAME": "mine", "FROM_SPEC": "yes"}
    creds = credentials(StorageSpec(), given)
    assert dict(creds.variables) == {"AZURE_STORAGE_ACCOUNT_KEY": key, "AZURE_STORAGE_ACCOUNT_NAME": "mine"}
    assert key in creds.secrets() and key not in repr(creds)
    server = {"AZURE_STORAGE_ACCOUNT_KEY": key, "AWS_PROFILE": "ops", "AWS_REGION": "eu-west-1", "PATH": "/bin"}
    assert drop_store_credentials(server) == ["AWS_PROFILE", "AZURE_STORAGE_ACCOUNT_KEY"]
    assert server["AWS_REGION"] == "eu-west-1" and server["AZURE_STORAGE_ANON"] == "true"
    assert server["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull and drop_store_credentials(server) == []


GOOGLE_DEFAULT = """
import os, google.auth
from google.auth.exceptions import DefaultCredentialsError
from clusterfit.storage.filesystems import drop_store_credentials
print(google.auth.default()[0].client_id)
drop_store_credentials(os.environ)
try:
    google.auth.default()
except DefaultCredentialsError:
    print("no credentials")
"""


def test_the_operator_s_google_login_serves_no_job(tmp_path: Path) -> None:
    """gcsfs (gs://) finds credentials through google-auth: a key file named in the environment, gcloud's
    application-default login in the home folder, the machine's metadata server. The job service's processes
    look in none of them: before, the operator's gcloud login would have served every owner's gs:// job."""
    login = tmp_path / ".config" / "gcloud" / "application_default_credentials.json"
    login.parent.mkdir(parents=True)
    operator = {"type": "authorized_user", "client_id": "operator", "client_secret": "s", "refresh_token": "r"}
    login.write_text(json.dumps(operator))
    env = {key: value for key, value in os.environ.items() if key not in ("CLOUDSDK_CONFIG", "NO_GCE_CHECK")}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    probe = subprocess.run(
        [sys.executable, "-c", GOOGLE_DEFAULT], env={**env, "HOME": str(tmp_path)}, capture_output=True, text=True
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines() == ["operator", "no credentials"]
