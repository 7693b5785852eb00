"""checkpoints/: the published-checkpoint index. Each `step-NNNNNNNN/` holds `state.pt` (rank 0's full state),
`rank-NNNNN.pt` (each rank's RNG state) and `manifest.json` (size and sha256 of every file, the step, world
size and model), written last: a folder without a manifest was never published. Torch-free, so the launcher
and the job service read it; the worker's CheckpointStore writes and loads the tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clusterfit.files import write_durably
from clusterfit.storage.checksums import sha256_of

MANIFEST = "manifest.json"
SHARED_STATE = "state.pt"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def published(root: Path) -> list[Path]:
    """Published checkpoints, newest first. Only folders with a manifest count."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Lists every file already in `folder` with its size and sha256, beside `manifest`'s own facts."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_of(f)} for f in sorted(folder.iterdir())}
    write_durably(folder / MANIFEST, json.dumps({**manifest, "files": files}, indent=2).encode())


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def verify(path: Path) -> str | None:
    """None if every file in the manifest is present with its size and checksum, else what is wrong."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    files = manifest.get("files", {})
    if SHARED_STATE not in files:
        return f"{SHARED_STATE} not listed"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, expected {expected['bytes']}"
        if sha256_of(file) != expected["sha256"]:
            return f"{name} checksum mismatch"
    return None
