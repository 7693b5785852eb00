"""The trained model as files other tools load: safetensors weights and a TorchScript program."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from clusterfit.outputs import model_torchscript, model_weights


def export_model(model: nn.Module, out_dir: Path, *, metadata: dict[str, Any], image_size: int) -> list[Path]:
    """Write fp32 CPU copies; `metadata` (model name, classes, spec...) travels inside the safetensors header."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.float().cpu().eval()
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    weights = model_weights(out_dir)
    save_file(state, str(weights), metadata={key: json.dumps(value) for key, value in metadata.items()})
    scripted = model_torchscript(out_dir)
    example = torch.zeros(1, 3, image_size, image_size)
    with warnings.catch_warnings(), torch.no_grad():
        # NOTE: TorchScript is deprecated upstream in favour of torch.export, but it is still what most
        # serving stacks (TorchServe, Triton's libtorch backend, C++ libtorch) load without Python.
        warnings.simplefilter("ignore", FutureWarning)
        # torch's own check_trace traces the model a second time and diffs the two graphs' text: two thirds of
        # the export's time (EfficientNet-V2-S: 5.8 of 8 s). What a loader of the file relies on is checked once.
        traced = torch.jit.trace(model, example, check_trace=False)
        # Its own generator: the export leaves the job's random state as it found it.
        other_image = torch.rand(example.shape, generator=torch.Generator().manual_seed(0))
        _warn_unless_it_computes_the_same(traced, model, other_image)
        traced.save(str(scripted))
    return [weights, scripted]


def _warn_unless_it_computes_the_same(traced: torch.jit.ScriptModule, model: nn.Module, image: torch.Tensor) -> None:
    """Warns, as torch's own trace check does, when the traced program's answer differs from the model's, here
    on an image other than the one traced: a model whose Python code branches on its input's values traces one
    branch only."""
    try:
        # Run as traced: the profiling executor's optimisation of a first call serves later calls, and there are
        # none here (EfficientNet-V2-S: 0.40 s against 0.07); a loader of the file optimises its own copy.
        with torch.jit.optimized_execution(False):
            answer = traced(image)
        torch.testing.assert_close(answer, model(image), rtol=1e-5, atol=1e-5)
    except AssertionError as difference:
        warnings.warn(
            f"the TorchScript export does not compute what the model does ({difference}); "
            "load the safetensors weights (clusterfit.scoring) instead",
            torch.jit.TracerWarning,
            stacklevel=3,
        )
