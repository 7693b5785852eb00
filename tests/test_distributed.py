"""Real multi-process training through the CLI: torchrun starts the workers, gloo moves the gradients."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch
from conftest import cli_command, exported_weights, max_abs_difference, run_cli, tiny_job, write_job

from clusterfit.models import build_model
from clusterfit.scoring import load_classifier


def _run_ok(job: Path) -> subprocess.CompletedProcess[str]:
    result = run_cli("run", str(job))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_two_ranks_match_one_rank_with_the_global_batch(tmp_path: Path) -> None:
    """DDP: 2 ranks x batch 4 must reach the weights of 1 rank x batch 8 (GroupNorm: no per-rank statistics)."""
    common = {"norm_layer": "group", "steps_per_epoch": 3, "epochs": 2}
    two = tiny_job(tmp_path / "two", batch_size=4, **common)
    one = tiny_job(tmp_path / "one", batch_size=8, **common)
    one["distribution"]["process_count_per_instance"] = 1
    _run_ok(write_job(tmp_path / "two.yaml", two))
    _run_ok(write_job(tmp_path / "one.yaml", one))

    torch.manual_seed(0)
    initial = build_model("resnet_tiny", 10, "group").state_dict()
    trained_two, trained_one = exported_weights(tmp_path / "two"), exported_weights(tmp_path / "one")
    moved = max_abs_difference(trained_one, initial)
    assert moved > 1e-2, "training must move the weights far more than the tolerance, or the test proves nothing"
    assert max_abs_difference(trained_two, trained_one) < 1e-5


def _worker_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "clusterfit" in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def test_killed_job_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """Train 16 steps straight vs. kill the launcher after the first checkpoint and rerun: same weights."""
    settings = {"norm_layer": "group", "steps_per_epoch": 8, "epochs": 2, "checkpoint": {"every_steps": 3, "keep": 2}}
    _run_ok(write_job(tmp_path / "straight.yaml", tiny_job(tmp_path / "straight", **settings)))

    out = tmp_path / "resumed"
    job = write_job(tmp_path / "resumed.yaml", tiny_job(out, **settings))
    launcher = subprocess.Popen(
        cli_command("run", str(job)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while not list((out / "checkpoints").glob("step-*/manifest.json")):
        assert launcher.poll() is None, "the job ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    launcher.kill()  # SIGKILL: no chance to clean up
    launcher.wait()
    deadline = time.monotonic() + 60
    while _worker_pids(str(out)):
        assert time.monotonic() < deadline, f"orphan processes left: {_worker_pids(str(out))}"
        time.sleep(0.2)
    assert not (out / "summary.json").exists(), "the job must have been stopped before it finished"

    rerun = _run_ok(job)
    assert "resuming from" in rerun.stdout
    assert max_abs_difference(exported_weights(out), exported_weights(tmp_path / "straight")) < 1e-6
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


def test_imagefolder_end_to_end(tmp_path: Path, tiny_imagefolder: Path) -> None:
    """A user's folder of JPEGs, 2 workers: validation counted exactly, model exported and usable."""
    job = tiny_job(
        tmp_path / "out",
        norm_layer="batch",
        epochs=2,
        steps_per_epoch=None,
        batch_size=8,
        optimizer={"lr": 0.4},
        data={
            "train": str(tiny_imagefolder / "train"),
            "val": str(tiny_imagefolder / "val"),
            "image_size": 32,
            "num_classes": None,
            "loader_workers": 1,
        },
    )
    result = _run_ok(write_job(tmp_path / "job.yaml", job))
    out = tmp_path / "out"
    assert "[rank0]" in result.stdout and "[rank1]" in result.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert summary["final"]["val_images"] == 15  # 8 + 7 across 2 ranks: nothing padded or counted twice
    assert all(e["images_per_s"] > 0 for e in summary["epochs"])
    assert summary["world_size"] == 2 and summary["global_batch"] == 16
    assert summary["steps"] == 2 * (48 // 16)

    classifier = load_classifier(out / "model")
    assert classifier.classes == ["class_0", "class_1", "class_2"]
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    probabilities = classifier.predict(images)
    assert probabilities.shape == (5, 3)
    assert torch.allclose(probabilities.sum(dim=1), torch.ones(5), atol=1e-5)

    scripted = torch.jit.load(str(out / "model" / "model.torchscript.pt"))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    logits = scripted((images.float() - mean) / std)
    assert torch.allclose(logits.softmax(dim=1), probabilities, atol=1e-5)

    for rank in (0, 1):
        assert f"rank {rank} of 2" in (out / "logs" / f"rank-{rank}.log").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert kinds == {"start", "train", "val", "end"}


def test_synthetic_end_to_end_and_rerun_of_a_finished_job(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out", precision="auto", channels_last=True))
    first = _run_ok(job)
    assert "model.safetensors" in first.stdout
    weights = exported_weights(tmp_path / "out")
    second = _run_ok(job)  # a finished job's rerun resumes at its end and trains nothing more
    assert "resuming from" in second.stdout
    assert max_abs_difference(exported_weights(tmp_path / "out"), weights) == 0.0
    assert (tmp_path / "out" / "logs" / "rank-0.log.1").exists(), "the first run's logs are kept"
