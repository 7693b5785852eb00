"""Follow a running job from the launcher: every rank's labelled lines, and a progress bar fed by
rank 0's metrics.jsonl (so the bar works the same whichever engine runs the workers)."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clusterfit.backends.base import RunHandle
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
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def follow(handle: RunHandle, outputs_dir: Path, console: Console) -> int:
    """Print the job's output and a progress bar until it ends; returns its exit code."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in handle.lines():
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    metrics = MetricsTail(outputs_dir / METRICS_FILE)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=None, stats="")
        output_open = True
        while output_open:
            try:
                line = lines.get(timeout=0.25)
                while line is not None:
                    bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
                    line = lines.get_nowait()
                output_open = False  # None: the job's output closed
            except queue.Empty:
                pass
            for record in metrics.read_new():
                _update(bar, task, record)
        for record in metrics.read_new():
            _update(bar, task, record)
    return handle.wait()


def _update(bar: Progress, task: Any, record: dict[str, Any]) -> None:
    kind = record.get("kind")
    if kind == "start":
        bar.reset(task, total=record["total_steps"], completed=record["step"], description="training")
    elif kind == "train":
        stats = f"epoch {record['epoch']} loss {record['loss']:.3f} {record['images_per_s']:.1f} img/s"
        bar.update(task, completed=record["step"], stats=stats, description="training")
    elif kind == "end":
        bar.update(task, completed=record["step"], description="done")


__all__ = ["MetricsTail", "follow"]
