"""A sweep with early stopping against the same sweep without it: the best validation top-1 each finds, and the
training steps and wall time each spends.

The data is scikit-learn's bundled handwritten digits (real 8x8 scans) rendered as 16x16 PNGs (as
benchmarks/accuracy.py does at 32); the job is ResNet-18 from scratch, 4 epochs, 1 process per trial (two trials
side by side on 2 cores). The search space is a grid (learning rate x label smoothing), walked in the same order
by both sweeps (Optuna's grid sampler, same seed); one sweep runs every trial to its end, the other stops a trial
at any validation (from its first, `warmup_reports: 1`) whose top-1 is below the median of the earlier trials at
that epoch, once two trials have reported (`early_stopping: median`). Each sweep has a job store of its own.
About 25 minutes on 2 cores.

    pip install -e ".[bench,sweep]"
    python benchmarks/sweep_pruning.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import render_digits  # noqa: E402 - the same rendered digits as the accuracy benchmark

from clusterfit.bench.machine import cpu_model  # noqa: E402

LEARNING_RATES = [0.02, 0.1, 0.4, 1.6]  # per 256 images, as trainer.optimizer.lr
LABEL_SMOOTHING = [0.0, 0.1]


def write_sweep(root: Path, data: Path, policy: str, epochs: int) -> Path:
    job = {
        "name": "digits",
        "trainer": {
            "model": "resnet18",
            "data": {"train": str(data / "train"), "val": str(data / "val"), "image_size": 16, "loader_workers": 1},
            "epochs": epochs,
            "batch_size": 32,
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
            "schedule": {"kind": "cosine", "warmup_epochs": 1},
            "precision": "fp32",
            "log_every_steps": 1000,
            "checkpoint": {"every_steps": None, "keep": 1},
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": 1},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(root / "unused")},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    sweep = {
        "name": f"digits-{policy}",
        "job": "job.yaml",
        "search_space": {
            "trainer.optimizer.lr": {"choice": LEARNING_RATES},
            "trainer.label_smoothing": {"choice": LABEL_SMOOTHING},
        },
        "objective": {"metric": "val_top1", "goal": "maximize"},
        "max_trials": len(LEARNING_RATES) * len(LABEL_SMOOTHING),
        "max_concurrent": 2,
        "sampler": "grid",
        "seed": 0,
        "early_stopping": {"policy": policy, "warmup_reports": 1, "min_trials": 2},
        "outputs_dir": str(root / f"trials-{policy}"),
    }
    path = root / f"sweep-{policy}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def run_sweep(root: Path, data: Path, policy: str, epochs: int) -> dict:
    home = root / f"home-{policy}"
    env = {**os.environ, "CLUSTERFIT_HOME": str(home)}
    sweep = write_sweep(root, data, policy, epochs)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "clusterfit", "sweep", "run", str(sweep), "--poll", "1"],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"sweep {policy} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    status = subprocess.run(
        [sys.executable, "-m", "clusterfit", "sweep", "status", f"digits-{policy}"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    # Read the study after the sweep, in a process that uses this sweep's home.
    summary = subprocess.run(
        [sys.executable, "-c", _STUDY_SUMMARY, f"digits-{policy}"], env=env, capture_output=True, text=True, check=True
    )
    return {"wall_s": wall, "status": status, **json.loads(summary.stdout)}


_STUDY_SUMMARY = """
import json, sys
from clusterfit.sweep.study import find_study
study = find_study(sys.argv[1])
trials = study.trials
print(json.dumps({
    "best_val_top1": study.best_value,
    "best_params": study.best_params,
    "trials": len(trials),
    "pruned": sum(t.state.name == "PRUNED" for t in trials),
    "epochs_trained": sum(len(t.intermediate_values) for t in trials),
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sweep_pruning.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cf-sweep-") as tmp:
        root = Path(tmp)
        data = render_digits(root / "digits", size=16)
        results = {policy: run_sweep(root, data, policy, args.epochs) for policy in ("none", "median")}
    full, pruned = results["none"], results["median"]
    print(f"machine: {cpu_model()}; precision fp32; {full['trials']} trials, {args.epochs} epochs each")
    print("| sweep | best val top-1 | best parameters | trials pruned | epochs trained | wall s |")
    print("|---|---:|---|---:|---:|---:|")
    for label, r in (("full grid", full), ("grid + median pruning", pruned)):
        print(
            f"| {label} | {r['best_val_top1']:.3f} | {r['best_params']} | {r['pruned']} | {r['epochs_trained']} "
            f"| {r['wall_s']:.0f} |"
        )
    print(
        f"pruned/full: epochs {pruned['epochs_trained'] / full['epochs_trained']:.2f}, "
        f"wall {pruned['wall_s'] / full['wall_s']:.2f}"
    )
    print(pruned["status"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": cpu_model(), "epochs": args.epochs, **results}, indent=2))


if __name__ == "__main__":
    main()
