"""summary.json: what a finished training job leaves beside its model, for people and for scoring jobs: the
spec, images/s and metrics per epoch, the final metrics, the exported files, the wall time."""

from __future__ import annotations

import json
from typing import Any

from clusterfit import __version__
from clusterfit.files import read_whole_regular, write_atomically
from clusterfit.outputs.layout import JobOutputs

_LARGEST_SUMMARY = 16 * 1024 * 1024  # rank 0 writes it: read whole only up to this size
SCORING = "scoring"  # a scoring job's summary says `"kind": "scoring"` (images scored, skipped, images/s)


def scoring_line(summary: dict[str, Any]) -> str:
    """A scoring job's summary in one line, for `run`/`score` and `show`."""
    return (
        f"scored {summary['images_scored']} of {summary['images']} images on {summary['world_size']} rank(s), "
        f"{summary['images_per_s']:.1f} images/s this run ({summary['images_this_run']} images); "
        f"skipped {summary['bad_images_skipped']} unreadable"
    )


def write_summary(
    outputs: JobOutputs,
    *,
    name: str,
    spec: dict[str, Any],
    epochs: list[dict[str, Any]],
    exported: list[str],
    wall_seconds: float,
    **facts: Any,
) -> dict[str, Any]:
    summary = {
        "name": name,
        "clusterfit_version": __version__,
        **facts,
        "wall_seconds": round(wall_seconds, 3),
        "epochs": epochs,
        "final": dict(epochs[-1]) if epochs else {},
        "exported": exported,
        "spec": spec,
    }
    write_atomically(outputs.summary, json.dumps(summary, indent=2))
    return summary


def read_summary(outputs: JobOutputs) -> dict[str, Any] | None:
    try:
        return json.loads(read_whole_regular(outputs.summary, _LARGEST_SUMMARY))
    except OSError:  # none yet, or not a file of the job's (a link)
        return None
    except ValueError:  # cut short, or larger than a summary is
        return None


def finished_this_run(outputs: JobOutputs) -> bool:
    """Whether the summary was written by the run that the current job.yaml started (and not by an earlier one).

    Both files are on the outputs filesystem, so their times come from one clock, even across nodes. A run that
    stopped at a checkpoint on request (SIGUSR1, before Slurm requeues it) leaves no newer summary."""
    try:
        return outputs.summary.stat().st_mtime >= outputs.resolved_spec.stat().st_mtime
    except FileNotFoundError:
        return False
