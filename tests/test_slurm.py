"""The Slurm engine: the sbatch script compared to its expected text, then real jobs on a one-node Slurm
cluster (munged, slurmctld, slurmd) started on localhost for this module, through `clusterfit run`."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO, cli_command, exported_weights, run_cli, tiny_job, wait_for, write_job
from job_accounts import python_for, submit_as_root_service
from slurm_cluster import SlurmCluster, missing_reason
from test_command_jobs import (
    assert_one_tensorflow_cluster_learned,
    command_job,
    framework_code,
    rank_logs,
    user_code,
)
from test_scoring import assert_every_good_image_scored_once, scoring_job
from test_session import ended, final_values, session_job, submit

from clusterfit.backends.job_folder import JobAccount
from clusterfit.backends.slurm import SCRIPT, SlurmBackend, sbatch_script
from clusterfit.errors import SpecError
from clusterfit.outputs import JobOutputs, read_heartbeats
from clusterfit.service.migrate import open_store
from clusterfit.spec import validate_spec
from clusterfit.storage.filesystems import cache_folder

# One worker runs them all: they share one slurm cluster, started once per session.
pytestmark = pytest.mark.xdist_group("slurm")

EXPECTED = REPO / "tests" / "data" / "slurm"


def test_sbatch_script_matches_the_expected_text() -> None:
    job = tiny_job(Path("/shared/runs/tiny"))
    job["resources"] = {
        "instance_count": 2,
        "backend": "slurm",
        "gpus_per_instance": 4,
        "slurm": {"partition": "gpu", "time_limit_minutes": 240, "extra_sbatch_args": ["--account=vision"]},
    }
    job["environment_variables"] = {"NCCL_DEBUG": "WARN", "GREETING": "hello world"}
    script = sbatch_script(validate_spec(job), python="/opt/venv/bin/python", workdir="/home/me/project")
    assert script == (EXPECTED / "tiny-2-nodes.sbatch").read_text()


def test_with_outputs_at_a_url_each_task_runs_its_agent_under_its_node_s_copy(tmp_path: Path) -> None:
    """The batch script names no folder of the launcher on the nodes: each srun task's agent runs under the node
    copy, in `outputs.cache_dir/nodes/<copy>-node-$SLURM_NODEID`; an mpi job, whose ranks one mpirun starts,
    is refused in one line."""
    job = tiny_job(tmp_path / "unused")
    job["resources"] = {"instance_count": 2, "backend": "slurm"}
    job["outputs"] = {"dir": "az://outputs/runs/tiny", "cache_dir": str(tmp_path / "cache")}
    rendered = SlurmBackend().dry_run(validate_spec(job))
    copy = cache_folder("az://outputs/runs/tiny", tmp_path / "cache")
    script = rendered.files[str(copy / SCRIPT)]
    assert "#SBATCH --output=/tmp/clusterfit-slurm-%j.out" in script and str(copy / "logs") not in script
    task = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "folder=$1-node-$SLURM_NODEID" in task and '[ "$SLURM_NODEID" = 0 ] && log=agent.log' in task
    agent = script.splitlines()[script.splitlines().index(task) + 1]
    assert agent.startswith(f"    {tmp_path / 'cache' / 'nodes' / copy.name} ")
    assert "-m clusterfit.backends.node_copy --url az://outputs/runs/tiny --folder __NODE_OUTPUTS__" in agent
    assert "--node-spec --agent-log __NODE_AGENT_LOG__ --" in agent
    assert "--log-dir=__NODE_OUTPUTS__/logs -m clusterfit.worker --spec __NODE_OUTPUTS__/job.yaml" in agent
    command_job = {**job, "trainer": None, "command": "python train.py", "distribution": {"type": "mpi"}}
    with pytest.raises(SpecError, match=r"^outputs.dir = 'az://outputs/runs/tiny': an mpi job on Slurm starts"):
        SlurmBackend().dry_run(validate_spec(command_job))


def test_a_root_job_service_runs_no_slurm_job_with_outputs_at_a_url_as_another_account(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "copy")
    job["resources"] = {"instance_count": 1, "backend": "slurm"}
    nobody = JobAccount.named("nobody")
    with pytest.raises(SpecError, match=r"^outputs.dir = 'az://outputs/runs/tiny': this job service runs Slurm jobs"):
        SlurmBackend().submit(validate_spec(job), confined=True, account=nobody, outputs_store="az://outputs/runs/tiny")
    assert not (tmp_path / "copy").exists()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    # Not in pytest's own folders, which only root may enter: slurmd runs the scripts of jobs of other accounts
    # from its spool folder in here.
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="clusterfit-slurm-")))
    cluster.root.chmod(0o711)
    saved = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ.update(cluster.env)  # the CLI under test and its sbatch/squeue find this cluster
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def _job_ids(slurm: SlurmCluster) -> list[str]:
    return slurm.run("squeue", "-h", "-o", "%i").stdout.split()


def _worker_pids(spec_path: Path) -> list[int]:
    """Processes whose command line names this job's resolved spec: the agent's workers."""
    marker = str(spec_path).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_example_job_runs_to_completion_on_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """With its outputs at a URL (a folder store, file://): the node works in a folder of its own, which its
    agent's node copy fills from the store, copies back and removes; the launcher's copy reads the store back
    (the console shows both ranks), and the store ends with the model, both ranks' logs and no writer."""
    store, cache = tmp_path / "store", tmp_path / "shared-cache"
    url = f"file://{store}"
    out = cache_folder(url, cache)
    example = REPO / "examples" / "engines-tiny.yaml"  # the example every engine runs; only --backend differs
    sets = ["--set", f"outputs.dir={url}", "--set", f"outputs.cache_dir={cache}"]
    result = run_cli("run", str(example), "--backend", "slurm", *sets, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[rank1] " in result.stdout and "exported" in result.stdout  # both ranks' logs streamed
    assert exported_weights(out)
    assert "#SBATCH --nodes=1" in (out / "slurm" / "job.sbatch").read_text()
    assert (store / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    assert {"rank-0.log", "rank-1.log", "agent.log"} <= {path.name for path in (store / "logs").iterdir()}
    assert not (store / ".clusterfit-writer.json").exists()
    assert f"outputs:\n  dir: {out}\n" in (store / "job.yaml").read_text(), "the store keeps the launcher's job.yaml"
    assert (cache / "nodes").is_dir() and not list((cache / "nodes").iterdir()), "the node's folder goes at its end"
    script = (out / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --output=/tmp/clusterfit-slurm-%j.out" in script and "node_copy --url" in script


def test_a_scoring_job_scores_every_image_once_under_sbatch(
    slurm: SlurmCluster, scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    """`clusterfit score`'s job under sbatch: 2 ranks on the node, each scoring its own chunks."""
    model, images = scoring_case
    out = tmp_path / "scored"
    job = scoring_job(model, images, out, backend="slurm", instances=1, per_instance=2)
    result = run_cli("run", str(write_job(tmp_path / "score.yaml", job)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "scored 21 of 22 images on 2 rank(s)" in result.stdout, result.stdout[-3000:]
    assert_every_good_image_scored_once(out, model, images)
    assert "#SBATCH --nodes=1" in (out / "slurm" / "job.sbatch").read_text()


@pytest.mark.parametrize("kind", ["pytorch", "mpi", "tensorflow"])
def test_command_job_gets_its_environment_on_slurm(slurm: SlurmCluster, tmp_path: Path, kind: str) -> None:
    """The user-script contract of each distribution.type holds under sbatch (1 node x 2 processes), and the
    frameworks' own programs form one world: mpi4py's under mpirun, TensorFlow's from TF_CONFIG."""
    out = tmp_path / "out"
    job = command_job(out, framework_code(tmp_path), f"python env_contract.py {kind}", kind)
    if kind == "mpi":  # and one MPI world of both ranks, started by mpirun inside the allocation
        job["command"] += " && python mpi_allreduce.py"
    if kind == "tensorflow":  # and a real cluster of both workers
        job["command"] += " && python tf_multiworker.py"
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--backend", "slurm", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        assert f"env ok: {kind} rank {rank}/2 in code" in rank_logs(out)
    if kind == "mpi":
        assert "mpirun -np 2 --map-by ppr:2:node:OVERSUBSCRIBE" in (out / "slurm" / "job.sbatch").read_text()
        for rank in range(2):
            assert f"mpi world of 2: rank {rank} agrees on the sum 3" in rank_logs(out)
    if kind == "tensorflow":
        assert_one_tensorflow_cluster_learned(out, workers=2)


def test_a_job_of_the_job_service_gets_none_of_the_server_s_environment_on_slurm(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch exports its caller's environment to the job; for a job of the job service that caller is a
    supervisor holding the server's home, database URL and whatever its operator exported."""
    monkeypatch.setenv("SERVER_ONLY_SECRET", "s3cr3t")  # as an operator's export, inherited by the supervisor
    out = tmp_path / "out"
    job = command_job(out, user_code(tmp_path), "env", processes=1)
    job["resources"]["backend"] = "slurm"
    job_id = submit(write_job(tmp_path / "job.yaml", job))
    assert ended(job_id) == "SUCCEEDED", run_cli("status", job_id).stdout
    env = dict(line.split("=", 1) for line in (out / "logs" / "rank-0.log").read_text().splitlines() if "=" in line)
    assert env["FROM_SPEC"] == "yes" and env["SLURM_CONF"] == slurm.env["SLURM_CONF"]
    assert not {"SERVER_ONLY_SECRET", "CLUSTERFIT_HOME"} & set(env), sorted(env)


def test_a_root_job_service_runs_a_slurm_job_as_the_job_s_account(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Slurm runs a job as the user who submits it: a root server's supervisor submits it as the job's account
    (`sbatch --uid`), in an outputs folder that account made; the job cannot read the service home. Before, such
    a server refused Slurm jobs, which would have run as root."""
    with python_for("nobody") as python:
        if python is None:
            pytest.skip("nobody can run no Python with clusterfit here (as root, with a python3 of this version)")
        shared = Path(tempfile.mkdtemp(prefix="clusterfit-slurm-outputs-"))
        try:
            shared.chmod(0o1777)  # a shared folder where each account makes its own
            out = shared / "out"
            home = tmp_path / "home"  # the service home: root's only
            job = command_job(out, user_code(shared), f"id -un; ls {home} 2>&1 | head -1; pwd", processes=1)
            job["resources"]["backend"] = "slurm"
            env = {**os.environ, "CLUSTERFIT_HOME": str(home), "CLUSTERFIT_JOB_USER": "nobody"}  # as a root server sets
            job_id = submit_as_root_service(python, write_job(tmp_path / "job.yaml", job), env, timeout=120)
            store = open_store(f"sqlite:///{home / 'jobs.db'}")
            try:
                final = wait_for(lambda: store.get(job_id).job_state.is_terminal and store.get(job_id), 180, "the end")
            except AssertionError:
                logs = {p.name: p.read_text() for p in (out / "logs").iterdir()} if (out / "logs").exists() else {}
                raise AssertionError(f"{store.get(job_id).state} {logs} {slurm.run('squeue').stdout}") from None
            assert final.state == "SUCCEEDED", f"{final.cause}: {final.cause_detail}"
            said = (out / "logs" / "rank-0.log").read_text().splitlines()
            assert said == ["nobody", f"ls: cannot access '{home}': Permission denied", str(out / "code")], said
            nobody = pwd.getpwnam("nobody").pw_uid
            assert {path.stat().st_uid for path in [out, out / "logs", out / "code", out / "logs" / "agent.log"]} == {
                nobody
            }
        finally:
            shutil.rmtree(shared, ignore_errors=True)


def _long_job(out: Path) -> dict:
    job = tiny_job(out, steps_per_epoch=100_000, norm_layer="group", log_every_steps=1)
    job["resources"]["backend"] = "slurm"
    return job


def _launch(job_file: Path, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli_command("run", str(job_file)),
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(out: Path, launcher: subprocess.Popen[str]) -> None:
    """Until rank 0 has logged its second step: the workers run and handle signals."""
    log, deadline = out / "logs" / "rank-0.log", time.monotonic() + 240
    while not (log.exists() and "step 2/" in log.read_text(errors="replace")):
        assert launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
        assert time.monotonic() < deadline, "the job never reached its second step"
        time.sleep(0.2)


def _describe(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return f"{state} {cmdline[:100]}"
    except OSError:
        return "gone"


def test_cancel_leaves_no_process_and_no_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job_file = write_job(tmp_path / "job.yaml", _long_job(out))
    launcher = _launch(job_file, tmp_path)
    try:
        _wait_for_step(out, launcher)
        pids = _worker_pids(out / "job.yaml")
        assert len(pids) >= 3, pids  # the agent and its two workers
        job_id = _job_ids(slurm)[0]
        launcher.send_signal(signal.SIGINT)  # Ctrl-C: the launcher cancels the Slurm job and waits
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, output[-3000:]
    assert _job_ids(slurm) == []
    assert "JobState=CANCELLED" in slurm.run("scontrol", "show", "job", job_id).stdout
    # A zombie (Z) has exited and holds nothing; only its parent has yet to read its status.
    alive = {pid: state for pid in pids if (state := _describe(pid)) != "gone" and not state.startswith("Z")}
    assert alive == {}, f"processes left behind: {alive}"


def _signal_requeue_and_finish(slurm: SlurmCluster, launcher: subprocess.Popen) -> str:
    """What Slurm does `checkpoint_signal_seconds` before the time limit (--signal=B:USR1@N) to the job's one
    batch job; waits for the requeue and for the launcher to end, and returns its output."""
    job_id = _job_ids(slurm)[0]
    assert slurm.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    wait_for(lambda: "Restarts=1" in slurm.run("scontrol", "show", "job", job_id).stdout, 120, "the requeue")
    output, _ = launcher.communicate(timeout=300)
    return output


def test_signal_before_the_time_limit_checkpoints_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """With its outputs at a URL: the requeued job's node fills its folder from the store again, so it resumes
    from the checkpoint the signal made (the session script's test below does this with a shared folder)."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    out = cache_folder(f"file://{store}", cache)  # the launcher's copy, read back from the store
    job = _long_job(out)
    job["outputs"] = {"dir": f"file://{store}", "cache_dir": str(cache), "upload_every_s": 1}
    job["trainer"]["steps_per_epoch"] = 40
    # Rank 0 a straggler: the signal's way (squeue, scancel, slurmd, the batch shell's trap, scancel again) lands
    # well before step 40 on any machine, which the two checkpoints below need.
    job["environment_variables"] = {"CLUSTERFIT_FAULT": "slow:rank=0:step=1:seconds=0.2"}
    launcher = _launch(write_job(tmp_path / "job.yaml", job), tmp_path)
    try:
        _wait_for_step(out, launcher)
        output = _signal_requeue_and_finish(slurm, launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "stopped at step" in output and "resuming from" in output
    stopped = [p.name for p in (store / "checkpoints").iterdir()]
    assert "step-00000040" in stopped and len(stopped) == 2, stopped  # the requested one, and the end
    assert exported_weights(out) and exported_weights(store)
    assert "node_copy --url" in (out / "slurm" / "job.sbatch").read_text()


def test_a_session_script_stops_on_the_time_limit_signal_checkpoints_and_resumes(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A user script (clusterfit.session) sees the signal in should_stop(), checkpoints, the job is requeued,
    and the script resumes from that checkpoint to the state an uninterrupted run ends with."""
    command = "python session_user.py --steps 40 --every 1000"
    reference = run_cli("run", str(session_job(tmp_path, "whole", command)))
    command += " --sleep 0.25"  # paces the run so the signal lands mid-way; the values do not depend on it
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    out = tmp_path / "stopped"
    spec = session_job(tmp_path, "stopped", command, resources={"instance_count": 1, "backend": "slurm"})
    launcher = _launch(spec, tmp_path)
    try:
        wait_for(lambda: any(beat.step >= 2 for beat in read_heartbeats(JobOutputs.at(out), 2).values()), 240, "step 2")
        output = _signal_requeue_and_finish(slurm, launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    # The stopped run's logs were rotated to rank-N.log.1 when the requeued run started.
    logs = "\n".join(path.read_text() for path in sorted((out / "logs").glob("rank-*.log*")))
    assert "on request" in logs and "resumed from step" in logs, logs[-3000:]
    assert final_values(out) == final_values(tmp_path / "whole")


@contextmanager
def _controller_down(slurm: SlurmCluster) -> Iterator[None]:
    slurm.stop_controller()
    try:
        yield
    finally:
        slurm.start_controller()  # whatever happened: the other tests of the session need the controller


def _job_history(job_id: str) -> list[tuple[str, str]]:
    return [(event.state, event.message) for event in open_store().events(job_id)]


def test_a_controller_outage_at_submission_is_retried_and_the_job_succeeds(slurm: SlurmCluster, tmp_path: Path) -> None:
    """sbatch cannot reach slurmctld: the attempt fails as UNAVAILABLE, the job waits and is submitted again once
    the controller is back, and trains to its exported model."""
    out = tmp_path / "out"
    job = tiny_job(out)
    job["resources"]["backend"] = "slurm"
    job["limits"] = {"max_retries": 2}
    with _controller_down(slurm):
        launcher = _launch(write_job(tmp_path / "job.yaml", job), tmp_path)
        try:
            wait_for(lambda: (out / SCRIPT).exists(), 120, "the first attempt to call sbatch")  # the job is recorded
            (job_id,) = [row.id for row in open_store().list_jobs()]
            wait_for(lambda: open_store().get(job_id).state == "RETRYING", 120, "sbatch to fail and the job to wait")
        except BaseException:
            launcher.kill()
            raise
    try:
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    history = _job_history(job_id)
    states = [state for state, _ in history]
    assert states[:3] == ["QUEUED", "STAGING", "RETRYING"] and states[-3:] == ["STAGING", "RUNNING", "SUCCEEDED"]
    retried = [message for state, message in history if state == "RETRYING"]
    assert retried[0].startswith(
        "slurm: sbatch could not hand the job to the Slurm controller (Unable to contact slurm controller"
    ), retried
    assert retried[0].endswith("attempt 1 of 3 failed; retrying from the last checkpoint in 5 s"), retried
    assert "attempt 1 failed: the engine or data store was unavailable: slurm: sbatch could not hand" in output
    assert exported_weights(out)


def test_a_refusal_of_the_job_fails_at_once_in_one_line_and_is_not_retried(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["resources"] = {**job["resources"], "backend": "slurm", "slurm": {"partition": "nope"}}
    job["limits"] = {"max_retries": 2}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (failed,) = open_store().list_jobs()
    assert result.stderr.strip().splitlines() == [
        f"error: job tiny ({failed.id}) failed: the engine refused the job",
        "error: slurm: resources.slurm.partition = 'nope': sbatch refused it (Invalid partition name specified); "
        "give a partition that sinfo lists, or null for the cluster's default",
    ]
    assert [state for state, _ in _job_history(failed.id)] == ["QUEUED", "STAGING", "FAILED"]
    assert (failed.attempt, failed.cause) == (1, "ENGINE")
    assert _job_ids(slurm) == []
