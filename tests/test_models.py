"""The model catalogue: every torchvision classification model by name, checked in the spec before any worker
starts; each family takes a training step, and trains on 2 ranks and exports; a non-ResNet model runs as a job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, tiny_job, write_job

from clusterfit.models import build_model, load_weights
from clusterfit.outputs.model_card import IMAGENET_MEAN, IMAGENET_STD
from clusterfit.scoring import load_classifier
from clusterfit.spec import SpecError, validate_spec
from clusterfit.spec.model_names import MODEL_NAMES, image_size_problem

# One of each family the docs name, at the smallest image size it takes.
FAMILIES = [
    ("resnext50_32x4d", 16), ("wide_resnet50_2", 16), ("regnet_x_400mf", 16), ("mobilenet_v2", 16),
    ("mobilenet_v3_small", 16), ("efficientnet_b0", 16), ("efficientnet_v2_s", 16), ("convnext_tiny", 32),
    ("vit_b_32", 32), ("swin_t", 16), ("swin_v2_t", 16), ("densenet121", 32), ("vgg11_bn", 32), ("alexnet", 64),
    ("googlenet", 16), ("inception_v3", 75), ("mnasnet0_5", 16), ("shufflenet_v2_x0_5", 16), ("squeezenet1_1", 32),
]  # fmt: skip


def test_the_catalogue_is_torchvision_s_classification_models() -> None:
    import torchvision

    assert set(MODEL_NAMES) == set(torchvision.models.list_models(module=torchvision.models)) - {"maxvit_t"} | {
        "resnet_tiny"
    }


@pytest.mark.parametrize(("name", "size"), FAMILIES)
def test_each_family_takes_a_training_step_at_its_smallest_size(name: str, size: int) -> None:
    assert image_size_problem(name, size) is None
    torch.manual_seed(0)
    model = build_model(name, num_classes=3, image_size=size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(2, 3, size, size)), torch.tensor([0, 2]))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)


def test_plain_weights_load_into_a_model_that_checks_its_modules_versions() -> None:
    """Safetensors files hold no per-module `version`, which MNASNet insists on when loading; an exported MNASNet
    must still load (scoring, serving, fine-tuning, the best epoch's export)."""
    torch.manual_seed(0)
    plain = {name: tensor.clone() for name, tensor in build_model("mnasnet0_5", 3, image_size=16).state_dict().items()}
    target = build_model("mnasnet0_5", 3, image_size=16)
    with pytest.raises(ValueError, match="version should be set to 1 or 2"):
        target.load_state_dict(plain)
    load_weights(target, plain)
    assert all(torch.equal(target.state_dict()[name], tensor) for name, tensor in plain.items())


# NOTE: VGG-11 (133M parameters) and Wide ResNet-50 (69M) would make the job below move and write 1.6 GB for
# layers that other families already cover (plain convolutions; ResNet blocks, exported by every ResNet job).
TWO_RANK_FAMILIES = [(name, size) for name, size in FAMILIES if name not in ("vgg11_bn", "wide_resnet50_2")]


def test_each_family_trains_on_two_ranks_and_exports(tmp_path: Path) -> None:
    """One job of 2 ranks: each family built from a validated spec by the trainer's model factory, wrapped by its
    DDP strategy, 2 steps on different data per rank, the same weights on both ranks, exported by rank 0 as a job
    exports its model; each export then loads and answers, and its TorchScript copy agrees."""
    out = tmp_path / "out"
    script = REPO / "tests" / "scripts" / "every_family.py"
    job = {
        "name": "every-family",
        "command": f"python {script} " + " ".join(f"{name}:{size}" for name, size in TWO_RANK_FAMILIES),
        "environment_variables": {"OUT": str(out / "models")},
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name, size in TWO_RANK_FAMILIES:
        assert f"[rank1] {name}: trained 2 steps on 2 ranks" in result.stdout, name
        classifier = load_classifier(out / "models" / name)
        assert classifier.metadata["model"] == name
        images = torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8)
        probabilities = classifier.predict(images)
        assert probabilities.shape == (2, 3) and torch.allclose(probabilities.sum(dim=1), torch.ones(2), atol=1e-5)
        scripted = torch.jit.load(str(out / "models" / name / "model.torchscript.pt"))
        mean, std = (torch.tensor(values).view(1, 3, 1, 1) * 255 for values in (IMAGENET_MEAN, IMAGENET_STD))
        with torch.no_grad():
            logits = scripted((images.float() - mean) / std)
        assert torch.allclose(logits.softmax(dim=1), probabilities, atol=1e-4), name


@pytest.mark.parametrize(
    ("trainer", "size", "message"),
    [
        ({"model": "vgg"}, 32, "trainer.model: 'vgg' is unknown; use a torchvision classification model such as"),
        ({"model": "vit_b_16"}, 40, "data.image_size = 40: vit_b_16 cuts images into 16-pixel patches; use a"),
        ({"model": "alexnet"}, 32, "data.image_size = 32: alexnet needs images of at least 64 px"),
        (
            {"model": "alexnet", "data": {"train_crop_size": 48}},
            64,
            "data.train_crop_size = 48: alexnet needs images of at least 64 px",
        ),
        (
            {"model": "vit_b_16", "data": {"val_crop_size": 48}},
            32,
            "data.val_crop_size = 48: vit_b_16 is built for data.image_size = 32 and takes only that size; set "
            "val_crop_size to 32 or null",
        ),
        ({"model": "mobilenet_v2", "norm_layer": "group"}, 32, "norm_layer: group applies to ResNet-style models"),
        (
            {"model": "efficientnet_b0", "strategy": "pipeline", "batch_size": 4},
            32,
            "strategy pipeline cuts ResNet-style models at their residual stages, not efficientnet_b0",
        ),
    ],
)
def test_a_model_that_cannot_run_the_job_is_refused_in_one_line(
    tmp_path: Path, trainer: dict, size: int, message: str
) -> None:
    job = tiny_job(tmp_path / "out", **trainer)
    job["trainer"]["data"]["image_size"] = size
    with pytest.raises(SpecError) as error:
        validate_spec(job)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_non_resnet_model_trains_on_two_ranks_and_exports(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out", model="mobilenet_v3_small", steps_per_epoch=2)
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 0, result.stderr
    classifier = load_classifier(tmp_path / "out" / "model")
    assert classifier.metadata["model"] == "mobilenet_v3_small"
    probabilities = classifier.predict(torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8))
    assert probabilities.shape == (3, 10)
