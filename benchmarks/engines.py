"""Wall time of the same example job through `clusterfit run` on each engine that can run on this machine.

    python benchmarks/engines.py --repeats 3

Local runs torchrun directly; Slurm runs on a one-node cluster started on localhost for the measurement
(munged, slurmctld, slurmd from Debian's slurm-wlm and munge packages, as in the tests; needs root). Runs
alternate between engines so that background noise hits both alike. The wall time is the user's: from the
command to the exported model, including submission, scheduling, the agent's rendezvous and export."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from slurm_cluster import SlurmCluster, missing_reason  # noqa: E402

EXAMPLE = REPO / "examples" / "engines-tiny.yaml"


def timed_run(engine: str, out: Path, env: dict[str, str]) -> float:
    command = [sys.executable, "-m", "clusterfit", "run", str(EXAMPLE), "--backend", engine]
    command += ["--set", f"outputs.dir={out}"]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{engine} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        raise SystemExit(f"cannot start Slurm here: {reason}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cluster = SlurmCluster(root / "slurm")
        cluster.start()
        try:
            env = {**os.environ, **cluster.env}
            times: dict[str, list[float]] = {"local": [], "slurm": []}
            for repeat in range(args.repeats):
                for engine in times:
                    times[engine].append(timed_run(engine, root / f"{engine}-{repeat}", env))
        finally:
            cluster.stop()
    print(f"{EXAMPLE.name}: {args.repeats} runs per engine, wall seconds of `clusterfit run` to the exported model")
    print("| engine | median s | runs (s) |")
    print("|---|---|---|")
    for engine, seconds in times.items():
        runs = ", ".join(f"{value:.1f}" for value in seconds)
        print(f"| {engine} | {statistics.median(seconds):.1f} | {runs} |")


if __name__ == "__main__":
    main()
