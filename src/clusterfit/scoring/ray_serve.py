"""`clusterfit serve MODEL_DIR --backend ray`: the same endpoint as a Ray Serve application on a Ray cluster,
`--replicas` copies of the model (or MIN:MAX, autoscaled) behind Ray Serve's HTTP proxy, batched by Ray Serve's
own `@serve.batch`.

Each replica loads the model folder itself, so the folder must be at the same path on every node (as a job's
outputs are). Requests are checked as the embedded server checks them (key, content type, declared size, a
usable image); the proxy does not cap body sizes, so a replica reads at most `max_body_bytes` of a body and
refuses the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from clusterfit.scoring.serve import (
    BatchStats,
    ServeSettings,
    check_key,
    image_bodies,
    load_predictor,
    preprocess,
    top_k_answer,
)
from clusterfit.spec.serving import ReplicaCount

APP_NAME = "clusterfit"


def model_deployment(settings: ServeSettings) -> Any:
    """The Ray Serve deployment class, with batching bound to `settings` (decorators take constants)."""
    import numpy as np
    import torch
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment
    class ModelReplica:
        def __init__(self, model_dir: str, runtime: str) -> None:
            from clusterfit.outputs.model_card import read_model_card

            self.card = read_model_card(Path(model_dir))
            self.predictor = load_predictor(Path(model_dir), runtime)
            self.top_k = min(settings.top_k, len(self.card.classes))
            self.stats = BatchStats()  # this replica's own: /stats answers from whichever replica gets it
            self.replica = serve.get_replica_context().replica_id.unique_id

        @serve.batch(max_batch_size=settings.max_batch, batch_wait_timeout_s=settings.max_wait_ms / 1000)
        async def score(self, images: list[torch.Tensor]) -> list[np.ndarray]:
            self.stats.images += len(images)
            self.stats.batch_sizes[len(images)] += 1
            return list(await asyncio.to_thread(self.predictor, torch.stack(images)))

        async def __call__(self, request: Request) -> JSONResponse:
            try:
                return JSONResponse(await self._answer(request))
            except HTTPException as refusal:
                return JSONResponse({"detail": refusal.detail}, status_code=refusal.status_code)

        async def _answer(self, request: Request) -> dict[str, Any]:
            path = request.url.path.rstrip("/")
            if path.endswith("/health"):
                return {"status": "ok"}
            if settings.keys and not check_key(request.headers.get("authorization"), settings.keys):
                raise HTTPException(401, "unknown key")
            if path.endswith("/metadata"):
                return {"model": self.card.model, "classes": self.card.classes, "runtime": self.predictor.runtime}
            if path.endswith("/stats"):
                return {**self.stats.to_dict(), "replica": self.replica}
            if request.method != "POST" or not path.endswith("/predict"):
                raise HTTPException(404, "POST /predict, GET /metadata, GET /stats or GET /health")
            self.stats.requests += 1
            body = await _bounded_body(request, settings.max_body_bytes)
            bodies, single = image_bodies(request.headers.get("content-type", ""), body)
            images = [await asyncio.to_thread(preprocess, one, self.card, settings.max_pixels) for one in bodies]
            rows = await asyncio.gather(*(self.score(image) for image in images))
            results = [top_k_answer(row, self.card.classes, self.top_k) for row in rows]
            return results[0] if single else {"results": results}

    return ModelReplica


async def _bounded_body(request: Any, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise HTTPException(413, f"request body over {max_bytes} bytes; send one image, or fewer")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(413, f"request body over {max_bytes} bytes; send one image, or fewer")
        chunks.append(chunk)
    return b"".join(chunks)


def deploy(
    model_dir: Path,
    settings: ServeSettings,
    *,
    runtime: str,
    replicas: ReplicaCount,
    cpus_per_replica: float,
    host: str,
    port: int,
) -> str:
    """Start (or update) the application on the Ray cluster named by RAY_ADDRESS; returns its URL. The
    application keeps running after this process ends: `clusterfit serve --backend ray --stop` removes it."""
    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    replica = model_deployment(settings).options(
        **replicas.deployment_options(settings.max_batch), ray_actor_options={"num_cpus": cpus_per_replica}
    )
    serve.run(replica.bind(str(model_dir.resolve()), runtime), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False)
    serve.delete(APP_NAME)
    serve.shutdown()
