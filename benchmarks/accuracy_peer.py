"""clusterfit's trainer against torchvision's classification reference script, run as a peer with torchrun on the
same data, model, epochs, global batch, learning rate and ranks, several seeds, in one run of this script.

The data is benchmarks/accuracy.py's: scikit-learn's digits as 32x32 PNGs in an ImageNet-layout folder (1,437
train, 360 val). Both train ResNet-18 from scratch on 2 local CPU ranks over gloo, global batch 64, SGD with
momentum 0.9, weight decay 5e-4 (not on normalisation weights and biases), lr 0.4 per 256 images (0.1 here), one
warm-up epoch then cosine, fp32, one DataLoader worker per rank, and validate on the whole 32 px image every
epoch. The reference runs under benchmarks/torchvision_reference_on_cpu.py, which patches what ties it to CUDA.

Rows, run interleaved for each seed (clusterfit, then the peer with the same augmentation):
  - the `small` preset (crop area 64-100 %, no flip) on both; the reference's preset patched to match;
  - ImageNet's augmentation (area 8-100 %, flip), the reference as it is.

Both sides are timed alike, from the command's start: the wall time of the whole command, and the time at which
a validation line reaching --target was printed.

    git clone https://github.com/pytorch/vision
    pip install -e ".[bench]"
    python benchmarks/accuracy_peer.py vision/references/classification --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from accuracy import MOMENTUM, RANKS, WARMUP_EPOCHS, WEIGHT_DECAY, render_digits, write_job

from clusterfit.bench.machine import cpu_model

SHIM = Path(__file__).with_name("torchvision_reference_on_cpu.py")
IMAGE_PX = 32
CLUSTERFIT_VAL = re.compile(r"epoch (\d+) validation: top1 ([0-9.]+)")
REFERENCE_VAL = re.compile(r"^Test:\s+Acc@1 ([0-9.]+)")  # a percentage, printed by rank 0 after each epoch


@dataclass(frozen=True)
class Config:
    name: str
    trainer: str  # "clusterfit" or "reference"
    preset: str  # "small" or "imagenet"


CONFIGS = (
    Config("clusterfit, `small` preset", "clusterfit", "small"),
    Config("torchvision reference, preset patched to `small`", "reference", "small"),
    Config("clusterfit, `imagenet` preset", "clusterfit", "imagenet"),
    Config("torchvision reference as it is (ImageNet augmentation)", "reference", "imagenet"),
)


@dataclass
class Run:
    val_top1: float  # the last epoch's
    wall_seconds: float  # the whole command
    seconds_to_target: float | None  # from the command's start to the first validation at --target
    epoch_seconds: list[float]  # when each validation was printed, from the command's start


def timed(command: list[str], validation: re.Pattern[str], scale: float, log: Path, target: float) -> Run:
    """Run `command`, stamping each validation line as it is printed; `scale` turns its value into a share."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # rank 0's prints reach the pipe as they are made
    start = time.monotonic()
    stamps: list[tuple[float, float]] = []
    with (
        log.open("w") as out,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            found = validation.search(line)
            if found:
                stamps.append((time.monotonic() - start, float(found.groups()[-1]) * scale))
    wall = time.monotonic() - start
    if process.returncode or not stamps:
        raise SystemExit(f"{' '.join(command)} failed (exit {process.returncode}):\n{log.read_text()[-3000:]}")
    return Run(
        val_top1=stamps[-1][1],
        wall_seconds=wall,
        seconds_to_target=next((at for at, top1 in stamps if top1 >= target), None),
        epoch_seconds=[at for at, _ in stamps],
    )


def run_clusterfit(workdir: Path, data: Path, config: Config, seed: int, args: argparse.Namespace) -> Run:
    out = workdir / f"clusterfit-{config.preset}-seed{seed}"
    trainer = {
        "augment": {"preset": config.preset},
        # NOTE: the reference's --val-resize-size 32 --val-crop-size 32: the whole image, not ImageNet's 87.5 %.
        "data": {"val_resize_size": IMAGE_PX, "val_crop_size": IMAGE_PX},
    }
    spec = write_job(workdir, out, data, trainer, seed, args)
    command = [sys.executable, "-m", "clusterfit", "run", str(spec)]
    return timed(command, CLUSTERFIT_VAL, 1.0, out.with_suffix(".log"), args.target)


def run_reference(workdir: Path, data: Path, config: Config, seed: int, args: argparse.Namespace) -> Run:
    out = workdir / f"reference-{config.preset}-seed{seed}"
    out.mkdir()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", str(SHIM)),
        *("--reference", str(args.reference), "--seed", str(seed)),
        *(["--small-preset"] if config.preset == "small" else []),
        "--",
        *("--data-path", str(data), "--model", args.model, "--device", "cpu", "--workers", "1"),
        *("--epochs", str(args.epochs), "--batch-size", str(args.batch // RANKS)),
        *("--opt", "sgd", "--lr", f"{args.lr * args.batch / 256:g}", "--momentum", f"{MOMENTUM:g}"),
        *("--wd", f"{WEIGHT_DECAY:g}", "--norm-weight-decay", "0", "--bias-weight-decay", "0"),
        *("--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", str(WARMUP_EPOCHS)),
        *("--lr-warmup-method", "linear"),
        *("--train-crop-size", str(IMAGE_PX), "--val-resize-size", str(IMAGE_PX), "--val-crop-size", str(IMAGE_PX)),
        *("--output-dir", str(out)),
    ]
    return timed(command, REFERENCE_VAL, 0.01, out.with_suffix(".log"), args.target)


def table(results: dict[str, list[Run]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"| configuration | val top-1 per seed ({args.seeds}) | mean | seconds to {args.target:.0%} per seed "
        "| wall seconds per seed | mean wall |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        tops = [r.val_top1 for r in runs]
        reached = ["never" if r.seconds_to_target is None else f"{r.seconds_to_target:.0f}" for r in runs]
        walls = [r.wall_seconds for r in runs]
        lines.append(
            f"| {name} | {', '.join(f'{t:.3f}' for t in tops)} | {statistics.mean(tops):.3f} | {', '.join(reached)} "
            f"| {', '.join(f'{w:.0f}' for w in walls)} | {statistics.mean(walls):.0f} |"
        )
    return lines


def main() -> None:
    args = parse_args()
    results: dict[str, list[Run]] = {config.name: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = render_digits(workdir / "digits", IMAGE_PX)
        for seed in (int(s) for s in args.seeds.split(",")):
            for config in CONFIGS:  # seeds outermost: a drifting machine speed touches every row alike
                runner = run_clusterfit if config.trainer == "clusterfit" else run_reference
                results[config.name].append(runner(workdir, data, config, seed, args))
                print(f"{config.name}, seed {seed}: {results[config.name][-1]}", flush=True)

    print(
        f"\n{args.model}, {IMAGE_PX} px digits (1,437 train / 360 val), {args.epochs} epochs, global batch "
        f"{args.batch}, {RANKS} ranks, {args.precision}, {cpu_model()}\n"
    )
    print("\n".join(table(results, args)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "cpu": cpu_model(),
                "results": {name: [asdict(r) for r in runs] for name, runs in results.items()},
            },
            indent=2,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="torchvision's references/classification folder")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help=f"global batch ({RANKS} ranks)")
    parser.add_argument("--lr", type=float, default=0.4, help="per 256 images, as trainer.optimizer.lr")
    parser.add_argument("--precision", default="fp32", help="clusterfit's; the reference trains in fp32 on CPUs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.9, help="val top-1 for the time-to-accuracy column")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/accuracy_peer.json"))
    args = parser.parse_args()
    if not (args.reference / "train.py").is_file():
        parser.error(
            f"{args.reference}: no train.py there; give the references/classification folder of a vision clone"
        )
    args.reference = args.reference.resolve()
    return args


if __name__ == "__main__":
    main()
