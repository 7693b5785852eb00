"""The one place that reads torch.distributed's standard environment (torchrun sets it on every engine).
Torch-free, so a user's script of any framework reads its rank through it too (clusterfit.session)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int = 0
    nodes: int = 1  # agents in this rendezvous round: an elastic job's count changes between rounds

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """RANK/WORLD_SIZE/LOCAL_RANK/GROUP_RANK/GROUP_WORLD_SIZE as set by torchrun (or any launcher); a plain
    `python` run is rank 0 of 1."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        world_size=world_size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
        node_rank=int(env.get("GROUP_RANK", "0")),
        nodes=int(env.get("GROUP_WORLD_SIZE", "1")),
    )
