"""The published-checkpoint index: names, manifests and checksums. No torch here, so the launcher can read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clusterfit.storage.checksums import sha256_of

CHECKPOINT_DIR = "checkpoints"  # under outputs.dir
MANIFEST = "manifest.json"
SHARED_STATE = "state.pt"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def published(root: Path) -> list[Path]:
    """Published checkpoints, newest first. Only folders with a manifest count."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


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
