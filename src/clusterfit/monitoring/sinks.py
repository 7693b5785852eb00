"""Metric sinks behind one tiny interface. Records are flat dicts with `kind` and `step`."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Protocol

from clusterfit.outputs import JobOutputs, MetricsWriter, RecordKind


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        # NOTE: tensorboard writes event files through TensorFlow when it is installed (the tensorflow extra),
        # which costs each rank seconds and hundreds of MB to import; `tensorboard.compat.notf` is tensorboard's
        # own switch to the stub it ships. A program that already imported TensorFlow keeps it.
        if "tensorflow" not in sys.modules:
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key not in ("kind", "step", "epoch", "time") and isinstance(value, (int, float)):
                self._writer.add_scalar(f"{RecordKind(record['kind']).value}/{key}", value, global_step=step)
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


def open_metric_sinks(outputs: JobOutputs, is_main: bool, *, tensorboard_required: bool = True) -> MetricSink:
    """Only the main process records metrics (metrics.jsonl and TensorBoard); the others get a sink that drops them.
    Without `tensorboard_required` (a user script of any framework), TensorBoard is skipped when torch's writer or
    tensorboard is not installed."""
    if not is_main:
        return FanOut([])
    sinks: list[MetricSink] = [MetricsWriter(outputs.metrics)]
    try:
        sinks.append(TensorBoardSink(outputs.tensorboard))
    except ImportError:
        if tensorboard_required:
            raise
    return FanOut(sinks)
