"""SIGUSR1 (what Slurm sends before a time limit) makes the trainer checkpoint at its next log step and stop
cleanly on every rank; running the job again resumes from there and finishes. Real processes, local engine."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import cli_command, run_cli, tiny_job, write_job


def _worker_pids(resolved_spec: Path) -> list[int]:
    """The trainer processes (not torchrun's agent) whose command line names this job's resolved spec."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # NOTE: a rank forked by the agent names itself as one string (setproctitle), not as argv.
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            is_agent = b"clusterfit.backends.agent" in cmdline
            if f"-m clusterfit.worker --spec {resolved_spec}".encode() in cmdline and not is_agent:
                pids.append(int(entry.name))
    return pids


def test_sigusr1_checkpoints_stops_and_a_rerun_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = tiny_job(out, steps_per_epoch=40, norm_layer="group", log_every_steps=1)
    spec["environment_variables"] = {"CLUSTERFIT_FAULT": "slow:rank=0:step=1:seconds=0.05"}  # stops before step 40
    job = write_job(tmp_path / "job.yaml", spec)
    launcher = subprocess.Popen(
        cli_command("run", str(job)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log, deadline = out / "logs" / "rank-0.log", time.monotonic() + 180
        while not (log.exists() and "step 2/" in log.read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, "the job never reached step 2"
            time.sleep(0.1)
        workers = _worker_pids(out / "job.yaml")
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGUSR1)  # one rank only: both must still stop at the same step
        output, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, output[-3000:]  # EX_TEMPFAIL: not finished, run again
    assert "stopped at step" in output and "run it again to resume" in output
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    assert not (out / "model").exists()

    resumed = run_cli("run", str(job))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout
    assert (out / "model" / "model.safetensors").exists()
