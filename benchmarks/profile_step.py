"""Where one ResNet training step spends its CPU time: torch.profiler over clusterfit's own step (its model,
optimizer, autocast and channels_last), operators grouped into kinds, and each kind's share of the step.

    python benchmarks/profile_step.py --model resnet50 --image-size 64 --batch 16 --precision bf16 --threads 2

After the profiled steps the same number of steps runs without the profiler: their wall time, the kernel's CPU
time and the page faults per step (glibc's malloc settings, `MALLOC_MMAP_THRESHOLD_` and the like, change the
last two). The matmul-like work (convolutions and the final linear layer) is what AMX accelerates; everything else
(normalisation, activations, pooling, dtype casts, the optimizer) is memory-bound. Prints a markdown table and
the top operators; `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from clusterfit.models import build_model
from clusterfit.spec.model import OptimizerSpec
from clusterfit.worker.optim import build_optimizer
from clusterfit.worker.precision import resolve_precision

# Operator name fragments -> kind; the first match wins, so more specific fragments come first.
KINDS = (
    ("convolution", ("convolution", "conv2d", "mkldnn_conv")),
    ("linear (fc)", ("addmm", "aten::mm", "aten::linear", "aten::matmul")),
    ("batch norm", ("batch_norm",)),
    ("relu", ("relu", "threshold_backward")),
    ("pooling", ("pool",)),
    ("dtype casts and copies", ("aten::to", "aten::copy_", "_to_copy", "clone", "contiguous")),
    ("optimizer", ("_foreach", "sgd", "adamw", "aten::add_", "aten::mul_", "aten::lerp")),
    ("gradient accumulation", ("aten::add", "aten::sum")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument(
        "--optimizer",
        default="clusterfit",
        choices=["clusterfit", "torch-default"],
        help="clusterfit's optimizer (fused kernel) or torch.optim.SGD with its defaults (a loop on the CPU)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cpu")
    precision = resolve_precision(args.precision, device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = build_model(args.model, 1000, "batch").to(memory_format=memory_format)
    if args.optimizer == "clusterfit":
        optimizer = build_optimizer(model, OptimizerSpec(), global_batch=args.batch)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, args.image_size, args.image_size).contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (args.batch,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(device):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()

    # The same steps again without the profiler: wall time, and the kernel's share (page faults among it).
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.steps):
        step()
    wall_ms = (time.perf_counter() - started) * 1000 / args.steps
    after = resource.getrusage(resource.RUSAGE_SELF)
    kernel_ms = (after.ru_stime - before.ru_stime) * 1000 / args.steps
    faults = (after.ru_minflt - before.ru_minflt) / args.steps

    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    by_kind: dict[str, float] = defaultdict(float)
    for event in events:
        by_kind[kind_of(event.key)] += event.self_cpu_time_total
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]

    print(
        f"{args.model}, {args.image_size} px, batch {args.batch}, {precision.name}, channels_last "
        f"{args.channels_last}, {args.optimizer} optimizer, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; "
        f"{args.steps} profiled steps, {total_us / args.steps / 1000:.0f} ms of operator time per step; "
        f"unprofiled: {wall_ms:.0f} ms per step, {kernel_ms:.0f} ms of kernel time and {faults:.0f} page faults"
    )
    print("\n| kind | ms per step | share |\n|---|---:|---:|")
    for kind, us in sorted(by_kind.items(), key=lambda item: item[1], reverse=True):
        print(f"| {kind} | {us / args.steps / 1000:.1f} | {us / total_us:.0%} |")
    print("\n| operator | calls per step | ms per step | share |\n|---|---:|---:|---:|")
    for event in top:
        print(
            f"| {event.key} | {event.count / args.steps:.0f} | {event.self_cpu_time_total / args.steps / 1000:.1f} "
            f"| {event.self_cpu_time_total / total_us:.0%} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "threads": torch.get_num_threads(),
                    "ms_per_step": total_us / args.steps / 1000,
                    "unprofiled": {"wall_ms": wall_ms, "kernel_ms": kernel_ms, "page_faults": faults},
                    "kinds": {k: v / args.steps / 1000 for k, v in by_kind.items()},
                    "top": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1000} for e in top],
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
