"""The job spec of `clusterfit score`: its flags become a `scorer:` job, validated like any job.yaml."""

from __future__ import annotations

from pathlib import Path

from clusterfit.errors import SpecError
from clusterfit.spec.load import validate_spec
from clusterfit.spec.model import JobSpec, is_url


def scoring_spec(
    model_dir: str,
    input_path: str,
    out: str,
    *,
    nproc: int = 1,
    top_k: int = 5,
    batch_size: int = 64,
    chunk_images: int = 1024,
    csv: bool = False,
) -> JobSpec:
    """A local scoring job on `nproc` ranks; paths are made absolute, so job.yaml means the same from anywhere."""
    if top_k < 1:
        raise SpecError(f"--top-k {top_k}: give at least 1 (it is capped at the model's number of classes)")
    if nproc < 1:
        raise SpecError(f"--nproc {nproc}: give at least 1 rank")
    raw = {
        "name": "score",
        "scorer": {
            "model_dir": str(Path(model_dir).resolve()),
            "input": input_path if is_url(input_path) else str(Path(input_path).resolve()),
            "top_k": top_k,
            "batch_size": batch_size,
            "chunk_images": chunk_images,
            "csv": csv,
        },
        "distribution": {"type": "pytorch", "process_count_per_instance": nproc},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(Path(out).resolve())},
    }
    return validate_spec(raw, source="clusterfit score")
