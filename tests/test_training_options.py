"""The trainer's options for real datasets: MixUp/CutMix, gradient clipping, validation every N epochs, and
ending a job early (a target metric reached, or no improvement): decided from the history, refused in one
line when they cannot work, and run for real on 2 ranks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import exported_weights, kill_after_first_checkpoint, max_abs_difference, run_cli, tiny_job, write_job
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import save_file

from clusterfit.data.batch_mix import batch_mix
from clusterfit.errors import SpecError
from clusterfit.models import build_model
from clusterfit.models.starting_weights import load_starting_weights
from clusterfit.spec.model import AugmentSpec, EarlyStoppingSpec, TrainerSpec
from clusterfit.worker.stopping import early_stop

# The two jobs share one trained model (a module fixture): one worker runs them.
pytestmark = pytest.mark.xdist_group("training_options")


def _epochs(*values: float | None, metric: str = "val_top1") -> list[dict]:
    """Epoch records as the trainer keeps them; None = an epoch without validation."""
    return [
        {"epoch": n, "elapsed_s": 10.0 * n, **({} if value is None else {metric: value})}
        for n, value in enumerate(values, start=1)
    ]


def test_stop_at_ends_on_the_first_validation_that_reaches_the_target() -> None:
    assert early_stop(_epochs(0.5, 0.9), {"val_top1": 0.95}, None) is None
    stop = early_stop(_epochs(0.5, 0.9, 0.96), {"val_top1": 0.95}, None)
    assert stop is not None and (stop.reason, stop.epoch, stop.value, stop.elapsed_s) == ("stop_at", 3, 0.96, 30.0)
    # A loss target is reached from above.
    assert early_stop(_epochs(2.0, 0.4, metric="val_loss"), {"val_loss": 0.5}, None).epoch == 2
    assert early_stop(_epochs(2.0, 0.6, metric="val_loss"), {"val_loss": 0.5}, None) is None
    # An epoch without validation decides nothing, even if an earlier one reached the target.
    assert early_stop(_epochs(0.99, None), {"val_top1": 0.95}, None) is None


def test_early_stopping_counts_validations_without_improvement() -> None:
    patience = EarlyStoppingSpec(metric="val_top1", patience=2, min_delta=0.01)
    assert early_stop(_epochs(0.5, 0.6, 0.6), {}, patience) is None  # one flat validation so far
    stop = early_stop(_epochs(0.5, 0.6, 0.6, 0.605), {}, patience)  # +0.005 is below min_delta
    assert stop is not None and (stop.reason, stop.value, stop.epoch) == ("early_stopping", 0.6, 4)
    assert early_stop(_epochs(0.5, 0.6, 0.6, 0.62), {}, patience) is None
    # Only validated epochs count towards patience.
    assert early_stop(_epochs(0.5, 0.6, None, 0.6, None), {}, patience) is None
    loss = EarlyStoppingSpec(metric="val_loss", patience=1)
    assert early_stop(_epochs(1.0, 0.8, 0.9, metric="val_loss"), {}, loss).value == 0.8
    assert early_stop(_epochs(1.0, 0.8, 0.7, metric="val_loss"), {}, loss) is None


@pytest.mark.parametrize(
    ("trainer", "names"),
    [
        ({"stop_at": {"val_top1": 0.9}}, ["stop_at", "data.val is null"]),
        ({"early_stopping": {"patience": 2}}, ["early_stopping", "data.val is null"]),
        ({"stop_at": {"top1": 0.9}, "data": {"val": "v"}}, ["stop_at", "top1"]),
        ({"clip_grad_norm": 1.0, "strategy": "pipeline"}, ["clip_grad_norm", "strategy ddp"]),
        ({"clip_grad_norm": 0}, ["clip_grad_norm"]),
        ({"augment": {"mixup_alpha": -1}}, ["mixup_alpha"]),
        ({"validate_every_epochs": 0}, ["validate_every_epochs"]),
        ({"ema": {"decay": 0.9}, "strategy": "fsdp"}, ["ema", "strategy ddp"]),
        ({"export_weights": "best"}, ["export_weights: best", "data.val is null"]),
        ({"accumulate_steps": 2, "strategy": "pipeline"}, ["accumulate_steps = 2", "accumulate_steps: 1"]),
        ({"ema": {"decay": 1.0}}, ["ema.decay"]),
        ({"init": {"weights": "w", "freeze_backbone_epochs": 1}, "strategy": "pipeline"}, ["freeze_backbone_epochs"]),
    ],
)
def test_options_that_cannot_work_are_refused_naming_the_field(trainer: dict, names: list[str]) -> None:
    data = {"train": "synthetic", "num_classes": 10, "image_size": 32, **trainer.pop("data", {})}
    with pytest.raises(ValidationError) as error:
        TrainerSpec(model="resnet_tiny", data=data, **trainer)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixup_and_cutmix_keep_shapes_and_give_labels_that_sum_to_one(mixup: float, cutmix: float) -> None:
    mix = batch_mix(AugmentSpec(mixup_alpha=mixup, cutmix_alpha=cutmix).resolved(32), num_classes=5)
    assert mix is not None
    images = torch.randn(8, 3, 32, 32).to(memory_format=torch.channels_last)
    labels = torch.arange(8) % 5
    torch.manual_seed(0)
    mixed, soft = mix(images, labels)
    assert mixed.shape == images.shape and mixed.dtype == images.dtype
    assert soft.shape == (8, 5)
    assert torch.allclose(soft.sum(dim=1), torch.ones(8))
    assert not torch.equal(mixed, images)  # something was mixed in
    assert batch_mix(AugmentSpec().resolved(32), num_classes=5) is None


def test_starting_weights_replace_only_a_head_of_another_class_count(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = build_model("resnet_tiny", 3, "group", 32)
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"model": source.state_dict()}, tmp_path / "reference.pth")  # torchvision reference's layout

    for name in ("w.safetensors", "reference.pth"):
        target = build_model("resnet_tiny", 5, "group", 32)
        taken = load_starting_weights(target, str(tmp_path / name))
        assert taken.replaced == ["fc.bias", "fc.weight"] and len(taken.sha256) == 64
        mine = target.state_dict()
        assert all(torch.equal(mine[k], v) for k, v in source.state_dict().items() if not k.startswith("fc."))
        assert mine["fc.weight"].shape == (5, 512)

    with pytest.raises(SpecError, match=r"trainer.init.weights = .*w.safetensors.*missing or shaped differently"):
        load_starting_weights(build_model("resnet18", 5, "group", 32), str(tmp_path / "w.safetensors"))


@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """2 ranks, MixUp+CutMix, a gradient norm clipped to almost nothing, validation every 2nd epoch, and a
    target every validation reaches; returns (job.yaml, outputs)."""
    from make_tiny_imagefolder import make_tiny_imagefolder

    root = tmp_path_factory.mktemp("stopped_early")
    data = make_tiny_imagefolder(root / "data", classes=3, train_per_class=16, val_per_class=5, size=40)
    out = root / "out"
    job = tiny_job(
        out,
        norm_layer="group",  # no running statistics: the parameters are all that training changes
        epochs=6,
        steps_per_epoch=2,
        validate_every_epochs=2,
        clip_grad_norm=1e-9,
        stop_at={"val_top1": 0.0},
        optimizer={"lr": 1.0, "weight_decay": 0.0},
        augment={"mixup_alpha": 0.2, "cutmix_alpha": 1.0},
        data={"train": str(data / "train"), "val": str(data / "val"), "num_classes": None},
        checkpoint={"min_interval_s": 3600},  # the job's seconds-long epochs: only the early stop's end is saved
    )
    spec = write_job(root / "job.yaml", job)
    result = run_cli("run", str(spec))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "checkpoints: every 100 steps, at an epoch's end once 3600 s have passed since the last one "
        "(checkpoint.min_interval_s), and at the last epoch" in result.stdout
    )
    assert "mixup alpha=0.2, cutmix alpha=1" in result.stdout
    assert "stopping early: val_top1 reached" in result.stdout
    return spec, out


def test_clipped_mixed_training_stops_at_its_target_and_a_rerun_does_not_train_on(
    stopped_early: tuple[Path, Path],
) -> None:
    """The job ends after epoch 2 of 6, and its weights barely moved."""
    spec, out = stopped_early

    summary = json.loads((out / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert "val_top1" not in summary["epochs"][0] and "val_top1" in summary["epochs"][1]
    assert 0 < summary["epochs"][0]["elapsed_s"] < summary["epochs"][1]["elapsed_s"]
    stopped = summary["stopped_early"]
    assert (stopped["reason"], stopped["metric"], stopped["epoch"]) == ("stop_at", "val_top1", 2)
    assert stopped["elapsed_s"] == summary["epochs"][1]["elapsed_s"]
    assert summary["steps"] == 4
    # Epoch 1 (step 2) came 3600 s too soon after the start for a checkpoint; the early stop's epoch is saved.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]
    card = json.loads((out / "model" / "model_card.json").read_text())
    assert "val_top1" in card["metrics"]
    # Per-class accuracy and the confusion matrix of the last validation agree with its totals.
    per_class = summary["per_class"]
    assert [row["class"] for row in per_class] == ["class_0", "class_1", "class_2"]
    assert sum(row["images"] for row in per_class) == summary["final"]["val_images"] == 15
    matrix = summary["confusion_matrix"]["rows_true_columns_predicted"]
    assert [sum(row) for row in matrix] == [row["images"] for row in per_class]
    assert sum(matrix[i][i] for i in range(3)) / 15 == pytest.approx(summary["final"]["val_top1"])
    with Image.open(out / "confusion_matrix.png") as png:
        assert png.size[0] == png.size[1] >= 3 * 10

    torch.manual_seed(0)  # the trainer's seed: the weights every rank starts from
    initial = build_model("resnet_tiny", 3, "group", 32).state_dict()
    trained = exported_weights(out)
    # 4 SGD steps at lr 1 with momentum move a weight by at most ~10 gradient norms: 1e-8 after clipping.
    assert max((trained[k] - initial[k]).abs().max().item() for k in initial) < 1e-7

    rerun = run_cli("run", str(spec))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_fine_tuning_starts_from_an_exported_model_with_a_new_head(
    tmp_path: Path, stopped_early: tuple[Path, Path]
) -> None:
    """A second job, 5 classes instead of 3, starts from the first one's export with its backbone frozen for
    its only epoch: the backbone comes out exactly as it went in, the new head trained."""
    weights = stopped_early[1] / "model" / "model.safetensors"
    out = tmp_path / "out"
    job = tiny_job(
        out,
        norm_layer="group",
        data={"num_classes": 5},
        init={"weights": str(weights), "freeze_backbone_epochs": 1},
    )
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "head replaced (fc.bias, fc.weight)" in result.stdout
    started, tuned = exported_weights(stopped_early[1]), exported_weights(out)
    assert all(torch.equal(tuned[k], v) for k, v in started.items() if not k.startswith("fc."))
    assert tuned["fc.weight"].shape == (5, 512)
    torch.manual_seed(0)  # the head the trainer initialised, before training moved it
    assert not torch.equal(tuned["fc.weight"], build_model("resnet_tiny", 5, "group", 32).state_dict()["fc.weight"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["starting_weights"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()

    job["trainer"]["init"]["weights"] = str(tmp_path / "missing.safetensors")
    refused = run_cli("run", str(write_job(tmp_path / "missing.yaml", job)))
    assert refused.returncode != 0
    assert (
        "trainer.init.weights = " in refused.stderr + refused.stdout
        and "no such file" in refused.stderr + refused.stdout
    )


def test_the_weight_average_resumes_exactly_and_is_what_is_exported(tmp_path: Path) -> None:
    """EMA with a short memory (decay 0.5), so it differs clearly from the raw weights: a job killed after its
    first checkpoint and rerun exports the average an uninterrupted job exports, and that average is not the
    raw model of the last checkpoint."""
    settings = {
        "norm_layer": "group",
        "steps_per_epoch": 4,
        "epochs": 2,
        "checkpoint": {"every_steps": 3, "keep": 2},
        "ema": {"decay": 0.5},
    }

    def one_process_job(out: Path) -> dict:  # averaging is per rank: one rank shows the resume as well as two
        job = tiny_job(out, **settings)
        job["distribution"]["process_count_per_instance"] = 1
        return job

    straight = tmp_path / "straight"
    result = run_cli("run", str(write_job(tmp_path / "straight.yaml", one_process_job(straight))))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    resumed = tmp_path / "resumed"
    job = write_job(tmp_path / "resumed.yaml", one_process_job(resumed))
    kill_after_first_checkpoint(job, resumed)
    rerun = run_cli("run", str(job))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming from" in rerun.stdout
    assert max_abs_difference(exported_weights(resumed), exported_weights(straight)) < 1e-6

    last = torch.load(straight / "checkpoints" / "step-00000008" / "state.pt", weights_only=True)
    average = {name.removeprefix("module."): t for name, t in last["ema"].items() if name.startswith("module.")}
    assert max_abs_difference(exported_weights(straight), average) < 1e-7
    assert max_abs_difference(exported_weights(straight), last["model"]) > 1e-4


def test_the_best_validation_s_weights_are_exported(tmp_path: Path, tiny_imagefolder: Path) -> None:
    """A learning rate too small to change a prediction: every epoch validates alike, so the first stays the best
    (ties keep the earlier one) while the weights still move. The export is epoch 1's checkpoint, bit for bit."""
    out = tmp_path / "out"
    job = tiny_job(
        out,
        norm_layer="group",
        epochs=3,
        steps_per_epoch=2,
        export_weights="best",
        best_metric="val_top1",
        optimizer={"lr": 1e-6},
        # Epochs 1 and 2 come long before the interval: epoch 1 is saved as the best, epoch 3 as the last.
        checkpoint={"every_steps": None, "keep": 3, "min_interval_s": 3600},
        data={"train": str(tiny_imagefolder / "train"), "val": str(tiny_imagefolder / "val"), "num_classes": None},
    )
    job["distribution"]["process_count_per_instance"] = 1
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len({e["val_top1"] for e in summary["epochs"]}) == 1 and summary["exported_epoch"] == 1
    assert "exporting the weights of epoch 1, the best val_top1" in result.stdout

    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000006"]
    exported = exported_weights(out)
    first, last = (torch.load(out / "checkpoints" / f"step-{s:08d}" / "state.pt")["model"] for s in (2, 6))
    assert all(torch.equal(exported[k], first[k]) for k in first)
    assert not all(torch.equal(exported[k], last[k]) for k in last)
    card = json.loads((out / "model" / "model_card.json").read_text())
    assert card["metrics"]["val_top1"] == summary["epochs"][0]["val_top1"]
