"""PyTorch-friendly helpers over clusterfit.session: save and restore a dict of modules, optimizers and plain
values as this rank's part of a checkpoint. torch is imported only when this module is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from clusterfit import session

STATE_FILE = "state.pt"


def _state_of(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") else value


def save(step: int, objects: Mapping[str, Any], *, keep: int = 2) -> None:
    """This rank's part of the checkpoint at `step`: each module's/optimizer's state_dict, other values as is."""
    with session.checkpoint(step, keep=keep) as folder:
        torch.save({name: _state_of(value) for name, value in objects.items()}, folder / STATE_FILE)


def restore(objects: Mapping[str, Any]) -> int:
    """Loads the latest complete checkpoint into `objects` (weights only, no pickled code); returns the step to
    start at: 0 on a fresh job, the saved step + 1 after a restart. Keep other state (an RNG, counters) as
    tensors in a module or pass it to `save` and read it back with `session.latest_checkpoint()`."""
    resume = session.latest_checkpoint()
    if resume is None:
        return 0
    saved = torch.load(resume.folder / STATE_FILE, map_location="cpu", weights_only=True)
    for name, value in objects.items():
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[name])
    return resume.step + 1
