"""Every model family given on the command line (NAME:SIZE ...), on the ranks torchrun started: each built by the
trainer's model factory from a validated spec, wrapped by the trainer's strategy, 2 SGD steps on different data
per rank, then the same weights on every rank, exported by rank 0 as a job exports its model (safetensors with its
metadata, TorchScript) into $OUT/NAME."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from clusterfit.models import build_model
from clusterfit.spec import validate_spec
from clusterfit.worker.dist import init_distributed, pick_device, read_dist_env
from clusterfit.worker.export import export_model
from clusterfit.worker.parallel import parallelize
from clusterfit.worker.precision import make_grad_scaler, resolve_precision

CLASSES = ["a", "b", "c"]

env = read_dist_env()
device = pick_device(env)
init_distributed(env, device)
torch.set_num_threads(1)  # two ranks share this machine's cores
precision = resolve_precision("fp32", device)
for family in sys.argv[1:]:
    name, size = family.split(":")
    job = {
        "name": "every-family",
        "trainer": {
            "model": name,
            "data": {"train": "synthetic", "image_size": int(size), "num_classes": len(CLASSES)},
            "batch_size": 2,
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": env.world_size},
        "outputs": {"dir": os.environ["OUT"]},
    }
    trainer = validate_spec(job).trainer
    torch.manual_seed(0)  # the same initial weights on every rank, as the trainer seeds them

    def model_factory(trainer=trainer):  # noqa: ANN202 - what the trainer's partial(build_model, ...) is
        return build_model(trainer.model, len(CLASSES), trainer.norm_layer, trainer.data.image_size)

    model = model_factory()
    strategy = parallelize(model, trainer, env, device, torch.nn.CrossEntropyLoss(), model_factory)
    optimizer = torch.optim.SGD(strategy.module.parameters(), lr=0.01)
    scaler = make_grad_scaler(precision, device)
    generator = torch.Generator().manual_seed(env.rank)  # each rank its own batches
    for _ in range(2):
        inputs = torch.randn(2, 3, int(size), int(size), generator=generator)
        targets = torch.randint(0, len(CLASSES), (2,), generator=generator)
        loss = strategy.train_step(inputs, targets, precision, scaler)
        # NOTE: batch norm over 2 images of 1x1 maps (the last stages at these sizes) gives gradient norms up to
        # 1e17; clipped, as a job would clip them (trainer.clip_grad_norm), the steps stay finite.
        torch.nn.utils.clip_grad_norm_(strategy.module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss), f"{name}: loss {loss}"
    # Per parameter, summed in float64 without a float64 copy of the model (ViT-B/32's would be 700 MB).
    with torch.no_grad():
        mine = torch.stack(
            [
                torch.stack(
                    [p.sum(dtype=torch.float64), p.abs().sum(dtype=torch.float64), p.square().sum(dtype=torch.float64)]
                )
                for p in strategy.eval_module().parameters()
            ]
        )
    first = mine.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(mine, first), f"{name}: rank {env.rank} holds other weights than rank 0"
    if env.is_main:
        metadata = {"model": name, "norm_layer": trainer.norm_layer, "classes": CLASSES, "image_size": int(size)}
        export_model(strategy.eval_module(), Path(os.environ["OUT"]) / name, metadata=metadata, image_size=int(size))
    print(f"{name}: trained 2 steps on {env.world_size} ranks, loss {loss.item():.3f}", flush=True)
dist.barrier()
dist.destroy_process_group()
