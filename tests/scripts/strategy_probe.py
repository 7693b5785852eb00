"""Run under torchrun (2 ranks, gloo). Drives clusterfit's `parallelize` step directly to look inside the
ranks, which the CLI cannot: `localsgd` checks when parameters agree across ranks, `compression` checks
that compressed gradients train like exact ones. Runs each check named on the command line in one process
group (one torchrun, not one per check); exits non-zero with the first failing check's message."""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from clusterfit.models import build_model
from clusterfit.spec.model import TrainerSpec
from clusterfit.worker.dist import init_distributed, read_dist_env
from clusterfit.worker.parallel import parallelize
from clusterfit.worker.precision import resolve_precision

CPU = torch.device("cpu")


def train(spec: TrainerSpec, steps: int, on_step=None) -> torch.Tensor:
    env = read_dist_env()
    factory = partial(build_model, "resnet_tiny", 10, "group")
    torch.manual_seed(0)
    model = factory()
    loss_fn = nn.CrossEntropyLoss()
    strategy = parallelize(model, spec, env, CPU, loss_fn, factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    precision = resolve_precision("fp32", CPU)
    data = torch.Generator().manual_seed(100 + env.rank)  # each rank its own data, so ranks can diverge
    for step in range(steps):
        images = torch.randn(4, 3, 32, 32, generator=data)
        labels = torch.randint(0, 10, (4,), generator=data)
        optimizer.zero_grad()
        strategy.train_step(images, labels, precision, scaler)
        scaler.step(optimizer)
        strategy.after_optimizer_step()
        if on_step:
            on_step(step, model)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def ranks_agree(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def check_localsgd() -> None:
    warmup, period = 2, 3
    spec = TrainerSpec(strategy="localsgd", strategy_options={"sync_every": period, "warmup_steps": warmup})
    seen = []

    def record(step: int, model: nn.Module) -> None:
        averaged = step >= warmup and (step - warmup) % period == 0
        seen.append((step, step < warmup or averaged, ranks_agree(model)))

    train(spec, steps=9, on_step=record)
    wrong = [(step, expected, agree) for step, expected, agree in seen if expected != agree]
    if wrong:
        sys.exit(f"localsgd: (step, expected agreement, agreement) mismatches: {wrong}")


def check_compression() -> None:
    exact = train(TrainerSpec(), steps=6)
    for kind, tolerance in (("fp16", 1e-3), ("bf16", 2e-2)):
        compressed = train(TrainerSpec(grad_compression=kind), steps=6)
        error = ((compressed - exact).norm() / exact.norm()).item()
        if not error < tolerance:
            sys.exit(f"{kind} compression: relative weight error {error:.2e} >= {tolerance}")
        if dist.get_rank() == 0:
            print(f"{kind}: relative weight error {error:.2e}")
    powersgd = train(TrainerSpec(grad_compression="powersgd"), steps=14)  # exact for 10 steps, then rank 4
    if not torch.isfinite(powersgd).all():
        sys.exit("powersgd produced non-finite weights")
    # Repeatable first (PowerSGD seeds its own random matrices), so that a difference below is the rank's.
    if not torch.equal(train(TrainerSpec(grad_compression="powersgd"), steps=14), powersgd):
        sys.exit("powersgd trained other weights when run again: the rank comparison below would prove nothing")
    rank_one = train(TrainerSpec(grad_compression="powersgd", powersgd_rank=1), steps=14)
    if torch.equal(rank_one, powersgd):
        sys.exit("powersgd_rank 1 trained the same weights as rank 4: the setting never reached the hook")


if __name__ == "__main__":
    init_distributed(read_dist_env(), CPU)
    checks = {"localsgd": check_localsgd, "compression": check_compression}
    for name in sys.argv[1:]:
        checks[name]()
    dist.destroy_process_group()
