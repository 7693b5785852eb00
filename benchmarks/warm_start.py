"""A small local job's CPU and wall time with its agent started cold (a new interpreter that imports torch,
torchvision and the trainer) and forked from `clusterfit warm-start`, in alternation for --rounds rounds.

CPU is counted with the kernel's own figures for whole process trees: the launcher's `getrusage` of its
waited-for children (`clusterfit run`, and under it a cold agent and its ranks), plus, for a warm start, what
the warm-start process and the agents it forked and waited for used meanwhile (/proc/PID/stat: utime, stime,
cutime, cstime).

    pip install -e .
    python benchmarks/warm_start.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clusterfit.backends.warm_start import READY_LINE, WARM_START_ENV
from clusterfit.bench.machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """A process's CPU time and that of the children it has waited for (fields 14 to 17 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) * TICK_S


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_job(job: str, out: Path, env: dict[str, str], warm_pid: int | None) -> dict[str, float]:
    before, warm_before, start = children_cpu_s(), tree_cpu_s(warm_pid) if warm_pid else 0.0, time.perf_counter()
    command = [sys.executable, "-m", "clusterfit", "run", job, "--set", f"outputs.dir={out}"]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(result.stdout[-2000:] + result.stderr[-2000:])
    warm_side = tree_cpu_s(warm_pid) - warm_before if warm_pid else 0.0
    return {"wall_s": wall, "cpu_s": children_cpu_s() - before + warm_side}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--job", default=str(REPO / "examples" / "engines-tiny.yaml"))
    parser.add_argument("--out", type=Path, help="JSON of every run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "warm"
        folder.mkdir(mode=0o700)
        socket_path = folder / "agents.sock"
        env = {**os.environ, "CLUSTERFIT_HOME": str(Path(scratch) / "home")}
        env.pop(WARM_START_ENV, None)
        warm = subprocess.Popen(
            [sys.executable, "-m", "clusterfit", "warm-start", "--socket", str(socket_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert warm.stdout is not None and warm.stdout.readline().startswith(READY_LINE)
        runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
        try:
            for round_number in range(args.rounds):
                order = ["cold", "warm"] if round_number % 2 == 0 else ["warm", "cold"]
                for kind in order:
                    out = Path(scratch) / f"{kind}-{round_number}"
                    job_env = {**env, WARM_START_ENV: str(socket_path)} if kind == "warm" else env
                    runs[kind].append(one_job(args.job, out, job_env, warm.pid if kind == "warm" else None))
                    print(kind, runs[kind][-1], flush=True)
        finally:
            warm.terminate()
            warm.wait(60)

    print(f"\n{cpu_model()}, {args.rounds} rounds, {Path(args.job).name}\n")
    print("| agent | core-s (median) | core-s (range) | wall s (median) | wall s (range) |")
    print("|---|---:|---:|---:|---:|")
    for kind, rows in runs.items():
        cpu, wall = [row["cpu_s"] for row in rows], [row["wall_s"] for row in rows]
        print(
            f"| {kind} | {statistics.median(cpu):.2f} | {min(cpu):.2f}–{max(cpu):.2f} | "
            f"{statistics.median(wall):.2f} | {min(wall):.2f}–{max(wall):.2f} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_model(), "job": args.job, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
