"""The job service end to end, as a user types it: real supervisors, real torchrun workers, a real store.

Each test submits a tiny job (resnet_tiny, 32 px, 2 ranks) and reads back what `clusterfit status`, `logs`
and `show` say; failures are real (an exception, a sleeping rank, SIGKILL, memory taken until the kernel's OOM
killer acts, through CLUSTERFIT_FAULT; a DataLoader filling a small /dev/shm)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from confinement import memory_limit_missing, memory_limited, small_shm, small_shm_missing
from conftest import cli_command, processes_mentioning, run_cli, tiny_job, wait_for, write_job
from sqlalchemy import update

from clusterfit.outputs import JobOutputs, RankBeat, read_heartbeats
from clusterfit.service.migrate import open_store
from clusterfit.service.records import record_job
from clusterfit.service.states import JobState
from clusterfit.service.store import Job, utcnow
from clusterfit.spec import load_spec


def _submit(tmp_path: Path, name: str = "tiny", prefix: Sequence[str] = (), **changes: Any) -> tuple[str, Path]:
    """Submits a tiny job; its supervisor and workers are started by `submit`, so they run under `prefix` too."""
    out = tmp_path / name
    spec = tiny_job(out, **changes.pop("trainer", {}))
    spec["name"] = name
    spec.update(changes)
    result = run_cli("submit", str(write_job(tmp_path / f"{name}.yaml", spec)), prefix=prefix)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip(), out


def _submit_command(tmp_path: Path, name: str, command: str, **changes: Any) -> str:
    """Submits a 2-process command job: the scheduler treats it as any job of 2 ranks, and it starts no torch."""
    spec = {
        "name": name,
        "command": command,
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(tmp_path / name)},
        **changes,
    }
    result = run_cli("submit", str(write_job(tmp_path / f"{name}.yaml", spec)))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _state(job_id: str) -> str:
    return open_store().get(job_id).state


def _status(job_id: str) -> str:
    result = run_cli("status", job_id)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _ended(job_id: str, timeout: float = 180) -> str:
    return wait_for(lambda: _state(job_id) in ("SUCCEEDED", "FAILED", "CANCELLED") and _state(job_id), timeout, "end")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_submitted_job_runs_to_success_and_is_shown(tmp_path: Path) -> None:
    job_id, out = _submit(tmp_path)
    assert len(job_id) == 10
    follower = subprocess.Popen(cli_command("logs", job_id, "-f"), stdout=subprocess.PIPE, text=True)
    followed, _ = follower.communicate(timeout=240)  # -f returns by itself once the job has ended
    assert _state(job_id) == "SUCCEEDED", _status(job_id)
    assert "exported" in followed and "[rank1@" in followed
    assert (out / "model" / "model.safetensors").exists()
    status = _status(job_id)
    assert f"job {job_id} (tiny): SUCCEEDED, attempt 1 of 1" in status
    assert "progress: step 4/4 (100%)" in status
    assert "rank 1 on " in status
    listing = run_cli("list").stdout
    assert job_id in listing and "SUCCEEDED" in listing
    show = run_cli("show", job_id).stdout
    assert "QUEUED" in show and "STAGING" in show and "RUNNING" in show
    assert "checkpoint: " in show and "model.safetensors" in show and "name: tiny" in show
    assert "\nsummary:\n  epoch 1: step 4, images_per_s " in show, show  # each epoch on a line of its own
    logs = run_cli("logs", job_id).stdout.splitlines()
    host = os.uname().nodename
    assert any(line.startswith(f"[rank0@{host}] ") and "exported" in line for line in logs)
    assert any(line.startswith(f"[rank1@{host}] ") for line in logs)
    only_rank1 = run_cli("logs", job_id, "--rank", "1").stdout.splitlines()
    assert only_rank1 and all(line.startswith(f"[rank1@{host}] ") for line in only_rank1)


def test_cancel_mid_run_leaves_no_process(tmp_path: Path) -> None:
    job_id, out = _submit(tmp_path, trainer={"steps_per_epoch": 5000})
    wait_for(lambda: _state(job_id) == "RUNNING", 180, "RUNNING")
    job = open_store().get(job_id)
    beats = wait_for(lambda: _both_heartbeats(out), 60, "both heartbeats")
    pids = [beat.pid for beat in beats.values()]
    pids += [int(json.loads(job.engine_ref)["id"]), int(json.loads(job.supervisor)["pid"])]
    assert all(_alive(pid) for pid in pids)
    result = run_cli("cancel", job_id)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"job {job_id} CANCELLED"
    wait_for(lambda: not any(_alive(pid) for pid in pids), 30, f"processes {pids} to end")
    assert not processes_mentioning(str(out))
    status = _status(job_id)
    assert "CANCELLED" in status and "cause: cancelled by user (CANCELLED)" in status
    # One step in all of status: the progress line and the cancel note both name the last step the ranks wrote.
    progress_step = re.search(r"progress: step (\d+)/", status)
    cancel_step = re.search(r"cancelled by user: at step (\d+)", status)
    assert progress_step and cancel_step and progress_step.group(1) == cancel_step.group(1), status


def test_a_second_job_on_the_same_outputs_is_refused_and_the_first_keeps_running(tmp_path: Path) -> None:
    # Command jobs that print and wait: the outputs lock is the same for every kind of job, and they leave the
    # cores to the other tests.
    waits = "python -u -c 'import time; print(\"first job running\"); time.sleep(600)'"
    first = _submit_command(tmp_path, "tiny", waits)
    out = tmp_path / "tiny"
    wait_for(lambda: "first job running" in _read(out / "logs" / "rank-0.log"), 180, "the first job's rank 0")
    log_before = (out / "logs" / "rank-0.log").read_text()
    second = run_cli("run", str(tmp_path / "tiny.yaml"))  # the same spec, so the same outputs.dir
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"error: outputs.dir {out} is in use by job {first} (pid " in second.stderr, second.stderr
    assert "Traceback" not in second.stderr and "every rank's log" not in second.stderr  # no rank of it ran
    assert _state(first) == "RUNNING"
    assert (out / "logs" / "rank-0.log").read_text().startswith(log_before), "the second run touched the first's log"
    assert run_cli("cancel", first).returncode == 0
    assert _ended(first) == "CANCELLED"
    # The lock went with the first job's supervisor: the folder is free again.
    third = _submit_command(tmp_path, "tiny", waits)
    try:
        settled = wait_for(
            lambda: _state(third) not in ("QUEUED", "STAGING") and _state(third), 180, "the next job to start"
        )
        assert settled == "RUNNING", _status(third)
    finally:
        cancelled = run_cli("cancel", third)  # whatever happened: its 10-minute sleep ends here
    assert cancelled.returncode == 0, cancelled.stderr


def test_a_rank_that_raises_fails_the_job_with_its_traceback(tmp_path: Path) -> None:
    job_id, _ = _submit(tmp_path, environment_variables={"CLUSTERFIT_FAULT": "raise:rank=1:step=2"})
    assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: Python exception (EXCEPTION)" in status
    assert "rank 1: InjectedFault: injected failure on rank 1 after step 2" in status
    assert "faults.py" in status  # the last lines of the traceback


def test_a_rank_that_sleeps_forever_is_a_hang_with_stacks_in_the_logs(tmp_path: Path) -> None:
    job_id, out = _submit(
        tmp_path,
        trainer={"steps_per_epoch": 50},
        environment_variables={"CLUSTERFIT_FAULT": "hang:rank=1:step=3"},
        limits={"hang_timeout": 6},
    )
    assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: hang: no progress (HANG)" in status
    assert "no training step on any rank for" in status and "rank-1.log" in status
    assert "every rank last reported step 3" in status  # the hanging rank's last step, not an older one
    hung_log = (out / "logs" / "rank-1.log").read_text()
    assert "most recent call first" in hung_log and "faults.py" in hung_log and "in trigger" in hung_log
    assert "most recent call first" in (out / "logs" / "rank-0.log").read_text()  # the waiting rank too
    assert not processes_mentioning(str(out))


def test_a_collective_that_waits_too_long_is_named(tmp_path: Path) -> None:
    job_id, out = _submit(
        tmp_path,
        trainer={"steps_per_epoch": 50},
        environment_variables={"CLUSTERFIT_FAULT": "hang:rank=1:step=2"},
        # Longer than a loaded machine takes to reach the first collective on both ranks (rank 0 imports
        # TensorBoard first): only the injected hang may time out, and it is rank 0 that waits for it.
        limits={"hang_timeout": 300, "collective_timeout": 20},
    )
    assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: collective timeout (COLLECTIVE_TIMEOUT)" in status
    assert "rank 0: a collective timed out; another rank stopped taking part" in status
    assert not processes_mentioning(str(out))


def test_a_rank_killed_by_sigkill_is_named(tmp_path: Path) -> None:
    job_id, out = _submit(tmp_path, trainer={"steps_per_epoch": 5000})
    wait_for(lambda: _state(job_id) == "RUNNING", 180, "RUNNING")
    beats = wait_for(lambda: _both_heartbeats(out), 60, "both heartbeats")
    os.kill(beats[1].pid, signal.SIGKILL)
    assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: killed by a signal (SIGNAL)" in status or "cause: killed by the OOM killer (OOM)" in status
    assert "rank 1 killed by" in status


@pytest.mark.skipif(bool(memory_limit_missing()), reason=str(memory_limit_missing()))
def test_a_rank_that_runs_out_of_memory_is_named_oom(tmp_path: Path) -> None:
    # The job's processes take about 1.5 GiB; rank 1 then takes memory until the kernel's OOM killer, acting
    # on the cgroup's limit, picks the biggest process: itself.
    with memory_limited(3 << 30) as prefix:
        job_id, out = _submit(
            tmp_path,
            prefix=prefix,
            trainer={"steps_per_epoch": 50},
            environment_variables={"CLUSTERFIT_FAULT": "oom:rank=1:step=2"},
        )
        assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: killed by the OOM killer (OOM)" in status, status
    assert "rank 1 killed by the kernel's OOM killer" in status and "lower trainer.batch_size" in status
    # A warm start would have put the agent outside the limited cgroup.
    assert "the launcher's cgroup differs" in (out / "logs" / "agent.log").read_text()


@pytest.mark.skipif(bool(small_shm_missing()), reason=str(small_shm_missing()))
def test_a_dataloader_out_of_shared_memory_is_named(tmp_path: Path, tiny_imagefolder: Path) -> None:
    # A batch of 8 images of 64 px is 384 KiB: more than the whole /dev/shm the job gets.
    job_id, out = _submit(
        tmp_path,
        prefix=small_shm(256 << 10),
        trainer={
            "data": {
                "train": str(tiny_imagefolder / "train"),
                "image_size": 64,
                "loader_workers": 1,
                "num_classes": None,
            },
            "batch_size": 8,
        },
    )
    assert _ended(job_id) == "FAILED"
    status = _status(job_id)
    assert "cause: out of shared memory (SHM)" in status, status
    assert "out of shared memory (/dev/shm)" in status
    # A warm start would have put the agent outside the private /dev/shm's mount namespace.
    assert "the launcher's mnt namespace differs" in (out / "logs" / "agent.log").read_text()


def test_a_failed_attempt_is_retried_from_its_last_checkpoint(tmp_path: Path) -> None:
    job_id, out = _submit(
        tmp_path,
        trainer={"steps_per_epoch": 6, "checkpoint": {"every_steps": 2}},
        environment_variables={"CLUSTERFIT_FAULT": "raise:rank=0:step=3:attempt=1"},
        limits={"max_retries": 1},
    )
    assert _ended(job_id) == "SUCCEEDED", _status(job_id)
    assert "attempt 2 of 2" in _status(job_id)
    history = run_cli("show", job_id).stdout
    assert "RETRYING" in history and "attempt 1 of 2 failed; retrying from the last checkpoint" in history
    assert "resuming from" in (out / "logs" / "rank-0.log").read_text()
    assert "injected failure" in (out / "logs" / "rank-0.log.1").read_text()  # the failed attempt's log is kept


def test_queued_jobs_start_by_priority_when_room_frees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERFIT_CAPACITY", "2")
    go = tmp_path / "go"  # `first` holds both slots until the test has queued the other two
    code = tmp_path / "code"
    code.mkdir()
    (code / "wait.py").write_text(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.1)\n")
    first = _submit_command(tmp_path, "first", "python wait.py", code=str(code))
    wait_for(lambda: _state(first) == "RUNNING", 120, "first to run")
    low = _submit_command(tmp_path, "low", "true")
    high = _submit_command(tmp_path, "high", "true", queue_settings={"priority": 10})
    assert _state(low) == "QUEUED" and _state(high) == "QUEUED"  # 2 slots, both taken by `first`
    go.touch()
    for job_id in (first, low, high):
        assert _ended(job_id, 300) == "SUCCEEDED", _status(job_id)
    store = open_store()
    started = {job_id: store.get(job_id).started_at for job_id in (first, low, high)}
    assert started[first] < started[high] < started[low]
    assert store.get(high).started_at >= store.get(first).ended_at


def test_a_job_whose_supervisor_died_is_not_shown_running(tmp_path: Path) -> None:
    job_id, out = _submit(tmp_path, trainer={"steps_per_epoch": 5000})
    wait_for(lambda: _state(job_id) == "RUNNING", 180, "RUNNING")
    supervisor = int(json.loads(open_store().get(job_id).supervisor)["pid"])
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not processes_mentioning(str(out)), 60, "the workers to stop with their supervisor")
    status = _status(job_id)
    assert "FAILED" in status and "cause: node lost (NODE_LOST)" in status
    assert f"the process supervising this job (pid {supervisor} on" in status


def test_a_job_whose_starter_died_before_its_supervisor_is_queued_again_and_runs_once(tmp_path: Path) -> None:
    """A submitter killed between the scheduler's claim of a job and the start of its supervisor (a sweep driver
    killed mid-submit) left it STAGING for ever, then FAILED as a lost node. It is queued again instead; a second
    supervisor started for the running job, or for the ended one, leaves it alone."""
    out, go = tmp_path / "out", tmp_path / "go"
    spec = {
        "name": "orphan",
        "command": f"while [ ! -e {go} ]; do sleep 0.1; done; echo ran once",  # runs until the test has looked
        "distribution": {"type": "pytorch", "process_count_per_instance": 1},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    store = open_store()
    job = record_job(store, load_spec(write_job(tmp_path / "job.yaml", spec)))
    store.transition(job.id, JobState.STAGING, "started by the scheduler")  # ... which then died
    with store.session() as session:  # as long ago as a supervisor may take to start
        session.execute(update(Job).where(Job.id == job.id).values(updated_at=utcnow() - timedelta(minutes=2)))

    assert "SUCCEEDED" not in _status(job.id)  # any command that reads the store puts it back and starts it
    wait_for(lambda: _state(job.id) == "RUNNING", 60, "RUNNING")
    supervisor_log = out / "logs" / "supervisor.log"

    def second_supervisor_says(words: str) -> None:
        subprocess.run([sys.executable, "-m", "clusterfit.service.supervisor", job.id], check=True)  # detaches
        wait_for(lambda: f"job {job.id} {words}" in supervisor_log.read_text(), 60, words)

    second_supervisor_says("is RUNNING and supervised by another process; leaving it alone")
    go.touch()
    assert _ended(job.id) == "SUCCEEDED"
    second_supervisor_says("has ended SUCCEEDED; nothing to supervise")
    assert _state(job.id) == "SUCCEEDED" and store.get(job.id).attempt == 1
    assert (out / "logs" / "rank-0.log").read_text().count("ran once") == 1
    assert [(event.state, event.message) for event in store.events(job.id)][:4] == [
        ("QUEUED", "submitted"),
        ("STAGING", "started by the scheduler"),
        ("QUEUED", "queued again: whoever started it stopped before its supervisor began"),
        ("STAGING", "started by the scheduler"),
    ]


def test_a_bad_spec_is_refused_at_submit_and_nothing_is_recorded(tmp_path: Path) -> None:
    spec = tiny_job(tmp_path / "out")
    spec["trainer"]["epochs"] = 0
    result = run_cli("submit", str(write_job(tmp_path / "job.yaml", spec)))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'job.yaml'}: trainer.epochs = 0: Input should be greater than or equal to 1"
    ]
    assert open_store().list_jobs() == []


def test_data_gone_before_a_queued_job_starts_is_a_bad_spec(
    tmp_path: Path, tiny_imagefolder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTERFIT_CAPACITY", "2")
    blocker = _submit_command(tmp_path, "blocker", "sleep 600")  # holds both slots, starts no torch
    data = {"train": str(tiny_imagefolder / "train"), "image_size": 32, "num_classes": None}
    waiting, _ = _submit(tmp_path, "waiting", trainer={"data": data})
    assert _state(waiting) == "QUEUED"
    shutil.rmtree(tiny_imagefolder / "train")
    assert run_cli("cancel", blocker).returncode == 0
    assert _ended(waiting) == "FAILED"
    status = _status(waiting)
    assert "cause: bad spec (BAD_SPEC)" in status and "no such folder" in status


def _both_heartbeats(out: Path) -> dict[int, RankBeat] | None:
    beats = read_heartbeats(JobOutputs(out), 2)
    return beats if len(beats) == 2 else None
