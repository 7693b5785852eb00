"""The training loop that runs inside every worker. It reads the torch.distributed environment and the
job spec, and knows nothing of the engine that started it."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clusterfit import __version__
from clusterfit.data.folders import inspect_data
from clusterfit.data.loaders import build_train_data, build_val_loader, normalize_on_device
from clusterfit.models import build_model
from clusterfit.monitoring.sinks import open_metric_sinks
from clusterfit.spec.model import JobSpec
from clusterfit.worker.checkpoint import CheckpointStore, capture_rng, restore_rng
from clusterfit.worker.dist import DistEnv, all_reduce_sum, init_distributed, pick_device
from clusterfit.worker.evaluate import evaluate
from clusterfit.worker.export import export_model
from clusterfit.worker.manifest import CHECKPOINT_DIR
from clusterfit.worker.optim import build_optimizer, build_schedule, scaled_lr
from clusterfit.worker.precision import Precision, make_grad_scaler, resolve_precision
from clusterfit.worker.summary import write_summary

log = logging.getLogger("clusterfit.train")

MODEL_DIR = "model"


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a rerun continues from here."""

    epoch: int = 0  # 0-based epoch in progress
    step_in_epoch: int = 0  # steps of that epoch already taken
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per finished epoch


@dataclass
class IntervalMeter:
    """Loss and throughput between two log lines; losses stay on the device until the log line."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait: float = 0.0
    loss_sum: torch.Tensor | float = 0.0

    def read(self, env: DistEnv, device: torch.device, global_batch: int) -> dict[str, float]:
        elapsed = time.perf_counter() - self.started
        loss_sum = float(self.loss_sum)
        total_loss, total_steps = all_reduce_sum([loss_sum, float(self.steps)], env, device)
        return {
            "loss": total_loss / max(1.0, total_steps),
            "images_per_s": global_batch * self.steps / elapsed,
            "data_wait": self.data_wait / elapsed,
        }


def train(spec: JobSpec, env: DistEnv) -> dict[str, Any] | None:
    """Train, checkpoint, validate and export; returns the summary on the main process."""
    wall_start = time.time()
    trainer = spec.trainer
    out = Path(spec.outputs.dir)
    device = pick_device(env)
    init_distributed(env, device)
    log.info(
        "rank %d of %d (local rank %d) on %s, %d CPU threads, pid %d",
        env.rank,
        env.world_size,
        env.local_rank,
        device,
        torch.get_num_threads(),
        os.getpid(),
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    precision = resolve_precision(trainer.precision, device)
    facts = inspect_data(trainer.data)

    torch.manual_seed(trainer.seed)  # identical initial weights on every rank
    model = build_model(trainer.model, len(facts.classes), trainer.norm_layer).to(device)
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    torch.manual_seed(trainer.seed + env.rank)  # distinct augmentation streams per rank

    pin = device.type == "cuda"
    train_data = build_train_data(
        trainer, facts, rank=env.rank, world_size=env.world_size, local_world_size=env.local_world_size, pin_memory=pin
    )
    val_loader = build_val_loader(
        trainer, facts, rank=env.rank, world_size=env.world_size, local_world_size=env.local_world_size, pin_memory=pin
    )
    steps_per_epoch = train_data.steps_per_epoch
    total_steps = steps_per_epoch * trainer.epochs
    global_batch = trainer.batch_size * env.world_size
    optimizer = build_optimizer(model, trainer.optimizer, global_batch)
    scheduler = build_schedule(optimizer, trainer.schedule, steps_per_epoch, total_steps)
    scaler = make_grad_scaler(precision, device)

    store = CheckpointStore(out / CHECKPOINT_DIR, trainer.checkpoint.keep, env)
    store.clean_partial()
    progress = Progress()
    loaded = store.load_latest(device)
    if loaded is not None:
        model.load_state_dict(loaded.shared["model"])
        optimizer.load_state_dict(loaded.shared["optimizer"])
        scheduler.load_state_dict(loaded.shared["scheduler"])
        scaler.load_state_dict(loaded.shared["scaler"])
        progress = Progress(**loaded.shared["progress"])
        if loaded.own is not None:
            restore_rng(loaded.own, device)
        if progress.step_in_epoch >= steps_per_epoch:  # the spec's epoch got shorter since
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
        if env.is_main:
            log.info("resuming from %s (epoch %d, step %d)", loaded.path, progress.epoch + 1, progress.global_step)

    ddp_model: nn.Module = model
    if env.is_distributed:
        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=trainer.label_smoothing)
    sinks = open_metric_sinks(out, env.is_main)
    peak_lr = scaled_lr(trainer.optimizer, global_batch)
    if env.is_main:
        log.info(
            "%s: %s on %d worker(s), %s, %s, global batch %d, peak lr %.4g, %d steps/epoch x %d epochs",
            spec.name,
            trainer.model,
            env.world_size,
            device.type,
            precision.name,
            global_batch,
            peak_lr,
            steps_per_epoch,
            trainer.epochs,
        )
    sinks.write(
        {
            "kind": "start",
            "step": progress.global_step,
            "total_steps": total_steps,
            "steps_per_epoch": steps_per_epoch,
            "epochs": trainer.epochs,
            "world_size": env.world_size,
            "precision": precision.name,
            "device": device.type,
            "time": time.time(),
        }
    )

    def save_checkpoint() -> None:
        shared = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "progress": asdict(progress),
            "spec": spec.model_dump(mode="json"),
            "version": __version__,
        }
        info = {
            "job": spec.name,
            "model": trainer.model,
            "num_classes": len(facts.classes),
            "norm_layer": trainer.norm_layer,
            "global_step": progress.global_step,
        }
        path = store.save(progress.global_step, shared, capture_rng(device), info)
        if env.is_main:
            log.info("checkpoint %s", path)

    every = trainer.checkpoint.every_steps
    while progress.epoch < trainer.epochs:
        epoch_started, epoch_steps = time.perf_counter(), 0
        epoch_loss_sum: torch.Tensor | float = 0.0
        meter = IntervalMeter()
        ddp_model.train()
        waited = time.perf_counter()
        for images, labels in train_data.batches(progress.epoch, progress.step_in_epoch):
            meter.data_wait += time.perf_counter() - waited
            loss = train_step(
                ddp_model, images, labels, optimizer, scaler, precision, loss_fn, device, trainer.channels_last
            )
            scheduler.step()
            meter.loss_sum = meter.loss_sum + loss
            epoch_loss_sum = epoch_loss_sum + loss
            meter.steps += 1
            epoch_steps += 1
            progress.step_in_epoch += 1
            progress.global_step += 1
            end_of_epoch = progress.step_in_epoch == steps_per_epoch
            if progress.global_step % trainer.log_every_steps == 0 or end_of_epoch:
                record = {
                    "kind": "train",
                    "step": progress.global_step,
                    "epoch": progress.epoch + 1,
                    "total_steps": total_steps,
                    "lr": scheduler.get_last_lr()[0],
                    "time": time.time(),
                    **meter.read(env, device, global_batch),
                }
                sinks.write(record)
                if env.is_main:
                    log.info(
                        "epoch %d/%d step %d/%d loss %.4f lr %.4g %.1f images/s (data wait %.0f%%)",
                        progress.epoch + 1,
                        trainer.epochs,
                        progress.global_step,
                        total_steps,
                        record["loss"],
                        record["lr"],
                        record["images_per_s"],
                        100 * record["data_wait"],
                    )
                meter = IntervalMeter()
            # The epoch's last step is checkpointed below, after validation.
            if every and progress.global_step % every == 0 and not end_of_epoch:
                save_checkpoint()
            waited = time.perf_counter()

        epoch_seconds = time.perf_counter() - epoch_started
        loss_total, loss_count = all_reduce_sum([float(epoch_loss_sum), float(epoch_steps)], env, device)
        epoch_record: dict[str, Any] = {
            "epoch": progress.epoch + 1,
            "step": progress.global_step,
            "images_per_s": global_batch * epoch_steps / max(epoch_seconds, 1e-9),
            "train_loss": loss_total / max(loss_count, 1.0),
        }
        if val_loader is not None:
            metrics = evaluate(model, val_loader, device, precision, trainer.channels_last, env)
            epoch_record.update({f"val_{key}": value for key, value in metrics.items()})
            sinks.write({"kind": "val", "step": progress.global_step, "epoch": progress.epoch + 1, **metrics})
            if env.is_main:
                log.info(
                    "epoch %d validation: top1 %.4f top5 %.4f loss %.4f on %d images",
                    progress.epoch + 1,
                    metrics["top1"],
                    metrics["top5"],
                    metrics["loss"],
                    metrics["images"],
                )
        progress.history.append(epoch_record)
        progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
        save_checkpoint()

    summary = None
    if env.is_main:
        metadata = {
            "model": trainer.model,
            "norm_layer": trainer.norm_layer,
            "classes": facts.classes,
            "image_size": trainer.data.image_size,
            "clusterfit_version": __version__,
            "job": spec.name,
            "global_step": progress.global_step,
        }
        exported = export_model(model, out / MODEL_DIR, metadata=metadata, image_size=trainer.data.image_size)
        summary = write_summary(
            out,
            spec=spec,
            progress_history=progress.history,
            exported=exported,
            wall_seconds=time.time() - wall_start,
            world_size=env.world_size,
            precision=precision.name,
            device=device.type,
            global_batch=global_batch,
            peak_lr=peak_lr,
            steps=progress.global_step,
            resumed_from=str(loaded.path) if loaded else None,
        )
        log.info("exported %s", ", ".join(str(p) for p in exported))
    sinks.write({"kind": "end", "step": progress.global_step, "time": time.time()})
    sinks.close()
    return summary


def train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    loss_fn: nn.Module,
    device: torch.device,
    channels_last: bool,
) -> torch.Tensor:
    inputs = normalize_on_device(images, device, channels_last)
    targets = labels.to(device, non_blocking=True)
    with precision.autocast(device):
        loss = loss_fn(model(inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()
