"""A scoring job's predictions: the per-rank chunk files the ranks publish while they score, and the one
predictions.parquet they are merged into. Writer and reader side by side; torch-free, pyarrow on demand (the
`score` extra).

The input's file list (sorted; a packed dataset's in shard order) is cut into chunks (at most `chunk_images`, and
small enough that each rank gets a few, so no rank idles while another finishes a long last chunk); chunk g belongs
to rank g mod world size and is published as `predictions/rank-R/chunk-G.parquet` by one rename, holding every file
of the chunk (a file that could not be decoded as a row with its `bad_reason`). A chunk is done once its file
exists, under any rank's folder: a run killed at any moment and run again scores only the chunks that have no file,
so no image is scored twice and the merged output is the same. `plan.json` pins the file list and the chunk size the
chunks were cut with: a rerun keeps that chunk size (under any number of ranks), and a rerun over other files or
another model is refused rather than mixed in."""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterfit.errors import SpecError
from clusterfit.files import write_atomically
from clusterfit.outputs.layout import JobOutputs

PLAN_FILE = "plan.json"
FILE_COLUMN = "file"  # the image's path relative to the input folder (a packed sample's SHARD:KEY.jpg)
LABEL_COLUMN = "label"  # its class, when the input has classes (ImageNet layout, or packed)
BAD_COLUMN = "bad_reason"  # chunk files only: why a file could not be scored (data/decode.py REASONS)
_CHUNK = re.compile(r"chunk-(\d+)\.parquet$")


def class_column(k: int) -> str:
    """The k-th most likely class name (k from 1)."""
    return f"class_{k}"


def probability_column(k: int) -> str:
    return f"probability_{k}"


def require_pyarrow() -> None:
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise SpecError("clusterfit score writes Parquet and needs pyarrow: pip install 'clusterfit[score]'")


CHUNKS_PER_RANK = 4  # when the input allows: a rank's share then ends at most a quarter of it after another's


def files_digest(files: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(files).encode()).hexdigest()


def plan_chunk_size(outputs: JobOutputs, files: Sequence[str], world_size: int, cap: int) -> int:
    """Images per chunk: the pinned plan's when these files were being scored here before (a rerun resumes under
    any number of ranks), else at most `cap` and small enough for CHUNKS_PER_RANK chunks per rank."""
    saved = _read_plan(outputs)
    if saved is not None and saved.get("files_sha256") == files_digest(files):
        return int(saved["chunk_images"])
    return max(1, min(cap, -(-len(files) // (CHUNKS_PER_RANK * world_size))))


@dataclass(frozen=True)
class ScorePlan:
    """Which files each chunk holds and which rank scores it; the same on every rank and every rerun."""

    files: Sequence[str]  # as `list_score_inputs` gives them: sorted, or a packed dataset's in shard order
    labels: Sequence[str] | None  # the class (folder) of each file, else None
    chunk_images: int

    @property
    def chunks(self) -> int:
        return -(-len(self.files) // self.chunk_images)

    def chunk(self, index: int) -> range:
        return range(index * self.chunk_images, min((index + 1) * self.chunk_images, len(self.files)))

    def chunks_of(self, rank: int, world_size: int) -> list[int]:
        return list(range(rank, self.chunks, world_size))

    def record(self, model_sha256: str) -> dict[str, Any]:
        return {
            "images": len(self.files),
            "chunk_images": self.chunk_images,
            "files_sha256": files_digest(self.files),
            "labelled": self.labels is not None,
            "model_sha256": model_sha256,
        }


def chunk_file(outputs: JobOutputs, rank: int, index: int) -> Path:
    return outputs.prediction_parts / f"rank-{rank:05d}" / f"chunk-{index:06d}.parquet"


def finished_chunks(outputs: JobOutputs) -> dict[int, Path]:
    """chunk index -> its published file, whichever rank wrote it (temp files are hidden and never match)."""
    found: dict[int, Path] = {}
    for path in outputs.prediction_parts.glob("rank-*/chunk-*.parquet"):
        match = _CHUNK.search(path.name)
        if match and not path.name.startswith("."):
            found[int(match.group(1))] = path
    return found


def check_plan(outputs: JobOutputs, record: dict[str, Any], *, write: bool) -> None:
    """Refuse outputs whose chunks were cut from other files, another chunk size or another model; with `write`,
    pin this plan when none is there yet."""
    saved = _read_plan(outputs)
    if saved is not None:
        changed = [f"{key} {saved.get(key)!r} vs {value!r}" for key, value in record.items() if saved.get(key) != value]
        if changed:
            raise SpecError(
                f"outputs.dir = {str(outputs.root)!r} holds predictions of another scoring run ({'; '.join(changed)}); "
                "choose a new --out, or move the old one away to start over"
            )
    elif write:
        write_atomically(outputs.prediction_parts / PLAN_FILE, json.dumps(record, indent=2) + "\n")


def _read_plan(outputs: JobOutputs) -> dict[str, Any] | None:
    path = outputs.prediction_parts / PLAN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_chunk(path: Path, columns: dict[str, list[Any]]) -> None:
    """One chunk, published by a rename: readers and reruns see all of it or nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # NOTE: typed explicitly, so a chunk without bad files (an all-null column) concatenates with one that has some.
    schema = pa.schema([(name, pa.float64() if name.startswith("probability_") else pa.string()) for name in columns])
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns, schema=schema), buffer)
    write_atomically(path, buffer.getvalue(), durable=True)


@dataclass(frozen=True)
class Merged:
    scored: int
    bad: list[tuple[str, str]]  # (file, reason)
    top1_correct: int | None  # images whose top-1 class is their folder's name (labelled inputs only)


def merge_predictions(outputs: JobOutputs, plan: ScorePlan, *, csv: bool) -> Merged:
    """Every chunk, in file order, into predictions.parquet (good rows only) and optionally predictions.csv."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    done = finished_chunks(outputs)
    missing = [index for index in range(plan.chunks) if index not in done]
    if missing:
        raise RuntimeError(f"chunks {missing[:5]} of {plan.chunks} have no file; each rank should have written its own")
    table = pa.concat_tables([pq.read_table(done[index]) for index in range(plan.chunks)])
    bad_rows = table.filter(pc.invert(pc.is_null(table[BAD_COLUMN])))
    good = table.filter(pc.is_null(table[BAD_COLUMN])).drop_columns([BAD_COLUMN])
    good = good.sort_by(FILE_COLUMN)
    buffer = io.BytesIO()
    pq.write_table(good, buffer)
    write_atomically(outputs.predictions, buffer.getvalue(), durable=True)
    if csv:
        text = io.BytesIO()
        pa_csv.write_csv(good, text)
        write_atomically(outputs.predictions_csv, text.getvalue())
    correct = None
    if plan.labels is not None:
        correct = int(pc.sum(pc.equal(good[LABEL_COLUMN], good[class_column(1)])).as_py() or 0)
    bad = list(zip(bad_rows[FILE_COLUMN].to_pylist(), bad_rows[BAD_COLUMN].to_pylist(), strict=True))
    return Merged(scored=good.num_rows, bad=bad, top1_correct=correct)


def read_predictions(outputs: JobOutputs) -> list[dict[str, Any]]:
    """The merged predictions as rows (for tests and small outputs)."""
    import pyarrow.parquet as pq

    return pq.read_table(outputs.predictions).to_pylist()
