"""Real multi-process training through the CLI: torchrun starts the workers, gloo moves the gradients."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from azure.storage.blob import BlobServiceClient
from azurite import Azurite, serving
from conftest import (
    REPO,
    WarmStart,
    cli_command,
    exported_weights,
    kill_after_first_checkpoint,
    max_abs_difference,
    processes_mentioning,
    run_cli,
    tiny_job,
    wait_for,
    wait_for_first_checkpoint,
    write_job,
)
from PIL import Image

from clusterfit.models import build_model
from clusterfit.outputs import FAULT_ENV
from clusterfit.scoring import load_classifier
from clusterfit.storage.filesystems import cache_folder


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


RESUME_SETTINGS = {
    "norm_layer": "group",
    "steps_per_epoch": 8,
    "epochs": 2,
    "checkpoint": {"every_steps": 3, "keep": 2},
}


# One worker runs them all: each worker would otherwise compute the straight reference run (a module fixture) again.
pytestmark = pytest.mark.xdist_group("distributed")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 steps without interruption: the reference the interrupted runs must reproduce. It starts cold, as a
    job whose interpreter settings differ from the warm-start process's must, and says why in its agent log;
    the interrupted runs start warm, so matching it also shows a forked agent trains as a new one does."""
    root = tmp_path_factory.mktemp("straight")
    other_hash_seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    job = write_job(root / "job.yaml", tiny_job(root / "out", **RESUME_SETTINGS))
    result = run_cli("run", str(job), env={**os.environ, "PYTHONHASHSEED": other_hash_seed})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    agent_log = (root / "out" / "logs" / "agent.log").read_text()
    assert "PYTHONHASHSEED differs from the warm-start process's" in agent_log, agent_log[:2000]
    assert "starting the agent cold" in agent_log
    # ... and on the console, since CLUSTERFIT_WARM_START asked for a warm start.
    assert re.search(r"attempt 1: its agent started cold: .*PYTHONHASHSEED differs", result.stdout), result.stdout
    return root / "out"


def test_killed_job_resumes_to_the_same_weights(tmp_path: Path, straight_run: Path) -> None:
    """Kill the launcher (SIGKILL) after the first checkpoint, rerun: no orphans, same weights as straight."""
    out = tmp_path / "resumed"
    job = write_job(tmp_path / "resumed.yaml", tiny_job(out, **RESUME_SETTINGS))
    kill_after_first_checkpoint(job, out)

    rerun = _run_ok(job)
    assert "resuming from" in rerun.stdout
    assert max_abs_difference(exported_weights(out), exported_weights(straight_run)) < 1e-6
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


@pytest.fixture(scope="module")
def outputs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    yield from serving(tmp_path_factory.mktemp("azurite"), "outputs")


def _stored(store: Azurite, prefix: str) -> dict[str, bytes]:
    container = BlobServiceClient.from_connection_string(store.connection_string()).get_container_client("outputs")
    blobs = container.list_blobs(name_starts_with=prefix + "/")
    return {b.name[len(prefix) + 1 :]: container.download_blob(b.name).readall() for b in blobs}


def _names(store: Azurite, prefix: str = "resumed") -> set[str]:
    container = BlobServiceClient.from_connection_string(store.connection_string()).get_container_client("outputs")
    return {b.name[len(prefix) + 1 :] for b in container.list_blobs(name_starts_with=prefix + "/")}


def test_outputs_at_a_url_outlive_the_machine_and_the_rerun_resumes_from_the_store(
    tmp_path: Path, straight_run: Path, outputs_store: Azurite
) -> None:
    """outputs.dir: az://...: the job works in a local copy that the store follows. Killed once a checkpoint is
    in the store, its local copy deleted (a fresh machine), the rerun resumes from the store and ends with the
    straight run's weights; show and logs read the store once the local copy is gone again."""
    url, cache = "az://outputs/resumed", tmp_path / "cache"
    spec = tiny_job(tmp_path / "unused", **RESUME_SETTINGS)
    spec["outputs"] = {"dir": url, "cache_dir": str(cache), "upload_every_s": 0.2}
    job = write_job(tmp_path / "job.yaml", spec)
    # The first run makes no progress after step 10 (its checkpoint of step 9 published), like a machine lost.
    stalls = write_job(tmp_path / "stalls.yaml", {**spec, "environment_variables": {FAULT_ENV: "hang:rank=0:step=10"}})
    local = cache_folder(url, cache)
    launcher = subprocess.Popen(
        cli_command("run", str(stalls)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_for(
        lambda: launcher.poll() is not None or "checkpoints/step-00000009/manifest.json" in _names(outputs_store),
        180,
        "the checkpoint of step 9 in the store",
    )
    assert launcher.poll() is None, "the job ended before its checkpoint reached the store"
    elsewhere = {**spec, "outputs": {**spec["outputs"], "cache_dir": str(tmp_path / "other-machine")}}
    second = run_cli("run", str(write_job(tmp_path / "second.yaml", elsewhere)))
    assert second.returncode != 0 and "outputs.dir az://outputs/resumed is in use by job " in second.stdout, (
        second.stdout[-2000:] + second.stderr[-2000:]
    )
    launcher.kill()
    launcher.wait()
    wait_for(lambda: not processes_mentioning(str(local)), 60, "the killed job's processes to end")
    records_before = _stored(outputs_store, "resumed")["metrics.jsonl"].splitlines()
    steps_before = [json.loads(line)["step"] for line in records_before]
    shutil.rmtree(cache)

    rerun = _run_ok(job)
    assert re.search(r"outputs: \d+ files from az://outputs/resumed, checkpoint step-00000009", rerun.stdout)
    assert "resuming from" in rerun.stdout
    assert max_abs_difference(exported_weights(local), exported_weights(straight_run)) < 1e-6
    stored = _stored(outputs_store, "resumed")
    expected = {"job.yaml", "summary.json", "metrics.jsonl", "model/model.safetensors", "logs/rank-0.log"}
    assert expected <= set(stored)
    assert stored["model/model.safetensors"] == (local / "model" / "model.safetensors").read_bytes()
    kept = sorted({name.split("/")[1] for name in stored if name.startswith("checkpoints/step-")})
    assert kept == ["step-00000015", "step-00000016"], "checkpoints rotated away here leave the store too"
    assert ".clusterfit-writer.json" not in stored, "the job ended: the store has no writer"
    steps = [json.loads(line)["step"] for line in stored["metrics.jsonl"].splitlines()]
    assert steps[: len(steps_before)] == steps_before and steps[-1] == 16, "the first attempt's records are kept"

    job_id = re.search(r"^job (\w+) ", rerun.stdout, re.MULTILINE).group(1)
    shutil.rmtree(cache)  # read from another machine
    show = run_cli("show", job_id)
    assert show.returncode == 0, show.stderr
    assert f"(a copy of {url})" in show.stdout and "\nsummary:\n  epoch 1: step " in show.stdout
    logs = run_cli("logs", job_id)
    assert "rank 0 of 2" in logs.stdout and "rank 1 of 2" in logs.stdout


def test_async_checkpoints_resume_to_the_same_weights_as_sync_ones(tmp_path: Path, straight_run: Path) -> None:
    """Checkpoints written in the background by 2 ranks: kill the job after the first one is published, rerun,
    and reach the weights of the straight run, which saved synchronously."""
    out = tmp_path / "async"
    spec = tiny_job(out, **RESUME_SETTINGS)
    spec["trainer"]["checkpoint"]["async_save"] = True
    job = write_job(tmp_path / "async.yaml", spec)
    kill_after_first_checkpoint(job, out)

    rerun = _run_ok(job)
    assert "resuming from" in rerun.stdout
    assert max_abs_difference(exported_weights(out), exported_weights(straight_run)) < 1e-6
    # The last save of the job was published before the export, like a synchronous one.
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-00000015", "step-00000016"]
    stalls = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in stalls if r["kind"] == "checkpoint"][-2:] == [15, 16]


def test_dead_worker_is_restarted_and_resumes(tmp_path: Path, straight_run: Path, warm_start: WarmStart) -> None:
    """SIGKILL one worker mid-training: torchrun restarts the group (max_restarts=1), the job resumes from
    its last checkpoint, finishes with the straight run's weights, and the dead attempt's log is kept. The
    ranks are forked from one process that imported the trainer (backends/agent.py), the agent's child, and
    show the command torchrun would have run; the agent is forked from the warm-start process, and leads a
    session of its own."""
    out = tmp_path / "restarted"
    spec = tiny_job(out, **RESUME_SETTINGS)
    spec["distribution"]["max_restarts"] = 1
    job = write_job(tmp_path / "job.yaml", spec)
    launcher = subprocess.Popen(
        cli_command("run", str(job)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for_first_checkpoint(out, launcher)
    rank0_pid, rank1_pid = (_rank_pid(out, rank) for rank in (0, 1))
    for pid in (rank0_pid, rank1_pid):
        assert f"-m clusterfit.worker --spec {out / 'job.yaml'}" in _cmdline(pid), _cmdline(pid)
    server = _parent(rank0_pid)
    assert _parent(rank1_pid) == server and "multiprocessing.forkserver" in _cmdline(server), _cmdline(server)
    agent = _parent(server)
    assert "-m clusterfit.backends.agent" in _cmdline(agent), _cmdline(agent)
    assert _parent(agent) == warm_start.pid and os.getsid(agent) == agent
    os.kill(rank1_pid, signal.SIGKILL)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "resuming from" in (out / "logs" / "rank-0.log").read_text()
    assert "rank 1 of 2" in (out / "logs" / "rank-1.log.1").read_text(), "the failed attempt's log must be kept"
    assert max_abs_difference(exported_weights(out), exported_weights(straight_run)) < 1e-6


def _rank_pid(out: Path, rank: int) -> int:
    return int(re.search(rf"rank {rank} of 2 .* pid (\d+)", (out / "logs" / f"rank-{rank}.log").read_text()).group(1))


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _parent(pid: int) -> int:
    # The field after the command name, which is in parentheses and may hold spaces.
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _add_awkward_files(train: Path, val: Path) -> None:
    """Files every real dataset has: two unusable ones and two odd-but-fine ones in train, a truncated one in val."""
    (train / "class_0" / "empty.jpg").write_bytes(b"")
    (train / "class_1" / "notes.jpg").write_text("not an image, whatever the extension says")
    source = Image.open(train / "class_2" / "0000.jpg")
    source.convert("CMYK").save(train / "class_2" / "cmyk.jpg")
    source.convert("LA").save(train / "class_2" / "grey-alpha.png")
    (val / "class_1" / "truncated.jpg").write_bytes((val / "class_1" / "0000.jpg").read_bytes()[:400])


def test_imagefolder_end_to_end(tmp_path: Path, tiny_imagefolder: Path) -> None:
    """A user's folder of JPEGs with a few bad files, 2 workers: the bad files are skipped and reported,
    validation is counted exactly, the model is exported and usable. Training crops are smaller than validation's
    (torchvision's --train-crop-size 24 --val-resize-size 40 --val-crop-size 32)."""
    _add_awkward_files(tiny_imagefolder / "train", tiny_imagefolder / "val")
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
            "train_crop_size": 24,
            "val_resize_size": 40,
            "val_crop_size": 32,
            "num_classes": None,
            "loader_workers": 1,
            "max_bad_fraction": 0.1,
        },
        checkpoint={"min_interval_s": 0.001},  # due at each epoch's end, as rank 0's clock tells both ranks
    )
    result = _run_ok(write_job(tmp_path / "job.yaml", job))
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    assert "[rank0]" in result.stdout and "[rank1]" in result.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert summary["final"]["val_images"] == 15  # 8 + 7 across 2 ranks: nothing padded or counted twice
    assert all(e["images_per_s"] > 0 for e in summary["epochs"])
    assert summary["world_size"] == 2 and summary["global_batch"] == 16
    assert summary["steps"] == 2 * (50 // 16)
    inputs = summary["inputs"]
    assert sorted(Path(e["file"]).name for e in inputs["files"]) == ["empty.jpg", "notes.jpg", "truncated.jpg"]
    assert inputs["by_reason"] == {"empty file": 1, "not an image": 1, "corrupt or truncated": 1}
    assert "skipped 3 unreadable input files" in result.stdout

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

    _check_model_card_and_onnx_export(out, tiny_imagefolder / "val", summary)

    for rank in (0, 1):
        assert f"rank {rank} of 2" in (out / "logs" / f"rank-{rank}.log").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert kinds == {"start", "train", "val", "checkpoint", "end"}


def _check_model_card_and_onnx_export(out: Path, images: Path, summary: dict) -> None:
    """The model folder stands alone: its card states classes, preprocessing, metrics and provenance; `clusterfit
    export` adds an ONNX model, and ONNX Runtime, TorchScript and the safetensors weights agree on real JPEGs."""
    import hashlib

    import onnxruntime

    from clusterfit.data.transforms import CenterCrop
    from clusterfit.outputs.model_card import spec_hash

    card = json.loads((out / "model" / "model_card.json").read_text())
    assert card["classes"] == ["class_0", "class_1", "class_2"] and card["model"] == "resnet_tiny"
    assert card["preprocessing"] == {
        "resize_shorter_side": 40, "center_crop": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
        "channel_order": "RGB", "layout": "NCHW", "scale": 1 / 255, "crop_fraction": 0.8, "interpolation": "bilinear",
        "antialias": True,
    }  # fmt: skip
    assert card["image_size"] == 32
    assert card["metrics"]["val_top1"] == summary["epochs"][-1]["val_top1"]
    assert card["spec_sha256"] == spec_hash(summary["spec"])
    weights = (out / "model" / "model.safetensors").read_bytes()
    assert card["files"]["model.safetensors"] == hashlib.sha256(weights).hexdigest()

    result = run_cli("export", str(out / "model"), "--images", str(images))
    assert result.returncode == 0, result.stderr
    assert "ONNX Runtime matches PyTorch on 8 images from" in result.stdout
    checks = json.loads((out / "model" / "model_card.json").read_text())["checks"]["onnx"]
    assert checks["same_top1"] and checks["max_abs_diff"] <= 1e-4 and checks["path"] == "model.onnx"

    files = sorted(images.rglob("*.jpg"))
    crop = CenterCrop(32, 0.8)  # the card's validation transform, which the ONNX check went through
    pixels = torch.stack([crop(str(f)) for f in files if f.stat().st_size > 1000])  # the awkward files left out
    from_weights = load_classifier(out / "model").predict(pixels)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    normalised = (pixels.float() - mean) / std
    from_torchscript = torch.jit.load(str(out / "model" / "model.torchscript.pt"))(normalised).softmax(dim=1)
    session = onnxruntime.InferenceSession(str(out / "model" / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: normalised.numpy()})[0])
    from_onnx = logits.softmax(dim=1)
    assert len(pixels) >= 15
    for other in (from_torchscript, from_onnx):
        assert torch.equal(other.argmax(dim=1), from_weights.argmax(dim=1))
        assert torch.allclose(other, from_weights, atol=1e-4)


def test_synthetic_end_to_end_and_rerun_of_a_finished_job(tmp_path: Path) -> None:
    out = tmp_path / "out[lr=0.1]"  # brackets, as a sweep's folder may have: never a glob, never console markup
    job = write_job(tmp_path / "job.yaml", tiny_job(out, precision="auto", channels_last=True))
    first = _run_ok(job)
    assert f"model: {out / 'model' / 'model.safetensors'}, " in first.stdout, first.stdout
    assert f"summary: {out / 'summary.json'}  metrics: " in first.stdout
    assert " input: " not in first.stdout, "synthetic data reads no file: no 'input: 0 samples read' line"
    weights = exported_weights(out)
    second = _run_ok(job)  # a finished job's rerun resumes at its end and trains nothing more
    assert "resuming from" in second.stdout
    assert max_abs_difference(exported_weights(out), weights) == 0.0
    assert (out / "logs" / "rank-0.log.1").exists(), "the first run's logs are kept"


def test_failed_job_names_the_rank_and_the_exception(tmp_path: Path, tiny_imagefolder: Path) -> None:
    """Most images unreadable: the job stops over max_bad_fraction, and the launcher exits 1 saying which
    rank failed and why, naming the files, in one line each."""
    for index, path in enumerate(sorted((tiny_imagefolder / "train").glob("*/*.jpg"))):
        if index % 6:  # 40 of 48 files
            path.write_bytes(b"not a jpeg at all")
    job = tiny_job(
        tmp_path / "out",
        steps_per_epoch=None,
        batch_size=8,
        data={"train": str(tiny_imagefolder / "train"), "image_size": 32, "num_classes": None, "loader_workers": 0},
    )
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert re.fullmatch(r"error: job tiny \(\w+\) failed: Python exception", errors[0]), errors[0]
    assert any(
        line.startswith("error: rank ")
        and "BadInputError: " in line
        and "unreadable input files, over trainer.data.max_bad_fraction = 0.01" in line
        and ".jpg (not an image)" in line
        for line in errors
    ), errors
    assert errors[-1].startswith(f"error: every rank's log is in {tmp_path / 'out' / 'logs'}, torchrun's report in")
    assert "Traceback" not in result.stderr
    assert "Traceback" not in result.stdout, "the ranks' tracebacks stay in their logs; the cause leads instead"


def test_a_killed_rank_leads_the_console_with_its_cause(tmp_path: Path) -> None:
    """One rank SIGKILLed mid-training: the console names it first and leaves out the peer's secondary
    "connection reset" traceback and torchrun's report (about 110 lines before), which stay in the logs."""
    job = tiny_job(tmp_path / "out", steps_per_epoch=50)
    job["environment_variables"] = {"CLUSTERFIT_FAULT": "kill:rank=1:step=3"}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert re.fullmatch(r"error: job tiny \(\w+\) failed: killed by a signal", errors[0]), result.stderr
    assert errors[1].startswith("error: rank 1 killed by SIGKILL (signal 9)"), errors
    console = result.stdout + result.stderr
    assert "Connection reset" not in console and "ChildFailedError" not in console, console
    assert len(console.splitlines()) < 25, console
    logs = tmp_path / "out" / "logs"
    assert "ChildFailedError" in (logs / "agent.log").read_text(), "torchrun's report is kept in its log"
    if "Traceback" in (logs / "rank-0.log").read_text():  # the peer failed on its own before torchrun stopped it
        assert errors[-1].endswith("(not shown here: the tracebacks of rank0)"), errors


def test_the_engines_example_runs_to_completion_locally(tmp_path: Path) -> None:
    """The example that the Ray and Slurm tests run unchanged but for the backend, on this machine."""
    out = tmp_path / "out"
    result = run_cli("run", str(REPO / "examples" / "engines-tiny.yaml"), "--set", f"outputs.dir={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert exported_weights(out)
