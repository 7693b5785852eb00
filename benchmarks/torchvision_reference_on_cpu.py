"""Runs torchvision's classification reference script (references/classification/train.py) on CPU ranks under
torchrun, for benchmarks/accuracy_peer.py. The script is written for one CUDA device per rank; the patches below
let it run over gloo on CPUs and leave its training loop, data loading and evaluation as they are.

    git clone https://github.com/pytorch/vision    # no torchvision release ships the reference scripts
    torchrun --standalone --nproc-per-node 2 benchmarks/torchvision_reference_on_cpu.py \\
        --reference vision/references/classification --seed 0 -- --device cpu --data-path DIGITS ...

Everything after `--` goes to train.py unchanged.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch.nn.parallel import DistributedDataParallel

from clusterfit.spec.model import AugmentSpec

# clusterfit's `small` preset, stated once by clusterfit itself.
SMALL_PRESET = AugmentSpec(preset="small").resolved(32)


class CpuDistributedDataParallel(DistributedDataParallel):
    """DDP without device_ids: train.py passes device_ids=[LOCAL_RANK], which DDP refuses for a CPU module."""

    def __init__(self, module: torch.nn.Module, device_ids: list[int] | None = None, **kwargs: Any) -> None:
        devices = {parameter.device.type for parameter in module.parameters()}
        if devices != {"cpu"}:
            raise SystemExit(f"the model is on {sorted(devices)}, not the CPU; pass --device cpu to train.py")
        super().__init__(module, **kwargs)


def run_on_cpu() -> None:
    # utils.init_distributed_mode calls torch.cuda.set_device(LOCAL_RANK) whatever --device says: no GPU to pick.
    torch.cuda.set_device = lambda device: None

    # ...and hard-codes backend="nccl", which needs CUDA; gloo is PyTorch's CPU backend.
    init_process_group = torch.distributed.init_process_group

    def init_gloo(*args: Any, **kwargs: Any) -> None:
        init_process_group(*args, **{**kwargs, "backend": "gloo"})

    torch.distributed.init_process_group = init_gloo

    # utils.reduce_across_processes (and SmoothedValue in older versions) makes the tensors it all-reduces with
    # device="cuda"; gloo reduces CPU tensors. Nothing else asks for "cuda" once train.py has --device cpu.
    make_tensor = torch.tensor

    def tensor_on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return make_tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.tensor = tensor_on_cpu
    torch.nn.parallel.DistributedDataParallel = CpuDistributedDataParallel


def use_small_preset() -> None:
    """ClassificationPresetTrain takes hflip_prob but fixes RandomResizedCrop's area range at 8-100 %: this
    gives it clusterfit's `small` preset (area 64-100 %, no flip), for a comparison of the training loops alone."""
    import presets  # the reference's own module, the one train.py imports next

    build = presets.ClassificationPresetTrain.__init__

    def build_small(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **{**kwargs, "hflip_prob": 0.5 if SMALL_PRESET.flip else 0.0})
        (crop,) = [step for step in self.transforms.transforms if type(step).__name__ == "RandomResizedCrop"]
        crop.scale, crop.ratio = SMALL_PRESET.crop_scale, SMALL_PRESET.crop_ratio

    presets.ClassificationPresetTrain.__init__ = build_small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="the references/classification folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small-preset", action="store_true", help="clusterfit's small augmentation preset")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's own arguments")
    args = parser.parse_args()
    train = args.reference / "train.py"
    if not train.is_file():
        raise SystemExit(f"--reference {args.reference}: no train.py there; give vision/references/classification")

    run_on_cpu()
    # NOTE: train.py seeds nothing. A seed names a run here: the initial weights (DDP broadcasts rank 0's) and
    # each rank's augmentation stream; its DistributedSampler shuffles with its own fixed seed, whatever this is.
    torch.manual_seed(1000 * args.seed + int(os.environ.get("RANK", "0")))
    sys.path.insert(0, str(args.reference))  # train.py imports presets, utils, transforms and sampler beside it
    if args.small_preset:
        use_small_preset()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    sys.argv = [str(train), *train_args]
    runpy.run_path(str(train), run_name="__main__")


if __name__ == "__main__":
    main()
