"""How long an elastic job stands still when it loses a node, and when it takes a new one.

A `1:2` job (resnet_tiny, 32 px, 1 process per node) runs on a Ray cluster of two nodes on this machine. Once
it trains on both, every process of the node that does not host the rendezvous is killed at once (its Ray
actor, torchrun's agent, the worker), as when a spot VM is reclaimed. Measured from the metrics the trainer
writes (each round's start record, each logged step):

- loss -> round: from the kill to the start record of the round on the remaining node (the failed
  collective, the agent's restart, the 5 s last call of the rendezvous, the new worker's start and its
  checkpoint load);
- loss -> training: from the kill to the first logged step after that;
- join -> training: from a new Ray node counted alive to the first logged step of the round that took it.

Steps trained again (those since the last checkpoint) are not counted here: `checkpoint.every_steps` bounds
them. Runs on a 2-core machine in about 5 minutes with `--repeats 3`:

    python benchmarks/elastic.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from raycluster import RayCluster  # noqa: E402 - the tests' helper: a two-node Ray cluster on 127.0.0.1

from clusterfit.bench.data import machine_description  # noqa: E402
from clusterfit.outputs import JobOutputs, RecordKind, read_records  # noqa: E402

STEPS = 600


def job(out: Path) -> dict:
    return {
        "name": "elastic",
        "trainer": {
            "model": "resnet_tiny",
            "data": {"train": "synthetic", "image_size": 32, "num_classes": 10},
            "epochs": 1,
            "steps_per_epoch": STEPS,
            "batch_size": 4,
            "optimizer": {"name": "sgd", "lr": 0.1},
            "precision": "fp32",
            "log_every_steps": 1,
            "checkpoint": {"every_steps": 10, "keep": 2},
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": 1, "max_restarts": 3},
        "resources": {"instance_count": "1:2", "backend": "ray"},
        "outputs": {"dir": str(out)},
    }


def wait_until(predicate, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def one_loss_and_join(cluster: RayCluster, root: Path, repeat: int) -> dict[str, float]:
    out = root / f"run-{repeat}"
    spec = root / f"job-{repeat}.yaml"
    spec.write_text(yaml.safe_dump(job(out)))
    metrics = JobOutputs.at(out).metrics
    with open(root / f"launcher-{repeat}.log", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "clusterfit", "run", str(spec)],
            env={**cluster.client_env(), "CLUSTERFIT_HOME": str(root / "home")},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def round_of(nodes: int, after: float) -> dict | None:
        starts = [s for s in read_records(metrics, (RecordKind.START,)) if s["time"] > after]
        return next((s for s in starts if s.get("nodes") == nodes), None)

    def first_step_after(start: dict) -> float | None:
        steps = [r["time"] for r in read_records(metrics, (RecordKind.TRAIN,)) if r["time"] > start["time"]]
        return min(steps) if steps else None

    both = wait_until(lambda: round_of(2, 0.0), 300, "a round on 2 nodes")
    wait_until(lambda: first_step_after(both), 120, "a step on 2 nodes")
    agent = next(
        p
        for p in psutil.process_iter(["cmdline"])
        if str(out) in " ".join(p.info["cmdline"] or []) and "is_host=0" in " ".join(p.info["cmdline"] or [])
    )
    for process in [agent.parent(), agent, *agent.children(recursive=True)]:
        process.kill()
    lost_at = time.time()
    alone = wait_until(lambda: round_of(1, lost_at), 180, "the round on one node")
    trained_alone = wait_until(lambda: first_step_after(alone), 120, "a step on one node")
    node = cluster.add_node()
    joined_at = time.time()
    try:
        both_again = wait_until(lambda: round_of(2, joined_at), 240, "the round with the new node")
        trained_both = wait_until(lambda: first_step_after(both_again), 120, "a step with the new node")
    finally:
        launcher.send_signal(signal.SIGINT)  # Ctrl-C: the launcher cancels the job and frees its placement
        launcher.wait(120)
        cluster.remove_node(node)
    return {
        "loss_to_round_s": alone["time"] - lost_at,
        "loss_to_training_s": trained_alone - lost_at,
        "join_to_training_s": trained_both - joined_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cluster = RayCluster()
    results = []
    try:
        cluster.start()
        with tempfile.TemporaryDirectory(prefix="cf-elastic-") as root:
            for repeat in range(args.repeats):
                results.append(one_loss_and_join(cluster, Path(root), repeat))
                print(json.dumps(results[-1]), flush=True)
    finally:
        cluster.stop()
    print(f"machine: {machine_description()}; precision fp32")
    print("| phase | median (s) | runs (s) |")
    print("|---|---:|---|")
    for key, label in [
        ("loss_to_round_s", "node lost -> round on the remaining node"),
        ("loss_to_training_s", "node lost -> training again"),
        ("join_to_training_s", "new node alive -> training on both"),
    ]:
        values = [r[key] for r in results]
        print(f"| {label} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
