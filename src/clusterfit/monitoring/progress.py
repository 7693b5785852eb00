"""Follow a running job from the launcher: every rank's labelled log lines, and a progress bar fed by
rank 0's metrics.jsonl, both read from the outputs folder so it works the same for any engine.

torchrun's own log (agent.log) is not shown: its messages are the agent's internals, and its report of a
failure repeats the ranks' tracebacks; the job service reads it to name the cause, and it stays in logs/."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clusterfit.monitoring.logtail import LogFollower
from clusterfit.monitoring.tracebacks import HeldTracebacks
from clusterfit.outputs import JobOutputs, MetricsTail, RecordKind, membership_changes, metrics_text


class LiveView:
    """The foreground display of a running job: every rank's labelled log lines and a progress bar fed by
    rank 0's metrics. Opened before the job starts, so it shows what this run writes and nothing older.
    Tracebacks are held back (see HeldTracebacks): after the job, `release_tracebacks()` shows them when it
    succeeded, `held_tracebacks()` names the ranks whose tracebacks a failed job's console leaves out."""

    def __init__(self, outputs: JobOutputs, world_size: int, console: Console) -> None:
        self.logs = LogFollower(outputs.logs, world_size, agent=False)
        self.tracebacks = HeldTracebacks()
        self.metrics = MetricsTail(outputs.metrics)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}", markup=False),  # a script's metric names as it wrote them
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.bar = Progress(*columns, console=console)
        self.task = self.bar.add_task("starting", total=None, stats="")
        self._last_start: dict[str, Any] | None = None

    def __enter__(self) -> LiveView:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tick(final=True)
        self.bar.__exit__(None, None, None)

    def tick(self, final: bool = False) -> None:
        for line in self.logs.drain() if final else self.logs.poll():
            for shown in self.tracebacks.feed(line):
                self._print(shown)
        for record in self.metrics.read_new():
            if record.get("kind") == RecordKind.START:
                self._report_membership(record)
            _update(self.bar, self.task, record)

    def _report_membership(self, start: dict[str, Any]) -> None:
        for change in membership_changes([self._last_start or start, start]):
            self._print(f"nodes: {change.text}")
        self._last_start = start

    def release_tracebacks(self) -> None:
        for line in self.tracebacks.release():
            self._print(line)

    def held_tracebacks(self) -> list[str]:
        return self.tracebacks.held_labels()

    def _print(self, line: str) -> None:
        self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)


def _train_stats(record: dict[str, Any]) -> str:
    """The trainer's epoch, loss and images/s; a user script's own metrics as they come."""
    if {"epoch", "loss", "images_per_s"} <= record.keys():
        return f"epoch {record['epoch']} loss {record['loss']:.3f} {record['images_per_s']:.1f} img/s"
    shown = {key: value for key, value in record.items() if key not in ("kind", "step", "time", "total_steps")}
    return metrics_text(shown, " ")


def _update(bar: Progress, task: Any, record: dict[str, Any]) -> None:
    kind = record.get("kind")
    if kind == RecordKind.START:
        bar.reset(task, total=record["total_steps"], completed=record["step"], description="training")
    elif kind == RecordKind.TRAIN:
        if record.get("total_steps"):  # a user script (clusterfit.session) may name its total in any report
            bar.update(task, total=record["total_steps"])
        bar.update(task, completed=record["step"], stats=_train_stats(record), description="training")
    elif kind == RecordKind.END:
        bar.update(task, completed=record["step"], description="done")
