"""summary.json: what a finished job leaves beside its model, for people and for scoring jobs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from clusterfit import __version__
from clusterfit.spec.model import JobSpec

SUMMARY_FILE = "summary.json"


def write_summary(
    out: Path,
    *,
    spec: JobSpec,
    progress_history: list[dict[str, Any]],
    exported: list[Path],
    wall_seconds: float,
    **facts: Any,
) -> dict[str, Any]:
    final = dict(progress_history[-1]) if progress_history else {}
    summary = {
        "name": spec.name,
        "clusterfit_version": __version__,
        **facts,
        "wall_seconds": round(wall_seconds, 3),
        "epochs": progress_history,
        "final": final,
        "exported": [str(p) for p in exported],
        "spec": spec.model_dump(mode="json"),
    }
    tmp = out / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / SUMMARY_FILE)
    return summary
