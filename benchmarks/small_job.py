"""The fixed costs of a small job: how much of a job's wall time is training, when its epochs take seconds.

The data is scikit-learn's bundled handwritten digits rendered as 32x32 PNGs (as in benchmarks/accuracy.py),
cut to --per-class training images per class (160 by default) and the full validation split (360). Each system
trains the same torchvision ResNet-18 for --epochs epochs with SGD at the same peak learning rate and global
batch, in rotating order for --rounds rounds:

- clusterfit, 2 ranks, the default checkpoint cadence (`checkpoint.min_interval_s: 60`), validating every epoch;
- the same with a checkpoint at every epoch's end (`min_interval_s: 0`, the cadence before it existed);
- clusterfit, 1 rank (no DDP wrapper, the cores' threads in one process), validating after the last epoch only:
  the plain loop's work;
- a plain single-process PyTorch loop (ImageFolder, DataLoader, the same crops), validated once at the end;
- the first system again, its agent forked from `clusterfit warm-start` (started once before the rounds, as a
  user runs one per machine; backends/warm_start.py).

--systems picks some of them by number (1 to 5, in that order).

Reported per system: wall time (launch to exit), training time (the epochs' loops, from the job's own figures),
their ratio, the checkpoints written and the training time they stalled, and the final val top-1.

    pip install -e ".[bench]"
    python benchmarks/small_job.py --epochs 40 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from clusterfit.backends.warm_start import WARM_START_ENV, running_warm_start
from clusterfit.bench.machine import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import render_digits  # noqa: E402 - the same rendering as the accuracy benchmark

PLAIN_LOOP = """
import sys, time
import torch, torchvision
from torch import nn
from torchvision import transforms as T

root, epochs, batch, lr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
torch.set_num_threads(2)
norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
train_tf = T.Compose([T.RandomResizedCrop(32, scale=(0.64, 1.0), antialias=True), T.ToTensor(), norm])
val_tf = T.Compose([T.Resize(36, antialias=True), T.CenterCrop(32), T.ToTensor(), norm])
train = torchvision.datasets.ImageFolder(f"{root}/train", train_tf)
val = torchvision.datasets.ImageFolder(f"{root}/val", val_tf)
loader = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, drop_last=True, num_workers=1,
                                     persistent_workers=True)
model = torchvision.models.resnet18(num_classes=len(train.classes))
opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader), pct_start=1 / epochs)
loss_fn = nn.CrossEntropyLoss()
training = 0.0
for epoch in range(epochs):
    started = time.perf_counter()
    model.train()
    for images, labels in loader:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        opt.step()
        sched.step()
    training += time.perf_counter() - started
model.eval()
correct = 0
with torch.inference_mode():
    for images, labels in torch.utils.data.DataLoader(val, batch_size=128):
        correct += (model(images).argmax(1) == labels).sum().item()
print(f"RESULT training_s={training:.3f} val_top1={correct / len(val):.4f}")
"""


def small_split(digits: Path, root: Path, per_class: int) -> Path:
    """The first `per_class` training images of each class, and the whole validation split."""
    for folder in sorted((digits / "train").iterdir()):
        target = root / "train" / folder.name
        target.mkdir(parents=True)
        for image in sorted(folder.iterdir())[:per_class]:
            shutil.copy(image, target / image.name)
    shutil.copytree(digits / "val", root / "val")
    return root


def clusterfit_job(
    workdir: Path,
    data: Path,
    name: str,
    args: argparse.Namespace,
    *,
    ranks: int,
    env: dict[str, str] | None = None,
    **trainer: Any,
) -> dict[str, Any]:
    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)  # every round trains from scratch
    job = {
        "name": name,
        "trainer": {
            "model": "resnet18",
            "epochs": args.epochs,
            "batch_size": args.batch // ranks,
            "optimizer": {"name": "sgd", "lr": args.lr * 256 / args.batch, "momentum": 0.9, "weight_decay": 5e-4},
            "schedule": {"kind": "cosine", "warmup_epochs": 1},
            "precision": args.precision,
            "log_every_steps": 1000,
            "data": {"train": str(data / "train"), "val": str(data / "val"), "image_size": 32, "loader_workers": 1},
            **trainer,
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": ranks},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out)},
    }
    spec = workdir / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(job, sort_keys=False))
    started = time.perf_counter()
    if env is None:  # a cold start, whatever the caller's shell names
        env = {key: value for key, value in os.environ.items() if key != WARM_START_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "clusterfit", "run", str(spec)], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps_per_epoch = summary["steps"] / len(summary["epochs"])
    training = sum(steps_per_epoch * summary["global_batch"] / e["images_per_s"] for e in summary["epochs"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["stall_s"] for r in records if r.get("kind") == "checkpoint"]
    in_trainer = next(r["time"] for r in records if r["kind"] == "end") - next(
        r["time"] for r in records if r["kind"] == "start"
    )
    return {
        "wall_s": wall,
        "training_s": training,
        "outside_trainer_s": wall - in_trainer,  # the CLI, torchrun's agent, the ranks' imports and start, the exit
        "validation_and_export_s": in_trainer - training - sum(stalls),
        "checkpoints": len(stalls),
        "stall_s": sum(stalls),
        "val_top1": summary["final"]["val_top1"],
        "precision": summary["precision"],
    }


def plain_loop(workdir: Path, data: Path, args: argparse.Namespace) -> dict:
    script = workdir / "plain_loop.py"
    script.write_text(PLAIN_LOOP)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(script), str(data), str(args.epochs), str(args.batch), str(args.lr)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"plain loop failed:\n{result.stderr[-2000:]}")
    figures = dict(item.split("=") for item in result.stdout.split("RESULT ", 1)[1].split())
    training = float(figures["training_s"])
    return {
        "wall_s": wall,
        "training_s": training,
        "outside_trainer_s": wall - training,  # its imports and start, and one validation at the end
        "validation_and_export_s": 0.0,
        "checkpoints": 0,
        "stall_s": 0.0,
        "val_top1": float(figures["val_top1"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--per-class", type=int, default=16, help="training images per class (10 classes)")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1, help="the peak learning rate at the global batch")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="1,2,3,4,5", help="which systems, by number (see above)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/small_job.json"))
    args = parser.parse_args()

    last_only = {"validate_every_epochs": args.epochs}
    systems = {
        "clusterfit, 2 ranks, default cadence": lambda w, d: clusterfit_job(w, d, "cadence", args, ranks=2),
        "clusterfit, 2 ranks, every epoch's end": lambda w, d: clusterfit_job(
            w, d, "every-epoch", args, ranks=2, checkpoint={"min_interval_s": 0}
        ),
        "clusterfit, 1 rank, default cadence, validating at the end": lambda w, d: clusterfit_job(
            w, d, "one-rank", args, ranks=1, **last_only
        ),
        "plain single-process loop, validating at the end": lambda w, d: plain_loop(w, d, args),
        "clusterfit, 2 ranks, default cadence, warm start": lambda w, d: clusterfit_job(
            w, d, "warm", args, ranks=2, env={**os.environ, WARM_START_ENV: str(w / "warm-start" / "agents.sock")}
        ),
    }
    names = [list(systems)[int(number) - 1] for number in args.systems.split(",")]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        data = small_split(render_digits(workdir / "digits"), workdir / "small", args.per_class)
        # NOTE: only now: rendering imports scikit-learn, which sets KMP_* variables in this process's environment,
        # and a job whose such variables differ from the warm start's starts cold (as it should).
        if any(name.endswith("warm start") for name in names):
            stack.enter_context(running_warm_start(workdir / "warm-start" / "agents.sock"))
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(systems[name](workdir, data))
                print(f"round {round_index + 1}, {name}: {results[name][-1]}", flush=True)

    print(
        f"\nResNet-18, 32 px digits ({args.per_class * 10} train / 360 val), {args.epochs} epochs, global batch "
        f"{args.batch}, {args.precision}, {cpu_model()}; medians of {args.rounds} rounds in rotating order"
    )
    print(
        "| system | wall s | training s | training / wall | start-up and exit s | validation and export s "
        "| checkpoints | stalled s | val top-1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():

        def median(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        ratio = statistics.median(r["training_s"] / r["wall_s"] for r in runs)
        print(
            f"| {name} | {median('wall_s'):.1f} | {median('training_s'):.1f} | {ratio:.2f} | "
            f"{median('outside_trainer_s'):.1f} | {median('validation_and_export_s'):.1f} | "
            f"{median('checkpoints'):.0f} | {median('stall_s'):.2f} | {median('val_top1'):.3f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
