"""Follow a running job from the launcher: every rank's labelled log lines, and a progress bar fed by
rank 0's metrics.jsonl, both read from the outputs folder so it works the same for any engine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clusterfit.backends.base import RunHandle
from clusterfit.monitoring.logtail import LOG_DIR, LogFollower
from clusterfit.monitoring.sinks import METRICS_FILE

_POLL_S = 0.2


class MetricsTail:
    """Reads records appended to metrics.jsonl since it was opened; tolerates a half-written last line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = ""

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


class JobWatch:
    """Opened before the job starts, so it shows everything this run writes and nothing of earlier runs."""

    def __init__(self, outputs_dir: Path) -> None:
        self.logs = LogFollower(outputs_dir / LOG_DIR)
        self.metrics = MetricsTail(outputs_dir / METRICS_FILE)


def follow(handle: RunHandle, watch: JobWatch, console: Console) -> int:
    """Print the job's log lines and a progress bar until it ends; returns its exit code."""
    logs, metrics = watch.logs, watch.metrics
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("starting", total=None, stats="")
        while True:
            code = handle.poll()
            for line in logs.drain() if code is not None else logs.poll():
                bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            for record in metrics.read_new():
                _update(bar, task, record)
            if code is not None:
                return code
            time.sleep(_POLL_S)


def _update(bar: Progress, task: Any, record: dict[str, Any]) -> None:
    kind = record.get("kind")
    if kind == "start":
        bar.reset(task, total=record["total_steps"], completed=record["step"], description="training")
    elif kind == "train":
        stats = f"epoch {record['epoch']} loss {record['loss']:.3f} {record['images_per_s']:.1f} img/s"
        bar.update(task, completed=record["step"], stats=stats, description="training")
    elif kind == "end":
        bar.update(task, completed=record["step"], description="done")
