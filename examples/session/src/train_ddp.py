"""Your own PyTorch DDP training script under clusterfit: its own small model and data, reported, checkpointed
and resumed through clusterfit.session. Runs as a command job on any engine (see ../job.yaml).

`--model keras` trains a Keras 3 model instead, on Keras's torch backend: such a model is a torch.nn.Module, so
the same DDP loop, optimizer and checkpoint helper train it (Keras's own recipe for several processes on torch;
its `fit` does not wrap the model in DDP, so each process would train alone)."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import clusterfit.session as cf
from clusterfit.session import torch as cf_torch


def make_data(seed: int, count: int = 4096, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy linear problem with two classes: the same on every rank, from the seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count, features, generator=generator)
    labels = (inputs @ torch.randn(features, generator=generator) > 0).long()
    return inputs, labels


def make_model(kind: str) -> nn.Module:
    if kind == "torch":
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    if os.environ.setdefault("KERAS_BACKEND", "torch") != "torch":
        raise SystemExit(f"--model keras runs on Keras's torch backend; KERAS_BACKEND is {os.environ['KERAS_BACKEND']}")
    import keras

    keras.utils.set_random_seed(0)  # Keras draws its initial weights from its own generator
    # Named layers: a checkpoint's keys are the layers' names, which Keras would otherwise number per process.
    layers = [keras.layers.Dense(32, activation="relu", name="hidden"), keras.layers.Dense(2, name="logits")]
    return keras.Sequential([keras.Input((16,)), *layers], name="classifier")


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--model", choices=["torch", "keras"], default="torch")
    parser.add_argument("--kill-at", type=int, default=-1, help="rank 1 kills itself here on attempt 1 (a demo)")
    args = parser.parse_args()

    ctx = cf.context()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(args.model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = make_data(seed=1)
    start = cf_torch.restore({"model": model, "optimizer": optimizer})
    if start:
        print(f"resumed at step {start} (attempt {ctx.attempt})", flush=True)

    for step in range(start, args.steps):
        began = time.perf_counter()
        # Each rank takes its own slice of a batch chosen by the step: a resumed run sees the same batches.
        rows = torch.arange(args.batch_size) + (step * ctx.world_size + ctx.rank) * args.batch_size
        batch = rows % len(inputs)
        loss = nn.functional.cross_entropy(model(inputs[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rate = args.batch_size * ctx.world_size / (time.perf_counter() - began)
        cf.report(step=step, total_steps=args.steps, loss=loss.item(), images_per_s=rate)
        if ctx.rank == 1 and step == args.kill_at and ctx.attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        stop = cf.should_stop()
        if (step + 1) % args.checkpoint_every == 0 or stop:
            cf_torch.save(step, {"model": model, "optimizer": optimizer})
        if stop:
            print(f"stopping at step {step}; the job resumes from its checkpoint", flush=True)
            break
    print(f"weights {weights_digest(model)}", flush=True)  # the same on every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
