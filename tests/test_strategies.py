"""Every strategy through the CLI on 2 real processes over gloo, compared with one process; cross-strategy
resume; and looks inside the ranks for local SGD and gradient compression."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, exported_weights, max_abs_difference, run_cli, tiny_job, write_job

# GroupNorm and fp32: the only differences between strategies are the order of float additions.
COMMON = {"norm_layer": "group", "steps_per_epoch": 3, "epochs": 2, "schedule": {"kind": "constant"}}
TOLERANCE = 1e-5


def _job(out: Path, processes: int, batch: int, **trainer: object) -> dict:
    job = tiny_job(out, batch_size=batch, **{**COMMON, **trainer})
    job["distribution"]["process_count_per_instance"] = processes
    return job


def _run(tmp: Path, job: dict, name: str = "job") -> Path:
    result = run_cli("run", str(write_job(tmp / f"{name}.yaml", job)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Path(job["outputs"]["dir"])


def _losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


# One worker runs them all: each worker would otherwise compute the one-process reference run (a module fixture) again.
pytestmark = pytest.mark.xdist_group("strategies")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: one process with the whole global batch of 8."""
    root = tmp_path_factory.mktemp("reference")
    return _run(root, _job(root / "out", processes=1, batch=8))


def test_fsdp_matches_one_process(tmp_path: Path, one_process: Path) -> None:
    out = _run(tmp_path, _job(tmp_path / "out", processes=2, batch=4, strategy="fsdp", channels_last=True))
    assert max_abs_difference(exported_weights(out), exported_weights(one_process)) < TOLERANCE
    assert _losses(out) == pytest.approx(_losses(one_process), abs=TOLERANCE)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_one_process(tmp_path: Path, one_process: Path, schedule: str) -> None:
    options = {"stages": 2, "microbatches": 4, "schedule": schedule}
    job = _job(
        tmp_path / "out",
        processes=2,
        batch=8,
        strategy="pipeline",
        strategy_options=options,
        channels_last=schedule == "1f1b",
    )  # channels_last changes layouts at stage boundaries
    out = _run(tmp_path, job)
    assert max_abs_difference(exported_weights(out), exported_weights(one_process)) < TOLERANCE
    assert _losses(out) == pytest.approx(_losses(one_process), abs=TOLERANCE)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulated_batches_match_one_process_with_the_global_batch(
    tmp_path: Path, one_process: Path, strategy: str
) -> None:
    """2 ranks x batch 2 x 2 accumulated batches per step = the reference's global batch of 8: same weights,
    so the gradients of a step's batches add up, none lost or counted twice, however they are synchronised."""
    job = _job(tmp_path / "out", processes=2, batch=2, strategy=strategy, accumulate_steps=2)
    out = _run(tmp_path, job)
    assert max_abs_difference(exported_weights(out), exported_weights(one_process)) < TOLERANCE
    assert json.loads((out / "summary.json").read_text())["global_batch"] == 8
    assert len(_losses(out)) == len(_losses(one_process))  # logged per optimizer step, as the reference


def test_localsgd_averaging_every_step_matches_one_process(tmp_path: Path, one_process: Path) -> None:
    options = {"sync_every": 1, "warmup_steps": 0}
    out = _run(tmp_path, _job(tmp_path / "out", processes=2, batch=4, strategy="localsgd", strategy_options=options))
    assert max_abs_difference(exported_weights(out), exported_weights(one_process)) < TOLERANCE


def test_inside_the_ranks() -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tests" / "scripts" / "strategy_probe.py"),
        "localsgd",
        "compression",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize(("first", "then"), [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_resume_under_another_strategy_and_world_size(tmp_path: Path, one_process: Path, first: str, then: str) -> None:
    """Epoch 1 under one strategy, epoch 2 resumed under another: the weights of one process running both."""
    shapes = {"fsdp": {"processes": 2, "batch": 4}, "ddp": {"processes": 1, "batch": 8}}
    out = tmp_path / "out"
    _run(tmp_path, _job(out, **shapes[first], strategy=first, epochs=1), name="first")
    _run(tmp_path, _job(out, **shapes[then], strategy=then), name="then")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000003")
    assert max_abs_difference(exported_weights(out), exported_weights(one_process)) < TOLERANCE
