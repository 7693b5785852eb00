"""Which models `trainer.model` may name, and the image sizes each can take: torch-free, so a spec is checked
without loading torchvision.

Every classification model of the pinned torchvision (a test compares this list with
`torchvision.models.list_models`) except MaxViT, whose attention windows fix its input at 224 px, plus
`resnet_tiny` (one block per stage) for tests. The minimum sizes were found by running each model's forward
pass at increasing sizes; the test checks each one still builds and runs at its minimum."""

from __future__ import annotations

import re

from clusterfit.spec.errors import did_you_mean

RESNET_FAMILY = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2",
    "resnet_tiny",
)  # fmt: skip
_REGNET_FLOPS = ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")
OTHER_MODELS = (
    "alexnet",
    *(f"convnext_{size}" for size in ("tiny", "small", "base", "large")),
    *(f"densenet{depth}" for depth in (121, 161, 169, 201)),
    *(f"efficientnet_b{n}" for n in range(8)),
    *(f"efficientnet_v2_{size}" for size in ("s", "m", "l")),
    "googlenet",
    "inception_v3",
    *(f"mnasnet{width}" for width in ("0_5", "0_75", "1_0", "1_3")),
    "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small",
    *(f"regnet_{kind}_{flops}" for kind in "xy" for flops in _REGNET_FLOPS),
    "regnet_y_128gf",
    *(f"shufflenet_v2_x{width}" for width in ("0_5", "1_0", "1_5", "2_0")),
    "squeezenet1_0", "squeezenet1_1",
    *(f"swin_{size}" for size in ("t", "s", "b")),
    *(f"swin_v2_{size}" for size in ("t", "s", "b")),
    *(f"vgg{depth}{bn}" for depth in (11, 13, 16, 19) for bn in ("", "_bn")),
    "vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14",
)  # fmt: skip
MODEL_NAMES = (*RESNET_FAMILY, *OTHER_MODELS)
EXAMPLES = "resnet50, efficientnet_b0, mobilenet_v3_small, convnext_tiny, vit_b_16, swin_t"

# Smallest image_size each model's forward pass takes (its last feature map would be empty below it).
_MIN_IMAGE_SIZE = {"alexnet": 64, "inception_v3": 75}
_MIN_BY_PREFIX = {"convnext_": 32, "densenet": 32, "squeezenet": 32, "vgg": 32}
_VIT_PATCH = re.compile(r"^vit_\w_(\d+)$")


def unknown_model(name: str) -> str | None:
    if name in MODEL_NAMES:
        return None
    return (
        f"{name!r} is unknown{did_you_mean(name, MODEL_NAMES)}; use a torchvision classification model such as "
        f"{EXAMPLES} (docs/training.md lists all)"
    )


def image_size_problem(model: str, image_size: int) -> str | None:
    """Why `model` cannot take `image_size` x `image_size` images, or None."""
    patch = _VIT_PATCH.match(model)
    if patch and image_size % int(patch.group(1)):
        return f"{model} cuts images into {patch.group(1)}-pixel patches; use a multiple of {patch.group(1)}"
    smallest = _MIN_IMAGE_SIZE.get(model) or next(
        (size for prefix, size in _MIN_BY_PREFIX.items() if model.startswith(prefix)), 16
    )
    if image_size < smallest:
        return f"{model} needs images of at least {smallest} px"
    return None


def input_size_is_fixed(model: str) -> bool:
    """Vision transformers build their position embeddings for one image_size and take no other."""
    return model.startswith("vit_")


def has_residual_stages(model: str) -> bool:
    """ResNet-style models: `norm_layer: group`, the pipeline cut at layer1..layer4 and per-block FSDP apply."""
    return model in RESNET_FAMILY
