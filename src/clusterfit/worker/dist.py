"""The one place that reads the torch.distributed environment. No engine-specific code lives here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def read_dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """RANK/WORLD_SIZE/LOCAL_RANK as set by torchrun (or any launcher); a plain `python` run is rank 0 of 1."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        world_size=world_size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 600) -> None:
    """NCCL between GPUs, gloo between CPU processes; MASTER_ADDR/MASTER_PORT come from the environment."""
    if not env.is_distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.is_distributed:
        dist.barrier()


def all_reduce_sum(values: list[float], env: DistEnv, device: torch.device) -> list[float]:
    if not env.is_distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()
