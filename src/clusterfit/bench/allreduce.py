"""One rank of `clusterfit bench comm`'s all-reduce sweep; started by torchrun, rank 0 prints one JSON line per size.

OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 -m clusterfit.bench.allreduce --sizes 1024,1048576
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from clusterfit.worker.dist import init_distributed, pick_device, read_dist_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes (fp32 elements x 4)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    env = read_dist_env()
    device = pick_device(env)
    init_distributed(env, device)
    for size in (int(part) for part in args.sizes.split(",")):
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(tensor)
        seconds = []
        for _ in range(args.repeats):
            dist.barrier()  # every rank starts together: the time is the collective's, not a straggler's
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        if env.is_main:
            record = {"bytes": tensor.numel() * 4, "seconds": statistics.median(seconds)}
            print(json.dumps({"kind": "allreduce", **record, "backend": dist.get_backend()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
