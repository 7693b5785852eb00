"""Batch scoring inside every worker rank (`clusterfit score`): each rank scores its own chunks of the input's file
list (a folder's, or a packed dataset's samples) with the exported model, publishes each chunk as it finishes, and
rank 0 merges them once every rank is done.

The network comes from the model folder (`load_classifier`), the pixels from the trainer's own validation
transform and decoder, built from the model card's preprocessing, so scoring sees what validation saw. Chunk
files, their names and the merge live in outputs/predictions.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from clusterfit.data.folders import list_score_inputs
from clusterfit.data.imagefolder import LabeledImages, collate_labeled, preprocessing_transform
from clusterfit.data.loaders import normalize_on_device
from clusterfit.data.quality import InputTally, describe
from clusterfit.data.shardreader import PackedImages
from clusterfit.data.shards import is_packed, read_index
from clusterfit.data.transforms import CenterCrop
from clusterfit.monitoring.sinks import open_metric_sinks
from clusterfit.outputs import JobOutputs, Phase, RecordKind, write_summary
from clusterfit.outputs.layout import WEIGHTS_FILE
from clusterfit.outputs.model_card import read_model_card
from clusterfit.outputs.predictions import (
    BAD_COLUMN,
    FILE_COLUMN,
    LABEL_COLUMN,
    ScorePlan,
    check_plan,
    chunk_file,
    class_column,
    finished_chunks,
    merge_predictions,
    plan_chunk_size,
    probability_column,
    write_chunk,
)
from clusterfit.outputs.summary import SCORING
from clusterfit.scoring import load_classifier
from clusterfit.spec.model import JobSpec
from clusterfit.worker.dist import DistEnv, all_reduce_sum, barrier, init_distributed, pick_device
from clusterfit.worker.faults import fault_from_env
from clusterfit.worker.heartbeat import Heartbeat

log = logging.getLogger("clusterfit.score")


def score(spec: JobSpec, env: DistEnv) -> dict[str, Any] | None:
    """Score this rank's unfinished chunks; on rank 0, merge every chunk and return the summary."""
    cfg = spec.scorer
    assert cfg is not None, "a scoring job's spec has scorer:"
    started = time.time()
    out = JobOutputs.at(spec.outputs.dir)
    device = pick_device(env)
    init_distributed(env, device, spec.limits.collective_timeout)
    heartbeat = Heartbeat(out, env.rank, spec.limits.hang_timeout, images_per_step=1)
    card = read_model_card(Path(cfg.model_dir))
    classifier = load_classifier(cfg.model_dir)
    model = classifier.model.to(device)
    inputs = list_score_inputs(cfg.input, "scorer.input")
    chunk_size = plan_chunk_size(out, inputs.files, env.world_size, cfg.chunk_images)
    plan = ScorePlan(inputs.files, inputs.labels, chunk_size)
    check_plan(out, plan.record(card.files.get(WEIGHTS_FILE, "")), write=env.is_main)
    barrier(env)  # plan.json is there before any chunk: a rerun finds the chunk size they were cut with
    done = finished_chunks(out)
    mine = [index for index in plan.chunks_of(env.rank, env.world_size) if index not in done]
    top_k = min(cfg.top_k, len(classifier.classes))
    log.info(
        "rank %d of %d on %s: %d of %d images left in %d chunk(s) of %d of this rank (%d chunk(s) done before)",
        env.rank,
        env.world_size,
        device,
        sum(len(plan.chunk(index)) for index in mine),
        len(plan.files),
        len(mine),
        plan.chunk_images,
        len(done),
    )
    sinks = open_metric_sinks(out, env.is_main)
    images_done_before = sum(len(plan.chunk(index)) for index in done)
    # NOTE: progress is counted in images (a training job's steps): `status` shows scored / total.
    sinks.write({"kind": RecordKind.START, "step": images_done_before, "total_steps": len(plan.files)})

    dataset = _images(cfg.input, plan.files, preprocessing_transform(card.preprocessing))
    # Batches never cross a chunk, so a chunk's rows are the same whichever run scores it.
    batches: list[list[int]] = []
    owners: list[int] = []  # the chunk of each batch
    for index in mine:
        files = list(plan.chunk(index))
        for start in range(0, len(files), cfg.batch_size):
            batches.append(files[start : start + cfg.batch_size])
            owners.append(index)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=0, collate_fn=collate_labeled)
    index_of = {path: index for path, index in dataset.samples}
    fault = fault_from_env()
    tally = InputTally()
    rows: dict[int, dict[str, Any]] = {}
    scored = 0
    loop_started = time.perf_counter()
    heartbeat.beat(Phase.SCORING, 0, force=True)
    with torch.inference_mode():
        for position, (images, indices, reads, bad) in enumerate(loader):
            chunk = owners[position]
            tally.add(reads, bad)
            for path, reason in bad:
                rows[index_of[path]] = {BAD_COLUMN: reason}
            if images is not None:
                pixels = normalize_on_device(images, device, False, card.preprocessing.mean, card.preprocessing.std)
                probabilities, classes = model(pixels).softmax(dim=1).topk(top_k, dim=1)
                for index, probs, best in zip(indices.tolist(), probabilities.tolist(), classes.tolist(), strict=True):
                    rows[index] = {"probabilities": probs, "classes": [classifier.classes[c] for c in best]}
                scored += len(indices)
            heartbeat.beat(Phase.SCORING, scored + tally.skipped_files)
            if position + 1 == len(owners) or owners[position + 1] != chunk:
                write_chunk(chunk_file(out, env.rank, chunk), _chunk_columns(plan, chunk, rows, top_k))
                rows.clear()
                finished = mine.index(chunk) + 1
                if env.is_main:
                    _record_progress(sinks, out, plan, images_done_before, loop_started)
                if fault is not None:
                    fault.trigger(env.rank, finished)
    # Waiting for the other ranks, then merging, is not a hang (and must not dump this rank's stack).
    heartbeat.beat(Phase.EXPORTING, scored + tally.skipped_files, force=True)
    barrier(env)  # every chunk is published
    seconds = time.perf_counter() - loop_started
    scored_this_run, bad_this_run = all_reduce_sum([float(scored), float(tally.skipped_files)], env, device)
    summary = _finish(spec, env, out, plan, started, seconds, int(scored_this_run), int(bad_this_run), sinks)
    heartbeat.beat(Phase.DONE, scored + tally.skipped_files, force=True)
    heartbeat.flush()
    return summary


def _images(root: str, files: list[str], transform: CenterCrop) -> LabeledImages | PackedImages:
    """The input's images by index in `files`; the label slot of their batches carries that index, and a bad
    image is dropped and counted."""
    if is_packed(root):
        return PackedImages(read_index(root), files, transform)
    samples = [(str(Path(root) / file), index) for index, file in enumerate(files)]
    return LabeledImages(samples, transform, substitute=False)


def _chunk_columns(plan: ScorePlan, chunk: int, rows: dict[int, dict[str, Any]], top_k: int) -> dict[str, list[Any]]:
    """One chunk's rows in file order: file, label, class_1..k, probability_1..k, bad_reason."""
    indices = list(plan.chunk(chunk))
    columns: dict[str, list[Any]] = {FILE_COLUMN: [plan.files[i] for i in indices]}
    if plan.labels is not None:
        columns[LABEL_COLUMN] = [plan.labels[i] for i in indices]
    for k in range(top_k):
        columns[class_column(k + 1)] = [rows[i]["classes"][k] if "classes" in rows[i] else None for i in indices]
        columns[probability_column(k + 1)] = [
            rows[i]["probabilities"][k] if "probabilities" in rows[i] else None for i in indices
        ]
    columns[BAD_COLUMN] = [rows[i].get(BAD_COLUMN) for i in indices]
    return columns


def _record_progress(sinks: Any, out: JobOutputs, plan: ScorePlan, before: int, since: float) -> None:
    """Rank 0's progress record: images in every rank's published chunks, and the rate of this run."""
    published = sum(len(plan.chunk(index)) for index in finished_chunks(out))
    rate = (published - before) / max(time.perf_counter() - since, 1e-9)
    sinks.write(
        {
            "kind": RecordKind.TRAIN,
            "step": published,
            "total_steps": len(plan.files),
            "images_per_s": rate,
            "time": time.time(),
        }
    )


def _finish(
    spec: JobSpec,
    env: DistEnv,
    out: JobOutputs,
    plan: ScorePlan,
    started: float,
    seconds: float,
    scored_this_run: int,
    bad_this_run: int,
    sinks: Any,
) -> dict[str, Any] | None:
    """Rank 0: merge the chunks into predictions.parquet and write summary.json."""
    if not env.is_main:
        sinks.close()
        return None
    cfg = spec.scorer
    assert cfg is not None
    merged = merge_predictions(out, plan, csv=cfg.csv)
    tally = InputTally(reads=len(plan.files))
    tally.add(0, merged.bad)
    rate = (scored_this_run + bad_this_run) / max(seconds, 1e-9)
    sinks.write({"kind": RecordKind.END, "step": len(plan.files), "images_per_s": rate, "time": time.time()})
    sinks.close()
    exported = [str(out.predictions), *([str(out.predictions_csv)] if cfg.csv else [])]
    facts: dict[str, Any] = {
        "kind": SCORING,
        "model_dir": str(Path(cfg.model_dir).resolve()),
        "input": cfg.input,
        "world_size": env.world_size,
        "images": len(plan.files),
        "images_scored": merged.scored,
        "bad_images_skipped": len(merged.bad),
        "images_this_run": scored_this_run + bad_this_run,
        "scoring_seconds": round(seconds, 3),
        "images_per_s": round(rate, 2),
        "inputs": tally.to_dict(),
    }
    if merged.top1_correct is not None:
        facts["top1_vs_folder_labels"] = merged.top1_correct / max(1, merged.scored)
    log.info(
        "scored %d images (%d skipped as unreadable) in %.1f s this run, %.1f images/s; %s",
        merged.scored,
        len(merged.bad),
        seconds,
        rate,
        exported[0],
    )
    log.info("%s", describe(tally))
    return write_summary(
        out,
        name=spec.name,
        spec=spec.model_dump(mode="json"),
        epochs=[],
        exported=exported,
        wall_seconds=time.time() - started,
        **facts,
    )
