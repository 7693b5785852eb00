"""Checkpoints that survive crashes: written to a temp folder, published by one rename once every
rank has written its part, verified by checksum on load, never unpickling code."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterfit.worker.dist import DistEnv, barrier
from clusterfit.worker.manifest import (
    MANIFEST,
    SHARED_STATE,
    TMP_PREFIX,
    checkpoint_name,
    published,
    read_manifest,
    sha256_of,
    verify,
)

log = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


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
    def __init__(self, root: str | Path, keep: int, env: DistEnv) -> None:
        self.root = Path(root)
        self.keep = keep
        self.env = env

    def complete(self) -> list[Path]:
        return published(self.root)

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any], info: dict[str, Any]) -> Path:
        """Collective: every rank calls it. `shared` is written by rank 0 only, `own` by every rank."""
        final = self.root / checkpoint_name(step)
        tmp = self.root / f"{TMP_PREFIX}{checkpoint_name(step)}"
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier(self.env)
        _write_durably(tmp / rank_file(self.env.rank), _serialize(own))
        if self.env.is_main:
            _write_durably(tmp / SHARED_STATE, _serialize(shared))
        # NOTE: the checkpoint only exists once every rank has written its part.
        barrier(self.env)
        if self.env.is_main:
            files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_of(f)} for f in sorted(tmp.iterdir())}
            manifest = {"step": step, "world_size": self.env.world_size, "created": time.time(), "files": files, **info}
            _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        return final

    def load_latest(self, device: torch.device) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies; corrupt ones are reported and skipped, never deleted."""
        for path in self.complete():
            problem = verify(path)
            if problem:
                log.warning("checkpoint %s is unusable (%s); trying an older one", path.name, problem)
                continue
            shared = torch.load(path / SHARED_STATE, map_location=device, weights_only=True)
            own_path = path / rank_file(self.env.rank)
            same_world = read_manifest(path).get("world_size") == self.env.world_size
            own = torch.load(own_path, map_location="cpu", weights_only=True) if same_world else None
            return LoadedCheckpoint(path, shared, own)
        return None

    def clean_partial(self) -> None:
        """Remove temp folders of checkpoints that a crash interrupted; they were never published."""
        if self.env.is_main and self.root.is_dir():
            for stale in self.root.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _prune(self) -> None:
        for old in self.complete()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
