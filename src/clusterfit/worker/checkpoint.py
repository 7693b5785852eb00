"""Checkpoints that survive crashes: written to a temp folder, published by one rename once every
rank has written its part, verified by checksum on load, never unpickling code.

With `async_save`, the training loop only waits for a copy of the state in memory; a background thread per
rank serializes and writes that rank's part, and rank 0's thread publishes once every rank's part is on disk.
The background threads coordinate through the files themselves (each part appears by rename once durable),
never through collectives: a gloo collective from a second thread would interleave with the training
loop's collectives on the same process group and corrupt both."""

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

from clusterfit.files import fsync_dir, write_atomically, write_durably
from clusterfit.outputs.checkpoints import (
    SHARED_STATE,
    TMP_PREFIX,
    checkpoint_name,
    newest_verified,
    publish,
    published,
    rank_file,
    read_manifest,
    wait_for_parts,
)
from clusterfit.worker.dist import DistEnv, barrier

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
    def __init__(
        self, root: str | Path, keep: int, env: DistEnv, async_save: bool = False, part_timeout_s: float = 1800
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        self.env = env
        self.async_save = async_save
        self.part_timeout_s = part_timeout_s  # rank 0 gives up publishing when another rank's part never comes
        self._background: _BackgroundSave | None = None

    def complete(self) -> list[Path]:
        return published(self.root)

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any], info: dict[str, Any]) -> Path:
        """Collective: every rank calls it. `shared` is written by rank 0 only, `own` by every rank.
        Synchronous: returns once published. Asynchronous: returns once the state is copied; `wait()` ends it."""
        self.wait()  # at most one save in flight; the previous one is published before the next starts
        final = self.root / checkpoint_name(step)
        tmp = self.root / f"{TMP_PREFIX}{checkpoint_name(step)}"
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier(self.env)
        if not self.async_save:
            self._write_part(tmp, shared, own)
            # NOTE: the checkpoint only exists once every rank has written its part.
            barrier(self.env)
            if self.env.is_main:
                self._publish(tmp, final, step, info)
            return final
        # The loop mutates parameters and optimizer buffers in place from the next step on: write a copy.
        snapshot = _detached_copy(shared), _detached_copy(own)
        self._background = _BackgroundSave(
            target=self._write_and_publish, args=(tmp, final, step, info, *snapshot), name=f"checkpoint-{step}"
        )
        self._background.start()
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and, on rank 0, published; re-raise its error."""
        background, self._background = self._background, None
        if background is not None:
            background.finish()

    def _write_and_publish(
        self, tmp: Path, final: Path, step: int, info: dict[str, Any], shared: dict[str, Any], own: dict[str, Any]
    ) -> None:
        self._write_part(tmp, shared, own)
        if self.env.is_main:
            # NOTE: the checkpoint only exists once every rank's part is durable; a part appears by rename.
            expected = [tmp / rank_file(rank) for rank in range(self.env.world_size)]
            wait_for_parts(expected, self.part_timeout_s, step)
            self._publish(tmp, final, step, info)
            log.info("checkpoint %s", final)

    def _write_part(self, tmp: Path, shared: dict[str, Any], own: dict[str, Any]) -> None:
        if self.env.is_main:
            write_durably(tmp / SHARED_STATE, _serialize(shared))
        # A part appears whole or not at all: rank 0 publishes as soon as every part's name exists.
        write_atomically(tmp / rank_file(self.env.rank), _serialize(own), durable=True)
        fsync_dir(tmp)

    def _publish(self, tmp: Path, final: Path, step: int, info: dict[str, Any]) -> None:
        manifest = {"step": step, "world_size": self.env.world_size, "created": time.time(), **info}
        publish(tmp, final, manifest, self.keep)

    def load_latest(self, device: torch.device) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies; corrupt ones are reported and skipped, never deleted."""
        path = newest_verified(self.root, _report_unusable)
        if path is None:
            return None
        shared = torch.load(path / SHARED_STATE, map_location=device, weights_only=True)
        own_path = path / rank_file(self.env.rank)
        same_world = read_manifest(path).get("world_size") == self.env.world_size
        own = torch.load(own_path, map_location="cpu", weights_only=True) if same_world else None
        return LoadedCheckpoint(path, shared, own)

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


def _detached_copy(obj: Any) -> Any:
    """The same nested dicts/lists with every tensor copied to CPU memory that nothing else writes to."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: _detached_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached_copy(value) for value in obj)
    return obj


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
