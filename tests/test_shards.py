"""Packed shards: what `clusterfit data pack` writes, and how the trainer reads it (coverage, determinism,
resume), with real DataLoader worker processes."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import one_image_per_class, run_cli, tiny_job, write_job
from PIL import Image
from torch.utils.data import DataLoader

from clusterfit.data.shardreader import ShardTrainSamples, as_is, consumed_per_role, delivery_order
from clusterfit.data.shards import INDEX, ShardError, iter_samples, pack_folder, parse_size, read_index
from clusterfit.data.transforms import CenterCrop, TrainCrop
from clusterfit.errors import DataError
from clusterfit.launch import preflight
from clusterfit.spec import validate_spec


def _train_samples(packed: Path, rank: int, **kw: int) -> ShardTrainSamples:
    settings = {"seed": 3, "world_size": 2, "batch_size": 4, "steps_per_epoch": 5, "block_steps": 2, **kw}
    return ShardTrainSamples(read_index(packed), TrainCrop(16), rank=rank, **settings)


def _epoch(dataset: ShardTrainSamples, epoch: int, start_step: int = 0, workers: int = 2) -> list[torch.Tensor]:
    dataset.set_position(epoch, start_step)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=as_is)
    return [(images, labels) for images, labels, _, _ in loader]


# One worker runs them all: each worker would otherwise make the packed dataset and its Azurite server again.
pytestmark = pytest.mark.xdist_group("shards")


@pytest.fixture(scope="module")
def packed40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed40")
    src = one_image_per_class(root / "src", 40)
    report = pack_folder(str(src), str(root / "packed"), shard_size=9_000, max_side=320, workers=1)
    assert report.shards > 3, "several shards, so the shard order matters"
    return root / "packed"


def test_pack_writes_webdataset_shards_and_an_index(tmp_path: Path) -> None:
    src = one_image_per_class(tmp_path / "src", 6, size=(900, 500))
    (src / "c000" / "broken.jpg").write_bytes(b"\xff\xd8\xff broken")
    Image.new("CMYK", (50, 50), (0, 255, 0, 0)).save(src / "c001" / "cmyk.jpg")
    result = run_cli("data", "pack", str(src), str(tmp_path / "packed"), "--shard-size", "200KB", "--max-side", "320")
    assert result.returncode == 0, result.stderr
    assert "packed 7 images" in result.stdout and "skipped 1" in result.stdout
    assert "broken.jpg: corrupt or truncated" in result.stderr

    index = json.loads((tmp_path / "packed" / INDEX).read_text())
    assert index["classes"] == [f"c{i:03d}" for i in range(6)]
    assert index["samples"] == 7 and index["class_counts"]["c001"] == 2
    assert len(index["shards"]) > 1 and sum(s["samples"] for s in index["shards"]) == 7
    for shard in index["shards"]:
        path = tmp_path / "packed" / shard["name"]
        assert path.stat().st_size == shard["bytes"] <= 200_000
        with tarfile.open(path) as tar:
            names = tar.getnames()
        assert all(n.split(".", 1)[1] in ("jpg", "cls") for n in names) and len(names) == 2 * shard["samples"]
        for _key, data, label in iter_samples(path):
            img = Image.open(io.BytesIO(data))
            assert img.format == "JPEG" and max(img.size) <= 320 and 0 <= label < 6
    assert index["skipped"][0]["reason"] == "corrupt or truncated"


def test_pack_refuses_a_used_destination(tmp_path: Path) -> None:
    src = one_image_per_class(tmp_path / "src", 2)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    result = run_cli("data", "pack", str(src), str(tmp_path / "dst"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: DST = '{tmp_path / 'dst'}': exists and is not empty; give a new folder"
    ]
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"


def _handmade_shard(path: Path, members: dict[str, bytes]) -> Path:
    """A shard written member by member, as no `clusterfit data pack` would write it."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


def test_shard_member_escaping_the_folder_is_refused_before_training(tmp_path: Path, packed40: Path) -> None:
    evil = tmp_path / "evil"
    evil.mkdir()
    index = json.loads((packed40 / INDEX).read_text())
    shard = _handmade_shard(evil / "shard-000000.tar", {"../../escape.cls": b"0", "../../escape.jpg": b"x"})
    index["shards"] = [{"name": shard.name, "samples": 1, "bytes": shard.stat().st_size, "sha256": "-"}]
    (evil / INDEX).write_text(json.dumps(index))
    raw = tiny_job(tmp_path / "out", data={"train": str(evil), "image_size": 16, "num_classes": None})
    with pytest.raises(DataError) as caught:
        preflight(validate_spec(raw))
    assert str(caught.value) == (
        f"trainer.data.train = '{evil}': shard-000000.tar: member '../../escape.cls' has a "
        "path that escapes the shard; refusing this shard"
    )


def test_a_class_that_is_not_an_index_is_one_line_naming_the_sample(tmp_path: Path) -> None:
    shard = _handmade_shard(tmp_path / "shard-000000.tar", {"a.cls": b"cat\n", "a.jpg": b"x"})
    with pytest.raises(ShardError) as caught:
        list(iter_samples(shard))
    expected = "shard-000000.tar: sample 'a' has class 'cat' in its .cls member; expected a class index"
    assert str(caught.value) == expected


def test_every_sample_once_per_epoch_across_two_ranks_and_two_workers(packed40: Path) -> None:
    seen_by_epoch = []
    for epoch in (0, 1):
        labels = [
            label
            for rank in (0, 1)
            for _, batch in _epoch(_train_samples(packed40, rank), epoch)
            for label in batch.tolist()
        ]
        assert sorted(labels) == list(range(40)), "2 ranks x 5 steps x 4 = 40 samples, each exactly once"
        seen_by_epoch.append(labels)
    assert seen_by_epoch[0] != seen_by_epoch[1], "a new epoch, a new order"


def test_a_capped_epoch_never_repeats_a_sample(packed40: Path) -> None:
    labels = [
        label
        for rank in (0, 1)
        for _, batch in _epoch(_train_samples(packed40, rank, steps_per_epoch=3), 0)
        for label in batch.tolist()
    ]
    assert len(labels) == 24 == len(set(labels))


def test_same_seed_same_batches_and_other_seed_others(packed40: Path) -> None:
    first = _epoch(_train_samples(packed40, 0), 0)
    again = _epoch(_train_samples(packed40, 0), 0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    other = _epoch(_train_samples(packed40, 0, seed=4), 0)
    assert [b[1].tolist() for b in other] != [b[1].tolist() for b in first]


@pytest.mark.parametrize("start_step", [1, 3, 4])
def test_resumed_epoch_reads_exactly_the_remaining_batches(packed40: Path, start_step: int) -> None:
    full = _epoch(_train_samples(packed40, 1), 1)
    resumed = _epoch(_train_samples(packed40, 1), 1, start_step=start_step)
    assert len(resumed) == len(full) - start_step
    for (images, labels), (want_images, want_labels) in zip(resumed, full[start_step:], strict=True):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_delivery_bookkeeping() -> None:
    assert delivery_order([3, 2]) == [0, 1, 0, 1, 0]
    assert delivery_order([1, 3]) == [0, 1, 1, 1]
    assert consumed_per_role(steps=5, block_steps=2, roles=2, start_step=3) == [2, 1]
    assert parse_size("256MB") == 256_000_000 and parse_size("1GiB") == 2**30


def test_two_workers_train_and_validate_on_shards(tmp_path: Path, tiny_imagefolder: Path) -> None:
    for split in ("train", "val"):
        result = run_cli("data", "pack", str(tiny_imagefolder / split), str(tmp_path / split), "--shard-size", "20KB")
        assert result.returncode == 0, result.stderr
    job = tiny_job(
        tmp_path / "out",
        epochs=2,
        steps_per_epoch=None,
        batch_size=8,
        optimizer={"lr": 0.4},
        data={
            "train": str(tmp_path / "train"),
            "val": str(tmp_path / "val"),
            "image_size": 32,
            "num_classes": None,
            "loader_workers": 2,
            "shuffle_buffer": 16,
        },
    )
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 * (48 // 16)
    assert summary["final"]["val_images"] == 15
    # Each epoch reads the 48 training images; the validation share is read once and then replayed from memory.
    assert summary["inputs"]["reads"] == 2 * 48 + 15 and summary["inputs"]["skipped_files"] == 0


def test_center_crop_of_shard_bytes(packed40: Path) -> None:
    key, data, label = next(iter_samples(packed40 / read_index(packed40).shards[0].name))
    assert CenterCrop(16)(data, None).shape == (3, 16, 16)


def test_shards_streamed_through_fsspec_give_the_same_batches(packed40: Path) -> None:
    """`mode: direct` reading (any fsspec URL; here file://) delivers exactly what the local reader does."""
    from clusterfit.data.shards import read_remote_index
    from clusterfit.data.staging import Credentials

    remote = read_remote_index(f"file://{packed40}", Credentials())
    for start_step in (0, 3):
        settings = {"seed": 3, "world_size": 2, "batch_size": 4, "steps_per_epoch": 5, "block_steps": 2}
        streamed = _epoch(ShardTrainSamples(remote, TrainCrop(16), rank=1, **settings), 1, start_step)
        local = _epoch(_train_samples(packed40, 1), 1, start_step)
        assert [b[1].tolist() for b in streamed] == [b[1].tolist() for b in local]
