"""Training strategies side by side on 2 local ranks: images/s, peak memory per rank, bytes sent per step.

Each configuration runs `clusterfit run` twice, with N1 and N2 steps; per-step figures are the differences
divided by N2 - N1, so start-up, the initial broadcast, checkpoints and export cancel out. Bytes are what
crossed the loopback interface (/proc/net/dev), so run nothing else that talks over loopback meanwhile.

    python benchmarks/strategies.py --model resnet50 --image-size 64 --batch 8 --steps 12,24
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp": {"strategy": "fsdp"},
    "pipeline (2 stages, 4 microbatches, 1f1b)": {
        "strategy": "pipeline",
        "strategy_options": {"stages": 2, "microbatches": 4, "schedule": "1f1b"},
    },
    "localsgd (sync every 8)": {"strategy": "localsgd", "strategy_options": {"sync_every": 8, "warmup_steps": 0}},
    "ddp + fp16 compression": {"grad_compression": "fp16"},
    "ddp + bf16 compression": {"grad_compression": "bf16"},
    "ddp + PowerSGD rank 1": {"grad_compression": "powersgd"},
}


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])  # received bytes: every byte sent over loopback once
    raise RuntimeError("no loopback interface in /proc/net/dev")


def run_job(workdir: Path, name: str, trainer: dict[str, Any], steps: int, args: argparse.Namespace) -> dict:
    per_rank_batch = args.batch * 2 if trainer.get("strategy") == "pipeline" else args.batch  # same global batch
    job = {
        "name": name,
        "trainer": {
            "model": args.model,
            "data": {"train": "synthetic", "image_size": args.image_size, "num_classes": 1000},
            "epochs": 1,
            "steps_per_epoch": steps,
            "batch_size": per_rank_batch,
            "precision": args.precision,
            "channels_last": True,
            "log_every_steps": steps,
            "checkpoint": {"every_steps": None, "keep": 1},
            **trainer,
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "outputs": {"dir": str(workdir / f"{name}-{steps}")},
    }
    spec = workdir / f"{name}-{steps}.yaml"
    spec.write_text(yaml.safe_dump(job))
    before = loopback_bytes()
    result = subprocess.run([sys.executable, "-m", "clusterfit", "run", str(spec)], capture_output=True, text=True)
    sent = loopback_bytes() - before
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    summary = json.loads((workdir / f"{name}-{steps}" / "summary.json").read_text())
    epoch = summary["epochs"][-1]
    return {
        "seconds": summary["global_batch"] * steps / epoch["images_per_s"],
        "global_batch": summary["global_batch"],
        "bytes": sent,
        "peak_memory": summary["peak_memory_bytes_per_rank"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="images per rank per step (pipeline: x2, one replica)")
    parser.add_argument("--steps", default="12,24", help="N1,N2")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/strategies.json"))
    args = parser.parse_args()
    short, long = (int(n) for n in args.steps.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, trainer) in enumerate(CONFIGS.items()):
            name = f"s{index}"
            first = run_job(Path(tmp), name, trainer, short, args)
            second = run_job(Path(tmp), name, trainer, long, args)
            extra_steps = long - short
            seconds_per_step = (second["seconds"] - first["seconds"]) / extra_steps
            row = {
                "strategy": label,
                "images_per_s": second["global_batch"] / seconds_per_step,
                "peak_memory_mib_per_rank": [round(b / 2**20) for b in second["peak_memory"]],
                "mib_sent_per_step": (second["bytes"] - first["bytes"]) / extra_steps / 2**20,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine, "rows": rows}, indent=2)
    )
    print("\n| strategy | images/s | peak memory per rank (MiB) | MiB sent per step |\n|---|---:|---:|---:|")
    for row in rows:
        memory = " / ".join(str(m) for m in row["peak_memory_mib_per_rank"])
        print(f"| {row['strategy']} | {row['images_per_s']:.1f} | {memory} | {row['mib_sent_per_step']:.1f} |")


if __name__ == "__main__":
    main()
