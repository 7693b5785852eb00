"""checkpoints/: the published-checkpoint index, and the one rule by which a checkpoint is published.

Two kinds share the folder and the rule. The built-in trainer's `step-NNNNNNNN/` holds `state.pt` (the full
state) and `rank-NNNNN.pt` (each rank's RNG state), all written by rank 0; a user script's (clusterfit.session)
holds one folder `rank-NNNNN/` per rank with whatever that rank wrote. Both end with `manifest.json` (size and
sha256 of every file, the step, the world size), written last: a folder without a manifest was never published,
and a folder is only published once every rank's part is there. Torch-free, so the launcher, the job service and
user scripts of any framework read it; the worker's CheckpointStore writes and loads the trainer's tensors."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clusterfit.files import fsync_dir, write_durably
from clusterfit.storage.checksums import sha256_of

MANIFEST = "manifest.json"
SHARED_STATE = "state.pt"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
PARTS_KEY = "parts"  # a user script's manifest lists its per-rank folders; the trainer's has none

_PART_POLL_S = 0.01


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX) :])


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def rank_folder(rank: int) -> str:
    """A user script's part of a checkpoint: everything rank `rank` wrote for it."""
    return f"rank-{rank:05d}"


def published(root: Path, newest: int | None = None) -> list[Path]:
    """Published checkpoints, newest first (the `newest` of them, when given). Only folders with a manifest
    count, and only those looked at are checked for one: a job may make any number of folders."""
    if not root.is_dir():
        return []
    candidates = sorted((p for p in root.iterdir() if p.name.startswith(STEP_PREFIX)), key=lambda p: p.name)
    return list(itertools.islice((p for p in reversed(candidates) if (p / MANIFEST).is_file()), newest))


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Lists every file already under `folder` (by its path inside it) with its size and sha256, beside
    `manifest`'s own facts."""
    files = {
        f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size, "sha256": sha256_of(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }
    write_durably(folder / MANIFEST, json.dumps({**manifest, "files": files}, indent=2).encode())


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def verify(path: Path) -> str | None:
    """None if every part and every file in the manifest is present with its size and checksum, else what is
    wrong."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    files = manifest.get("files", {})
    parts = manifest.get(PARTS_KEY)
    if parts is None and SHARED_STATE not in files:
        return f"{SHARED_STATE} not listed"
    for part in parts or []:
        if not (path / part).is_dir():
            return f"{part}/ missing"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, expected {expected['bytes']}"
        if sha256_of(file) != expected["sha256"]:
            return f"{name} checksum mismatch"
    return None


def newest_verified(root: Path, on_unusable: Any = None, *, of_script: bool = False) -> Path | None:
    """The newest published checkpoint of one kind (the trainer's, or a user script's with `of_script`) that
    verifies; `on_unusable(path, problem)` hears of each one skipped (corrupt ones are reported and skipped, never
    deleted). The other kind is passed over: a folder reused by a trainer job and a script never mixes them."""
    for path in published(root):
        try:
            if (PARTS_KEY in read_manifest(path)) != of_script:
                continue
        except (OSError, ValueError):
            pass  # verify() names the unreadable manifest
        problem = verify(path)
        if problem is None:
            return path
        if on_unusable is not None:
            on_unusable(path, problem)
    return None


def wait_for_parts(parts: Sequence[Path], timeout_s: float, step: int) -> None:
    """Blocks until every part exists (each appears whole, by rename); TimeoutError naming the missing ones."""
    deadline = time.monotonic() + timeout_s
    while not all(part.exists() for part in parts):
        if time.monotonic() > deadline:
            missing = [p.name for p in parts if not p.exists()]
            raise TimeoutError(f"checkpoint step {step}: no {', '.join(missing)} after {timeout_s:g}s")
        time.sleep(_PART_POLL_S)


def publish(tmp: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """The manifest last, then one rename makes the checkpoint visible; then only the newest `keep` stay.
    Called once every rank's part is in `tmp`."""
    write_manifest(tmp, manifest)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in published(final.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
