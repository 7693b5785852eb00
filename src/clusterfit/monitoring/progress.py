"""Follow a running job from the launcher: every rank's labelled log lines, and a progress bar fed by
rank 0's metrics.jsonl, both read from the outputs folder so it works the same for any engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clusterfit.monitoring.logtail import LOG_DIR, LogFollower
from clusterfit.monitoring.sinks import METRICS_FILE


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


class LiveView:
    """The foreground display of a running job: every rank's labelled log lines and a progress bar fed by
    rank 0's metrics. Opened before the job starts, so it shows what this run writes and nothing older."""

    def __init__(self, outputs_dir: Path, console: Console) -> None:
        self.logs = LogFollower(outputs_dir / LOG_DIR)
        self.metrics = MetricsTail(outputs_dir / METRICS_FILE)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.bar = Progress(*columns, console=console)
        self.task = self.bar.add_task("starting", total=None, stats="")

    def __enter__(self) -> LiveView:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tick(final=True)
        self.bar.__exit__(None, None, None)

    def tick(self, final: bool = False) -> None:
        for line in self.logs.drain() if final else self.logs.poll():
            self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        for record in self.metrics.read_new():
            _update(self.bar, self.task, record)


def _update(bar: Progress, task: Any, record: dict[str, Any]) -> None:
    kind = record.get("kind")
    if kind == "start":
        bar.reset(task, total=record["total_steps"], completed=record["step"], description="training")
    elif kind == "train":
        stats = f"epoch {record['epoch']} loss {record['loss']:.3f} {record['images_per_s']:.1f} img/s"
        bar.update(task, completed=record["step"], stats=stats, description="training")
    elif kind == "end":
        bar.update(task, completed=record["step"], description="done")
