"""Pure pieces of the worker and the local engine, without any process launched."""

from __future__ import annotations

import faulthandler
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import run_cli, wait_for

from clusterfit.backends.torchrun import threads_per_worker
from clusterfit.data.imagefolder import CountedBatches, KeptBatches, ShardSampler
from clusterfit.data.synthetic import SyntheticData
from clusterfit.models import build_model
from clusterfit.monitoring.tracebacks import HeldTracebacks
from clusterfit.outputs import JobOutputs, Phase, membership_changes, read_heartbeats
from clusterfit.outputs.logs import rotate
from clusterfit.service.home import threads_per_slot
from clusterfit.service.render import status_lines
from clusterfit.spec.model import OptimizerSpec
from clusterfit.worker.heartbeat import Heartbeat
from clusterfit.worker.optim import build_optimizer, lr_factor, scaled_lr
from clusterfit.worker.precision import cpu_has_native_bf16, resolve_precision


def test_linear_lr_scaling() -> None:
    assert scaled_lr(OptimizerSpec(lr=0.1), global_batch=1024) == pytest.approx(0.4)
    assert scaled_lr(OptimizerSpec(lr=0.1), global_batch=128) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("step", "kind", "expected"),
    [
        (0, "cosine", 1 / 10),  # warm-up starts near zero...
        (9, "cosine", 1.0),  # ...and reaches the peak at its last step
        (10, "cosine", 1.0),
        (55, "cosine", 0.5),  # half-way through the decay
        (100, "cosine", 0.0),
        (55, "linear", 0.5),
        (80, "constant", 1.0),
    ],
)
def test_lr_schedule(step: int, kind: str, expected: float) -> None:
    assert lr_factor(step, total_steps=100, warmup_steps=10, kind=kind) == pytest.approx(expected, abs=1e-9)


def test_cosine_is_monotone_after_warmup() -> None:
    values = [lr_factor(s, 50, 5, "cosine") for s in range(5, 51)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert math.isclose(values[-1], 0.0, abs_tol=1e-12)


def test_no_weight_decay_on_norm_and_bias() -> None:
    model = build_model("resnet_tiny", 10)
    optimizer = build_optimizer(model, OptimizerSpec(weight_decay=1e-4), global_batch=256)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 1e-4 and plain["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decayed["params"])
    bn = model.bn1
    assert any(p is bn.weight for p in plain["params"]) and any(p is model.fc.bias for p in plain["params"])


def test_synthetic_batches_split_one_global_batch_across_ranks() -> None:
    whole = SyntheticData(image_size=8, num_classes=5, batch_size=6, rank=0, world_size=1, steps_per_epoch=3, seed=1)
    halves = [
        SyntheticData(image_size=8, num_classes=5, batch_size=3, rank=r, world_size=2, steps_per_epoch=3, seed=1)
        for r in range(2)
    ]
    for step, (images, labels) in enumerate(whole.batches(0)):
        parts = [list(h.batches(0))[step] for h in halves]
        assert torch.equal(images, torch.cat([p[0] for p in parts]))
        assert torch.equal(labels, torch.cat([p[1] for p in parts]))
        assert images.dtype == torch.uint8
    assert len(list(whole.batches(0, start_step=2))) == 1


def test_train_and_validation_sizes_reach_the_transforms_and_the_model_card(tmp_path: Path) -> None:
    """torchvision's --train-crop-size, --val-resize-size and --val-crop-size: the validation transform equals
    its Resize + CenterCrop, and the model card states it; unset, they are today's image_size and 0.875."""
    import numpy as np
    from PIL import Image
    from torchvision.transforms import v2

    from clusterfit.data.imagefolder import preprocessing_transform, train_transform
    from clusterfit.data.loaders import val_preprocessing
    from clusterfit.outputs.model_card import Preprocessing
    from clusterfit.spec.model import TrainerSpec

    default = TrainerSpec(data={"train": "synthetic", "num_classes": 3, "image_size": 32})
    assert val_preprocessing(default.data) == Preprocessing(resize_shorter_side=37, center_crop=32, crop_fraction=0.875)
    sized = TrainerSpec(
        data={"train": "synthetic", "num_classes": 3, "image_size": 64, "train_crop_size": 24, "val_resize_size": 40,
              "val_crop_size": 32}
    )  # fmt: skip
    assert sized.resolved_augment().preset == "small"  # `auto` goes by the 24 px training crop, not image_size 64
    preprocessing = val_preprocessing(sized.data)
    assert (preprocessing.resize_shorter_side, preprocessing.center_crop, preprocessing.crop_fraction) == (40, 32, 0.8)

    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(photo)
    reference = v2.Compose([v2.PILToTensor(), v2.Resize(40), v2.CenterCrop(32)])(Image.open(photo).convert("RGB"))
    assert torch.equal(preprocessing_transform(preprocessing)(str(photo)), reference)
    crop = train_transform(sized.data.train_crop, sized.resolved_augment())(str(photo), torch.Generator())
    assert crop.shape == (3, 24, 24)


def test_validation_batches_are_twice_the_training_batch(tiny_imagefolder: Path) -> None:
    """Forward only, nothing kept for a backward pass: a batch twice the training one fits where training fits."""
    from clusterfit.data.folders import inspect_data
    from clusterfit.data.loaders import build_val_loader
    from clusterfit.spec.model import TrainerSpec

    data = {"train": str(tiny_imagefolder / "train"), "val": str(tiny_imagefolder / "val"), "image_size": 32}
    trainer = TrainerSpec(data={**data, "loader_workers": 0}, batch_size=4)
    loader = build_val_loader(
        trainer, inspect_data(trainer.data), rank=0, world_size=1, local_world_size=1, pin_memory=False
    )
    sizes = [len(labels) for _, labels in loader]
    assert sizes == [8, 7] and loader.take_reads()[0] == 15  # 3 classes x 5 validation images, each once


def test_a_small_validation_set_is_read_once_and_replayed_from_memory(
    tiny_imagefolder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The validation transform is deterministic: later validations get the first one's tensors and read no
    file. A pass cut short keeps nothing, and a share over the budget is read again at every validation."""
    from clusterfit.data import loaders
    from clusterfit.data.folders import inspect_data
    from clusterfit.spec.model import TrainerSpec

    data = {"train": str(tiny_imagefolder / "train"), "val": str(tiny_imagefolder / "val"), "image_size": 32}
    trainer = TrainerSpec(data={**data, "loader_workers": 1}, batch_size=4)
    facts = inspect_data(trainer.data)

    def build() -> CountedBatches | KeptBatches:
        loader = loaders.build_val_loader(trainer, facts, rank=0, world_size=1, local_world_size=1, pin_memory=False)
        assert loader is not None
        return loader

    loader = build()
    assert isinstance(loader, KeptBatches)
    next(iter(loader))  # cut short: nothing kept
    loader.take_reads()
    first = list(loader)
    assert loader.take_reads()[0] == 15
    again = list(loader)
    assert loader.take_reads() == (0, [])
    assert all(a is b for (a, _), (b, _) in zip(first, again, strict=True))
    # 15 images of 3x32x32 bytes: a budget of 14 of them keeps none
    monkeypatch.setattr(loaders, "KEPT_VAL_BYTES", 14 * 3 * 32 * 32)
    unkept = build()
    assert isinstance(unkept, CountedBatches)
    assert [len(labels) for _, labels in unkept] == [8, 7] and unkept.take_reads()[0] == 15
    assert [torch.equal(a, b) for (a, _), (b, _) in zip(first, unkept, strict=True)] == [True, True]
    assert unkept.take_reads()[0] == 15


def test_validation_shards_cover_each_sample_once() -> None:
    shards = [list(ShardSampler(15, rank, 4)) for rank in range(4)]
    assert sorted(i for shard in shards for i in shard) == list(range(15))


def test_threads_never_oversubscribe() -> None:
    assert threads_per_worker(2, cores=2) == 1
    assert threads_per_worker(4, cores=2) == 1
    assert threads_per_worker(2, cores=16) == 8
    # a rank of the job service holds one slot: its share of the cores, however few ranks its job has
    assert threads_per_slot(1, cores=2, capacity=2) == 1
    assert threads_per_slot(1, cores=64, capacity=8) == 8  # 8 GPUs: 8 slots
    assert threads_per_slot(1, cores=2, capacity=4) == 1
    assert threads_per_slot(4, cores=64, capacity=2) == 16  # more ranks than slots: it runs alone


def test_precision_auto_follows_the_hardware() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert resolve_precision("fp32", cpu).autocast_dtype is None
    assert resolve_precision("bf16", cpu).autocast_dtype is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16' needs a CUDA GPU"):
            resolve_precision("fp16", cpu)


def test_rank_log_rotation_keeps_every_attempt(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    for attempt in range(3):
        rotate(log)
        log.write_text(f"attempt {attempt}")
    assert log.read_text() == "attempt 2"
    assert (tmp_path / "rank-0.log.1").read_text() == "attempt 1"
    assert (tmp_path / "rank-0.log.2").read_text() == "attempt 0"


def test_log_follower_labels_lines_and_follows_rotation(tmp_path: Path) -> None:
    from clusterfit.monitoring.logtail import LogFollower

    (tmp_path / "rank-0.log").write_text("from an earlier run\n")
    follower = LogFollower(tmp_path, 2)  # earlier runs' lines are not shown again
    with open(tmp_path / "rank-0.log", "a") as f:
        f.write("step 1\nhalf a li")
    (tmp_path / "rank-1.log").write_text("ready\n")
    assert follower.poll() == ["[rank0] step 1", "[rank1] ready"]
    with open(tmp_path / "rank-0.log", "a") as f:
        f.write("ne\n")
    rotate(tmp_path / "rank-0.log")  # a restart: the old attempt's file moves away, a new one starts
    (tmp_path / "rank-0.log").write_text("attempt 2\n")
    (tmp_path / "agent.log").write_text("restarting workers")
    # The unterminated agent line only comes out with the final drain.
    assert follower.drain() == ["[rank0] half a line", "[rank0] attempt 2", "[torchrun] restarting workers"]


def test_log_follower_goes_on_when_a_log_is_rotated_away_between_its_listing_and_its_opening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart renames rank-0.log before it makes the next one: a poll that listed the old name in between
    finishes the old file once and waits for the new one (it stopped `clusterfit run` with FileNotFoundError)."""
    from clusterfit.monitoring import logtail

    (tmp_path / "rank-0.log").write_text("")
    follower = logtail.LogFollower(tmp_path, 1, agent=False)
    with open(tmp_path / "rank-0.log", "a") as f:
        f.write("step 1\nlast wor")
    rotate(tmp_path / "rank-0.log")
    monkeypatch.setattr(logtail, "followed_logs", lambda *args, **kwargs: ["rank-0.log"])  # listed just before
    assert follower.poll() == ["[rank0] step 1", "[rank0] last wor"]
    assert follower.poll() == []
    monkeypatch.undo()
    (tmp_path / "rank-0.log").write_text("attempt 2\n")
    assert follower.drain() == ["[rank0] attempt 2"]


def test_heartbeat_file_ends_at_the_last_step_when_steps_come_faster_than_writes(tmp_path: Path) -> None:
    """A rank that hangs right after a few fast steps must be reported at its true last step, timed by it."""
    # A 3 s interval: the read below must come before the delayed write, even on a busy machine.
    heartbeat = Heartbeat(JobOutputs(tmp_path), rank=0, hang_timeout=600, images_per_step=8, interval=3.0)
    try:
        for step in (1, 2, 3):
            heartbeat.beat(Phase.TRAINING, step)
        last_step_at = time.time()
        # The first beat is written at once, the others wait.
        assert read_heartbeats(JobOutputs(tmp_path), 1)[0].step == 1
        outputs = JobOutputs(tmp_path)
        beat = wait_for(lambda: (beat := read_heartbeats(outputs, 1)[0]).step == 3 and beat, 10, "the last step")
        assert beat.time <= last_step_at  # the step's own time, not the later write's
        assert beat.images_per_s is not None and beat.images_per_s > 0
    finally:
        faulthandler.cancel_dump_traceback_later()


PEER_TRACEBACK = [
    "[rank0] [rank0]: Traceback (most recent call last):",
    '[rank0] [rank0]:   File "train.py", line 3, in step',
    "[rank0] [rank0]:     loss.backward()",
    "[rank0] [rank0]: RuntimeError: Connection reset by peer",
]


def test_a_traceback_is_held_until_its_rank_writes_on() -> None:
    held = HeldTracebacks()
    assert held.feed("[rank0] 12:00:01 step 1") == ["[rank0] 12:00:01 step 1"]
    assert [line for raw in PEER_TRACEBACK for line in held.feed(raw)] == []
    assert held.feed("[rank1] 12:00:02 step 2") == ["[rank1] 12:00:02 step 2"], "other ranks are not held up"
    assert held.held_labels() == ["rank0"]
    # The rank survived it (a caught, printed exception): the traceback is shown, in order, before the new line.
    assert held.feed("[rank0] 12:00:03 step 3") == [*PEER_TRACEBACK, "[rank0] 12:00:03 step 3"]
    assert held.held_labels() == []


def test_a_chained_traceback_is_one_held_block_and_release_gives_it_back() -> None:
    lines = [
        "[rank1] Traceback (most recent call last):",
        '[rank1]   File "a.py", line 1, in <module>',
        "[rank1] KeyError: 'x'",
        "[rank1] ",
        "[rank1] During handling of the above exception, another exception occurred:",
        "[rank1] ",
        "[rank1] Traceback (most recent call last):",
        '[rank1]   File "a.py", line 3, in <module>',
        "[rank1] ValueError: bad",
    ]
    held = HeldTracebacks()
    assert [line for raw in lines for line in held.feed(raw)] == []
    assert held.release() == lines and held.held_labels() == []


def test_a_hang_stack_dump_is_not_held() -> None:
    held = HeldTracebacks()
    dump = ["[rank0] Timeout (0:00:06)!", "[rank0] Thread 0x7f (most recent call first):", '[rank0]   File "x.py"']
    assert [line for raw in dump for line in held.feed(raw)] == dump


def test_a_process_tree_is_found_and_killed_by_pid_and_start_time() -> None:
    import subprocess

    from clusterfit.processes import descendants, is_running, kill_if_same, process_start_time

    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; wait"])
    try:
        tree = wait_for(lambda: len(found := descendants(shell.pid)) == 2 and found, 10, "the two sleeps")
        assert all(is_running(pid, start) for pid, start in tree.items())
        assert not is_running(shell.pid, "0"), "another start time is another process"
        for pid, start in tree.items():
            kill_if_same(pid, start)
        wait_for(lambda: not any(is_running(pid, start) for pid, start in tree.items()), 10, "the sleeps to die")
    finally:
        shell.kill()
        shell.wait()
    assert process_start_time(shell.pid) is None and not is_running(shell.pid), "reaped: gone"


def test_export_refuses_a_folder_that_is_not_an_exported_model(tmp_path: Path) -> None:
    result = run_cli("export", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path}: no model_card.json; pass the model/ folder of a finished job"
    ]


def test_the_progress_line_shows_a_user_s_epoch_report_without_a_loss() -> None:
    """A script's report may carry the trainer's epoch and images/s names without its loss."""
    from clusterfit.monitoring.progress import _train_stats

    trainer = {"kind": "train", "step": 7, "epoch": 1, "loss": 0.25, "images_per_s": 12.0}
    assert _train_stats(trainer) == "epoch 1 loss 0.250 12.0 img/s"
    user = {"kind": "train", "step": 7, "epoch": 1, "images_per_s": 12.5}
    assert _train_stats(user) == "epoch 1 images_per_s 12.5"


def test_the_progress_bar_shows_a_script_s_metric_names_as_written(tmp_path: Path) -> None:
    """A script's metric named `acc[bold]` is shown so, not taken for rich markup."""
    from rich.console import Console

    from clusterfit.monitoring.progress import LiveView

    out = JobOutputs.at(tmp_path)
    out.logs.mkdir(parents=True)
    console = Console(width=200, record=True, force_terminal=False)
    with LiveView(out, 1, console) as view:
        out.metrics.write_text(json.dumps({"kind": "train", "step": 3, "total_steps": 9, "acc[bold]": 0.5}) + "\n")
        view.tick()
    assert "acc[bold] 0.5" in console.export_text()


def test_membership_changes_are_the_start_records_whose_node_count_differs_from_the_one_before() -> None:
    starts = [
        {"step": 0, "nodes": 1, "world_size": 2, "time": 1.0},
        {"step": 0, "nodes": 2, "world_size": 4, "time": 2.0},  # a node joined before the first step
        {"step": 30, "nodes": 2, "world_size": 4, "time": 3.0},  # a restart on the same nodes: no change
        {"step": 40, "nodes": 1, "world_size": 2, "time": 4.0},
        {"step": 40},  # a record of a version that did not count nodes: no change
        {"step": 50, "nodes": 2, "world_size": 4, "time": 5.0},
    ]
    changes = membership_changes(starts)
    assert [(c.step, c.nodes_before, c.nodes, c.world_size) for c in changes] == [
        (0, 1, 2, 4),
        (40, 2, 1, 2),
        (50, 1, 2, 4),
    ]
    assert changes[1].text == "2 -> 1 node(s) (world size 2) at step 40"


def test_status_shows_an_elastic_jobs_nodes_and_each_change() -> None:
    change = membership_changes([{"step": 0, "nodes": 2}, {"step": 40, "nodes": 1, "world_size": 1, "time": 0.0}])[0]
    status = {
        "id": "abc",
        "name": "tiny",
        "state": "RUNNING",
        "attempt": 1,
        "max_retries": 0,
        "backend": "ray",
        "ranks": 2,
        "priority": 0,
        "submitted_at": None,
        "logs_dir": "runs/tiny/logs",
        "nodes": {"allowed": "1:2", "now": 1, "changes": [{**asdict(change), "text": change.text}]},
    }
    lines = status_lines(status)
    assert "nodes: 1 now, 1:2 allowed (elastic)" in lines
    assert any(line.endswith("  2 -> 1 node(s) (world size 1) at step 40") for line in lines)
    assert not any(line.startswith("nodes:") for line in status_lines({**status, "nodes": None}))


def test_the_model_card_states_the_resampling_a_scorer_must_use(tmp_path: Path) -> None:
    """The card says bilinear with antialiasing: torchvision's `resized_crop(..., BILINEAR, antialias=True)` on the
    card's centre square gives the scorer's pixels (0.1 levels of 255 apart on average; 9 without antialiasing).
    A card written before these fields reads with them."""
    import json

    import numpy as np
    from PIL import Image
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    from clusterfit.data.transforms import CenterCrop
    from clusterfit.outputs.model_card import ModelCard, Preprocessing, read_model_card, write_model_card

    rows, columns = np.mgrid[0:160, 0:200]
    noise = np.random.default_rng(0).normal(0, 20, (160, 200, 3))
    pixels = np.stack([columns * 1.2 % 256, rows * 1.5 % 256, (columns + rows) * 0.7 % 256], -1) + noise
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(tmp_path / "photo.png")  # PNG: no JPEG draft
    card = Preprocessing.for_size(32)
    assert (card.interpolation, card.antialias) == ("bilinear", True)
    scored = CenterCrop(card.center_crop, card.crop_fraction)(str(tmp_path / "photo.png")).float()
    side = round(160 * card.crop_fraction)  # 140: the box falls on whole pixels
    image = torch.from_numpy(np.array(Image.open(tmp_path / "photo.png"))).permute(2, 0, 1)
    for antialias, (mean_below, mean_above) in ((True, (0.0, 0.5)), (False, (5.0, 255.0))):
        theirs = F.resized_crop(
            image, 10, 30, side, side, [32, 32], interpolation=InterpolationMode.BILINEAR, antialias=antialias
        ).float()
        assert mean_below <= (scored - theirs).abs().mean() < mean_above, antialias

    folder = tmp_path / "model"
    folder.mkdir()
    write_model_card(folder, ModelCard("resnet_tiny", ["a"], 32, card, {}, "0" * 64, "0", "job"))
    written = json.loads((folder / "model_card.json").read_text())
    assert (written["preprocessing"]["interpolation"], written["preprocessing"]["antialias"]) == ("bilinear", True)
    for field in ("interpolation", "antialias"):
        del written["preprocessing"][field]
    (folder / "model_card.json").write_text(json.dumps(written))
    assert read_model_card(folder).preprocessing == card


def test_a_rank_s_error_file_is_whole_and_torchrun_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's error file is written beside its place and renamed: a rank stopped while writing it leaves
    no empty file for the agent to choke on, and the agent reads the finished one as its own format."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from clusterfit.worker.__main__ import WholeErrorFile

    error_file = tmp_path / "rank-1.error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("a bad batch")
    except ValueError as exc:
        WholeErrorFile().record_exception(exc)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "ValueError: a bad batch"
    assert 'raise ValueError("a bad batch")' in failure.error_file_data["message"]["extraInfo"]["py_callstack"]
    assert [p.name for p in tmp_path.iterdir()] == ["rank-1.error.json"]


def test_injected_faults_fire_once_and_a_straggler_from_its_step_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from clusterfit.worker.faults import Fault, InjectedFault

    assert Fault.parse("slow:rank=0:step=3:seconds=0.05") == Fault("slow", 0, 3, None, 0.05)
    assert Fault.parse("raise:rank=1:step=2:attempt=1") == Fault("raise", 1, 2, 1)
    failure = Fault.parse("raise:rank=1:step=2")
    for rank, step in [(1, 1), (1, 3), (0, 2)]:
        failure.trigger(rank, step)
    with pytest.raises(InjectedFault, match="rank 1 after step 2"):
        failure.trigger(1, 2)
    slept: list[float] = []
    monkeypatch.setattr("clusterfit.worker.faults.time.sleep", slept.append)
    straggler = Fault.parse("slow:rank=0:step=3:seconds=0.05")
    for rank, step in [(0, 1), (0, 2), (1, 3), (0, 3), (0, 4), (0, 90)]:
        straggler.trigger(rank, step)
    assert slept == [0.05, 0.05, 0.05]
    released = tmp_path / "go"
    held = Fault.parse(f"slow:rank=0:step=1:seconds=0.25:until={released}")
    assert held == Fault("slow", 0, 1, None, 0.25, str(released))
    held.trigger(0, 1)
    released.touch()  # a straggler until the file exists, at full speed after
    held.trigger(0, 2)
    assert slept == [0.05, 0.05, 0.05, 0.25]
    with pytest.raises(ValueError, match="KIND one of"):
        Fault.parse("crawl:rank=0:step=1")


def test_what_the_job_service_reads_of_a_job_s_files_is_bounded_whatever_their_size(tmp_path: Path) -> None:
    """A job writes its metrics, heartbeats, summary and error files, and may make them any size: 256 MiB of
    zeros (a sparse file: no disk) before its last records, a line that never ends, a heartbeat of 1 MiB. The
    chart, the node membership, the follower and the status read bounded pieces and go on with what follows."""
    import tracemalloc

    from clusterfit.outputs import MetricsTail, read_summary
    from clusterfit.service.store import Job
    from clusterfit.service.views import metrics_series, node_membership

    outputs = JobOutputs.at(tmp_path / "out")
    outputs.heartbeats.mkdir(parents=True)
    with open(outputs.metrics, "wb") as f:
        f.truncate(256 * 1024 * 1024)
        f.seek(0, os.SEEK_END)
        for step in range(1, 3001):
            record = {"kind": "start", "step": step, "nodes": 1 + step // 2000, "world_size": 2, "time": step}
            f.write(b"\n" + json.dumps(record if step % 1000 == 0 else {**record, "kind": "train"}).encode())
        f.write(b"\n")
    (outputs.heartbeats / "rank-0.json").write_text(json.dumps({"pad": "x" * 1024 * 1024}))
    outputs.summary.write_bytes(b"{" + b" " * (17 * 1024 * 1024) + b"}")
    job = Job(outputs_dir=str(outputs.root), spec_yaml="resources: {instance_count: '1:2'}")

    tracemalloc.start()
    try:
        series = metrics_series(job, limit=2000)
        membership = node_membership(job)
        heartbeats, summary = read_heartbeats(outputs, 2), read_summary(outputs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, peak  # the whole file read at once: over 256 MiB
    assert [r["step"] for r in series] == [step for step in range(1, 3001) if step % 1000][-2000:]
    assert membership is not None and membership["now"] == 2
    assert [(c["nodes_before"], c["nodes"]) for c in membership["changes"]] == [(1, 2)]
    assert heartbeats == {} and summary is None  # larger than any real one: not read

    tracemalloc.start()
    try:
        follower, followed = MetricsTail(outputs.metrics, from_start=True), []
        while follower.offset < outputs.metrics.stat().st_size:  # a bounded piece per read
            followed += follower.read_new()
        with open(outputs.metrics, "ab") as f:
            for _ in range(3):  # a line too long to be a record, written in pieces
                f.write(b"x" * (3 * 1024 * 1024))
                followed += follower.read_new()
            f.write(b'y\n{"kind": "end", "step": 3001}\n')
        followed += follower.read_new()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, peak
    assert [r["step"] for r in followed] == [*range(1, 3001), 3001]


def test_metrics_follower_reads_a_file_replaced_whole_past_what_it_has_read(tmp_path: Path) -> None:
    """An elastic job's rank 0 moved to a node with its own copy of metrics.jsonl, which replaced the launcher's
    whole: the follower reads the new file from its start, past the records it has read (by their time), so a
    membership change written there is shown once and nothing is shown twice."""
    from clusterfit.files import write_atomically
    from clusterfit.outputs import MetricsTail

    path = tmp_path / "metrics.jsonl"

    def line(kind: str, time: float, **fields: object) -> str:
        return json.dumps({"kind": kind, "time": time, **fields}) + "\n"

    path.write_text(line("start", 1.0, nodes=2))
    tail = MetricsTail(path, from_start=True)
    with open(path, "a") as f:
        f.write(line("train", 2.0, step=5) + line("start", 3.0, nodes=1) + line("train", 4.0, step=10))
    assert [r["time"] for r in tail.read_new()] == [1.0, 2.0, 3.0, 4.0]
    # The new node's copy: what it pulled at its start (up to t=3), then its own records; shorter than the old one.
    write_atomically(path, line("start", 1.0, nodes=2) + line("start", 3.0, nodes=1) + line("start", 5.0, nodes=2))
    assert [(r["time"], r.get("nodes")) for r in tail.read_new()] == [(5.0, 2)]
    with open(path, "a") as f:
        f.write(line("train", 6.0, step=15) + "[1, 2]\n" + line("train", "soon", step=16))
    assert [r["time"] for r in tail.read_new()] == [6.0, "soon"]  # what is not a record is skipped, not fatal
    write_atomically(path, path.read_text() + line("train", 7.0, step=20))
    assert [r["time"] for r in tail.read_new()] == [7.0]


def test_a_program_ends_with_the_code_the_interpreter_would_give_it(capsys) -> None:
    """The agent ends through exit_code_of and exit_without_teardown: the codes and messages a script gets."""
    from clusterfit.processes import exit_code_of

    def raising(error: BaseException):  # noqa: ANN202
        def program() -> None:
            raise error

        return program

    assert exit_code_of(lambda: None) == 0
    assert exit_code_of(raising(SystemExit())) == 0
    assert exit_code_of(raising(SystemExit(3))) == 3
    assert exit_code_of(raising(SystemExit("usage: agent ..."))) == 1
    assert capsys.readouterr().err == "usage: agent ...\n"
    assert exit_code_of(raising(RuntimeError("rank 1 failed"))) == 1
    printed = capsys.readouterr().err
    assert printed.startswith("Traceback (most recent call last):")
    assert printed.endswith("RuntimeError: rank 1 failed\n")


def test_a_fork_of_the_agent_retitles_itself_after_the_environment_changed() -> None:
    """The agent's fork server and ranks show their own command in `ps`, even once something in the agent set
    its first environment variable again before forking them (setproctitle would then retitle nothing)."""
    program = """
import os, sys, setproctitle
from clusterfit.backends.agent import hold_the_process_title
if sys.argv[1] == "held":
    hold_the_process_title()
first = next(iter(os.environ))
os.environ[first] += "-set-again"
retitled, told = os.pipe()
parent_ends, parent_alive = os.pipe()
child = os.fork()
if child == 0:
    os.close(parent_alive)
    setproctitle.setproctitle("the retitled child")
    os.write(told, b"1")
    os.read(parent_ends, 1)
    os._exit(0)
os.read(retitled, 1)
print(open(f"/proc/{child}/cmdline", "rb").read().split(bytes(1))[0].decode())
"""

    def child_title(held: str) -> str:
        result = subprocess.run([sys.executable, "-c", program, held], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert child_title("held") == "the retitled child"
    assert child_title("not held") != "the retitled child"  # as the agent was before: the trap is real


def test_the_agent_gives_rank_0_a_store_port_outside_the_kernel_s_ephemeral_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port among the ephemeral ones could be taken by any connect() before rank 0 binds it (EADDRINUSE)."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    from clusterfit.backends.agent import pick_rank_zero_ports_outside_the_ephemeral_range

    low, high = (int(word) for word in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    monkeypatch.setattr(rendezvous_api, "get_free_port", rendezvous_api.get_free_port)  # restored afterwards
    torch_picks = {rendezvous_api.RendezvousStoreInfo.build(0, HashStore(), "127.0.0.1").master_port for _ in range(5)}
    assert all(low <= port <= high for port in torch_picks)  # the race is real: torch's own picks
    pick_rank_zero_ports_outside_the_ephemeral_range()
    ours = {rendezvous_api.RendezvousStoreInfo.build(0, HashStore(), "127.0.0.1").master_port for _ in range(5)}
    assert not any(low <= port <= high for port in ours), ours


def _rank_1_killed_then_rank_0_fails(index: int) -> None:
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # rank 0 fails on the lost peer a moment later
    sys.exit(1)


def test_the_agent_reports_every_forked_ranks_exit_where_torchrun_names_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 SIGKILLed, then rank 0 failing on it, both gone before the agent looks: torchrun's join reports
    rank 0 alone (the first in its order). The agent's own lines give both exits, rank 1's signal included."""
    from torch.multiprocessing import ProcessExitedException, start_processes
    from torch.multiprocessing.spawn import ProcessContext

    from clusterfit.backends.agent import report_every_rank_exit
    from clusterfit.outputs.logs import rank_process_exits

    monkeypatch.setattr(ProcessContext, "join", ProcessContext.join)  # restored after the test
    report_every_rank_exit()
    context = start_processes(_rank_1_killed_then_rank_0_fails, nprocs=2, join=False, start_method="fork")
    wait_for(lambda: not any(p.is_alive() for p in context.processes), 30, "both ranks to exit")
    with pytest.raises(ProcessExitedException) as raised:
        context.join(-1)
    assert raised.value.error_index == 0, "torchrun's report: the rank that only lost its peer"
    host, (rank_0, rank_1) = socket.gethostname(), context.pids()
    assert rank_process_exits(capsys.readouterr().err.splitlines()) == {(host, rank_0): 1, (host, rank_1): -9}


def test_an_export_that_computes_something_else_than_the_model_is_flagged(tmp_path: Path) -> None:
    """The TorchScript copy is checked on an image other than the one traced: a model that branches on its
    input's values is traced down one branch, and the export says so; a plain model exports silently."""
    import warnings

    from clusterfit.worker.export import export_model

    class BranchesOnItsInput(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            pooled = images.mean(dim=(2, 3))
            return pooled if pooled.sum() > 0 else -pooled  # traced on zeros: the second branch only

    metadata = {"model": "test", "classes": ["a", "b", "c"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_model(torch.nn.Conv2d(3, 3, 1), tmp_path / "plain", metadata=metadata, image_size=8)
        assert not [w for w in caught if "TorchScript export" in str(w.message)]
        export_model(BranchesOnItsInput(), tmp_path / "branching", metadata=metadata, image_size=8)
    flagged = [str(w.message) for w in caught if "TorchScript export" in str(w.message)]
    assert len(flagged) == 1 and "load the safetensors weights" in flagged[0], [str(w.message) for w in caught]
    assert (tmp_path / "branching" / "model.torchscript.pt").exists()  # written, as torch's own check leaves it


def test_long_lived_imports_run_no_collection_and_freeze_what_they_made() -> None:
    from clusterfit.processes import long_lived_imports

    frozen_before = gc.get_freeze_count()
    try:
        with long_lived_imports():
            assert not gc.isenabled()
            made = [[index] for index in range(1000)]  # containers the collector would track
        assert gc.isenabled() and gc.get_freeze_count() >= frozen_before + len(made)
        gc.disable()
        with long_lived_imports():  # a caller's own choice is left as it was
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_help_shows_extras_and_layouts_as_written_and_reflows_paragraphs() -> None:
    """Help texts are Markdown: rich's own markup took `clusterfit[bench]` for a style and printed `clusterfit`."""
    bench = run_cli("bench", "data", "--help").stdout
    assert "(needs clusterfit[bench])" in " ".join(bench.replace("│", " ").split())
    assert "SRC/<class>/<image>" in run_cli("data", "pack", "--help").stdout
    # A docstring's paragraph wrapped in the source reflows: its first line fills the 200 columns run_cli sets.
    plan = run_cli("plan", "--help").stdout
    assert "the step split into compute, exposed all-reduce and input pipeline" in plan
