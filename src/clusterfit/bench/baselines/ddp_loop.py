"""The hand-written baseline: the minimal torchrun + DDP training loop a user would write for a throughput test.

A torchvision model, one batch of random tensors reused every step, cross-entropy, SGD with momentum, DDP over
gloo (CPU) or NCCL (CUDA), channels_last and the autocast dtype it is given (`clusterfit bench train` resolves
`--precision auto` once and gives every system the same dtype). Rank 0 prints one JSON line per step with its
wall time; every rank runs with the OMP_NUM_THREADS its launcher set (cores / ranks).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 -m clusterfit.bench.baselines.ddp_loop \
        --model resnet50 --image-size 64 --batch 16 --steps 20

`clusterfit bench train` runs it side by side with clusterfit's trainer. With `--no-comm` every rank trains its
own replica with no DDP wrapper: the same per-rank work on the same shared cores without any communication,
which is the compute part of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    if name == "resnet_tiny":  # clusterfit's test model: one BasicBlock per stage
        from torchvision.models.resnet import BasicBlock, ResNet

        return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--precision", default="fp32", choices=list(AUTOCAST_DTYPES), help="fp16 needs a GPU")
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--no-comm", dest="communicate", action="store_false", help="no DDP: compute only")
    return parser.parse_args(argv)


def train_steps(
    args: argparse.Namespace,
    device: torch.device,
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    on_step: Callable[[int, float], None],
) -> None:
    """The measured loop, shared with the Ray Train baseline: `wrap` makes the model data-parallel."""
    autocast_dtype = AUTOCAST_DTYPES[args.precision]
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes).to(device, memory_format=memory_format)
    if args.communicate:
        model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 gradients underflow
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, args.num_classes, (args.batch,), device=device)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        on_step(step, time.perf_counter() - started)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if rank == 0:
        start = {"kind": "start", "world_size": dist.get_world_size(), "threads": torch.get_num_threads()}
        print(json.dumps(start), flush=True)

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        return DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)

    def on_step(step: int, seconds: float) -> None:
        if rank == 0:
            print(json.dumps({"kind": "step", "step": step, "seconds": seconds}), flush=True)

    train_steps(args, device, wrap, on_step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
