"""clusterfit.session: a user's own training script reports, checkpoints and resumes like the built-in trainer.
Real 2-rank jobs (torchrun, gloo on loopback) of tests/scripts/session_user.py, submitted through the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_cli, wait_for, write_job

from clusterfit.outputs import JobOutputs, read_heartbeats, read_records
from clusterfit.service.local_jobs import LocalJobs
from clusterfit.service.migrate import open_store
from clusterfit.session import SessionError
from clusterfit.session.checkpoints import CheckpointWriter, latest_checkpoint
from clusterfit.session.context import JobContext
from clusterfit.session.reporting import checked_record

USER_SCRIPT = REPO / "tests" / "scripts" / "session_user.py"


def session_job(tmp_path: Path, name: str, command: str, **changes: Any) -> Path:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    shutil.copy(USER_SCRIPT, code / USER_SCRIPT.name)
    job = {
        "name": name,
        "command": command,
        "code": str(code),
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(tmp_path / name)},
        **changes,
    }
    return write_job(tmp_path / f"{name}.yaml", job)


def submit(spec: Path) -> str:
    result = run_cli("submit", str(spec))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def state(job_id: str) -> str:
    return open_store().get(job_id).state


def ended(job_id: str, timeout: float = 180) -> str:
    return wait_for(lambda: state(job_id) in ("SUCCEEDED", "FAILED", "CANCELLED") and state(job_id), timeout, "end")


def status(job_id: str) -> str:
    result = run_cli("status", job_id)
    assert result.returncode == 0, result.stderr
    return result.stdout


def final_values(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"final-rank-{rank}.json").read_text()) for rank in range(2)]


def context(tmp_path: Path, rank: int, hang_timeout: float = 600, token: str = "r1.0.0") -> JobContext:
    return JobContext(rank, rank, 2, 2, 0, "unit", 1, tmp_path, hang_timeout, token)


# --- the API's own rules, without a job ---------------------------------------------------------------------
def test_a_wrong_metric_or_step_is_refused_in_one_line() -> None:
    assert checked_record(3, {"loss": 1, "acc": 0.5}) == {"loss": 1.0, "acc": 0.5}
    with pytest.raises(SessionError, match=r"report\(loss='high'\): metrics are numbers; pass a float"):
        checked_record(3, {"loss": "high"})
    with pytest.raises(SessionError, match=r"report\(step=-1\): step must be a whole number >= 0"):
        checked_record(-1, {})
    with pytest.raises(SessionError, match=r"'time' is the record's own field"):
        checked_record(1, {"time": 2.0})


def test_a_checkpoint_missing_a_rank_s_part_is_never_offered(tmp_path: Path) -> None:
    rank0, rank1 = CheckpointWriter(context(tmp_path, 0, hang_timeout=0.5)), CheckpointWriter(context(tmp_path, 1))
    for writer in (rank0, rank1):
        with writer.save(2, keep=3) as folder:
            (folder / "state.json").write_text(f"rank {writer.context.rank} at 2")
    rank0.wait()
    with rank0.save(4, keep=3) as folder:  # rank 1 never writes its part of step 4
        (folder / "state.json").write_text("rank 0 at 4")
    with pytest.raises(RuntimeError, match="step-00000004 was not published: checkpoint step 4: no rank-00001"):
        rank0.wait()
    checkpoints = JobOutputs.at(tmp_path).checkpoints
    resume = latest_checkpoint(checkpoints, rank=1)
    assert resume is not None and resume.step == 2
    assert (resume.folder / "state.json").read_text() == "rank 1 at 2"
    # A published checkpoint that lost a part afterwards is skipped too, for an older one (here none).
    shutil.rmtree(resume.part(1))
    assert latest_checkpoint(checkpoints, rank=0) is None
    # A part a failed run left behind is removed by the next run's rank 0, never mixed into its checkpoints.
    assert list(checkpoints.glob(".tmp-step-00000004.r1.0.0/rank-00000"))
    CheckpointWriter(context(tmp_path, 0, token="r2.0.0"))
    assert not list(checkpoints.glob(".tmp-*"))


def test_a_folder_reused_by_a_trainer_job_and_a_script_never_mixes_their_checkpoints(tmp_path: Path) -> None:
    from clusterfit.outputs.checkpoints import SHARED_STATE, checkpoint_name, newest_verified, publish

    checkpoints = JobOutputs.at(tmp_path).checkpoints
    trainer_tmp = checkpoints / ".tmp-trainer"  # a trainer's checkpoint at step 2, as the trainer publishes it
    trainer_tmp.mkdir(parents=True)
    (trainer_tmp / SHARED_STATE).write_bytes(b"weights")
    publish(trainer_tmp, checkpoints / checkpoint_name(2), {"step": 2, "world_size": 2}, keep=3)
    rank0, rank1 = CheckpointWriter(context(tmp_path, 0)), CheckpointWriter(context(tmp_path, 1))
    for writer in (rank0, rank1):  # then a 2-rank script's, newer, at step 5
        with writer.save(5, keep=3) as folder:
            (folder / "state.json").write_text("script at 5")
    rank0.wait()
    assert newest_verified(checkpoints) == checkpoints / checkpoint_name(2)  # what the trainer resumes from
    resume = latest_checkpoint(checkpoints, rank=0)
    assert resume is not None and resume.step == 5


def test_outside_a_job_the_calls_work_and_write_nothing(tmp_path: Path) -> None:
    script = (
        "import sys, clusterfit.session as cf; cf.report(step=1, loss=0.5)\n"
        "print('torch' in sys.modules, cf.context(), cf.latest_checkpoint())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFIT_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False JobContext(rank=0")  # no framework imported
    assert "world_size=1" in done.stdout and done.stdout.strip().endswith("None")
    assert list(tmp_path.iterdir()) == []


# --- real 2-rank jobs ----------------------------------------------------------------------------------------
def test_a_reporting_script_shows_its_step_and_metrics_in_status_the_api_and_tensorboard(tmp_path: Path) -> None:
    go = tmp_path / "go"  # the script holds after step 6 until the test has seen it running
    job_id = submit(session_job(tmp_path, "reports", f"python session_user.py --steps 8 --sleep 0.4 --hold 6:{go}"))

    def shown() -> str | None:
        text = status(job_id)
        return text if "metrics at step " in text and "progress: step " in text else None

    running = wait_for(shown, 60, "a reported step and metric")
    print(running)  # the status of a running user-script job
    go.touch()
    assert "RUNNING" in running and "/8 (" in running and "training step" in running
    assert ended(job_id) == "SUCCEEDED", status(job_id)
    final = status(job_id)
    assert "progress: step 7/8" in final and "metrics at step 7: score " in final, final
    series = LocalJobs(open_store(), start_jobs=False).metrics(job_id)
    assert [record["step"] for record in series] == list(range(8))
    assert series[-1]["score"] == pytest.approx(final_values(tmp_path / "reports")[0]["value"])
    assert list((tmp_path / "reports" / "tensorboard").glob("events.out.tfevents.*"))
    beats = read_heartbeats(JobOutputs.at(tmp_path / "reports"), 2)
    expected = {"total_steps": 8.0, "score": series[-1]["score"], "rank_value": 1.0, "node": 0.0}
    assert beats[1].metrics == expected


def test_a_script_that_stops_reporting_is_a_hang_with_every_rank_s_stacks(tmp_path: Path) -> None:
    command = "python session_user.py --steps 50 --hang-at 2"
    job_id = submit(session_job(tmp_path, "hangs", command, limits={"hang_timeout": 5}))
    assert ended(job_id) == "FAILED"
    text = status(job_id)
    print(text)  # the status of a hung user-script job
    assert "cause: hang: no progress (HANG)" in text and "every rank last reported step 2" in text
    for rank in range(2):
        log = (tmp_path / "hangs" / "logs" / f"rank-{rank}.log").read_text()
        assert "most recent call first" in log and "session_user.py" in log, log


def test_a_script_that_never_reports_is_alive_and_never_hung(tmp_path: Path) -> None:
    job_id = submit(session_job(tmp_path, "silent", "sleep 9", limits={"hang_timeout": 5}))
    beats = wait_for(lambda: len(b := read_heartbeats(JobOutputs.at(tmp_path / "silent"), 2)) == 2 and b, 30, "beats")
    assert {beat.phase for beat in beats.values()} == {"running"}
    assert ended(job_id) == "SUCCEEDED", status(job_id)


def test_a_rank_killed_mid_run_is_retried_from_the_last_complete_checkpoint_exactly(tmp_path: Path) -> None:
    command = "python session_user.py --steps 14 --every 3"
    reference = run_cli("run", str(session_job(tmp_path, "whole", command)))
    command += " --sleep 0.25"  # paces the run so the kill lands mid-way; the values do not depend on it
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    job_id = submit(session_job(tmp_path, "killed", command, limits={"max_retries": 1}))
    out = JobOutputs.at(tmp_path / "killed")
    wait_for(lambda: list(out.checkpoints.glob("step-*")), 60, "a published checkpoint")
    os.kill(read_heartbeats(out, 2)[1].pid, signal.SIGKILL)
    assert ended(job_id) == "SUCCEEDED", status(job_id)
    job = open_store().get(job_id)
    assert job.attempt == 2
    resumed = (out.root / "logs" / "rank-1.log").read_text()
    assert "resumed from step " in resumed and "(attempt 2)" in resumed
    assert final_values(out.root) == final_values(tmp_path / "whole")


KERAS = importlib.util.find_spec("keras") is not None


@pytest.mark.parametrize(
    "model", ["torch", pytest.param("keras", marks=pytest.mark.skipif(not KERAS, reason="the test extra has keras"))]
)
def test_the_resume_example_is_killed_and_resumes_through_the_torch_helper(tmp_path: Path, model: str) -> None:
    """Also with a Keras 3 model on the torch backend, which DDP, a torch optimizer and the torch helper train
    and checkpoint as any module: the ranks end with the same weights."""
    example = REPO / "examples" / "session" / "resume-after-kill.yaml"
    command = f"python train_ddp.py --model {model} --steps 30 --kill-at 25 --checkpoint-every 10"
    result = run_cli("run", str(example), "--set", f"outputs.dir={tmp_path}", "--set", f"command={command}", cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "attempt 1 failed: killed by a signal: rank 1 killed by SIGKILL" in result.stdout
    assert "[rank1] resumed at step 20 (attempt 2)" in result.stdout
    outputs = JobOutputs.at(tmp_path)
    kept = sorted(path.name for path in outputs.checkpoints.glob("step-*"))
    assert kept == ["step-00000019", "step-00000029"]  # keep=2
    weights = {line.split()[-1] for line in result.stdout.splitlines() if " weights " in line}
    assert len(weights) == 1, result.stdout[-3000:]  # both ranks print theirs: one value
    losses = [record["loss"] for record in read_records(outputs.metrics) if "loss" in record]
    assert len(losses) >= 30 and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    if model == "keras":
        import torch

        saved = torch.load(outputs.checkpoints / kept[-1] / "rank-00000" / "state.pt", weights_only=True)
        assert "module._torch_params.classifier/hidden/kernel" in saved["model"]  # Keras's variables, by name


@pytest.mark.skipif(not KERAS, reason="keras is not installed (the test extra has it)")
def test_the_keras_callback_reports_every_batch(tmp_path: Path) -> None:
    spec = session_job(
        tmp_path,
        "keras",
        "python keras_user.py",
        environment_variables={"KERAS_BACKEND": "torch"},
        distribution={"type": "pytorch", "process_count_per_instance": 1},
    )
    shutil.copy(REPO / "tests" / "scripts" / "keras_user.py", tmp_path / "code")
    result = run_cli("run", str(spec))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_records(JobOutputs.at(tmp_path / "keras").metrics)
    assert [record["step"] for record in records] == list(range(8))  # 4 batches x 2 epochs
    assert all(record["loss"] > 0 for record in records)


def test_the_keras_callback_checkpoints_each_epoch_and_a_restarted_fit_resumes(tmp_path: Path) -> None:
    """The first attempt dies as epoch 2 begins; the retry restores the model and the optimizer's state from
    epoch 1's checkpoint and goes on from epoch 2, its steps continuing the first attempt's."""
    spec = session_job(
        tmp_path,
        "keras",
        "python keras_user.py --epochs 4 --checkpoint --kill-at-epoch 2",
        environment_variables={"KERAS_BACKEND": "torch"},
        distribution={"type": "pytorch", "process_count_per_instance": 1},
        limits={"max_retries": 1},
    )
    shutil.copy(REPO / "tests" / "scripts" / "keras_user.py", tmp_path / "code")
    result = run_cli("run", str(spec))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "attempt 1 starts at epoch 0 after 0 optimizer steps" in result.stdout
    assert "attempt 2 starts at epoch 2 after 8 optimizer steps" in result.stdout  # 4 batches x 2 epochs
    out = JobOutputs.at(tmp_path / "keras")
    steps = [record["step"] for record in read_records(out.metrics) if "loss" in record]
    assert steps == list(range(16)), steps
    assert sorted(path.name for path in out.checkpoints.glob("step-*")) == ["step-00000002", "step-00000003"]


def test_a_cancel_reaches_should_stop_and_the_script_checkpoints_before_it_ends(tmp_path: Path) -> None:
    job_id = submit(session_job(tmp_path, "cancelled", "python session_user.py --steps 1000 --every 1000 --sleep 0.2"))
    out = JobOutputs.at(tmp_path / "cancelled")
    wait_for(lambda: any(beat.step >= 2 for beat in read_heartbeats(out, 2).values()), 60, "step 2")
    assert run_cli("cancel", job_id).returncode == 0
    assert ended(job_id) == "CANCELLED"
    logs = "\n".join(path.read_text() for path in sorted(out.logs.glob("rank-*.log")))
    assert logs.count("on request") == 2, logs  # both ranks saw SIGTERM in should_stop()
    stopped = latest_checkpoint(out.checkpoints, rank=0)
    assert stopped is not None and stopped.step >= 2  # every 1000 steps, so only the stop wrote one
