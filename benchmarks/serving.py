"""The model endpoint under load: `clusterfit serve` with dynamic batching, the same with batching off
(--max-batch 1), and a plain FastAPI endpoint that decodes and runs the model per request, side by side.

Each server is started on loopback with the same exported model (built here: a ResNet-18 at 64 px, 10 classes,
random weights, which cost as trained ones do), then loaded by C concurrent clients, each sending a JPEG and
waiting for the answer, for --seconds per cell; requests/s and p50/p99 latency per cell. The servers are
measured in rotation within each concurrency, so drift touches each alike. Clients and server share this
machine's cores: say so when quoting the figures.

    python benchmarks/serving.py --clients 1,8,32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from clusterfit import __version__
from clusterfit.bench.machine import cpu_model
from clusterfit.models import build_model
from clusterfit.outputs.model_card import ModelCard, Preprocessing, write_model_card
from clusterfit.worker.export import export_model

PLAIN_FASTAPI = textwrap.dedent(
    """
    import sys, torch
    from fastapi import FastAPI, Request
    from clusterfit.data.imagefolder import val_transform
    from clusterfit.scoring import load_classifier

    classifier = load_classifier(sys.argv[1])
    transform = val_transform(classifier.image_size)
    app = FastAPI()

    @app.post("/predict")
    async def predict(request: Request):
        image = transform(await request.body())
        probabilities = classifier.predict(image.unsqueeze(0))[0]
        top = probabilities.topk(5)
        return {"top_k": [{"class": classifier.classes[i], "probability": float(p)}
                          for p, i in zip(top.values.tolist(), top.indices.tolist())]}

    if __name__ == "__main__":
        import uvicorn
        print("listening on http://127.0.0.1:%s" % sys.argv[2], flush=True)
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    """
)


def make_model(folder: Path, size: int) -> Path:
    torch.manual_seed(0)
    classes = [f"class{i}" for i in range(10)]
    model = build_model("resnet18", len(classes), "batch", size)
    export_model(
        model,
        folder,
        metadata={"model": "resnet18", "norm_layer": "batch", "classes": classes, "image_size": size},
        image_size=size,
    )
    card = ModelCard("resnet18", classes, size, Preprocessing.for_size(size), {}, "0" * 64, __version__, "bench")
    write_model_card(folder, card)
    return folder


def start(command: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    raise SystemExit(f"server did not start: {' '.join(command)}")


async def load(url: str, image: bytes, clients: int, seconds: float) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            response = await http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        await http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.image_size)
        plain = Path(tmp) / "plain_fastapi.py"
        plain.write_text(PLAIN_FASTAPI)
        pixels = np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        image = buffer.getvalue()
        serve = [
            sys.executable,
            "-m",
            "clusterfit",
            "serve",
            str(model),
            "--no-auth",
            "--port",
            "0",
            "--runtime",
            "torch",
            "--max-wait-ms",
            str(args.max_wait_ms),
        ]
        servers = {
            "clusterfit serve, dynamic batching (max 32)": [*serve, "--max-batch", "32"],
            "clusterfit serve, no batching (max 1)": [*serve, "--max-batch", "1"],
            "plain FastAPI, model per request": [sys.executable, str(plain), str(model), "8765"],
        }
        running = {name: start(command) for name, command in servers.items()}
        results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in servers}
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                for name, (_, url) in running.items():
                    results[name][clients] = asyncio.run(load(url, image, clients, args.seconds))
                    print(f"{name}, {clients} clients: {results[name][clients]}", flush=True)
        finally:
            for process, _ in running.values():
                process.terminate()
                process.wait(timeout=60)

    print(
        f"\nResNet-18 at {args.image_size} px, torch fp32 CPU, {cpu_model()}, {torch.get_num_threads()} threads; "
        f"clients on the same machine; {args.seconds:g} s per cell"
    )
    print("| server | clients | requests/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for name, by_clients in results.items():
        for clients, cell in by_clients.items():
            print(
                f"| {name} | {clients} | {cell['requests_per_s']:.1f} | {cell['p50_ms']:.1f} | {cell['p99_ms']:.1f} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
