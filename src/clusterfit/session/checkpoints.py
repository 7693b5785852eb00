"""A user script's checkpoints: each rank writes its part into a folder of its own; the checkpoint is published
(by the built-in trainer's rule: manifest last, one rename, keep the newest N) only once every rank's part is
there, so a checkpoint missing a part is never offered for resume.

Nothing here is a collective: a part appears whole by rename, and a background thread on rank 0 publishes once
it sees every part, while the script trains on. The files are written once, where they stay."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clusterfit import __version__
from clusterfit.files import fsync_dir
from clusterfit.outputs import JobOutputs
from clusterfit.outputs.checkpoints import (
    PARTS_KEY,
    TMP_PREFIX,
    checkpoint_name,
    newest_verified,
    publish,
    rank_folder,
    read_manifest,
    step_of,
    wait_for_parts,
)
from clusterfit.session.context import JobContext
from clusterfit.session.errors import SessionError

_WRITING_SUFFIX = ".writing"


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint of a user script."""

    step: int
    path: Path  # checkpoints/step-NNNNNNNN/
    world_size: int  # of the run that wrote it
    rank: int  # the reader's rank

    @property
    def folder(self) -> Path:
        """This rank's part: what this rank wrote (for another world size, read `part(rank)` as fits)."""
        return self.part(self.rank)

    def part(self, rank: int) -> Path:
        return self.path / rank_folder(rank)


def latest_checkpoint(root: Path, rank: int) -> Checkpoint | None:
    """The newest published checkpoint whose every part and file verifies; a damaged one is skipped for an older."""
    path = newest_verified(root, of_script=True)
    if path is None:
        return None
    return Checkpoint(step_of(path), path, int(read_manifest(path)["world_size"]), rank)


class CheckpointWriter:
    def __init__(self, context: JobContext) -> None:
        assert context.outputs_dir is not None
        self.context = context
        self.root = JobOutputs.at(context.outputs_dir).checkpoints
        self._publisher: _Publisher | None = None
        if context.is_main:
            self._remove_other_runs_parts()

    @contextlib.contextmanager
    def save(self, step: int, keep: int) -> Iterator[Path]:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SessionError(f"checkpoint(step={step!r}): step must be a whole number >= 0")
        if keep < 1:
            raise SessionError(f"checkpoint(keep={keep!r}): keep at least 1 checkpoint, or none could be resumed")
        self.wait()  # at most one save in flight; the previous one is published before the next starts
        tmp = self.root / f"{TMP_PREFIX}{checkpoint_name(step)}.{self.context.restart_token}"
        part = tmp / rank_folder(self.context.rank)
        writing = part.with_name(part.name + _WRITING_SUFFIX)
        shutil.rmtree(writing, ignore_errors=True)
        writing.mkdir(parents=True)
        try:
            yield writing
        except BaseException:
            shutil.rmtree(writing, ignore_errors=True)
            raise
        _fsync_tree(writing)
        shutil.rmtree(part, ignore_errors=True)  # the same step saved twice in one run: the newer part counts
        os.replace(writing, part)  # NOTE: the part appears whole or not at all; rank 0 publishes on seeing it
        fsync_dir(tmp)
        if self.context.is_main:
            manifest = {
                "step": step,
                "world_size": self.context.world_size,
                PARTS_KEY: [rank_folder(rank) for rank in range(self.context.world_size)],
                "job": self.context.job_name,
                "attempt": self.context.attempt,
                "clusterfit_version": __version__,
            }
            self._publisher = _Publisher(tmp, self.root / checkpoint_name(step), manifest, keep, self.context)
            self._publisher.start()

    def wait(self) -> None:
        """Until the save in flight (rank 0's) is published; re-raises what stopped it."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.finish()

    def _remove_other_runs_parts(self) -> None:
        """Parts an earlier run left unpublished (a rank died): never mixed with this run's."""
        if self.root.is_dir():
            for stale in self.root.glob(f"{TMP_PREFIX}*"):
                if not stale.name.endswith(f".{self.context.restart_token}"):
                    shutil.rmtree(stale, ignore_errors=True)


class _Publisher(threading.Thread):
    def __init__(self, tmp: Path, final: Path, manifest: dict, keep: int, context: JobContext) -> None:
        super().__init__(daemon=True, name=f"publish-{final.name}")
        self.tmp, self.final, self.manifest, self.keep = tmp, final, manifest, keep
        self.part_timeout_s = context.hang_timeout  # a rank that sends no part for that long is hung or gone
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            parts = [self.tmp / name for name in self.manifest[PARTS_KEY]]
            wait_for_parts(parts, self.part_timeout_s, self.manifest["step"])
            publish(self.tmp, self.final, {**self.manifest, "created": time.time()}, self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the script's thread in finish()
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"checkpoint {self.final.name} was not published: {self.error}") from self.error


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        fsync_dir(sub)
