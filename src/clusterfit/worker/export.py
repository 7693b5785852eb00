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
        torch.jit.trace(model, example).save(str(scripted))
    return [weights, scripted]
