"""Throughput of the job service's HTTP API: concurrent submissions and job-list reads against a real
`clusterfit server --paused` (jobs are recorded and queued, none starts), on SQLite or PostgreSQL.

    python benchmarks/service_api.py --jobs 200 --clients 40
    python benchmarks/service_api.py --database-url postgresql+psycopg://user@127.0.0.1:5432/db

Each submission is validated on the server exactly like `clusterfit submit` (spec + preflight), recorded,
and answered with the job's row; the figures are wall-clock over all requests of one kind."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import yaml


def tiny_spec(out_dir: Path) -> str:
    return yaml.safe_dump(
        {
            "name": "bench",
            "trainer": {
                "model": "resnet_tiny",
                "data": {"train": "synthetic", "image_size": 32, "num_classes": 10},
                "steps_per_epoch": 4,
                "batch_size": 4,
            },
            "outputs": {"dir": str(out_dir)},
        }
    )


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "clusterfit", "server", "--port", "0", "--paused"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "listening on " in line:
            return process, line.split("listening on ", 1)[1].split()[0]
    raise RuntimeError("the server did not start")


def timed(pool: ThreadPoolExecutor, call, count: int) -> tuple[float, list[float]]:  # noqa: ANN001
    def one(_: int) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    start = time.perf_counter()
    latencies = list(pool.map(one, range(count)))
    return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=40, help="concurrent HTTP clients")
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp CLUSTERFIT_HOME")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="clusterfit-bench-home-"))
    env = {**os.environ, "CLUSTERFIT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("CLUSTERFIT_DATABASE_URL", None)
    if args.database_url:
        env["CLUSTERFIT_DATABASE_URL"] = args.database_url
    os.environ.update(env)
    from clusterfit.service.auth import issue_token
    from clusterfit.service.migrate import open_store

    token = issue_token(open_store(), "submit", timedelta(hours=1), "bench").secret
    process, url = start_server(env)
    try:
        headers = {"Authorization": f"Bearer {token}"}
        body = {"spec": tiny_spec(home / "out")}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http, ThreadPoolExecutor(args.clients) as pool:
            assert http.post("/api/jobs", json=body).status_code == 201  # warm-up: the first one imports torch
            submit_s, submit_lat = timed(pool, lambda: http.post("/api/jobs", json=body).raise_for_status(), args.jobs)
            list_s, list_lat = timed(pool, lambda: http.get("/api/jobs?limit=50").raise_for_status(), args.jobs)
            total = len(http.get("/api/jobs", params={"limit": 10000}).json())
    finally:
        process.terminate()
        process.wait(timeout=60)
    database = "postgresql" if args.database_url else "sqlite"
    result = {
        "database": database,
        "jobs": args.jobs,
        "clients": args.clients,
        "records": total,
        "submissions_per_s": round(args.jobs / submit_s, 1),
        "submit_median_ms": round(1000 * statistics.median(submit_lat), 1),
        "list_per_s": round(args.jobs / list_s, 1),
        "list_median_ms": round(1000 * statistics.median(list_lat), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
