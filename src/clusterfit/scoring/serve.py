"""`clusterfit serve MODEL_DIR`: a real-time HTTP endpoint for an exported model, with dynamic batching.

Requests are decoded and preprocessed (the model card's validation transform) in FastAPI's thread pool, then
queued; one batcher task takes what is queued, up to `max_batch` images, waiting at most `max_wait_ms` after
the first, and runs the model once for all of them in a worker thread (ONNX Runtime, or torch). Under load a
batch amortises the per-call cost over many requests; alone, a request waits at most `max_wait_ms` more.

The same guards as the job server, before any route: body size, security headers, Host/Origin checks without
keys; requests need a key from `--key-file` (compared in constant time; failed attempts limited per address).

SIGTERM or SIGINT drains the endpoint with uvicorn's graceful shutdown (`DRAIN_TIMEOUT_S`)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import gc
import hmac
import logging
import math
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Protocol

import numpy as np
import torch
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

from clusterfit import __version__
from clusterfit.data.decode import BadImage, open_image
from clusterfit.data.imagefolder import preprocessing_transform
from clusterfit.outputs.layout import model_onnx
from clusterfit.outputs.model_card import ModelCard, read_model_card
from clusterfit.service.api import (
    BodyLimit,
    FailedAuthentications,
    LoopbackOnly,
    SecurityHeaders,
    stop_gracefully_on_signals,
)

log = logging.getLogger("clusterfit.serve")

IMAGE_TYPES = {"image/jpeg", "image/png", "image/webp"}
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_PIXELS = 40_000_000  # a 40-megapixel photo; decompression bombs claim far more
MAX_IMAGES_PER_REQUEST = 64
# On SIGTERM or SIGINT the listener closes at once; requests already received (a slow upload too) then have this
# long to be answered before the process exits (0 either way).
DRAIN_TIMEOUT_S = 30


class Predictor(Protocol):
    runtime: str

    def __call__(self, images: torch.Tensor) -> np.ndarray:
        """uint8 NCHW images of the model's input size -> class probabilities, N x classes."""
        ...


@dataclass
class TorchPredictor:
    model_dir: Path
    runtime: str = "torch"

    def __post_init__(self) -> None:
        from clusterfit.scoring import load_classifier

        self.classifier = load_classifier(self.model_dir)

    def __call__(self, images: torch.Tensor) -> np.ndarray:
        return self.classifier.predict(images).numpy()


@dataclass
class OnnxPredictor:
    model_dir: Path
    card: ModelCard
    runtime: str = "onnx"

    def __post_init__(self) -> None:
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(model_onnx(self.model_dir)), providers=_onnx_providers())
        self.input_name = self.session.get_inputs()[0].name
        prep = self.card.preprocessing
        self.mean = np.asarray(prep.mean, dtype=np.float32).reshape(1, 3, 1, 1) * 255
        self.std = np.asarray(prep.std, dtype=np.float32).reshape(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor) -> np.ndarray:
        inputs = (images.numpy().astype(np.float32) - self.mean) / self.std
        logits = self.session.run(None, {self.input_name: inputs})[0]
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


def _onnx_providers() -> list[str]:
    import onnxruntime

    available = onnxruntime.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def load_predictor(model_dir: Path, runtime: str) -> Predictor:
    """`auto`: ONNX Runtime when the folder has model.onnx (from `clusterfit export`) and it is installed."""
    card = read_model_card(model_dir)
    if runtime == "auto":
        runtime = "onnx" if model_onnx(model_dir).is_file() and _has_onnxruntime() else "torch"
    if runtime == "onnx":
        return OnnxPredictor(model_dir, card)
    return TorchPredictor(model_dir)


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class BatchStats:
    requests: int = 0
    images: int = 0
    batch_sizes: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        batches = sum(self.batch_sizes.values())
        return {
            "requests": self.requests,
            "images": self.images,
            "batches": batches,
            "mean_batch_size": self.images / batches if batches else 0.0,
            "batch_sizes": {str(size): count for size, count in sorted(self.batch_sizes.items())},
        }


class DynamicBatcher:
    """Collects queued images into batches of up to `max_batch`, waiting at most `max_wait_s` after the first
    for images that are on their way (requests being read or decoded); with none on the way, a batch runs at
    once, so a lone client pays no batching delay."""

    def __init__(self, predict: Predictor, max_batch: int, max_wait_s: float) -> None:
        self.predict, self.max_batch, self.max_wait_s = predict, max_batch, max_wait_s
        self.queue: asyncio.Queue[tuple[torch.Tensor, asyncio.Future]] = asyncio.Queue()
        self.stats = BatchStats()
        # NOTE: one thread for every model call. torch's OpenMP pool belongs to the thread that calls it, and
        # calls from a rotating pool of threads kept several pools spinning against each other (1 client: 64 ms
        # per request instead of 13).
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.coming = 0  # images of requests being received or preprocessed, not yet queued

    @contextlib.contextmanager
    def expecting(self, images: int) -> Iterator[None]:
        """While a request's images are read and preprocessed: a batch being formed may wait for them."""
        self.coming += images
        try:
            yield
        finally:
            self.coming -= images

    def enqueue(self, image: torch.Tensor) -> asyncio.Future:
        """Queue one image; the future gets its class probabilities."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((image, future))
        return future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch:
                if self.queue.empty():
                    if self.coming <= 0:
                        break  # nothing else on the way: waiting would only add latency
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self.queue.get(), left))
                    except TimeoutError:
                        break
                else:
                    batch.append(self.queue.get_nowait())
            images = torch.stack([image for image, _ in batch])
            try:
                probabilities = await loop.run_in_executor(self.model_thread, self.predict, images)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure, the loop goes on
                log.exception("the model failed on a batch of %d", len(batch))
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.stats.images += len(batch)
            self.stats.batch_sizes[len(batch)] += 1
            for (_, future), row in zip(batch, probabilities, strict=True):
                if not future.done():  # a client that went away leaves a cancelled future
                    future.set_result(row)


@dataclass(frozen=True)
class ServeSettings:
    keys: tuple[str, ...] = ()  # empty: no keys (loopback only)
    max_batch: int = 32
    max_wait_ms: float = 5.0
    top_k: int = 5
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    auth_failures_allowed: int = 30
    auth_failure_window_s: float = 60.0


def preprocess(body: bytes, card: ModelCard, max_pixels: int) -> torch.Tensor:
    """One image's bytes -> the model's uint8 CHW input; a 422 naming the problem if it is not a usable image."""
    try:
        with open_image(body) as header:  # reads the header only: the size is known before any decoding
            width, height = header.size
        if width * height > max_pixels:
            raise HTTPException(422, f"image of {width}x{height} pixels is over the limit of {max_pixels}")
        return preprocessing_transform(card.preprocessing)(body)
    except BadImage as exc:
        raise HTTPException(422, f"not a usable image: {exc}") from None


def check_key(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Whether the Authorization header carries one of `keys`; a 401 if it carries none at all."""
    scheme, _, offered = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not offered.strip():
        raise HTTPException(
            401, "missing key: send Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"}
        )
    # Every key is compared, in constant time each, so the answer's timing says nothing about which was close.
    return any([hmac.compare_digest(offered.strip().encode(), key.encode()) for key in keys])


def _key_check(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    settings: ServeSettings = request.app.state.settings
    if not settings.keys:
        return
    address = request.client.host if request.client else "unknown"
    failures: FailedAuthentications = request.app.state.failed_authentications
    wait_s = math.ceil(failures.wait_s(address))
    if wait_s:
        raise HTTPException(429, f"too many failed authentications from {address}; try again in {wait_s} s")
    if not check_key(authorization, settings.keys):
        failures.record(address)
        log.warning("failed authentication from %s on %s", address, request.url.path)
        raise HTTPException(401, "unknown key", headers={"WWW-Authenticate": "Bearer"})


def image_bodies(content_type: str, body: bytes) -> tuple[list[bytes], bool]:
    """The images a /predict request carries, and whether it was one image (not a JSON batch)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in IMAGE_TYPES:
        return [body], True
    if kind == "application/json":
        return _batch_bodies(body), False
    raise HTTPException(
        415,
        f"Content-Type {kind or 'missing'!r}: send image/jpeg, image/png or image/webp bytes, or "
        'application/json {"images": [base64, ...]}',
    )


def top_k_answer(probabilities: np.ndarray, classes: list[str], top_k: int) -> dict[str, Any]:
    order = np.argsort(-probabilities)[:top_k]
    return {"top_k": [{"class": classes[i], "probability": float(probabilities[i])} for i in order]}


Keyed = Annotated[None, Depends(_key_check)]


def create_serving_app(model_dir: Path, predictor: Predictor, settings: ServeSettings) -> FastAPI:
    card = read_model_card(model_dir)
    batcher = DynamicBatcher(predictor, settings.max_batch, settings.max_wait_ms / 1000)
    top_k = min(settings.top_k, len(card.classes))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.run())
        app.state.ready = True
        yield
        app.state.ready = False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        batcher.model_thread.shutdown(wait=True)

    app = FastAPI(
        title="clusterfit model endpoint",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings, app.state.ready = settings, False
    app.state.failed_authentications = FailedAuthentications(
        settings.auth_failures_allowed, settings.auth_failure_window_s
    )
    if not settings.keys:
        app.add_middleware(LoopbackOnly)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, hint="send one image, or fewer (serve --max-body-bytes)"
    )
    app.add_middleware(SecurityHeaders)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    def ready(request: Request) -> JSONResponse:
        ok = bool(request.app.state.ready)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metadata")
    def metadata(_: Keyed) -> dict[str, Any]:
        return {
            **asdict(card),
            "runtime": predictor.runtime,
            "max_batch": settings.max_batch,
            "max_wait_ms": settings.max_wait_ms,
            "top_k": top_k,
        }

    @app.get("/stats")
    def stats(_: Keyed) -> dict[str, Any]:
        return batcher.stats.to_dict()

    @app.post("/predict")
    async def predict(request: Request, _: Keyed) -> dict[str, Any]:
        with batcher.expecting(1):  # until its images are queued
            bodies, single = image_bodies(request.headers.get("content-type", ""), await request.body())
            batcher.stats.requests += 1
            images = [await asyncio.to_thread(preprocess, one, card, settings.max_pixels) for one in bodies]
            futures = [batcher.enqueue(image) for image in images]
        rows = await asyncio.gather(*futures)
        results = [top_k_answer(row, card.classes, top_k) for row in rows]
        return results[0] if single else {"results": results}

    return app


def _batch_bodies(body: bytes) -> list[bytes]:
    import json

    try:
        encoded = json.loads(body)["images"]
        if not isinstance(encoded, list) or not encoded or not all(isinstance(item, str) for item in encoded):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise HTTPException(422, 'a JSON batch is {"images": ["<base64 image>", ...]} with at least one') from None
    if len(encoded) > MAX_IMAGES_PER_REQUEST:
        raise HTTPException(413, f"{len(encoded)} images in one request; send at most {MAX_IMAGES_PER_REQUEST}")
    try:
        return [base64.b64decode(item, validate=True) for item in encoded]
    except binascii.Error:
        raise HTTPException(422, "an image of the batch is not valid base64") from None


def read_or_create_keys(path: Path, announce: Callable[[str], None]) -> tuple[str, ...]:
    """The keys in `path`, one per line; a missing file is created (0600) with one new key."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x", opener=lambda name, flags: os.open(name, flags, 0o600)) as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        announce(f"created {path} with a new key (clients send it as Authorization: Bearer <key>)")
    keys = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not keys:
        raise ValueError(f"{path} holds no key; put one per line, or delete it to have one made")
    return keys


def run_endpoint(
    app: FastAPI,
    sock: socket.socket,
    *,
    tls_cert: Path | None,
    tls_key: Path | None,
    announce: Callable[[str], None],
) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        log_level="warning",
        timeout_graceful_shutdown=DRAIN_TIMEOUT_S,
    )
    server = uvicorn.Server(config)
    stop_gracefully_on_signals(server)
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    announce(f"clusterfit serve listening on {scheme}://{shown}:{port} (POST /predict)")
    # NOTE: torch, the model and the web stack are some 400k objects that live as long as the process; frozen,
    # the collector's full passes skip them, both while serving (pauses that land on some requests) and at exit
    # (which took 2-4 s after a drain on a busy 2-core machine, 1 s frozen).
    gc.freeze()
    started = time.monotonic()
    server.run(sockets=[sock])
    announce(f"clusterfit serve stopped after {time.monotonic() - started:.0f} s")
