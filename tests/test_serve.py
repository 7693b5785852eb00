"""`clusterfit serve` for real: an endpoint process on loopback, concurrent clients, dynamic batching, every
bad request answered 4xx in one line while the server stays up, and SIGTERM draining what is in flight."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
from conftest import cli_command, exported_test_model, run_cli, wait_for
from PIL import Image

from clusterfit.data.imagefolder import val_transform
from clusterfit.errors import SpecError
from clusterfit.scoring import load_classifier

CLASSES = ["cat", "dog", "fox"]


def _jpeg(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exported_test_model(tmp_path_factory.mktemp("model"), CLASSES)


@dataclass
class Endpoint:
    url: str
    key: str
    process: subprocess.Popen

    def client(self, key: str | None = None) -> httpx.Client:
        token = self.key if key is None else key
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    """`clusterfit serve ARGS --port 0` and the URL it announces."""
    process = subprocess.Popen(
        cli_command("serve", *args, "--port", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            break
        assert line or process.poll() is None, "".join(lines)
    else:
        raise AssertionError("the endpoint did not start: " + "".join(lines))
    return process, found.group(1)


@pytest.fixture(scope="module")
def endpoint(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    key_file = tmp_path_factory.mktemp("keys") / "serve.keys"
    limits = ["--max-wait-ms", "20", "--top-k", "3", "--max-body-bytes", str(1 << 20)]
    process, url = _start(str(model_dir), "--key-file", str(key_file), "--runtime", "torch", *limits)
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    yield Endpoint(url, key_file.read_text().strip(), process)
    process.terminate()
    process.wait(timeout=60)


def test_concurrent_clients_get_the_model_s_answers_in_shared_batches(endpoint: Endpoint, model_dir: Path) -> None:
    images = [_jpeg(seed, (40 + seed, 36 + 2 * seed)) for seed in range(24)]
    classifier = load_classifier(model_dir)
    expected = classifier.predict(torch.stack([val_transform(32)(image) for image in images]))

    def ask(image: bytes) -> dict:
        with endpoint.client() as http:
            response = http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(max_workers=24) as pool:
        answers = list(pool.map(ask, images))
    for answer, probabilities in zip(answers, expected, strict=True):
        top = answer["top_k"]
        assert [entry["class"] for entry in top] == [CLASSES[i] for i in probabilities.argsort(descending=True)]
        assert [entry["probability"] for entry in top] == pytest.approx(
            sorted(probabilities.tolist(), reverse=True), abs=1e-5
        )

    with endpoint.client() as http:
        stats = http.get("/stats").json()
        metadata = http.get("/metadata").json()
    assert stats["images"] >= 24 and stats["requests"] >= 24
    assert max(int(size) for size in stats["batch_sizes"]) > 1, stats  # requests did share batches
    assert metadata["classes"] == CLASSES and metadata["runtime"] == "torch"


def test_a_json_batch_answers_each_image_as_alone(endpoint: Endpoint) -> None:
    images = [_jpeg(100 + n, (48, 48)) for n in range(3)]
    with endpoint.client() as http:
        alone = [http.post("/predict", content=i, headers={"Content-Type": "image/jpeg"}).json() for i in images]
        batch = http.post("/predict", json={"images": [base64.b64encode(i).decode() for i in images]})
    assert batch.status_code == 200, batch.text
    for one, together in zip(alone, batch.json()["results"], strict=True):
        assert [e["class"] for e in one["top_k"]] == [e["class"] for e in together["top_k"]]


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("key", "content_type", "body", "status", "words"),
    [
        (None, "image/jpeg", b"\xff\xd8\xff\xe0 not really a jpeg", 422, "not a usable image"),
        (None, "text/plain", b"hello", 415, "send image/jpeg"),
        ("", "image/jpeg", b"x", 401, "missing key"),
        ("wrong", "image/jpeg", b"x", 401, "unknown key"),
        (None, "image/png", "2 MiB", 413, "request body over"),
        (None, "image/png", "huge", 422, "over the limit of"),  # a 60-megapixel PNG of a few kB
        (None, "application/json", b'{"images": 3}', 422, "a JSON batch is"),
    ],
)
def test_a_bad_request_is_one_line_4xx_and_the_server_stays_up(
    endpoint: Endpoint, key: str | None, content_type: str, body: bytes | str, status: int, words: str
) -> None:
    # Big bodies are made in the test, not the parameters: a parameter's bytes become the test's id.
    payload = {"huge": lambda: _png(10_000, 6_000), "2 MiB": lambda: b"\0" * (2 << 20)}.get(body, lambda: body)()
    with endpoint.client(key) as http:
        response = http.post("/predict", content=payload, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert words in detail and "\n" not in detail
    with endpoint.client() as http:
        assert http.get("/health").json() == {"status": "ok"}
        ok = http.post("/predict", content=_jpeg(7, (40, 40)), headers={"Content-Type": "image/jpeg"})
    assert ok.status_code == 200
    assert endpoint.process.poll() is None


def test_unsafe_settings_are_refused(model_dir: Path) -> None:
    refused = run_cli("serve", str(model_dir), "--host", "0.0.0.0", "--no-auth")
    assert refused.returncode != 0 and "--no-auth with --host 0.0.0.0" in refused.stderr
    neither = run_cli("serve", str(model_dir))
    assert neither.returncode != 0 and "give --key-file" in neither.stderr
    missing = run_cli("serve", str(model_dir.parent / "nope"), "--no-auth")
    assert missing.returncode != 0 and "no model_card.json" in missing.stderr
    bounds = run_cli("serve", str(model_dir), "--no-auth", "--backend", "ray", "--replicas", "3:1")
    assert bounds.returncode != 0 and bounds.stderr.strip().splitlines() == [
        "error: --replicas 3:1: give a count (2) or bounds MIN:MAX (1:4), MIN at least 1"
    ]
    no_onnx = run_cli("serve", str(model_dir), "--no-auth", "--runtime", "onnx")
    assert no_onnx.returncode != 0 and no_onnx.stderr.strip().endswith(
        "run `clusterfit export " + str(model_dir) + "` first"
    )


def test_ray_serve_replicas_are_a_count_or_autoscaling_bounds() -> None:
    from ray import serve

    from clusterfit.spec.serving import ReplicaCount

    fixed = serve.deployment(lambda: None).options(**ReplicaCount.parse("3").deployment_options(max_batch=32))
    assert fixed.num_replicas == 3 and fixed.max_ongoing_requests == 64  # Ray Serve's default, 5, caps a batch at 5
    bounds = ReplicaCount.parse("1:4")
    assert str(bounds) == "1-4 (autoscaled)"
    options = bounds.deployment_options(max_batch=8)
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    autoscaled = serve.deployment(lambda: None).options(**options)  # Ray Serve validates the bounds' names
    assert autoscaled.max_ongoing_requests == 16
    for text in ("0", "2:1", "two", "1:"):
        with pytest.raises(SpecError, match=f"^--replicas {text}: give a count \\(2\\) or bounds MIN:MAX"):
            ReplicaCount.parse(text)


def test_onnx_runtime_answers_as_torch_does(model_dir: Path, tmp_path: Path) -> None:
    """`clusterfit export` adds model.onnx; served with ONNX Runtime, the answers are torch's."""
    onnx_dir = tmp_path / "model"
    shutil.copytree(model_dir, onnx_dir)
    samples = tmp_path / "samples"
    samples.mkdir()
    images = [_jpeg(200 + n, (44, 40)) for n in range(4)]
    for n, image in enumerate(images):
        (samples / f"{n}.jpg").write_bytes(image)
    exported = run_cli("export", str(onnx_dir), "--images", str(samples))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    expected = load_classifier(model_dir).predict(torch.stack([val_transform(32)(image) for image in images]))
    process, url = _start(str(onnx_dir), "--no-auth", "--runtime", "onnx")
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/metadata").json()["runtime"] == "onnx"
            for image, probabilities in zip(images, expected, strict=True):
                top = http.post("/predict", content=image, headers={"Content-Type": "image/jpeg"}).json()["top_k"]
                assert top[0]["class"] == CLASSES[int(probabilities.argmax())]
                assert top[0]["probability"] == pytest.approx(float(probabilities.max()), abs=1e-4)
    finally:
        process.terminate()
        process.wait(timeout=60)


def _refuses_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # The kernel answered with a reset while the listener was being closed: the next try is refused.
        return False
    return False


def test_sigterm_answers_the_requests_in_flight_and_exits_0(model_dir: Path) -> None:
    """SIGTERM while one upload is half sent and three requests wait in the batch window: the listener closes at
    once, every request already received is answered with the model's classes, and the process exits 0."""
    images = [_jpeg(300 + n, (48, 44)) for n in range(4)]
    expected = load_classifier(model_dir).predict(torch.stack([val_transform(32)(image) for image in images]))
    # A long batch window: while the upload is unfinished, the batch of the other three waits for its image.
    process, url = _start(str(model_dir), "--no-auth", "--runtime", "torch", "--max-wait-ms", "1000")
    host, port = urlsplit(url).hostname, urlsplit(url).port
    assert host and port

    def ask(image: bytes) -> tuple[int, str]:
        response = httpx.post(f"{url}/predict", content=image, headers={"Content-Type": "image/jpeg"}, timeout=30)
        return response.status_code, response.text

    upload = http.client.HTTPConnection(host, port, timeout=30)
    try:
        upload.putrequest("POST", "/predict")
        upload.putheader("Content-Type", "image/jpeg")
        upload.putheader("Content-Length", str(len(images[0])))
        upload.endheaders(images[0][:-1])  # all but the last byte
        with ThreadPoolExecutor(max_workers=3) as pool:
            queued = [pool.submit(ask, image) for image in images[1:]]
            # Once /stats counts their bodies, the server has also read the upload's headers, sent before them.
            wait_for(lambda: httpx.get(f"{url}/stats").json()["requests"] == 3, 30, "3 requests", interval=0.02)
            process.send_signal(signal.SIGTERM)
            stopping = time.monotonic()
            wait_for(lambda: _refuses_connections(host, port), 10, "the listener to close", interval=0.02)
            time.sleep(0.5)  # a slow client: uvicorn by itself gives connections 0.1 s, the drain must wait for it
            upload.send(images[0][-1:])
            response = upload.getresponse()
            answers = [(response.status, response.read().decode()), *(future.result() for future in queued)]
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - stopping < 15, "the drain waited for something that was not in flight"
    finally:
        upload.close()
        process.kill()
        output = process.communicate()[0]
    assert "clusterfit serve stopped" in output, output
    for (status, body), probabilities in zip(answers, expected, strict=True):
        assert status == 200, body
        answer = json.loads(body)
        assert answer["top_k"][0]["class"] == CLASSES[int(probabilities.argmax())]
        assert answer["top_k"][0]["probability"] == pytest.approx(float(probabilities.max()), abs=1e-5)
