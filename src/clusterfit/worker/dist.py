"""torch.distributed for the trainer: device, process group, the collectives it needs. The environment is read in
`dist_env.py`; no engine-specific code lives here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from clusterfit.worker.dist_env import DistEnv, read_dist_env

__all__ = [
    "DistEnv",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_main",
    "gather_to_main",
    "init_distributed",
    "pick_device",
    "read_dist_env",
    "scatter_from_main",
    "shutdown_distributed",
]


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


def gather_to_main(value: Any, env: DistEnv) -> list[Any] | None:
    """Every rank's `value` (a picklable object), in rank order, on rank 0; None on the other ranks."""
    if not env.is_distributed:
        return [value]
    gathered: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def broadcast_from_main(value: Any, env: DistEnv) -> Any:
    """Rank 0's `value` (a picklable object), on every rank."""
    if not env.is_distributed:
        return value
    box = [value if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_from_main(values: list[Any], env: DistEnv) -> Any:
    """`values[rank]` of rank 0's list, on each rank (the other ranks' `values` are not read)."""
    if not env.is_distributed:
        return values[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, values if env.is_main else None, src=0)
    return box[0]


def all_reduce_sum(values: list[float], env: DistEnv, device: torch.device) -> list[float]:
    if not env.is_distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()
