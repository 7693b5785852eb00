"""report(): rank 0's metric records (metrics.jsonl, TensorBoard) and every rank's heartbeat, as the built-in
trainer writes them, so status, logs, the dashboard and hang detection read a user's script the same way.

Nothing here waits for another rank: each rank writes its own files, so ranks may report unequally."""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping

from clusterfit.monitoring.sinks import open_metric_sinks
from clusterfit.outputs import LIVENESS_ENV, JobOutputs, Phase, RecordKind
from clusterfit.processes import is_running, kill_if_same
from clusterfit.session.context import JobContext
from clusterfit.session.errors import SessionError
from clusterfit.worker.heartbeat import Heartbeat

_LIVENESS_STOP_S = 5.0
_RESERVED = ("kind", "step", "time")


class Reporter:
    def __init__(self, context: JobContext, environ: Mapping[str, str]) -> None:
        assert context.outputs_dir is not None
        outputs = JobOutputs.at(context.outputs_dir)
        self._heartbeat = Heartbeat(outputs, context.rank, context.hang_timeout, images_per_step=None)
        self._sinks = open_metric_sinks(outputs, context.is_main, tensorboard_required=False)
        self._liveness = environ.get(LIVENESS_ENV)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        record = checked_record(step, metrics)
        if self._liveness:
            # This script now reports its own steps: the wrapper's "alive" heartbeat must not overwrite them.
            stop_liveness(self._liveness)
            self._liveness = None
        self._sinks.write({"kind": RecordKind.TRAIN.value, "step": step, "time": time.time(), **record})
        self._heartbeat.beat(Phase.TRAINING, step, metrics=record)

    def close(self) -> None:
        self._heartbeat.flush()  # the heartbeat ends at the script's true last step
        self._sinks.close()


def checked_record(step: int, metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics as plain floats; a mistake is one line naming the metric, the value and the fix."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SessionError(f"report(step={step!r}): step must be a whole number >= 0 (the training step)")
    record: dict[str, float] = {}
    for key, value in metrics.items():
        if key in _RESERVED:
            raise SessionError(f"report({key}=...): {key!r} is the record's own field; name the metric otherwise")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise SessionError(
                f"report({key}={value!r}): metrics are numbers; pass a float (e.g. loss.item() for a tensor)"
            ) from None
        record[key] = number
    return record


def stop_liveness(token: str) -> None:
    """Ends the command wrapper's liveness process (PID:START_TIME) and waits until it can write no more."""
    pid_text, _, start_time = token.partition(":")
    pid = int(pid_text)
    kill_if_same(pid, start_time, signal.SIGTERM)
    deadline = time.monotonic() + _LIVENESS_STOP_S
    while is_running(pid, start_time) and time.monotonic() < deadline:
        time.sleep(0.01)
