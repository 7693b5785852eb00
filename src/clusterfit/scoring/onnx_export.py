"""`clusterfit export MODEL_DIR`: an ONNX model beside the safetensors weights, with a dynamic batch, checked
against the PyTorch model before it is kept.

torch's current exporter (`torch.onnx.export(..., dynamo=True)`, through torch.export) writes the graph; ONNX
Runtime then scores the same inputs as PyTorch — real images through the validation transform the model card
states, or random inputs without them — at two batch sizes, and the export is kept only if the probabilities
agree within the tolerance and the top-1 classes are the same. The result goes into the model card's checks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clusterfit.errors import ClusterfitError
from clusterfit.outputs.layout import model_onnx
from clusterfit.outputs.model_card import Preprocessing, read_model_card, write_model_card

DEFAULT_TOLERANCE = 1e-4  # on probabilities; fp32 kernels of two runtimes differ by ~1e-7 on small models
_CHECK_IMAGES = 8


class ExportError(ClusterfitError):
    """The export cannot be made or does not match the PyTorch model; never retried."""


@dataclass(frozen=True)
class OnnxCheck:
    path: Path
    inputs: str  # what was compared: "N images from FOLDER" or "N random inputs"
    max_abs_diff: float  # of the class probabilities, over every input
    tolerance: float
    same_top1: bool


def require_onnx() -> None:
    import importlib.util

    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"clusterfit export needs {', '.join(missing)}: pip install 'clusterfit[onnx]'")


def export_onnx(model_dir: Path, images: Path | None = None, tolerance: float = DEFAULT_TOLERANCE) -> OnnxCheck:
    require_onnx()
    import numpy as np
    import onnxruntime
    import torch

    from clusterfit.scoring import load_classifier

    model = load_classifier(model_dir).model
    # NOTE: the graph's image side is fixed (only the batch is dynamic): the card's validation crop, what
    # scorers and servers feed it.
    inputs, what = _inputs(images, read_model_card(model_dir).preprocessing)
    path = model_onnx(model_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.onnx.export(
            model, (inputs[:1],), dynamo=True, dynamic_shapes=({0: batch},), verbose=False, optimize=True
        )
    program.save(str(tmp))
    session = onnxruntime.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    worst, same_top1 = 0.0, True
    for part in (inputs[:1], inputs):  # one image, then the whole batch: the batch dimension is dynamic
        with torch.no_grad():
            expected = model(part).softmax(dim=1).numpy()
        logits = session.run(None, {name: part.numpy()})[0]
        got = np.exp(logits - logits.max(axis=1, keepdims=True))
        got /= got.sum(axis=1, keepdims=True)
        worst = max(worst, float(np.abs(got - expected).max()))
        same_top1 &= bool((got.argmax(axis=1) == expected.argmax(axis=1)).all())
    check = OnnxCheck(path, what, worst, tolerance, same_top1)
    if worst > tolerance or not same_top1:
        tmp.unlink()
        raise ExportError(
            f"the ONNX export of {model_dir} disagrees with PyTorch on {what}: probabilities differ by up to "
            f"{worst:.2g} (tolerance {tolerance:g}), same top-1: {same_top1}; nothing was kept"
        )
    os.replace(tmp, path)
    card = read_model_card(model_dir)
    checks = {**card.checks, "onnx": {**dataclasses.asdict(check), "path": path.name}}
    write_model_card(model_dir, dataclasses.replace(card, checks=checks))
    return check


def _inputs(images: Path | None, preprocessing: Preprocessing):  # noqa: ANN202 - a torch.Tensor, imported on demand
    """Normalised NCHW float inputs: real images through the model card's validation transform, else random ones."""
    import torch

    from clusterfit.data.decode import BadImage
    from clusterfit.data.imagefolder import preprocessing_transform

    if images is None:
        generator = torch.Generator().manual_seed(0)
        size = preprocessing.center_crop
        return torch.randn(_CHECK_IMAGES, 3, size, size, generator=generator), f"{_CHECK_IMAGES} random inputs"
    crop = preprocessing_transform(preprocessing)
    decoded = []
    for file in _image_files(images):
        with contextlib.suppress(BadImage):  # an unreadable file is no comparison; the next one is
            decoded.append(crop(str(file)))
        if len(decoded) == _CHECK_IMAGES:
            break
    if not decoded:
        raise ExportError(f"--images {images}: no readable .jpg, .jpeg, .png or .webp file; pass a folder of images")
    pixels = torch.stack(decoded).float() / 255
    mean = torch.tensor(preprocessing.mean).view(1, 3, 1, 1)
    std = torch.tensor(preprocessing.std).view(1, 3, 1, 1)
    return (pixels - mean) / std, f"{len(decoded)} images from {images}"


def _image_files(folder: Path) -> Sequence[Path]:
    suffixes = {".jpg", ".jpeg", ".png", ".webp"}
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
