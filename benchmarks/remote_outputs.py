"""Outputs at a URL, against a real Azure Blob Storage emulator (Azurite): what they cost a training job, and how
fast the mirror uploads compared with the Azure SDK alone.

1. Training stall per checkpoint: the same 2-rank job (resnet_tiny, 32 px, a checkpoint every 2 steps) with
   `outputs.dir` a local folder and an `az://` URL, in alternating rounds; each run's median stall is the
   trainer's own "checkpoint" record in metrics.jsonl (the time training waited for the save), and its wall time
   is measured around `clusterfit run`.
2. Upload MB/s: one folder holding a checkpoint of CHECKPOINT_MB (incompressible bytes) pushed by
   `OutputsMirror.push()` and uploaded file by file with `BlobClient.upload_blob`, in alternating rounds.

    python benchmarks/remote_outputs.py --rounds 3 --checkpoint-mb 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from azure.storage.blob import BlobServiceClient  # noqa: E402
from azurite import Azurite  # noqa: E402 - the tests' helper: one way to start the emulator

from clusterfit.bench.data import machine_description  # noqa: E402
from clusterfit.outputs import JobOutputs  # noqa: E402
from clusterfit.outputs.checkpoints import publish  # noqa: E402
from clusterfit.storage.filesystems import Credentials  # noqa: E402
from clusterfit.storage.outputs_mirror import OutputsMirror  # noqa: E402

CONTAINER = "bench"


def job_spec(outputs_dir: str, cache: Path, steps: int) -> dict:
    return {
        "name": "remote-outputs-bench",
        "trainer": {
            "model": "resnet_tiny",
            "data": {"train": "synthetic", "image_size": 32, "num_classes": 10},
            "epochs": 1,
            "steps_per_epoch": steps,
            "batch_size": 8,
            "precision": "fp32",
            "log_every_steps": 2,
            "checkpoint": {"every_steps": 2, "keep": 2},
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": outputs_dir, "cache_dir": str(cache), "upload_every_s": 2},
    }


def train_once(folder: Path, outputs_dir: str, steps: int) -> tuple[float, float, Path]:
    """(median checkpoint stall in s, wall s, local outputs folder)."""
    from clusterfit.service.records import local_outputs_dir
    from clusterfit.spec import validate_spec

    spec = job_spec(outputs_dir, folder / "cache", steps)
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "CLUSTERFIT_HOME": str(folder / "home")}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "clusterfit", "run", str(job)], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - started
    local = local_outputs_dir(validate_spec(spec))
    records = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["stall_s"] for r in records if r.get("kind") == "checkpoint"]
    return statistics.median(stalls), wall, local


def checkpoint_folder(root: Path, megabytes: int) -> JobOutputs:
    outputs = JobOutputs.at(root)
    tmp = outputs.checkpoints / ".tmp-1"
    tmp.mkdir(parents=True)
    (tmp / "state.pt").write_bytes(os.urandom(megabytes * 1_000_000))
    (tmp / "rank-00000.pt").write_bytes(os.urandom(20_000))
    publish(tmp, outputs.checkpoints / "step-00000001", {"step": 1, "world_size": 1}, keep=1)
    return outputs


def sdk_upload(service: BlobServiceClient, outputs: JobOutputs, prefix: str) -> float:
    container = service.get_container_client(CONTAINER)
    started = time.perf_counter()
    for path in sorted(p for p in outputs.root.rglob("*") if p.is_file()):
        with open(path, "rb") as data:
            name = f"{prefix}/{path.relative_to(outputs.root).as_posix()}"
            container.upload_blob(name, data, overwrite=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (a checkpoint every 2)")
    parser.add_argument("--checkpoint-mb", type=int, default=200)
    args = parser.parse_args(argv)
    print(machine_description())
    with tempfile.TemporaryDirectory(prefix="clusterfit-remote-outputs-") as tmp:
        root = Path(tmp)
        server = Azurite(root / "azurite")
        server.start()
        try:
            service = BlobServiceClient.from_connection_string(server.connection_string())
            service.create_container(CONTAINER)
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string()

            runs: dict[str, list[tuple[float, float]]] = {"local folder": [], "az:// URL": []}
            for round_ in range(args.rounds):
                order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
                for name in order:
                    folder = root / f"train-{round_}-{name[:2]}"
                    folder.mkdir()
                    target = str(folder / "out") if name == "local folder" else f"az://{CONTAINER}/run-{round_}"
                    stall, wall, _ = train_once(folder, target, args.steps)
                    runs[name].append((stall, wall))
            print("\n| outputs.dir | median stall per checkpoint (ms), per round | wall s, per round |")
            print("|---|---|---|")
            for name, values in runs.items():
                stalls = ", ".join(f"{s * 1000:.0f}" for s, _ in values)
                walls = ", ".join(f"{w:.1f}" for _, w in values)
                print(f"| {name} | {stalls} | {walls} |")

            outputs = checkpoint_folder(root / "upload", args.checkpoint_mb)
            total = sum(p.stat().st_size for p in outputs.root.rglob("*") if p.is_file())
            rates: dict[str, list[float]] = {"OutputsMirror.push": [], "BlobClient.upload_blob": []}
            for round_ in range(args.rounds):
                order = list(rates) if round_ % 2 == 0 else list(reversed(rates))
                for name in order:
                    if name == "OutputsMirror.push":
                        mirror = OutputsMirror(outputs, f"az://{CONTAINER}/push-{round_}", Credentials())
                        seconds = mirror.push().seconds
                    else:
                        seconds = sdk_upload(service, outputs, f"sdk-{round_}")
                    rates[name].append(total / 1e6 / seconds)
            print(f"\n| upload of {total / 1e6:.0f} MB | MB/s per round | median |")
            print("|---|---|---|")
            for name, values in rates.items():
                print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
