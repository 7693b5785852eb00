"""Images/s of a Keras ResNet-50 on TensorFlow (MultiWorkerMirroredStrategy, examples/tensorflow) against
clusterfit's PyTorch trainer (DDP) at the same image size, per-worker batch and precision (fp32), on 1 and 2
workers of this machine, both launched by `clusterfit run`.

    python benchmarks/frameworks.py --rounds 3

Each round runs every (framework, workers) cell once, in an order that alternates between rounds so that
neither framework is always measured first. A run is 2 epochs; its second epoch's images/s is taken (the first
includes graph tracing, compilation and the allocator's warm-up). Prints a markdown table of medians and
spreads."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _last_epoch_rate(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [record["images_per_s"] for record in records if "epoch" in record and "images_per_s" in record]
    return rates[-1]


def run_tensorflow(out: Path, workers: int, args: argparse.Namespace) -> float:
    command = (
        f"python train_keras.py --data synthetic --image-size {args.image_size} --batch-size {args.batch} "
        f"--epochs 2 --steps-per-epoch {args.steps}"
    )
    overrides = [f"command={command}", f"distribution.process_count_per_instance={workers}", f"outputs.dir={out}"]
    _clusterfit_run(REPO / "examples" / "tensorflow" / "job.yaml", overrides)
    return _last_epoch_rate(out)


def run_pytorch(out: Path, workers: int, args: argparse.Namespace) -> float:
    overrides = [
        f"trainer.data.image_size={args.image_size}",
        "trainer.data.num_classes=10",
        f"trainer.batch_size={args.batch}",
        f"trainer.steps_per_epoch={args.steps}",
        "trainer.epochs=2",
        "trainer.precision=fp32",
        "trainer.channels_last=false",
        f"distribution.process_count_per_instance={workers}",
        f"outputs.dir={out}",
    ]
    _clusterfit_run(REPO / "examples" / "resnet50-synthetic.yaml", overrides)
    return _last_epoch_rate(out)


def _clusterfit_run(example: Path, overrides: list[str]) -> None:
    command = [sys.executable, "-m", "clusterfit", "run", str(example)]
    for override in overrides:
        command += ["--set", override]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{example.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="per worker")
    parser.add_argument("--steps", type=int, default=8, help="per epoch")
    args = parser.parse_args()
    runners = {"tensorflow/keras": run_tensorflow, "pytorch (clusterfit trainer)": run_pytorch}
    cells = [(name, int(workers)) for workers in args.workers.split(",") for name in runners]
    rates: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = cells if round_index % 2 == 0 else cells[::-1]
            for name, workers in order:
                out = Path(tmp) / f"{name.split()[0].replace('/', '-')}-{workers}-{round_index}"
                rates[(name, workers)].append(runners[name](out, workers, args))
                print(
                    f"round {round_index + 1}: {name}, {workers} worker(s): {rates[(name, workers)][-1]:.1f} images/s"
                )
    print(
        f"\nResNet-50, {args.image_size}x{args.image_size}, batch {args.batch} per worker, fp32, "
        f"{cpu_model()} ({os.cpu_count()} cores), {args.rounds} rounds"
    )
    print("| framework | workers | median images/s | runs | TF ÷ PyTorch |")
    print("|---|---|---|---|---|")
    for name, workers in cells:
        runs = rates[(name, workers)]
        ratio = statistics.median(runs) / statistics.median(rates[("pytorch (clusterfit trainer)", workers)])
        shown = ", ".join(f"{rate:.1f}" for rate in runs)
        print(f"| {name} | {workers} | {statistics.median(runs):.1f} | {shown} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
