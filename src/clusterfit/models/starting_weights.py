"""Starting weights for fine-tuning: a state dict from a file (safetensors, or a torchvision-style state dict
read with `weights_only=True`, never unpickling code), fitted to the job's model. The classifier head is left
freshly initialised when the class count differs; any other mismatch is a one-line refusal."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from clusterfit.errors import SpecError
from clusterfit.models import load_weights

FIELD = "trainer.init.weights"


@dataclass(frozen=True)
class StartingWeights:
    path: str
    sha256: str
    loaded: int  # tensors taken from the file
    replaced: list[str]  # the head's tensors, left at their fresh initialisation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        head = f"; head replaced ({', '.join(self.replaced)})" if self.replaced else ""
        return f"starting weights {self.path} (sha256 {self.sha256[:12]}): {self.loaded} tensors{head}"


def classifier_head(model: nn.Module) -> str:
    """The name of the model's last Linear layer: the classifier every torchvision classification model ends in."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise SpecError(f"{FIELD}: the model has no Linear classifier to replace; start from scratch (init: null)")
    return linears[-1]


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # torchvision's reference checkpoints keep the weights under "model"
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise SpecError(f"{FIELD} = {str(path)!r}: holds no state dict of tensors; give a .safetensors file")
    return state


def load_starting_weights(model: nn.Module, path: str) -> StartingWeights:
    """Copy the file's weights into `model` (in place) and say what was taken."""
    file = Path(path)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    state = {name.removeprefix("module."): tensor for name, tensor in _read_state(file).items()}
    own = model.state_dict()
    head = classifier_head(model) + "."
    missing = sorted(set(own) - set(state))
    misfits = sorted(name for name in set(own) & set(state) if own[name].shape != state[name].shape)
    replaced = [name for name in missing + misfits if name.startswith(head)]
    problems = [name for name in missing + misfits if name not in replaced]
    if problems:
        raise SpecError(
            f"{FIELD} = {path!r}: {len(problems)} of the model's {len(own)} tensors are missing or shaped "
            f"differently (e.g. {problems[0]}); give weights of the same model (trainer.model)"
        )
    load_weights(model, {name: state[name] for name in own if name not in replaced}, strict=False)
    return StartingWeights(path=path, sha256=digest, loaded=len(own) - len(replaced), replaced=replaced)


def backbone_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter except the classifier head's: what `freeze_backbone_epochs` holds still."""
    head = classifier_head(model) + "."
    return [parameter for name, parameter in model.named_parameters() if not name.startswith(head)]
