"""Whether a job should end before its last epoch: a target metric reached (`stop_at`) or no improvement for
`patience` validations (`early_stopping`). Decided from the epoch history alone, which every checkpoint holds,
so a resumed job decides exactly as an uninterrupted one would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from clusterfit.spec.model import EarlyStoppingSpec

LOWER_IS_BETTER = frozenset({"val_loss"})


@dataclass(frozen=True)
class EarlyStop:
    reason: str  # "stop_at" or "early_stopping"
    metric: str
    value: float
    epoch: int
    elapsed_s: float  # job time from its first start to that epoch's end, across restarts

    def describe(self) -> str:
        if self.reason == "stop_at":
            return f"{self.metric} reached {self.value:.4f} at epoch {self.epoch} after {self.elapsed_s:.1f} s"
        return f"{self.metric} stopped improving (best {self.value:.4f}); ended after epoch {self.epoch}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_new_best(history: Sequence[Mapping[str, Any]], metric: str, value: float) -> bool:
    """Whether `value` beats every earlier validation's (strictly: the first of equals stays the best)."""
    earlier = [record[metric] for record in history if metric in record]
    return all(_better(metric, value, previous) for previous in earlier)


def best_record(history: Sequence[Mapping[str, Any]], metric: str) -> Mapping[str, Any] | None:
    best = None
    for record in history:
        if metric in record and (best is None or _better(metric, record[metric], best[metric])):
            best = record
    return best


def _better(metric: str, value: float, than: float, by: float = 0.0) -> bool:
    return value < than - by if metric in LOWER_IS_BETTER else value > than + by


def _reached(metric: str, value: float, target: float) -> bool:
    return value <= target if metric in LOWER_IS_BETTER else value >= target


def early_stop(
    history: Sequence[Mapping[str, Any]], stop_at: Mapping[str, float], patience: EarlyStoppingSpec | None
) -> EarlyStop | None:
    """The reason to stop after the last epoch of `history`, if any; only validated epochs count."""
    validated = [record for record in history if any(key.startswith("val_") for key in record)]
    if not validated or validated[-1] is not history[-1]:
        return None  # the last epoch was not validated: nothing new to decide on
    last = validated[-1]

    def stop(reason: str, metric: str, value: float) -> EarlyStop:
        return EarlyStop(reason, metric, float(value), int(last["epoch"]), float(last.get("elapsed_s", 0.0)))

    for metric, target in stop_at.items():
        if metric in last and _reached(metric, last[metric], target):
            return stop("stop_at", metric, last[metric])
    if patience is not None and len(validated) > patience.patience:
        metric = patience.metric
        before = [record[metric] for record in validated[: -patience.patience]]
        recent = [record[metric] for record in validated[-patience.patience :]]
        best_before = min(before) if metric in LOWER_IS_BETTER else max(before)
        if not any(_better(metric, value, best_before, patience.min_delta) for value in recent):
            return stop("early_stopping", metric, best_before)
    return None
