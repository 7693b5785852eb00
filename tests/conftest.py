"""Shared helpers: tiny jobs, the CLI run as a user would run it, and reading exported weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

# NOTE: the suite runs three tests at a time on two cores, each with its own processes, so cores are always
# oversubscribed. OpenMP threads that spin between parallel regions (libgomp's default) then burn the CPU that
# other processes need: building and stepping six torchvision models took 13.3 s of CPU with two threads
# spinning and 4.6 s with them sleeping, the same as one thread. Set before anything loads libgomp (torch), and
# inherited by every process a test starts (jobs, servers, Ray and Slurm daemons).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from safetensors.torch import load_file  # noqa: E402 - loads torch, so after the OpenMP setting

from clusterfit.backends.warm_start import READY_LINE, WARM_START_ENV  # noqa: E402

if TYPE_CHECKING:
    import httpx
    from raycluster import RayCluster

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

# Files of short tests (most under a second, none over about ten; no training job among them). pytest-xdist
# hands each worker the next test as it frees up (the grouped files first, largest first), in collection order:
# these go last, so the workers end together, where in file order one worker still ran a 44-second sweep while
# the others idled.
QUICK_FILES = {
    "test_checkpoint.py", "test_data_decode.py", "test_docs.py", "test_job_service.py", "test_kubernetes.py",
    "test_local_rendering.py", "test_network.py", "test_service_states.py", "test_service_store.py",
    "test_spec.py", "test_units.py",
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in QUICK_FILES)  # stable: file order otherwise


def tiny_job(out_dir: Path, **trainer_overrides: Any) -> dict[str, Any]:
    """A job that trains in seconds on a CPU: resnet_tiny, 32 px, fp32, 2 workers."""
    trainer: dict[str, Any] = {
        "model": "resnet_tiny",
        "data": {"train": "synthetic", "image_size": 32, "num_classes": 10},
        "epochs": 1,
        "steps_per_epoch": 4,
        "batch_size": 4,
        "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.9, "weight_decay": 1e-4},
        "precision": "fp32",
        "log_every_steps": 2,
        # Every epoch's end, as the tests of resuming expect; jobs' default waits a minute between them.
        "checkpoint": {"every_steps": 100, "keep": 2, "min_interval_s": 0},
    }
    for key, value in trainer_overrides.items():
        if isinstance(value, dict) and isinstance(trainer.get(key), dict):
            trainer[key] = {**trainer[key], **value}
        else:
            trainer[key] = value
    return {
        "name": "tiny",
        "trainer": trainer,
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out_dir)},
    }


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "clusterfit", *args]


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`clusterfit ARGS` in `env` (default: this process's); `prefix` runs it under another command (a resource
    limit, a namespace)."""
    env = {**(os.environ if env is None else env), "COLUMNS": "200"}
    command = [*prefix, *cli_command(*args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def processes_mentioning(marker: str) -> list[int]:
    """PIDs of clusterfit processes whose command line contains `marker` (e.g. a job's outputs folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "clusterfit" in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def shared_by_threads(threads: int) -> httpx.Limits:
    """Limits for one httpx.Client that `threads` threads share: a connection for each, all kept. With fewer kept
    (20 by default), httpcore 1.0.9 closes an idle connection whenever the pool holds more connections than that,
    even one just handed to a waiting request, which then fails reading a closed socket (EBADF) or hangs
    (encode/httpcore#1110)."""
    import httpx

    return httpx.Limits(max_connections=threads, max_keepalive_connections=threads)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll until `predicate()` is truthy; returns its value, or fails the test naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)


def wait_for_first_checkpoint(out: Path, launcher: subprocess.Popen) -> None:
    wait_for(
        lambda: launcher.poll() is not None or list((out / "checkpoints").glob("step-*/manifest.json")),
        180,
        "the first checkpoint",
        interval=0.02,
    )
    assert launcher.poll() is None, "the job ended before its first checkpoint"


def kill_after_first_checkpoint(job: Path, out: Path) -> None:
    """Run the job, SIGKILL its launcher (no chance to clean up) once a checkpoint is published, and wait until
    no process of it is left: a job killed mid-training, as a lost login node or an OOM-killed launcher leaves it."""
    launcher = subprocess.Popen(
        cli_command("run", str(job)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_for_first_checkpoint(out, launcher)
    launcher.kill()
    launcher.wait()
    wait_for(lambda: not processes_mentioning(str(out)), 60, "the killed job's processes to end")
    assert not (out / "summary.json").exists(), "the job must have been stopped before it finished"


def exported_weights(out_dir: Path) -> dict[str, Any]:
    return load_file(str(out_dir / "model" / "model.safetensors"))


def max_abs_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def exported_test_model(folder: Path, classes: list[str]) -> Path:
    """An exported model as a job leaves it (weights with their metadata, TorchScript, a model card), without
    training: resnet_tiny at 32 px with GroupNorm and seeded random weights."""
    import torch

    from clusterfit import __version__
    from clusterfit.models import build_model
    from clusterfit.outputs.model_card import ModelCard, Preprocessing, write_model_card
    from clusterfit.worker.export import export_model

    torch.manual_seed(0)
    model = build_model("resnet_tiny", len(classes), "group", 32)
    metadata = {"model": "resnet_tiny", "norm_layer": "group", "classes": classes, "image_size": 32}
    export_model(model, folder, metadata=metadata, image_size=32)
    card = ModelCard("resnet_tiny", classes, 32, Preprocessing.for_size(32), {}, "0" * 64, __version__, "test")
    write_model_card(folder, card)
    return folder


def one_image_per_class(root: Path, count: int, size: tuple[int, int] = (60, 40)) -> Path:
    """`count` classes of one image each: a label then names its sample, so coverage can be checked."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for index in range(count):
        folder = root / f"c{index:03d}"
        folder.mkdir(parents=True)
        pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "img.jpg", quality=85)
    return root


@pytest.fixture(scope="module")
def scoring_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an exported model folder, its ImageNet-layout folder of 21 JPEGs and one corrupt file), per module."""
    from test_scoring import make_scoring_case

    return make_scoring_case(tmp_path_factory.mktemp("scoring"))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A real two-node Ray cluster on 127.0.0.1 with token authentication, shared by the tests of a module (all
    in tests/test_ray.py): stopped after them, since its idle daemons take about a tenth of a core."""
    from raycluster import RayCluster

    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftover_processes(), "the test Ray cluster left processes behind"


@pytest.fixture
def tiny_imagefolder(tmp_path: Path) -> Path:
    from make_tiny_imagefolder import make_tiny_imagefolder

    # 15 validation images: 2 ranks get 8 and 7, so exact counting across ranks is exercised.
    return make_tiny_imagefolder(tmp_path / "data", classes=3, train_per_class=16, val_per_class=5, size=40)


@dataclass(frozen=True)
class WarmStart:
    pid: int
    socket: Path


@pytest.fixture(scope="session", autouse=True)
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmStart]:
    """`clusterfit warm-start`, one per test worker, named in the environment of every process the tests start:
        local jobs' agents fork from it (backends/warm_start.py), as a user's do who runs one, instead of each
        importing torch again. What must start cold still does (docs/testing.md). The test Ray cluster's nodes run
    their own (tests/raycluster.py); Slurm's agents always start cold."""
    socket_path = tmp_path_factory.mktemp("warm") / "agents.sock"
    command = cli_command("warm-start", "--socket", str(socket_path))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    ready = process.stdout.readline()  # once torch, torchvision and the trainer are imported
    assert ready.startswith(READY_LINE), f"clusterfit warm-start did not start: {ready!r}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WARM_START_ENV, str(socket_path))
        yield WarmStart(process.pid, socket_path)
    process.terminate()
    try:
        process.wait(60)  # it waits for the agents it started, which a failed test may have left
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def service_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own job store (CLUSTERFIT_HOME), inherited by the CLI processes it starts."""
    home = tmp_path_factory.mktemp("clusterfit-home")
    monkeypatch.setenv("CLUSTERFIT_HOME", str(home))
    monkeypatch.delenv("CLUSTERFIT_DATABASE_URL", raising=False)
    monkeypatch.delenv("CLUSTERFIT_SERVER", raising=False)
    return home


@pytest.fixture(scope="session")
def postgres_server():  # noqa: ANN201
    """A real PostgreSQL cluster on loopback for the whole session (Debian's postgresql; `make services`)."""
    from postgres import PostgresServer, postgres_bin
    from services import skip_reason

    reason = skip_reason("postgresql")
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer(postgres_bin())
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, service_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The job store's URL, once per database: SQLite in the test's home, or a new PostgreSQL database.
    Set in the environment too, so servers and CLI processes the test starts use the same store."""
    if request.param == "sqlite":
        url = f"sqlite:///{service_home / 'jobs.db'}"
    else:
        url = request.getfixturevalue("postgres_server").new_database()
    monkeypatch.setenv("CLUSTERFIT_DATABASE_URL", url)
    return url
