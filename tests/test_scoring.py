"""`clusterfit score`: an exported model scores a folder of real JPEGs on 2 ranks (gloo on loopback, launched by
torchrun's agent like a training job), each image once, a corrupt one counted; killed and rerun, it finishes the
same output without scoring anything twice; its top-1 is what the model gives on the same images directly; and a
packed dataset is read sample by sample as its folder would be."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from conftest import cli_command, processes_mentioning, run_cli, wait_for

from clusterfit.errors import DataError, SpecError
from clusterfit.outputs import JobOutputs
from clusterfit.outputs.predictions import ScorePlan, check_plan, finished_chunks, plan_chunk_size

CLASSES = ["class_0", "class_1", "class_2"]
IMAGE_SIZE = 32
PER_CLASS = 7
GOOD = len(CLASSES) * PER_CLASS  # 21 JPEGs, plus one corrupt file
CHUNK = 3  # 22 files: chunks 0-7 (the last of one file), rank 0 scores 0, 2, 4, 6 and rank 1 scores 1, 3, 5, 7


def _make_model(model_dir: Path, images: Path) -> Path:
    """A resnet_tiny folder as the trainer exports it (weights, TorchScript, model card), without training: random
    features, and a last layer that points each class at the mean features of its folder (nearest centroid), so
    the top-1 classes differ from image to image."""
    from clusterfit import __version__
    from clusterfit.data.transforms import CenterCrop
    from clusterfit.models import build_model
    from clusterfit.outputs.model_card import IMAGENET_MEAN, IMAGENET_STD, ModelCard, Preprocessing, write_model_card
    from clusterfit.worker.export import export_model

    torch.manual_seed(0)
    model = build_model("resnet_tiny", len(CLASSES), "batch", IMAGE_SIZE).eval()
    crop, fc = CenterCrop(IMAGE_SIZE), model.fc
    model.fc = torch.nn.Identity()
    centroids = []
    with torch.no_grad():
        for name in CLASSES:
            pixels = torch.stack([crop(str(p)) for p in sorted((images / name).glob("0*.jpg"))]).float() / 255
            normalised = (pixels - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(
                1, 3, 1, 1
            )
            centroids.append(model(normalised).mean(dim=0))
        centre = torch.stack(centroids).mean(dim=0)
        fc.weight.copy_(torch.stack(centroids) - centre)
        fc.bias.copy_(-(fc.weight @ centre))
    model.fc = fc
    metadata = {"model": "resnet_tiny", "norm_layer": "batch", "classes": CLASSES, "image_size": IMAGE_SIZE}
    export_model(model, model_dir, metadata=metadata, image_size=IMAGE_SIZE)
    card = ModelCard(
        model="resnet_tiny",
        classes=CLASSES,
        image_size=IMAGE_SIZE,
        preprocessing=Preprocessing.for_size(IMAGE_SIZE),
        metrics={},
        spec_sha256="0" * 64,
        clusterfit_version=__version__,
        job="test",
    )
    write_model_card(model_dir, card)
    return model_dir


def make_scoring_case(root: Path) -> tuple[Path, Path]:
    """(model folder, ImageNet-layout folder of 21 JPEGs of 40 px and one corrupt .jpg); the `scoring_case`
    fixture of every module that scores (conftest.py)."""
    from make_tiny_imagefolder import make_tiny_imagefolder

    images = make_tiny_imagefolder(root / "data", classes=3, train_per_class=0, val_per_class=PER_CLASS, size=40)
    (images / "val" / "class_1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    return _make_model(root / "model", images / "val"), images / "val"


def _score(model: Path, images: Path, out: Path, *extra: str) -> list[str]:
    return cli_command(
        "score", str(model), str(images), "--out", str(out), "--nproc", "2", "--chunk-images", str(CHUNK),
        "--batch-size", "3", *extra,
    )  # fmt: skip


def _score_ok(command: list[str], **popen: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, **popen)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _direct_top_k(model_dir: Path, images: Path, files: list[str]) -> tuple[list[list[str]], torch.Tensor]:
    """The model on its own: safetensors into torchvision's network, the validation transform in this process;
    each file's classes, most likely first, and their probabilities."""
    from safetensors.torch import load_file

    from clusterfit.data.transforms import CenterCrop
    from clusterfit.models import build_model

    model = build_model("resnet_tiny", len(CLASSES), "batch", IMAGE_SIZE)
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    crop = CenterCrop(IMAGE_SIZE)
    pixels = torch.stack([crop(str(images / file)) for file in files]).float() / 255
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        probabilities, indices = model.eval()((pixels - mean) / std).softmax(dim=1).sort(dim=1, descending=True)
    return [[CLASSES[i] for i in row] for row in indices.tolist()], probabilities


def _scored_top_k(table: pa.Table) -> tuple[list[list[str]], torch.Tensor]:
    ks = range(1, len(CLASSES) + 1)
    rows = table.to_pylist()
    classes = [[row[f"class_{k}"] for k in ks] for row in rows]
    return classes, torch.tensor([[row[f"probability_{k}"] for k in ks] for row in rows], dtype=torch.float64)


def _chunk_rows(out: Path) -> dict[Path, list[str]]:
    return {path: pq.read_table(path)["file"].to_pylist() for path in finished_chunks(JobOutputs.at(out)).values()}


def scoring_job(model: Path, images: Path, out: Path, *, backend: str, instances: int, per_instance: int) -> dict:
    """The job `clusterfit score --chunk-images 3 --batch-size 3` writes, on any engine and layout of ranks."""
    return {
        "name": "score",
        "scorer": {"model_dir": str(model), "input": str(images), "batch_size": 3, "chunk_images": CHUNK},
        "distribution": {"type": "pytorch", "process_count_per_instance": per_instance},
        "resources": {"instance_count": instances, "backend": backend},
        "outputs": {"dir": str(out)},
    }


def assert_every_good_image_scored_once(out: Path, model: Path, images: Path) -> pa.Table:
    """By 2 ranks, each image once (the corrupt one counted), in file order, with every top-k class and
    probability the model gives on the same images loaded directly; each rank wrote its own chunks."""
    table = pq.read_table(out / "predictions.parquet")
    expected = sorted(f"{p.parent.name}/{p.name}" for p in images.rglob("*.jpg") if p.name != "broken.jpg")
    assert len(expected) == GOOD
    assert table["file"].to_pylist() == expected
    assert table["label"].to_pylist() == [file.split("/")[0] for file in expected]
    # top-k is capped at the model's 3 classes
    assert table.column_names == ["file", "label", *(f"{c}_{k}" for k in (1, 2, 3) for c in ("class", "probability"))]
    classes, probabilities = _scored_top_k(table)
    direct_classes, direct_probabilities = _direct_top_k(model, images, expected)
    assert [row[0] for row in classes] == [row[0] for row in direct_classes]  # top-1
    assert classes == direct_classes
    assert torch.allclose(probabilities, direct_probabilities.double(), atol=1e-5)
    assert len({row[0] for row in classes}) == len(CLASSES), "a model that answers one class for all proves little"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["images"], summary["images_scored"], summary["bad_images_skipped"]) == (GOOD + 1, GOOD, 1)
    assert summary["inputs"]["files"] == [{"file": "class_1/broken.jpg", "reason": "corrupt or truncated", "count": 1}]
    assert summary["images_per_s"] > 0
    assert summary["top1_vs_folder_labels"] == 1.0  # the nearest-centroid model knows these folders
    chunks = _chunk_rows(out)
    assert len(chunks) == 8
    assert all(int(path.parent.name.split("-")[1]) == int(path.stem.split("-")[1]) % 2 for path in chunks)
    assert sorted(file for files in chunks.values() for file in files) == sorted([*expected, "class_1/broken.jpg"])
    beats = {path.name: json.loads(path.read_text()) for path in (out / "heartbeats").glob("rank-*.json")}
    assert sorted(beats) == ["rank-0.json", "rank-1.json"] and {b["phase"] for b in beats.values()} == {"done"}
    return table


def test_two_ranks_score_every_good_image_once_with_the_models_own_top1(
    scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    model, images = scoring_case
    out = tmp_path / "out"
    result = _score_ok(_score(model, images, out, "--csv"))
    assert "scored 21 of 22 images on 2 rank(s)" in result.stdout and "skipped 1 unreadable" in result.stdout
    assert_every_good_image_scored_once(out, model, images)
    assert pa_csv.read_csv(out / "predictions.csv").num_rows == GOOD
    # Progress went to the records a training job writes, which the progress bar and `status` read.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "start" and records[0]["total_steps"] == GOOD + 1
    assert records[-1]["kind"] == "end" and records[-1]["step"] == GOOD + 1


def test_killed_run_finishes_on_rerun_without_scoring_anything_twice(
    scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rank 0 stops (hangs) after its 2nd chunk, rank 1 finishes its 4; the launcher is killed with SIGKILL. The
    rerun scores only chunks 4 and 6, leaves the other chunk files as they were, and merges the model's own
    answers."""
    model, images = scoring_case
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        _score(model, images, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "CLUSTERFIT_FAULT": "hang:rank=0:step=2"},
    )
    try:
        wait_for(lambda: len(finished_chunks(JobOutputs.at(out))) == 6 or launcher.poll() is not None, 120, "6 chunks")
        assert launcher.poll() is None, "the run ended before it could be killed"
        time.sleep(0.3)  # a 7th chunk, if one were coming, would be there by now
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    wait_for(lambda: not processes_mentioning(str(out)), 60, "every process of the killed run to stop")
    before = {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in _chunk_rows(out)}
    assert sorted(path.name for path in before) == [f"chunk-{i:06d}.parquet" for i in (0, 1, 2, 3, 5, 7)]
    assert not (out / "predictions.parquet").exists()

    _score_ok(_score(model, images, out))
    after = _chunk_rows(out)
    assert {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in before} == before  # none redone
    assert sorted(set(after) - set(before)) == [
        out / "predictions" / "rank-00000" / f"chunk-{i:06d}.parquet" for i in (4, 6)
    ]
    in_chunks = [file for files in after.values() for file in files]
    assert len(in_chunks) == len(set(in_chunks)) == GOOD + 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images_this_run"] == 2 * CHUNK  # only chunks 4 and 6 were scored
    assert (summary["images_scored"], summary["bad_images_skipped"]) == (GOOD, 1)
    table = pq.read_table(out / "predictions.parquet")
    files = table["file"].to_pylist()
    assert files == sorted(files) and len(files) == GOOD
    classes, probabilities = _scored_top_k(table)
    direct_classes, direct_probabilities = _direct_top_k(model, images, files)
    assert classes == direct_classes
    assert torch.allclose(probabilities, direct_probabilities.double(), atol=1e-5)


def test_a_packed_dataset_is_read_sample_by_sample_in_shard_order(
    scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    """`clusterfit data pack` output as a scoring input: every sample listed once, in shard order, named
    SHARD:KEY.jpg with its class, and the scorer's batches, several spanning two shards, hold each sample's own
    pixels (small JPEGs are packed byte for byte, so each sample is one of the folder's files)."""
    from torch.utils.data import DataLoader

    from clusterfit.data.folders import list_score_inputs
    from clusterfit.data.imagefolder import collate_labeled, val_transform
    from clusterfit.data.shards import pack_folder, read_index, sample_name
    from clusterfit.scoring.batch import _images

    _, images = scoring_case
    packed = tmp_path / "packed"
    report = pack_folder(str(images), str(packed), shard_size=16_000, workers=1)
    assert [reason for _, reason in report.skipped] == ["corrupt or truncated"]
    index = read_index(packed)
    originals = {path.read_bytes(): path for path in images.rglob("*.jpg")}
    source_of = {
        sample_name(shard.name, key): originals[data]
        for shard in index.shards
        for key, data, _ in index.iter_samples(shard)
    }
    inputs = list_score_inputs(str(packed), "scorer.input")
    assert inputs.files == list(source_of) and len(inputs.files) == GOOD
    assert inputs.labels == [source_of[file].parent.name for file in inputs.files]

    batch = 4
    shard_ends = list(itertools.accumulate(shard.samples for shard in index.shards))[:-1]
    assert any(end % batch for end in shard_ends), "no batch spans two shards"
    transform = val_transform(IMAGE_SIZE)
    dataset = _images(str(packed), inputs.files, transform)
    batches = [list(range(start, min(start + batch, GOOD))) for start in range(0, GOOD, batch)]
    seen = []
    for pixels, positions, _, bad in DataLoader(dataset, batch_sampler=batches, collate_fn=collate_labeled):
        assert not bad
        for image, position in zip(pixels, positions.tolist(), strict=True):
            assert torch.equal(image, transform(str(source_of[inputs.files[position]])))
            seen.append(position)
    assert seen == list(range(GOOD))


def test_user_mistakes_are_one_line_with_the_value_and_the_fix(scoring_case: tuple[Path, Path], tmp_path: Path) -> None:
    from clusterfit.launch import preflight
    from clusterfit.spec.scoring import scoring_spec

    model, images = scoring_case
    with pytest.raises(SpecError, match=r"scorer.model_dir = '.*nowhere': no model_card.json there; pass the model/"):
        preflight(scoring_spec(str(tmp_path / "nowhere"), str(images), str(tmp_path / "o")))
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(DataError, match=r"scorer.input = '.*empty': holds no images"):
        preflight(scoring_spec(str(model), str(tmp_path / "empty"), str(tmp_path / "o")))
    with pytest.raises(SpecError, match=r"--top-k 0: give at least 1"):
        scoring_spec(str(model), str(images), str(tmp_path / "o"), top_k=0)
    result = run_cli("score", str(model), str(images), "--out", str(tmp_path / "o"), "--top-k", "-1")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "--top-k -1: give at least 1" in result.stderr


def test_every_chunk_has_one_rank_for_any_world_size_and_plans_pin_their_files(tmp_path: Path) -> None:
    files = [f"img{i:03d}.jpg" for i in range(23)]
    plan = ScorePlan(files, None, chunk_images=4)
    assert plan.chunks == 6 and list(plan.chunk(5)) == [20, 21, 22]
    for world in (1, 2, 3, 7):
        owned = sorted(index for rank in range(world) for index in plan.chunks_of(rank, world))
        assert owned == list(range(6))
    outputs = JobOutputs.at(tmp_path)
    # A few chunks per rank, under the cap; once pinned, a rerun keeps the chunk size under any number of ranks.
    assert [plan_chunk_size(outputs, files, world, 1024) for world in (1, 2, 3)] == [6, 3, 2]
    assert plan_chunk_size(outputs, files, 1, 4) == 4
    check_plan(outputs, plan.record("abc"), write=True)
    assert [plan_chunk_size(outputs, files, world, 1024) for world in (1, 2, 7)] == [4, 4, 4]
    assert plan_chunk_size(outputs, files[1:], 2, 1024) == 3  # other files: refused by check_plan below
    check_plan(outputs, plan.record("abc"), write=False)  # the same plan: a rerun goes on
    with pytest.raises(SpecError, match="holds predictions of another scoring run .*chunk_images 4 vs 5"):
        check_plan(outputs, ScorePlan(files, None, chunk_images=5).record("abc"), write=False)
    with pytest.raises(SpecError, match="files_sha256"):
        check_plan(outputs, ScorePlan(files[1:], None, chunk_images=4).record("abc"), write=False)


def test_an_input_at_a_url_is_staged_like_training_data(scoring_case: tuple[Path, Path], tmp_path: Path) -> None:
    """The worker's staging step copies a scorer's URL input into the node's cache and hands the scorer the copy."""
    from clusterfit.data.folders import list_score_inputs
    from clusterfit.data.staging import stage_inputs
    from clusterfit.spec import validate_spec

    model, images = scoring_case
    raw = {
        "name": "score",
        "scorer": {"model_dir": str(model), "input": f"file://{images}", "cache_dir": str(tmp_path / "cache")},
        "outputs": {"dir": str(tmp_path / "out")},
    }
    staged = stage_inputs(validate_spec(raw), run_token="test", log=lambda line: None)
    assert staged.scorer is not None and Path(staged.scorer.input).is_relative_to(tmp_path / "cache")
    assert list_score_inputs(staged.scorer.input, "scorer.input") == list_score_inputs(str(images), "scorer.input")


def test_a_flat_folder_has_no_labels_and_a_mixed_one_is_refused(
    scoring_case: tuple[Path, Path], tmp_path: Path
) -> None:
    from clusterfit.data.folders import list_score_inputs

    _, images = scoring_case
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(images.glob("class_0/*.jpg"))[:3]:
        (flat / path.name).write_bytes(path.read_bytes())
    (flat / "notes.txt").write_text("not an image")
    found = list_score_inputs(str(flat), "scorer.input")
    assert found.files == ["0000.jpg", "0001.jpg", "0002.jpg"] and found.labels is None
    labelled = list_score_inputs(str(images), "scorer.input")
    assert labelled.labels is not None and labelled.labels[:2] == ["class_0", "class_0"]
    (flat / "cats").mkdir()
    (flat / "cats" / "a.jpg").write_bytes((flat / "0000.jpg").read_bytes())
    with pytest.raises(DataError, match="holds both images and class folders of images"):
        list_score_inputs(str(flat), "scorer.input")


def test_a_silent_scoring_rank_is_a_hang_like_a_silent_training_rank() -> None:
    from clusterfit.outputs import RankBeat
    from clusterfit.service.supervisor import _hang

    def beats(phase: str) -> dict[int, RankBeat]:
        return {rank: RankBeat(rank, phase, 4, 1000.0, 10.0, 1, "host", 1) for rank in (0, 1)}

    assert _hang(beats("scoring"), 60, now=1030.0) is None
    assert "every rank last reported step 4" in (_hang(beats("scoring"), 60, now=1100.0) or "")
    assert _hang(beats("staging"), 60, now=1100.0) is None
