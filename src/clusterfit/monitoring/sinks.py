"""Metric sinks behind one tiny interface. Records are flat dicts with `kind` and `step`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed at once so followers (the CLI, the dashboard) see it live."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key not in ("kind", "step", "epoch", "time") and isinstance(value, (int, float)):
                self._writer.add_scalar(f"{record['kind']}/{key}", value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class FanOut:
    def __init__(self, sinks: list[MetricSink]) -> None:
        self._sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def open_metric_sinks(outputs_dir: Path, is_main: bool) -> MetricSink:
    """Only the main process records metrics; the others get a sink that drops them."""
    if not is_main:
        return FanOut([])
    return FanOut([JsonlSink(outputs_dir / METRICS_FILE), TensorBoardSink(outputs_dir / TENSORBOARD_DIR)])
