"""Accuracy on a small real dataset: the trainer's augmentation presets, or its gradient compressions, side by
side, several seeds.

The data is scikit-learn's bundled handwritten digits (1,797 real 8x8 greyscale scans of 10 classes, shipped
inside the package, so nothing is downloaded), rendered once as 32x32 RGB PNGs (bicubic upscaling) in an
ImageNet-layout folder with a fixed stratified 80/20 train/val split. Each configuration trains the same
ResNet-18 with the same optimizer, schedule, epochs and global batch on 2 local ranks; what differs is the
augmentation (`--compare augmentation`) or what DDP all-reduces (`--compare grad-compression`: fp32 gradients,
or `trainer.grad_compression` fp16, bf16, PowerSGD rank 1 or 4). Reported per configuration: final val top-1
per seed, the mean, and the job time at which val top-1 first reached --target (from summary.json's per-epoch
`elapsed_s`).

    pip install -e ".[bench]"
    python benchmarks/accuracy.py --seeds 0,1,2 --epochs 8 --target 0.9
    python benchmarks/accuracy.py --compare grad-compression --seeds 0,1,2 --epochs 8 --target 0.9
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from clusterfit.bench.machine import cpu_model

RANKS = 2
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4  # clusterfit leaves normalisation weights and biases undecayed
WARMUP_EPOCHS = 1

COMPARISONS: dict[str, dict[str, dict[str, Any]]] = {
    "augmentation": {
        "small preset (auto at 32 px)": {"augment": {"preset": "auto"}},
        "imagenet preset": {"augment": {"preset": "imagenet"}},
        "small + mixup 0.2 + label smoothing 0.1": {
            "augment": {"preset": "small", "mixup_alpha": 0.2},
            "label_smoothing": 0.1,
        },
    },
    "grad-compression": {
        "fp32 gradients (no compression)": {},
        "fp16 gradients": {"grad_compression": "fp16"},
        "bf16 gradients": {"grad_compression": "bf16"},
        "PowerSGD rank 1": {"grad_compression": "powersgd", "powersgd_rank": 1},
        "PowerSGD rank 4 (the default)": {"grad_compression": "powersgd"},
    },
}


def render_digits(root: Path, size: int = 32) -> Path:
    """scikit-learn's digits as <root>/{train,val}/<digit>/<n>.png; the split is stratified and fixed."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train, val = train_test_split(indices, test_size=0.2, stratify=digits.target, random_state=0)
    for split, chosen in (("train", train), ("val", val)):
        for index in chosen:
            folder = root / split / str(digits.target[index])
            folder.mkdir(parents=True, exist_ok=True)
            grey = (digits.images[index] * (255 / 16)).astype(np.uint8)  # values 0..16
            image = Image.fromarray(grey).resize((size, size), Image.Resampling.BICUBIC).convert("RGB")
            image.save(folder / f"{index:04d}.png")
    return root


def write_job(
    workdir: Path, out: Path, data: Path, trainer: dict[str, Any], seed: int, args: argparse.Namespace
) -> Path:
    """The job file of one configuration and seed; `trainer` overrides the shared settings (`data` key by key)."""
    data_spec = {"train": str(data / "train"), "val": str(data / "val"), "image_size": 32, "loader_workers": 1}
    job = {
        "name": "accuracy",
        "trainer": {
            "model": args.model,
            "epochs": args.epochs,
            "batch_size": args.batch // RANKS,
            "optimizer": {"name": "sgd", "lr": args.lr, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY},
            "schedule": {"kind": "cosine", "warmup_epochs": WARMUP_EPOCHS},
            "precision": args.precision,
            "log_every_steps": 1000,
            "checkpoint": {"every_steps": None, "keep": 1},
            "seed": seed,
            **trainer,
            "data": {**data_spec, **trainer.get("data", {})},
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": RANKS},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    spec = workdir / f"{out.name}.yaml"
    spec.write_text(yaml.safe_dump(job, sort_keys=False))
    return spec


def run(workdir: Path, data: Path, config: int, trainer: dict[str, Any], seed: int, args: argparse.Namespace) -> dict:
    out = workdir / f"config{config}-seed{seed}"
    spec = write_job(workdir, out, data, trainer, seed, args)
    result = subprocess.run(
        [sys.executable, "-m", "clusterfit", "run", str(spec)], capture_output=True, text=True, timeout=3600
    )
    if result.returncode:
        raise SystemExit(f"{out.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    reached = next((e["elapsed_s"] for e in summary["epochs"] if e.get("val_top1", 0) >= args.target), None)
    return {
        "val_top1": summary["final"]["val_top1"],
        "seconds_to_target": reached,
        "wall_seconds": summary["wall_seconds"],
        "precision": summary["precision"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help=f"global batch ({RANKS} ranks)")
    parser.add_argument("--lr", type=float, default=0.4, help="per 256 images, as trainer.optimizer.lr")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.9, help="val top-1 for the time-to-accuracy column")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="augmentation")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/accuracy.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = render_digits(workdir / "digits")
        for seed in seeds:  # seeds outermost: a drifting machine speed touches every configuration alike
            for config, (name, trainer) in enumerate(COMPARISONS[args.compare].items()):
                results.setdefault(name, []).append(run(workdir, data, config, trainer, seed, args))
                print(f"{name} seed {seed}: {results[name][-1]}", flush=True)

    cpu = cpu_model()
    print(
        f"\n{args.model}, 32 px digits (1,437 train / 360 val), {args.epochs} epochs, global batch {args.batch}, "
        f"2 ranks, {results[next(iter(results))][0]['precision']}, {cpu}"
    )
    print(f"| configuration | val top-1 per seed | mean | seconds to {args.target:.0%} per seed |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        tops = [r["val_top1"] for r in runs]
        times = ["-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.0f}" for r in runs]
        print(f"| {name} | {', '.join(f'{t:.3f}' for t in tops)} | {statistics.mean(tops):.3f} | {', '.join(times)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
