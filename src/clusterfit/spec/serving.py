"""Settings of `clusterfit serve` checked before the model, torch or Ray is loaded: a mistake is refused in one
line at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterfit.errors import SpecError


@dataclass(frozen=True)
class ReplicaCount:
    """`--replicas N` (fixed) or `MIN:MAX` (Ray Serve's autoscaler adds replicas while requests queue)."""

    minimum: int
    maximum: int

    @classmethod
    def parse(cls, text: str) -> ReplicaCount:
        low, bounded, high = text.partition(":")
        try:
            minimum, maximum = int(low), int(high if bounded else low)
        except ValueError:
            minimum = maximum = 0
        if minimum < 1 or maximum < minimum:
            raise SpecError(f"--replicas {text}: give a count (2) or bounds MIN:MAX (1:4), MIN at least 1")
        return cls(minimum, maximum)

    def deployment_options(self, max_batch: int) -> dict[str, Any]:
        # NOTE: Ray Serve sends a replica at most max_ongoing_requests at once (5 by default), which would cap
        # every batch at 5: a replica takes two batches' worth, one filling while the other runs.
        options: dict[str, Any] = {"max_ongoing_requests": 2 * max_batch}
        if self.minimum == self.maximum:
            return {**options, "num_replicas": self.minimum}
        # A replica is busy enough once a full batch waits for it: scale out beyond that.
        bounds = {"min_replicas": self.minimum, "max_replicas": self.maximum, "target_ongoing_requests": max_batch}
        return {**options, "autoscaling_config": bounds}

    def __str__(self) -> str:
        return str(self.minimum) if self.minimum == self.maximum else f"{self.minimum}-{self.maximum} (autoscaled)"
