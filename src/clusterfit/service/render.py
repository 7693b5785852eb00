"""How the CLI prints the service's views (dicts from `views`), the same whether they came from the local
store or from a server."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import yaml
from rich.table import Table

from clusterfit.outputs import metrics_text
from clusterfit.outputs.summary import SCORING, scoring_line

_STATE_STYLE = {
    "QUEUED": "cyan",
    "STAGING": "blue",
    "RUNNING": "green",
    "RETRYING": "yellow",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "CANCELLED": "magenta",
}


def age(value: str | None) -> str:
    """'3 min ago' style, for tables, from a view's ISO time (always with its UTC offset)."""
    if not value:
        return "-"
    seconds = (datetime.now(timezone.utc) - datetime.fromisoformat(value)).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _progress(row: dict[str, Any]) -> str:
    if row.get("step") is None:
        return "-"
    total = row.get("total_steps")
    text = f"{row['step']}/{total}" if total else str(row["step"])
    if total:
        text += f" ({100 * row['step'] / total:.0f}%)"
    return text


def jobs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("id", "name", "state", "engine", "ranks", "progress", "images/s", "age"):
        table.add_column(column, justify="right" if column in ("ranks", "images/s") else "left")
    for row in rows:
        rate = row.get("images_per_s")
        table.add_row(
            row["id"],
            row["name"],
            f"[{_STATE_STYLE.get(row['state'], '')}]{row['state']}[/]",
            row["backend"],
            str(row["ranks"]),
            _progress(row),
            "-" if rate is None else f"{rate:.1f}",
            age(row["submitted_at"]),
        )
    return table


def status_lines(status: dict[str, Any]) -> list[str]:
    """Plain lines (no markup): what `clusterfit status` prints."""
    attempts = f"attempt {status['attempt']} of {status['max_retries'] + 1}" if status["attempt"] else "not started"
    lines = [
        f"job {status['id']} ({status['name']}): {status['state']}, {attempts}",
        f"engine {status['backend']}, {status['ranks']} rank(s), priority {status['priority']}, "
        f"submitted {age(status['submitted_at'])} ago",
    ]
    if status.get("step") is not None:
        parts = [f"step {_progress(status)}"]
        if status.get("epoch"):
            parts.append(f"epoch {status['epoch']}")
        if status.get("images_per_s") is not None:
            parts.append(f"{status['images_per_s']:.1f} images/s")
        if status.get("loss") is not None:
            parts.append(f"loss {status['loss']:.4f}")
        lines.append("progress: " + ", ".join(parts))
    if status.get("metrics"):
        lines.append(f"metrics at step {status['metrics_step']}: " + metrics_text(status["metrics"]))
    if status.get("nodes"):
        nodes = status["nodes"]
        now = "not started" if nodes["now"] is None else f"{nodes['now']} now"
        lines.append(f"nodes: {now}, {nodes['allowed']} allowed (elastic)")
        lines += [f"  {_clock(change['time'])}  {change['text']}" for change in nodes["changes"]]
    for rank in status.get("ranks_health", []):
        rate = "" if rank["images_per_s"] is None else f", {rank['images_per_s']:.1f} images/s"
        lines.append(
            f"  rank {rank['rank']} on {rank['host']} (pid {rank['pid']}): {rank['health']}, {rank['phase']} "
            f"step {rank['step']}{rate}, last heartbeat {rank['seconds_since_heartbeat']:.0f} s ago"
        )
    if status.get("cause"):
        lines.append(f"cause: {status['cause_words']} ({status['cause']})")
        lines += [f"  {line}" for line in (status.get("cause_detail") or "").splitlines()]
    lines.append(f"logs: {status['logs_dir']}  (clusterfit logs {status['id']})")
    return lines


def _clock(seconds: float | None) -> str:
    return "--:--:--" if seconds is None else time.strftime("%H:%M:%S", time.localtime(seconds))


def history_lines(status: dict[str, Any]) -> list[str]:
    return [f"  {event['at'][:19]}  {event['state']:<9}  {event['message']}" for event in status["history"]]


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    if summary.get("kind") == SCORING:
        return [f"summary: {scoring_line(summary)}; {', '.join(summary['exported'])}"]
    lines = ["summary:"]
    for epoch in summary.get("epochs", []):
        fields = {key: value for key, value in epoch.items() if key != "epoch"}
        lines.append(f"  epoch {epoch['epoch']}: {metrics_text(fields)}")
    return lines


def details_lines(details: dict[str, Any]) -> list[str]:
    """Plain lines: what `clusterfit show` prints."""
    return [
        *status_lines(details),
        "history:",
        *history_lines(details),
        f"outputs: {details['outputs_dir']}"
        + (f" (a copy of {details['outputs_url']})" if details.get("outputs_url") else ""),
        *(f"  model: {path}" for path in details["model_files"]),
        *(f"  checkpoint: {path}" for path in details["checkpoints"]),
        f"  metrics: {details['metrics_file']}  tensorboard: {details['tensorboard_dir']}",
        *(_summary_lines(details["summary"]) if details["summary"] else []),
        "spec:",
        *yaml.safe_dump(details["spec"], sort_keys=False).splitlines(),
    ]
