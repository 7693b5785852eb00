"""The training loop that runs inside every worker. It reads the torch.distributed environment and the
job spec, and knows nothing of the engine that started it."""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from clusterfit import __version__
from clusterfit.data.batch_mix import batch_mix
from clusterfit.data.folders import inspect_data
from clusterfit.data.loaders import build_train_data, build_val_loader, normalize_on_device, val_preprocessing
from clusterfit.data.quality import InputTally, describe
from clusterfit.files import write_atomically
from clusterfit.models import build_model, load_weights
from clusterfit.models.starting_weights import StartingWeights, backbone_parameters, load_starting_weights
from clusterfit.monitoring.sinks import open_metric_sinks
from clusterfit.outputs import JobOutputs, Phase, RecordKind, write_summary
from clusterfit.outputs.confusion import confusion_facts, write_confusion_png
from clusterfit.outputs.model_card import ModelCard, spec_hash, write_model_card
from clusterfit.spec.model import JobSpec
from clusterfit.worker.checkpoint import CheckpointStore, capture_rng, restore_rng
from clusterfit.worker.dist import DistEnv, all_reduce_sum, init_distributed, pick_device
from clusterfit.worker.ema import WeightAverage
from clusterfit.worker.evaluate import evaluate
from clusterfit.worker.export import export_model
from clusterfit.worker.faults import fault_from_env
from clusterfit.worker.heartbeat import Heartbeat
from clusterfit.worker.inputs import InputWatch, take_reads
from clusterfit.worker.optim import build_optimizer, build_schedule, match_kernel_to_parameters, scaled_lr
from clusterfit.worker.parallel import Accumulation, Strategy, parallelize
from clusterfit.worker.precision import Precision, make_grad_scaler, resolve_precision
from clusterfit.worker.stop_signal import StoppedForRequeue, StopRequest
from clusterfit.worker.stopping import EarlyStop, best_record, early_stop, is_new_best

log = logging.getLogger("clusterfit.train")


def describe_cadence(every_steps: int | None, min_interval_s: float) -> str:
    """When a job checkpoints, as its log says at the start."""
    steps = f"every {every_steps} steps, " if every_steps else ""
    if min_interval_s == 0:
        return f"{steps}at every epoch's end"
    return (
        f"{steps}at an epoch's end once {min_interval_s:g} s have passed since the last one "
        "(checkpoint.min_interval_s), and at the last epoch"
    )


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a rerun continues from here."""

    epoch: int = 0  # 0-based epoch in progress
    step_in_epoch: int = 0  # steps of that epoch already taken
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per finished epoch
    inputs: dict[str, Any] = field(default_factory=dict)  # InputTally: unreadable files skipped so far
    elapsed_s: float = 0.0  # job time of the runs before this one, up to their last checkpoint


@dataclass
class LossMeter:
    """Loss, steps and data wait since `started`; losses stay on the device until read (no sync per step)."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait: float = 0.0
    loss_sum: torch.Tensor | float = 0.0
    losses: int = 0  # steps with a loss on this rank (inner pipeline stages have none)

    def add(self, loss: torch.Tensor | None, data_wait: float) -> None:
        if loss is not None:
            self.loss_sum = self.loss_sum + loss
            self.losses += 1
        self.steps += 1
        self.data_wait += data_wait

    def read(self, env: DistEnv, device: torch.device, global_batch: int) -> dict[str, float]:
        """Collective: the loss is averaged over every rank."""
        return self.summary(*all_reduce_sum(self.local_loss(), env, device), global_batch)

    def local_loss(self) -> list[float]:
        """[sum of this rank's losses, their count], to be summed over every rank for `summary`."""
        return [float(self.loss_sum), float(self.losses)]

    def summary(self, total_loss: float, total_losses: float, global_batch: int) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "loss": total_loss / max(1.0, total_losses),
            "images_per_s": global_batch * self.steps / elapsed,
            "data_wait": self.data_wait / elapsed,
        }


def train(spec: JobSpec, env: DistEnv) -> dict[str, Any] | None:
    """Train, checkpoint, validate and export; returns the summary on the main process."""
    return Trainer(spec, env).run()


class Trainer:
    """Builds every component from the spec once, then runs epochs; all state worth keeping is in `progress`."""

    def __init__(self, spec: JobSpec, env: DistEnv) -> None:
        self.started = time.time()
        self.spec, self.env, self.cfg = spec, env, spec.trainer
        self.out = JobOutputs.at(spec.outputs.dir)
        self.device = pick_device(env)
        init_distributed(env, self.device, spec.limits.collective_timeout)
        log.info(
            "rank %d of %d (local rank %d) on %s, %d CPU threads, pid %d",
            env.rank,
            env.world_size,
            env.local_rank,
            self.device,
            torch.get_num_threads(),
            os.getpid(),
        )
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        self.precision: Precision = resolve_precision(self.cfg.precision, self.device)
        self.facts = inspect_data(self.cfg.data, spec.storage)

        self.model_factory = partial(
            build_model, self.cfg.model, len(self.facts.classes), self.cfg.norm_layer, self.cfg.data.image_size
        )
        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank
        model = self.model_factory()
        self.starting_weights: StartingWeights | None = None
        if self.cfg.init is not None:  # a resumed job then loads its checkpoint over these
            self.starting_weights = load_starting_weights(model, self.cfg.init.weights)
            if env.is_main:
                log.info("%s", self.starting_weights.describe())
        model = model.to(self.device)
        if self.cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=self.cfg.label_smoothing)
        self.strategy: Strategy = parallelize(model, self.cfg, env, self.device, self.loss_fn, self.model_factory)
        torch.manual_seed(self.cfg.seed + env.rank)  # distinct augmentation streams per rank
        freeze_epochs = self.cfg.init.freeze_backbone_epochs if self.cfg.init else 0
        self.frozen_until_epoch = freeze_epochs
        self.backbone = backbone_parameters(self.strategy.module) if freeze_epochs else []

        loader_args = {
            "rank": self.strategy.data_rank,
            "world_size": self.strategy.data_world,
            "local_world_size": env.local_world_size,
            "pin_memory": self.device.type == "cuda",
            "storage": spec.storage,
        }
        self.train_data = build_train_data(self.cfg, self.facts, **loader_args)
        augment = self.cfg.resolved_augment()
        if self.env.is_main and not self.cfg.data.is_synthetic:
            log.info("%s", augment.describe())
        self.mix = batch_mix(augment, len(self.facts.classes))
        self.val_loader = build_val_loader(self.cfg, self.facts, **loader_args)
        self.steps_per_epoch = self.train_data.steps_per_epoch // self.cfg.accumulate_steps  # optimizer steps
        self.total_steps = self.steps_per_epoch * self.cfg.epochs
        self.global_batch = self.cfg.batch_size * self.strategy.data_world * self.cfg.accumulate_steps
        self.peak_lr = scaled_lr(self.cfg.optimizer, self.global_batch)
        self.optimizer = build_optimizer(self.strategy.module, self.cfg.optimizer, self.global_batch)
        self.scheduler = build_schedule(self.optimizer, self.cfg.schedule, self.steps_per_epoch, self.total_steps)
        self.scaler = make_grad_scaler(self.precision, self.device)

        self.store = CheckpointStore(
            self.out.checkpoints, self.cfg.checkpoint.keep, env, async_save=self.cfg.checkpoint.async_save
        )
        self.ema = WeightAverage(self.strategy.module, self.cfg.ema, self.device) if self.cfg.ema else None
        self.progress = Progress()
        self.last_confusion: list[list[int]] | None = None  # of this run's last validation
        self.best_kept_at: int | None = None  # the epoch whose validated weights are the best kept so far
        self.resumed_from = self._restore()
        self.last_checkpoint_at = time.monotonic()  # or the start: the interval between epoch-end checkpoints
        self.elapsed_before = self.progress.elapsed_s
        # A rerun of a job that already stopped early must not train on.
        self.stopped_early: EarlyStop | None = early_stop(
            self.progress.history, self.cfg.stop_at, self.cfg.early_stopping
        )
        self.inputs = InputWatch(
            InputTally.from_dict(self.progress.inputs),
            samples_per_epoch=self.steps_per_epoch * self.global_batch,
            max_bad_fraction=self.cfg.data.max_bad_fraction,
            env=env,
            device=self.device,
        )
        self.sinks = open_metric_sinks(self.out, env.is_main)
        self.stop_request = StopRequest()
        self.heartbeat = Heartbeat(self.out, env.rank, spec.limits.hang_timeout, self.cfg.batch_size)
        self.fault = fault_from_env()

    def run(self) -> dict[str, Any] | None:
        cfg, progress = self.cfg, self.progress
        if self.env.is_main:
            log.info(
                "%s: %s on %d worker(s) (%s), %s, %s, global batch %d, peak lr %.4g, %d steps/epoch x %d epochs",
                self.spec.name,
                cfg.model,
                self.env.world_size,
                self.strategy.name,
                self.device.type,
                self.precision.name,
                self.global_batch,
                self.peak_lr,
                self.steps_per_epoch,
                cfg.epochs,
            )
            log.info("checkpoints: %s", describe_cadence(cfg.checkpoint.every_steps, cfg.checkpoint.min_interval_s))
        self.sinks.write(
            {
                "kind": RecordKind.START,
                "step": progress.global_step,
                "total_steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch,
                "epochs": cfg.epochs,
                "world_size": self.env.world_size,
                "nodes": self.env.nodes,
                "precision": self.precision.name,
                "device": self.device.type,
                "time": time.time(),
            }
        )
        try:
            while progress.epoch < cfg.epochs and self.stopped_early is None:
                record = self._train_epoch()
                if self.val_loader is not None and self._validates_after(progress.epoch):
                    self.heartbeat.beat(Phase.VALIDATING, progress.global_step, force=True)
                    record.update(self._validate())
                record["elapsed_s"] = round(self._elapsed(), 3)
                progress.history.append(record)
                progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
                self.stopped_early = early_stop(progress.history, cfg.stop_at, cfg.early_stopping)
                if progress.epoch == cfg.epochs or self.stopped_early is not None or self._epoch_checkpoint_due():
                    self._save_checkpoint()
                if self.stopped_early is not None and self.env.is_main:
                    log.info("stopping early: %s", self.stopped_early.describe())
        except StoppedForRequeue:
            self.store.wait()  # the stop's checkpoint must be published before the process ends
            if self.env.is_main:
                log.info("stopped at step %d on request; a rerun resumes from its checkpoint", progress.global_step)
            self.sinks.close()
            return None
        self.store.wait()  # the last checkpoint is published before the model is exported
        self.heartbeat.beat(Phase.EXPORTING, progress.global_step, force=True)
        peak_memory = self._peak_memory_per_rank()  # measured before export adds its own copies
        full = self.strategy.full_state(self.optimizer)  # collective
        if full is not None and self.ema is not None:
            full = ({name: t.detach().cpu() for name, t in self.ema.module.state_dict().items()}, full[1])
        summary = self._export(full[0], peak_memory) if full is not None else None
        self.sinks.write({"kind": RecordKind.END, "step": progress.global_step, "time": time.time()})
        self.sinks.close()
        self.heartbeat.beat(Phase.DONE, progress.global_step, force=True)
        return summary

    def _train_epoch(self) -> dict[str, Any]:
        progress, every, batches_per_step = self.progress, self.cfg.checkpoint.every_steps, self.cfg.accumulate_steps
        epoch_meter, interval = LossMeter(), LossMeter()
        self.strategy.module.train()
        losses: list[torch.Tensor] = []  # of the optimizer step's batches so far (none on inner pipeline stages)
        batches = 0  # of the optimizer step so far
        data_wait = 0.0
        waited_since = time.perf_counter()
        first_batch = progress.step_in_epoch * batches_per_step
        for images, labels in self.train_data.batches(progress.epoch, first_batch):
            data_wait += time.perf_counter() - waited_since
            inputs = normalize_on_device(images, self.device, self.cfg.channels_last)
            targets = labels.to(self.device, non_blocking=True)
            if self.mix is not None:
                inputs, targets = self.mix(inputs, targets)
            batch_loss = self.strategy.train_step(
                inputs,
                targets,
                self.precision,
                self.scaler,
                Accumulation(batches_per_step, last=batches == batches_per_step - 1),
            )
            batches += 1
            if batch_loss is not None:
                losses.append(batch_loss)
            if batches < batches_per_step:
                waited_since = time.perf_counter()
                continue
            loss = torch.stack(losses).mean() if losses else None
            losses, batches = [], 0
            self._optimizer_step()
            epoch_meter.add(loss, data_wait)
            interval.add(loss, data_wait)
            data_wait = 0.0
            progress.step_in_epoch += 1
            progress.global_step += 1
            self.heartbeat.beat(Phase.TRAINING, progress.global_step)
            if self.fault:
                self.fault.trigger(self.env.rank, progress.global_step)
            end_of_epoch = progress.step_in_epoch == self.steps_per_epoch
            if progress.global_step % self.cfg.log_every_steps == 0 or end_of_epoch:
                stop = self._log_interval(interval)
                interval = LossMeter()
                # Agreed at log steps only (a collective every step would stall GPUs for one flag), and acted on
                # before an epoch's end only: run() checkpoints that after validation.
                if stop and not end_of_epoch:
                    self._save_checkpoint()
                    raise StoppedForRequeue
            # The epoch's last step is checkpointed by run(), after validation.
            if every and progress.global_step % every == 0 and not end_of_epoch:
                self._save_checkpoint()
            waited_since = time.perf_counter()
        totals = epoch_meter.read(self.env, self.device, self.global_batch)
        return {
            "epoch": progress.epoch + 1,
            "step": progress.global_step,
            "images_per_s": totals["images_per_s"],
            "train_loss": totals["loss"],
        }

    def _optimizer_step(self) -> None:
        """From the gradients of the step's batches to new weights (and their average)."""
        if self.progress.epoch < self.frozen_until_epoch:
            # Without a gradient, the optimizer leaves a parameter alone (no weight decay, no momentum);
            # requires_grad stays on, which DDP's buckets need.
            for parameter in self.backbone:
                parameter.grad = None
        if self.cfg.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the fp16 loss-scaled ones
            nn.utils.clip_grad_norm_(self.strategy.module.parameters(), self.cfg.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.strategy.after_optimizer_step()  # local SGD's averager picks the parameters that have gradients
        self.optimizer.zero_grad(set_to_none=True)  # so the next step's batches add up from zero
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.strategy.module, self.progress.global_step + 1)

    def _epoch_checkpoint_due(self) -> bool:
        """Collective: whether this epoch's end is checkpointed. Rank 0's clock decides for every rank (a save
        is collective): seconds-long epochs would otherwise stand still for a checkpoint after each one.
        An epoch whose weights were kept as the best is always saved: a rerun from an older checkpoint would
        otherwise hold a best-weights file that its history does not name."""
        every = self.cfg.checkpoint.every_steps
        if (
            self.cfg.checkpoint.min_interval_s == 0
            or every
            and self.progress.global_step % every == 0
            or self.best_kept_at == self.progress.epoch
        ):
            return True
        waited = time.monotonic() - self.last_checkpoint_at
        due = self.env.is_main and waited >= self.cfg.checkpoint.min_interval_s
        return all_reduce_sum([float(due)], self.env, self.device)[0] > 0

    def _validates_after(self, epoch: int) -> bool:
        """Whether the 0-based `epoch` ends with a validation: every Nth epoch and the last one."""
        return (epoch + 1) % self.cfg.validate_every_epochs == 0 or epoch + 1 == self.cfg.epochs

    def _elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def _sync_inputs(self) -> None:
        """Collective: merge every rank's skipped files; stops the job when there are too many."""
        self.inputs.sync([self.train_data, self.val_loader])
        self.progress.inputs = self.inputs.tally.to_dict()

    def _log_interval(self, interval: LossMeter) -> bool:
        """Collective, in one all-reduce: the interval's loss over every rank, the skipped input files merged
        and whether any rank was asked to stop (Slurm's signal before the time limit, which reaches the ranks at
        different steps); writes the train record. Returns whether every rank stops here. Three all-reduces,
        each a synchronisation with the device on GPUs, were one."""
        mine = take_reads([self.train_data, self.val_loader])
        stop = 1.0 if self.stop_request.received else 0.0
        totals = all_reduce_sum(
            [*interval.local_loss(), float(mine[0]), float(len(mine[1])), stop], self.env, self.device
        )
        total_loss, total_losses, total_reads, total_bad, stops = totals
        self.inputs.merge(mine, total_reads, total_bad)
        self.progress.inputs = self.inputs.tally.to_dict()
        progress = self.progress
        record = {
            "kind": RecordKind.TRAIN,
            "step": progress.global_step,
            "epoch": progress.epoch + 1,
            "total_steps": self.total_steps,
            "lr": self.scheduler.get_last_lr()[0],
            "time": time.time(),
            **interval.summary(total_loss, total_losses, self.global_batch),
        }
        self.sinks.write(record)
        if self.env.is_main:
            log.info(
                "epoch %d/%d step %d/%d loss %.4f lr %.4g %.1f images/s (data wait %.0f%%)",
                progress.epoch + 1,
                self.cfg.epochs,
                progress.global_step,
                self.total_steps,
                record["loss"],
                record["lr"],
                record["images_per_s"],
                100 * record["data_wait"],
            )
        return stops > 0

    def _validate(self) -> dict[str, Any]:
        assert self.val_loader is not None
        epoch = self.progress.epoch + 1
        model = self.ema.module if self.ema is not None else self.strategy.eval_module()
        evaluation = evaluate(
            model,
            self.val_loader,
            self.device,
            self.precision,
            self.cfg.channels_last,
            self.env,
            len(self.facts.classes),
        )
        self.last_confusion = evaluation.confusion
        metrics = evaluation.metrics
        self._keep_if_best(model, {f"val_{key}": value for key, value in metrics.items()})
        self.sinks.write({"kind": RecordKind.VAL, "step": self.progress.global_step, "epoch": epoch, **metrics})
        if self.env.is_main:
            log.info(
                "epoch %d validation: top1 %.4f top5 %.4f loss %.4f on %d images",
                epoch,
                metrics["top1"],
                metrics["top5"],
                metrics["loss"],
                metrics["images"],
            )
        return {f"val_{key}": value for key, value in metrics.items()}

    def _keep_if_best(self, model: nn.Module, record: dict[str, Any]) -> None:
        """With `export_weights: best`, write the validated weights when they beat every earlier validation;
        the decision comes from the history, so a resumed job keeps the same file."""
        metric = self.cfg.best_metric
        if self.cfg.export_weights != "best" or not is_new_best(self.progress.history, metric, record[metric]):
            return
        self.best_kept_at = self.progress.epoch + 1  # every rank: this epoch's end is checkpointed (see run())
        if self.env.is_main:
            state = {name: t.detach().float().cpu().contiguous() for name, t in model.state_dict().items()}
            epoch = str(self.progress.epoch + 1)
            write_atomically(self.out.best_weights, save(state, metadata={"epoch": epoch, metric: str(record[metric])}))
            log.info("best %s so far (%.4f): weights kept in %s", metric, record[metric], self.out.best_weights)

    def _restore(self) -> Path | None:
        self.store.clean_partial()
        loaded = self.store.load_latest(self.device)
        if loaded is None:
            return None
        self.progress = Progress(**loaded.shared["progress"])
        self.strategy.load_full_state(
            self.optimizer, loaded.shared["model"], loaded.shared["optimizer"], self.progress.global_step
        )
        match_kernel_to_parameters(self.optimizer)
        self.scheduler.load_state_dict(loaded.shared["scheduler"])
        self.scaler.load_state_dict(loaded.shared["scaler"])
        if self.ema is not None and "ema" in loaded.shared:  # absent when ema was switched on since
            self.ema.load_state_dict(loaded.shared["ema"])
        if loaded.own is not None:
            restore_rng(loaded.own, self.device)
        if self.progress.step_in_epoch >= self.steps_per_epoch:  # the spec's epoch got shorter since
            self.progress.epoch, self.progress.step_in_epoch = self.progress.epoch + 1, 0
        if self.env.is_main:
            log.info(
                "resuming from %s (epoch %d, step %d)", loaded.path, self.progress.epoch + 1, self.progress.global_step
            )
        return loaded.path

    def _save_checkpoint(self) -> None:
        started = time.perf_counter()
        self._sync_inputs()
        self.progress.elapsed_s = self._elapsed()
        full = self.strategy.full_state(self.optimizer)  # collective; the state lands on the main rank only
        model_state, optim_state = full if full is not None else ({}, {})
        shared = {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": asdict(self.progress),
            **({"ema": self.ema.state_dict()} if self.ema is not None and self.env.is_main else {}),
            "spec": self.spec.model_dump(mode="json"),
            "version": __version__,
        }
        info = {
            "format": 2,  # state dicts keyed by parameter name, unsharded: loadable by any strategy
            "strategy": self.strategy.name,
            "job": self.spec.name,
            "model": self.cfg.model,
            "num_classes": len(self.facts.classes),
            "norm_layer": self.cfg.norm_layer,
            "global_step": self.progress.global_step,
        }
        path = self.store.save(self.progress.global_step, shared, capture_rng(self.device), info)
        stalled = time.perf_counter() - started  # how long training stood still for this checkpoint
        self.last_checkpoint_at = time.monotonic()
        self.sinks.write(
            {"kind": RecordKind.CHECKPOINT, "step": self.progress.global_step, "stall_s": stalled, "time": time.time()}
        )
        if self.env.is_main:
            written = "writing in the background" if self.store.async_save else "published"
            log.info("checkpoint %s %s, training stalled %.3f s", path, written, stalled)

    def _peak_memory_per_rank(self) -> list[int]:
        """Collective: each rank's peak memory in bytes (CUDA allocator peak on GPUs, peak RSS on CPUs)."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        per_rank = [0.0] * self.env.world_size
        per_rank[self.env.rank] = float(peak)
        return [int(value) for value in all_reduce_sum(per_rank, self.env, self.device)]

    def _export(self, model_state: dict[str, Any], peak_memory: list[int]) -> dict[str, Any]:
        """A plain model rebuilt from the full state: the same files whatever the strategy."""
        cfg = self.cfg
        model = self.model_factory()
        best = best_record(self.progress.history, cfg.best_metric) if cfg.export_weights == "best" else None
        if best is not None:
            model_state = load_file(str(self.out.best_weights))
            log.info("exporting the weights of epoch %d, the best %s", best["epoch"], cfg.best_metric)
        load_weights(model, model_state)
        metadata = {
            "model": cfg.model,
            "norm_layer": cfg.norm_layer,
            "classes": self.facts.classes,
            "image_size": cfg.data.image_size,
            "clusterfit_version": __version__,
            "job": self.spec.name,
            "global_step": self.progress.global_step,
        }
        exported = export_model(model, self.out.model, metadata=metadata, image_size=cfg.data.val_crop)
        validated = [e for e in self.progress.history if any(key.startswith("val_") for key in e)]
        last_epoch = best or (validated[-1] if validated else {})
        card = ModelCard(
            model=cfg.model,
            classes=list(self.facts.classes),
            image_size=cfg.data.val_crop,
            preprocessing=val_preprocessing(cfg.data),
            metrics={k: float(v) for k, v in last_epoch.items() if k.startswith("val_") and isinstance(v, int | float)},
            spec_sha256=spec_hash(self.spec.model_dump(mode="json")),
            clusterfit_version=__version__,
            job=self.spec.name,
        )
        exported.append(write_model_card(self.out.model, card))
        log.info("exported %s", ", ".join(str(p) for p in exported))
        if self.inputs.tally.reads or self.inputs.tally.files:  # synthetic data reads no file to speak of
            log.info("%s", describe(self.inputs.tally))
        confusion = {}
        if self.last_confusion is not None:
            classes = list(self.facts.classes)
            confusion = confusion_facts(self.last_confusion, classes)
            write_confusion_png(self.last_confusion, classes, self.out.confusion_png)
        return write_summary(
            self.out,
            name=self.spec.name,
            spec=self.spec.model_dump(mode="json"),
            epochs=self.progress.history,
            exported=[str(path) for path in exported],
            wall_seconds=time.time() - self.started,
            world_size=self.env.world_size,
            precision=self.precision.name,
            device=self.device.type,
            global_batch=self.global_batch,
            peak_lr=self.peak_lr,
            steps=self.progress.global_step,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            strategy=self.strategy.name,
            peak_memory_bytes_per_rank=peak_memory,
            inputs=self.inputs.tally.to_dict(),
            stopped_early=self.stopped_early.to_dict() if self.stopped_early else None,
            starting_weights=self.starting_weights.to_dict() if self.starting_weights else None,
            **confusion,
            exported_epoch=int(best["epoch"]) if best else self.progress.epoch,
        )
