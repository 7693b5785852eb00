"""What the launcher does before any worker starts: every check that can fail fast, on the client."""

from __future__ import annotations

from pathlib import Path

from clusterfit.data import inspect_data, steps_per_epoch
from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import JobSpec
from clusterfit.worker.checkpoint import CheckpointStore, read_manifest
from clusterfit.worker.dist import DistEnv
from clusterfit.worker.train import CHECKPOINT_DIR


def preflight(spec: JobSpec) -> None:
    """Raise SpecError for data that is missing or too small, and for outputs holding another job's checkpoints."""
    facts = inspect_data(spec.trainer.data)
    steps_per_epoch(spec.trainer, facts, spec.world_size)
    store = CheckpointStore(Path(spec.outputs.dir) / CHECKPOINT_DIR, keep=1, env=DistEnv(0, 1, 0, 1))
    latest = store.complete()
    if latest:
        saved = read_manifest(latest[0])
        wanted = {"model": spec.trainer.model, "num_classes": len(facts.classes), "norm_layer": spec.trainer.norm_layer}
        clashes = [f"{key} {saved.get(key)!r} vs {value!r}" for key, value in wanted.items() if saved.get(key) != value]
        if clashes:
            raise SpecError(
                f"outputs.dir = {spec.outputs.dir!r} holds checkpoints of another model ({'; '.join(clashes)}); "
                "choose a new outputs.dir, or move the old one away to start over"
            )
