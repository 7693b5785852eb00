"""Checkpoints in one process: atomic publish, verification, corrupt ones skipped, old ones pruned."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from clusterfit.outputs.checkpoints import read_manifest
from clusterfit.worker.checkpoint import CheckpointStore, capture_rng, restore_rng
from clusterfit.worker.dist import DistEnv

SOLO = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
CPU = torch.device("cpu")


def _save(store: CheckpointStore, step: int) -> Path:
    shared = {"model": {"w": torch.full((3,), float(step))}, "progress": {"global_step": step}}
    return store.save(step, shared, capture_rng(CPU), {"model": "m"})


def test_latest_good_checkpoint_is_loaded(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, env=SOLO)
    for step in (10, 20, 30):
        _save(store, step)
    loaded = store.load_latest(CPU)
    assert loaded is not None and loaded.shared["progress"]["global_step"] == 30
    assert torch.equal(loaded.shared["model"]["w"], torch.full((3,), 30.0))


def test_corrupt_checkpoint_is_skipped_not_deleted(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, env=SOLO)
    _save(store, 10)
    newest = _save(store, 20)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    (newest / "state.pt").write_bytes(bytes(data))
    loaded = store.load_latest(CPU)
    assert loaded is not None and loaded.shared["progress"]["global_step"] == 10
    assert newest.exists(), "a corrupt checkpoint is evidence; it must not be deleted"


def test_truncated_and_unpublished_checkpoints_are_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, env=SOLO)
    _save(store, 10)
    truncated = _save(store, 20)
    (truncated / "state.pt").write_bytes((truncated / "state.pt").read_bytes()[:100])
    partial = tmp_path / ".tmp-step-00000030"  # a crash while writing: never published
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half")
    assert store.load_latest(CPU).shared["progress"]["global_step"] == 10
    store.clean_partial()
    assert not partial.exists()


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, env=SOLO)
    for step in range(1, 6):
        _save(store, step)
    assert [p.name for p in store.complete()] == ["step-00000005", "step-00000004"]


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, env=SOLO)
    path = _save(store, 1)

    class Evil:
        def __reduce__(self):  # runs `print` on unpickling with weights_only=False
            return (print, ("pwned",))

    torch.save({"model": Evil()}, path / "state.pt")
    # Re-publish with a matching manifest, as anyone with write access to the store could.
    manifest = read_manifest(path)
    data = (path / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        store.load_latest(CPU)


def test_rng_state_round_trips() -> None:
    state = capture_rng(CPU)
    first = torch.rand(4)
    restore_rng(state, CPU)
    assert torch.equal(torch.rand(4), first)


def test_async_save_writes_the_state_as_it_was_when_saved(tmp_path: Path) -> None:
    """Training goes on mutating the weights in place while the background thread writes: the checkpoint must
    hold the values at the moment of the save, and be published once `wait()` returns."""
    store = CheckpointStore(tmp_path, keep=2, env=SOLO, async_save=True)
    weights = torch.full((1000,), 1.0)
    store.save(7, {"model": {"w": weights}, "progress": {"global_step": 7}}, capture_rng(CPU), {"model": "m"})
    weights.add_(41.0)  # what the next optimizer step does to a parameter
    store.wait()
    loaded = store.load_latest(CPU)
    assert loaded is not None and loaded.path.name == "step-00000007"
    assert torch.equal(loaded.shared["model"]["w"], torch.full((1000,), 1.0))


def test_failed_async_save_is_reported_and_never_published(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, env=SOLO, async_save=True)
    _save(store, 1)
    store.save(2, {"model": {"w": torch.zeros(2)}, "not_a_tensor": lambda: None}, capture_rng(CPU), {})
    with pytest.raises(RuntimeError, match="asynchronous checkpoint checkpoint-2 failed"):
        store.wait()
    assert [p.name for p in store.complete()] == ["step-00000001"]
    assert store.load_latest(CPU).shared["progress"]["global_step"] == 1
    store.wait()  # the error is reported once; the store can save again
    _save(store, 3)
    store.wait()
    assert store.load_latest(CPU).shared["progress"]["global_step"] == 3
