"""The Ray Train baseline: the hand-written loop of ddp_loop.py (the same function) run by Ray Train's
TorchTrainer on a local Ray instance this script starts and stops (or on a running cluster: `--address`).
Ray sets up the gloo/NCCL process group, `ray.train.torch.prepare_model` wraps the model in DDP, and each
worker gets cores / workers CPUs and as many torch threads. Prints the same JSON lines as ddp_loop.py: one per
step with rank 0's wall time.

    python -m clusterfit.bench.baselines.ray_loop --workers 2 --model resnet50 --image-size 64 --batch 16 --steps 20

Needs `pip install 'ray[train]==2.60.0'` (clusterfit's `ray` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

OBJECT_STORE_BYTES = 256 * 2**20  # the loop passes no data through Ray; Ray's default would reserve GiBs


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Runs in every Ray Train worker process; rank 0's return value comes back to `fit()`'s caller."""
    import ray.train.torch
    import torch

    from clusterfit.bench.baselines.ddp_loop import parse_args, train_steps

    torch.set_num_threads(config["threads"])
    seconds: list[float] = []
    train_steps(
        parse_args(config["loop_args"]),
        ray.train.torch.get_device(),
        ray.train.torch.prepare_model,
        lambda step, elapsed: seconds.append(elapsed),
    )
    return {"step_seconds": seconds, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--address", help="a running Ray cluster to join (host:port or auto)")
    args, loop_args = parser.parse_known_args()

    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // args.workers)
    use_gpu = torch.cuda.is_available()
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        # NOTE: address="local" always starts a fresh instance, never joins a cluster someone else started here.
        ray.init(
            address="local",
            num_cpus=cores,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        with tempfile.TemporaryDirectory(prefix="ray-baseline-") as storage:
            trainer = TorchTrainer(
                train_func,
                train_loop_config={"loop_args": loop_args, "threads": threads},
                scaling_config=ScalingConfig(
                    num_workers=args.workers, use_gpu=use_gpu, resources_per_worker={"CPU": threads}
                ),
                run_config=RunConfig(storage_path=storage, name="ray-baseline"),
            )
            result = trainer.fit()
    finally:
        ray.shutdown()
    if result.error is not None:
        raise SystemExit(f"Ray Train failed: {result.error}")
    start = {"kind": "start", "world_size": args.workers, "threads": result.return_value["threads"]}
    print(json.dumps(start), flush=True)
    for step, seconds in enumerate(result.return_value["step_seconds"], start=1):
        print(json.dumps({"kind": "step", "step": step, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
