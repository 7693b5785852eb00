"""Wall time of the same job on each engine: `clusterfit run` from start to exit, and the part of it the
workers spent from their start to their exit (summary.json's wall_seconds); the rest is the engine's
placement, torchrun's start and rendezvous, and tear-down.

The job is examples/resnet50-synthetic.yaml at test size, 2 workers: 1 node x 2 processes on `local`,
2 nodes x 1 process on `ray`. The engines take turns, so slow phases of a noisy machine hit both alike.
Ray needs a running cluster with two nodes of one CPU each, for example on this machine:

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(openssl rand -hex 32)
    ray start --head --port=6379 --num-cpus=1 --memory=2147483648 --object-store-memory=209715200 \\
        --include-dashboard=false --disable-usage-stats
    ray start --address=127.0.0.1:6379 --num-cpus=1 --memory=2147483648 --object-store-memory=209715200 \\
        --dashboard-agent-listen-port=52366 --disable-usage-stats
    python benchmarks/engines_ray.py --ray-address 127.0.0.1:6379 --repeats 3
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

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "resnet50-synthetic.yaml"
TEST_SIZE = [
    "trainer.model=resnet_tiny",
    "trainer.data.image_size=32",
    "trainer.batch_size=4",
    "trainer.steps_per_epoch=4",
    "trainer.precision=fp32",
]
ENGINES = {
    "local": ["resources.backend=local", "resources.instance_count=1", "distribution.process_count_per_instance=2"],
    "ray": ["resources.backend=ray", "resources.instance_count=2", "distribution.process_count_per_instance=1"],
}


def run_once(engine: str, out: Path, ray_address: str | None, home: Path) -> tuple[float, float]:
    overrides = [*TEST_SIZE, *ENGINES[engine], f"outputs.dir={out}"]
    if engine == "ray" and ray_address:
        overrides.append(f"resources.ray_address={ray_address}")
    command = [sys.executable, "-m", "clusterfit", "run", str(EXAMPLE)]
    for override in overrides:
        command += ["--set", override]
    start = time.perf_counter()
    # A job store of its own: the benchmark's jobs never queue behind, or reconcile, anyone else's.
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "CLUSTERFIT_HOME": str(home)})
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{engine} run failed:\n{result.stderr[-3000:]}")
    return wall, json.loads((out / "summary.json").read_text())["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-address", help="the Ray cluster (default: $RAY_ADDRESS, else auto)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="local,ray")
    args = parser.parse_args()
    engines = args.engines.split(",")
    times: dict[str, list[tuple[float, float]]] = {engine: [] for engine in engines}
    with tempfile.TemporaryDirectory(prefix="cf-engines-") as root:
        for repeat in range(args.repeats):
            for engine in engines:
                out = Path(root) / f"{engine}-{repeat}"
                times[engine].append(run_once(engine, out, args.ray_address, Path(root) / "service"))
    print("| engine | nodes x processes | job wall time (s), median | workers' wall time (s) | engine overhead (s) |")
    print("|---|---|---:|---:|---:|")
    for engine in engines:
        wall = statistics.median(t[0] for t in times[engine])
        workers = statistics.median(t[1] for t in times[engine])
        shape = "1 x 2" if engine == "local" else "2 x 1"
        print(f"| {engine} | {shape} | {wall:.1f} | {workers:.1f} | {wall - workers:.1f} |")
    print(json.dumps({engine: times[engine] for engine in engines}))


if __name__ == "__main__":
    main()
