"""Checkpoints that survive crashes: written to a temp folder, published by one rename, verified by checksum on
load, never unpickling code.

Rank 0 writes the whole checkpoint: the shared state and every rank's own part (its RNG state, a few KB, gathered
to rank 0 by one collective when the save starts), and rank 0 reads it back for every rank on resume. So no
rank waits for another's file or reads one, and a job whose nodes share no folder (outputs at a URL on Ray)
needs its checkpoints on rank 0's node alone.

With `async_save`, the training loop only waits for the gather and a copy of the state in memory; a background
thread on rank 0 serializes, writes and publishes. That thread never runs a collective: a gloo collective from a
second thread would interleave with the training loop's collectives on the same process group and corrupt both."""

from __future__ import annotations

import io
import logging
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterfit.files import fsync_dir, write_durably
from clusterfit.outputs.checkpoints import (
    SHARED_STATE,
    TMP_PREFIX,
    checkpoint_name,
    newest_verified,
    publish,
    published,
    rank_file,
    read_manifest,
)
from clusterfit.worker.dist import DistEnv, broadcast_from_main, gather_to_main, scatter_from_main

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    shared: dict[str, Any]  # model, optimizer, scheduler, scaler, progress, spec: identical on every rank
    own: dict[str, Any] | None  # this rank's RNG state; None if the job ran with another world size


def capture_rng(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state(
        ("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class CheckpointStore:
    def __init__(self, root: str | Path, keep: int, env: DistEnv, async_save: bool = False) -> None:
        self.root = Path(root)
        self.keep = keep
        self.env = env
        self.async_save = async_save
        self._background: _BackgroundSave | None = None

    def complete(self) -> list[Path]:
        return published(self.root)

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any], info: dict[str, Any]) -> Path:
        """Collective: every rank calls it with its `own` state; rank 0 writes it all. Synchronous: returns once
        published. Asynchronous: returns once the state is gathered and copied; `wait()` ends it."""
        self.wait()  # at most one save in flight; the previous one is published before the next starts
        final = self.root / checkpoint_name(step)
        owns = gather_to_main(own, self.env)  # every rank's, on rank 0; None elsewhere
        if owns is None:
            return final
        tmp = self.root / f"{TMP_PREFIX}{checkpoint_name(step)}"
        if not self.async_save:
            self._write_and_publish(tmp, final, step, info, shared, owns)
            return final
        # The loop mutates parameters and optimizer buffers in place from the next step on: write a copy.
        self._background = _BackgroundSave(
            target=self._write_and_publish,
            args=(tmp, final, step, info, _tensors_on(shared, "cpu", copy=True), owns),
            name=f"checkpoint-{step}",
        )
        self._background.start()
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; re-raise its error."""
        background, self._background = self._background, None
        if background is not None:
            background.finish()

    def _write_and_publish(
        self, tmp: Path, final: Path, step: int, info: dict[str, Any], shared: dict[str, Any], owns: list[Any]
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_durably(tmp / SHARED_STATE, _serialize(shared))
        for rank, own in enumerate(owns):
            write_durably(tmp / rank_file(rank), _serialize(own))
        fsync_dir(tmp)
        manifest = {"step": step, "world_size": self.env.world_size, "created": time.time(), **info}
        publish(tmp, final, manifest, self.keep)
        log.info("checkpoint %s", final)

    def load_latest(self, device: torch.device) -> LoadedCheckpoint | None:
        """Collective. Rank 0 loads the newest checkpoint that verifies (corrupt ones are reported and skipped,
        never deleted) and every rank gets its state from rank 0: the shared state broadcast, each rank's own part
        sent to it. So every rank resumes from the same checkpoint, also where each node has a folder of its own
        that may lack it or hold an older one (a restart on Ray with outputs at a URL)."""
        found = self._read_newest() if self.env.is_main else None
        path, shared, owns = found if found is not None else (None, None, [None] * self.env.world_size)
        path, shared = broadcast_from_main((path, shared), self.env)
        if path is None:
            return None
        own = scatter_from_main(owns, self.env)
        # No copy: rank 0's state is its own load, the others' came unpickled; only the device may change.
        return LoadedCheckpoint(Path(path), _tensors_on(shared, device, copy=False), own)

    def _read_newest(self) -> tuple[str, dict[str, Any], list[Any]] | None:
        path = newest_verified(self.root, _report_unusable)
        if path is None:
            return None
        shared = torch.load(path / SHARED_STATE, map_location="cpu", weights_only=True)
        ranks = range(self.env.world_size)
        if read_manifest(path).get("world_size") != self.env.world_size:
            return str(path), shared, [None for _ in ranks]  # RNG states of another world size mean nothing here
        owns = [torch.load(path / rank_file(rank), map_location="cpu", weights_only=True) for rank in ranks]
        return str(path), shared, owns

    def clean_partial(self) -> None:
        """Remove temp folders of checkpoints that a crash interrupted; they were never published."""
        if self.env.is_main and self.root.is_dir():
            for stale in self.root.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)


def _report_unusable(path: Path, problem: str) -> None:
    log.warning("checkpoint %s is unusable (%s); trying an older one", path.name, problem)


class _BackgroundSave(threading.Thread):
    """A daemon thread that keeps its exception for `finish()`: a process that dies mid-save leaves only a
    temp folder, which is never loaded and is removed by the next run."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(daemon=True, **kwargs)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread in finish()
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"asynchronous checkpoint {self.name} failed: {self.error}") from self.error


def _tensors_on(obj: Any, device: torch.device | str, *, copy: bool) -> Any:
    """The same nested dicts/lists with every tensor detached and on `device`; with `copy`, in memory that nothing
    else writes to (the training loop goes on changing the originals)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=copy)
    if isinstance(obj, dict):
        return {key: _tensors_on(value, device, copy=copy) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors_on(value, device, copy=copy) for value in obj)
    return obj


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
