"""A job's outputs at a URL (`outputs.dir: az://...`, `s3://...`, `file://...`).

The job works in a local folder of the node (`outputs.cache_dir`), exactly as with a path; this mirror keeps the
store a copy of it, from a process that is not training (the job's supervisor), so no step waits for an upload:

- `push()` uploads what changed since the last push: logs, metrics, summary, the model, TensorBoard events, and
  every published checkpoint, its files first and its manifest last. A checkpoint in the store counts only once
  its manifest is there and every file matches it, so an interrupted upload is never resumed from. Checkpoints
  rotated away locally are deleted from the store once a newer one is complete there.
- `pull()` makes a fresh node's folder the store's: files missing here are downloaded, and the newest complete
  checkpoint in the store (verified against its manifest after the download) unless one as new is here.
- Where the nodes share no folder (outputs at a URL on Ray and Kubernetes), each node works in a folder of its
  own and the store is what they share (`MirrorRole`): each node's mirror uploads what its ranks write,
  heartbeats included; checkpoint parts of other ranks come to the node of rank 0 through the store before it
  publishes; and the launcher's copy only uploads its own files (job.yaml, code/, supervisor.log) and reads the
  rest back, logs by appending what is new so a follower of them sees them grow.
- `claim()` makes a job the one writer of the store's copy, as the local lock does for a folder: a record in the
  store names the job, its machine and process, renewed at every push. Another job finds it and stops in one
  line while that writer lives: a process of this machine is checked directly; one elsewhere counts as alive
  until its record is `ttl_s` old (a machine that vanished cannot say so).

Torch-free. Credentials come from the job's storage section or the environment and are never written anywhere.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from clusterfit.errors import ClusterfitError, OutputsInUse
from clusterfit.files import folder_beneath, open_beneath
from clusterfit.outputs import JobOutputs
from clusterfit.outputs.checkpoints import (
    MANIFEST,
    STEP_PREFIX,
    TMP_PREFIX,
    published,
    rank_folder,
    verify,
)
from clusterfit.outputs.layout import (
    CHECKPOINT_DIR,
    CODE_DIR,
    HEARTBEAT_DIR,
    LOCK_FILE,
    LOG_DIR,
    METRICS_FILE,
    RESOLVED_SPEC,
    SUPERVISOR_LOG,
    TENSORBOARD_DIR,
    WRITER_FILE,
)
from clusterfit.processes import is_running, process_start_time
from clusterfit.storage.filesystems import (
    PREFLIGHT_DEADLINE_S,
    Credentials,
    StorageError,
    answered_within,
    open_filesystem,
    public,
    storage_error,
)

# This folder's own lock, and the store's own record of its writer: never copied either way.
_NOT_MIRRORED = {LOCK_FILE, WRITER_FILE}
_FINAL_TRIES = 4
_LAUNCHER_FILES = (RESOLVED_SPEC, CODE_DIR, f"{LOG_DIR}/{SUPERVISOR_LOG}")
# Files only ever appended to: the launcher's copy takes only their new bytes, so their followers see them grow.
_APPENDED = (LOG_DIR, METRICS_FILE, TENSORBOARD_DIR)
_OVERLAP = 256  # bytes read again before a growing file's new ones, to check it is still the file read so far
_PART = re.compile(r"rank-\d{5}")  # a user script's rank's part of a checkpoint (the trainer's rank 0 writes all)
_SENT = ".sent"  # beside a part in the store once all of it is there


class MirrorRole(str, enum.Enum):
    """Which copy of a job's outputs this is, and so what it writes to the store and what it reads back.

    FOLDER: the job's one folder, which every node writes (a path they all see): all of it goes up but the
        heartbeats, which mean nothing once read elsewhere.
    NODE: one node's own folder, where nodes share no folder: what its ranks write goes up, heartbeats too (the
        launcher reads them from the store); its ranks' checkpoint parts go to the node of rank 0 through the store.
    LAUNCHER: the launcher's copy beside such nodes: it writes job.yaml, code/ and its supervisor.log, and reads
        everything else back as the nodes write it."""

    FOLDER = "folder"
    NODE = "node"
    LAUNCHER = "launcher"

    def writes(self, rel: str) -> bool:
        """Whether this copy puts the file at `rel` (a path inside the folder) into the store."""
        launchers = _under(rel, _LAUNCHER_FILES)
        if self is MirrorRole.LAUNCHER:
            return launchers
        if self is MirrorRole.NODE:
            return not launchers
        return not _under(rel, (HEARTBEAT_DIR,))


def _under(rel: str, names: tuple[str, ...]) -> bool:
    return any(rel == name or rel.startswith(name + "/") for name in names)


def writer_ttl_s(upload_every_s: float) -> float:
    """How long a writer on another machine counts as alive after its last renewal: long enough for a push of a
    large checkpoint between two renewals, short enough that a job rerun elsewhere after a machine vanished waits
    minutes, not hours."""
    return 300.0 + 6 * upload_every_s


@dataclass(frozen=True)
class StoreWriter:
    """The job that writes a store's copy of an outputs folder, as its record in the store says."""

    job: str
    host: str
    pid: int
    start_time: str
    renewed: float  # seconds since the epoch, by the writer's clock

    @classmethod
    def this_process(cls, job: str) -> StoreWriter:
        pid = os.getpid()
        return cls(job, socket.gethostname(), pid, process_start_time(pid) or "", time.time())

    @property
    def identity(self) -> tuple[str, str, int, str]:
        return self.job, self.host, self.pid, self.start_time

    def alive(self, ttl_s: float) -> bool:
        if self.host == socket.gethostname():
            return is_running(self.pid, self.start_time or None)
        return time.time() - self.renewed < ttl_s

    def __str__(self) -> str:
        return f"job {self.job} (pid {self.pid} on {self.host}, seen {max(0.0, time.time() - self.renewed):.0f} s ago)"


@dataclass
class Transfer:
    """What one push or pull moved."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    checkpoints: list[str] = field(default_factory=list)  # published (push) or restored (pull)
    skipped: list[str] = field(default_factory=list)  # store checkpoints not used, with why

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


class OutputsMirror:
    def __init__(
        self,
        outputs: JobOutputs,
        url: str,
        creds: Credentials,
        on_file: Callable[[str], None] | None = None,
        role: MirrorRole = MirrorRole.FOLDER,
    ) -> None:
        self.outputs, self.url, self.creds, self.role = outputs, url, creds, role
        self.fs, self.root = open_filesystem(url, creds)
        _fail_fast(self.fs)
        self.on_file = on_file  # hears each file's path inside the folder once it is in the store
        # path inside the folder -> (size, mtime_ns) when uploaded, or when downloaded (then it is the store's)
        self._sent: dict[str, tuple[int, int]] = {}
        self._seen: dict[str, tuple[int, str]] = {}  # launcher: path -> the store's (size, modified) read back
        self._parts_sent: set[str] = set()  # node: "<tmp folder>/<part>" put into the store
        self._writer: StoreWriter | None = None  # set by claim(): every push renews it first

    def claim(self, job: str, ttl_s: float, settle_s: float = 1.0) -> None:
        """Makes `job` the store copy's one writer, or raises OutputsInUse naming the live one. Two claims at once
        both write their record; the last write stands, and the other job sees it after `settle_s` and stops."""
        try:
            current = self._read_writer()
            if current is not None and current.job != job and current.alive(ttl_s):
                raise self._in_use(current)
            me = StoreWriter.this_process(job)
            self._write_writer(me)
            time.sleep(settle_s)
            current = self._read_writer()
        except ClusterfitError:
            raise
        except Exception as exc:  # noqa: BLE001 - every store's SDK raises its own types
            raise storage_error(f"outputs.dir = {public(self.url)!r}: claiming", exc, self.creds) from None
        if current is None or current.identity != me.identity:
            raise self._in_use(current or me)
        self._writer = me

    def release(self) -> None:
        """Gives up the claim (the job ended); best effort: a record left behind is taken over once stale."""
        writer, self._writer = self._writer, None
        with contextlib.suppress(Exception):  # every store's SDK raises its own types
            current = self._read_writer() if writer is not None else None
            if writer is not None and current is not None and current.identity == writer.identity:
                self.fs.rm(self._writer_path)

    def _renew(self) -> None:
        """Before each push: the store is still this job's (then its record is renewed), or StorageError, not
        retryable, and nothing is uploaded over the other job's files."""
        if self._writer is None:
            return
        current = self._read_writer()
        if current is not None and current.identity != self._writer.identity:
            raise StorageError(
                f"outputs.dir {public(self.url)}: {current} took it over; this job stops uploading there",
                retryable=False,
            )
        self._writer = replace(self._writer, renewed=time.time())
        self._write_writer(self._writer)

    @property
    def _writer_path(self) -> str:
        return f"{self.root}/{WRITER_FILE}"

    def _in_use(self, writer: StoreWriter) -> OutputsInUse:
        return OutputsInUse(
            f"outputs.dir {public(self.url)} is in use by {writer}; wait for it to end or cancel it, or give this "
            "job another outputs.dir"
        )

    def _read_writer(self) -> StoreWriter | None:
        try:
            return StoreWriter(**json.loads(self.fs.cat_file(self._writer_path)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return None  # not a record this version wrote: no writer to respect

    def _write_writer(self, writer: StoreWriter) -> None:
        self.fs.pipe_file(self._writer_path, json.dumps(asdict(writer)).encode())

    def push(self, *, read_back: bool = True) -> Transfer:
        """Upload what this copy writes and changed here since the last push; a node's copy also trades checkpoint
        parts, and the launcher's reads back what the nodes wrote (unless not `read_back`). StorageError
        (retryable if unreachable) on failure."""
        started, moved = time.perf_counter(), Transfer()
        try:
            self._renew()
            for path in self._plain_files():
                if self.role.writes(path.relative_to(self.outputs.root).as_posix()):
                    self._upload_if_changed(path, moved)
            if self.role is MirrorRole.NODE:
                self._trade_parts(moved)
            if self.role is MirrorRole.LAUNCHER:
                if read_back:
                    self._read_back(moved)
            else:
                self._push_checkpoints(moved)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - every store's SDK raises its own types
            raise storage_error(f"outputs.dir = {public(self.url)!r}: uploading", exc, self.creds) from None
        moved.seconds = time.perf_counter() - started
        return moved

    def _push_checkpoints(self, moved: Transfer) -> None:
        kept = published(self.outputs.checkpoints)
        for checkpoint in reversed(kept):  # oldest first: the newest is complete last
            if self._upload_checkpoint(checkpoint, moved):
                moved.checkpoints.append(checkpoint.name)
        # A node that only pulled a checkpoint at its start is not the one that rotates them.
        if kept and (self.role is MirrorRole.FOLDER or moved.checkpoints):
            self._delete_rotated({p.name for p in kept}, oldest_kept=kept[-1].name)
        if self.role is MirrorRole.NODE and moved.checkpoints:
            self._forget_parts(moved.checkpoints[-1])

    def pull(self, *, checkpoints: bool = True) -> Transfer:
        """Download the files this folder lacks and (with `checkpoints`) the store's newest complete checkpoint,
        unless one as new is here. A store without the folder yet is an empty one."""
        started, moved = time.perf_counter(), Transfer()
        try:
            listing = self._remote_listing()
            remote = {rel: size for rel, (size, _) in listing.items()}
            for rel, size in sorted(remote.items()):
                top = rel.split("/", 1)[0]
                if top in (*_NOT_MIRRORED, HEARTBEAT_DIR) or top == CHECKPOINT_DIR and rel.count("/") > 1:
                    continue  # an earlier run's heartbeats say nothing; checkpoint folders come whole, below
                local = self.outputs.root / rel
                if not local.exists():
                    self._download(rel, local, moved, size)
            if checkpoints:
                self._pull_newest_checkpoint(remote, moved)
            # The launcher's copy reads back only what changes in the store from now on.
            self._seen = {rel: sig for rel, sig in listing.items() if _size_or_none(self.outputs.root / rel) == sig[0]}
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise storage_error(f"outputs.dir = {public(self.url)!r}: downloading", exc, self.creds) from None
        moved.seconds = time.perf_counter() - started
        return moved

    def _plain_files(self) -> list[Path]:
        """Every file but the checkpoint folders (published ones go whole, others are still being written)."""
        found = []
        for path in sorted(self.outputs.root.rglob("*")):
            rel = path.relative_to(self.outputs.root)
            if not path.is_file() or rel.parts[0] in _NOT_MIRRORED:
                continue
            if rel.parts[0] == CHECKPOINT_DIR and len(rel.parts) > 2:
                continue
            if path.name.startswith(TMP_PREFIX) or path.name.endswith(".part"):
                continue
            found.append(path)
        return found

    def _upload_if_changed(self, path: Path, moved: Transfer) -> bool:
        rel = path.relative_to(self.outputs.root).as_posix()
        try:
            # NOTE: opened once, without following a link below the folder, and uploaded through that descriptor:
            # a job that swaps a file for a link to one it may not read, after a check by name, gains nothing.
            fd = open_beneath(self.outputs.root, rel, os.O_RDONLY)
        except OSError:
            return False  # rotated away meanwhile; or a link, or not a file, which is never uploaded
        try:
            stat = os.fstat(fd)
            if self._sent.get(rel) == (stat.st_size, stat.st_mtime_ns):
                return False
            self.fs.put_file(f"/proc/self/fd/{fd}", f"{self.root}/{rel}")
        finally:
            os.close(fd)
        self._sent[rel] = (stat.st_size, stat.st_mtime_ns)
        moved.files, moved.bytes = moved.files + 1, moved.bytes + stat.st_size
        if self.on_file is not None:
            self.on_file(rel)
        return True

    def _upload_checkpoint(self, checkpoint: Path, moved: Transfer) -> bool:
        """Its files, then its manifest: True when this push completed it in the store."""
        manifest = checkpoint / MANIFEST
        rel_manifest = manifest.relative_to(self.outputs.root).as_posix()
        if rel_manifest in self._sent:
            return False
        remote_manifest = f"{self.root}/{rel_manifest}"
        if self.fs.exists(remote_manifest) and self.fs.cat_file(remote_manifest) == manifest.read_bytes():
            stat = manifest.stat()  # pushed by an earlier supervisor of this job, or pulled from the store
            self._sent[rel_manifest] = (stat.st_size, stat.st_mtime_ns)
            return False
        for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and p != manifest):
            self._upload_if_changed(path, moved)
        return self._upload_if_changed(manifest, moved)

    def _delete_rotated(self, kept: set[str], oldest_kept: str) -> None:
        """Store checkpoints older than every one kept here: rotated away, or left half-uploaded."""
        folder = f"{self.root}/{CHECKPOINT_DIR}"
        if not self.fs.exists(folder):
            return
        for entry in self.fs.ls(folder, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(STEP_PREFIX) and name not in kept and name < oldest_kept:
                self.fs.rm(f"{folder}/{name}", recursive=True)

    def _remote_files(self, under: str = "") -> dict[str, int]:
        """Path inside the folder -> size, for every file in the store's copy (under `under` only, if given)."""
        return {rel: size for rel, (size, _) in self._remote_listing(under).items()}

    def _remote_listing(self, under: str = "") -> dict[str, tuple[int, str]]:
        """Path inside the folder -> (size, when it was last modified, as the store says it)."""
        top = f"{self.root}/{under}".rstrip("/")
        if not self.fs.exists(top):
            return {}
        found = self.fs.find(top, detail=True)
        prefix = self.root.rstrip("/") + "/"
        return {
            name[len(prefix) :]: (int(info.get("size") or 0), _modified(info))
            for name, info in found.items()
            if info.get("type") == "file" and name.startswith(prefix)
        }

    def _download(self, rel: str, local: Path, moved: Transfer, size: int) -> None:
        self._refuse_outside(rel, local)
        # NOTE: through descriptors, never through a link below the folder: a root job service pulls into the
        # folders of jobs that run as other accounts, which could swap a folder for a link meanwhile.
        self.outputs.root.mkdir(parents=True, exist_ok=True)
        parent = folder_beneath(self.outputs.root, local.parent.relative_to(self.outputs.root).as_posix(), make=True)
        try:
            part = f"{local.name}.part"
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666, dir_fd=parent)
            try:
                self.fs.get_file(f"{self.root}/{rel}", f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            os.replace(part, local.name, src_dir_fd=parent, dst_dir_fd=parent)
        finally:
            os.close(parent)
        moved.files, moved.bytes = moved.files + 1, moved.bytes + size
        if local.is_relative_to(self.outputs.root):  # the store's already: not uploaded back unless changed here
            stat = local.stat()
            self._sent[local.relative_to(self.outputs.root).as_posix()] = (stat.st_size, stat.st_mtime_ns)

    def _refuse_outside(self, rel: str, local: Path) -> None:
        """Anyone who can write the store names the files: a name climbing out of this folder (`..`) is refused,
        never written."""
        if not local.resolve().is_relative_to(self.outputs.root.resolve()):
            raise StorageError(
                f"{public(self.url)}/{rel}: this object would land outside {self.outputs.root}; refusing it "
                "(remove it from the store)",
                retryable=False,
            )

    def _read_back(self, moved: Transfer) -> None:
        """The launcher's copy: every file the nodes changed in the store since the last look, checkpoints aside
        (the nodes resume from the store's). Logs and metrics only grow, so only their new bytes come, appended."""
        for rel, (size, modified) in sorted(self._remote_listing().items()):
            if self._seen.get(rel) == (size, modified):
                continue
            top = rel.split("/", 1)[0]
            if top in _NOT_MIRRORED or top == CHECKPOINT_DIR or self.role.writes(rel) or rel.endswith(_SENT):
                continue
            local = self.outputs.root / rel
            self._refuse_outside(rel, local)
            have = _size_or_none(local) or 0
            if not (_under(rel, _APPENDED) and 0 < have < size and self._append_new_bytes(rel, local, have, size)):
                self._download(rel, local, moved, size)
            else:
                moved.files, moved.bytes = moved.files + 1, moved.bytes + size - have
            self._seen[rel] = (size, modified)

    def _append_new_bytes(self, rel: str, local: Path, have: int, size: int) -> bool:
        """Appends the store's bytes past `have` to `local`, if the store's file still starts as `local` ends
        (checked on an overlap); False if not: another node wrote it since (an elastic job's rank 0 moved)."""
        overlap = min(have, _OVERLAP)
        with open(local, "rb") as f:
            f.seek(have - overlap)
            tail = f.read(overlap)
        data = self.fs.cat_file(f"{self.root}/{rel}", start=have - overlap, end=size)
        if data[:overlap] != tail:
            return False
        with open(local, "ab") as f:
            f.write(data[overlap:])
        return True

    def _trade_parts(self, moved: Transfer) -> None:
        """A node's copy and the checkpoints a user script's ranks are writing (`.tmp-*` folders, each rank's part a
        folder appearing whole): where rank 0's part is here, the checkpoint is published here, so the other
        ranks' parts are fetched from the store into it; elsewhere this node's parts are put into the store, each
        followed by its marker."""
        root = self.outputs.checkpoints
        for tmp in sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []:
            if not tmp.is_dir():
                continue
            remote = f"{CHECKPOINT_DIR}/{tmp.name}"
            if (tmp / rank_folder(0)).is_dir():
                self._fetch_parts(tmp, remote, moved)
                continue
            for part in sorted(p for p in tmp.iterdir() if _PART.fullmatch(p.name) and p.is_dir()):
                key = f"{tmp.name}/{part.name}"
                if key in self._parts_sent:
                    continue
                for file in sorted(f for f in part.rglob("*") if f.is_file()):
                    self._upload_if_changed(file, moved)
                self.fs.pipe_file(f"{self.root}/{remote}/{part.name}{_SENT}", b"")
                self._parts_sent.add(key)

    def _fetch_parts(self, tmp: Path, remote: str, moved: Transfer) -> None:
        listing = self._remote_files(remote)
        for marker in sorted(rel for rel in listing if rel.endswith(_SENT)):
            name = marker.rsplit("/", 1)[1].removesuffix(_SENT)
            if (tmp / name).exists():
                continue
            part = f"{remote}/{name}"
            landing = tmp / f"{name}.pulling"  # whole, then one rename, as its rank wrote it
            shutil.rmtree(landing, ignore_errors=True)
            for rel, size in listing.items():
                if rel.startswith(part + "/"):
                    self._download(rel, landing / rel[len(part) + 1 :], moved, size)
            landing.mkdir(exist_ok=True)
            os.replace(landing, tmp / name)

    def _forget_parts(self, newest: str) -> None:
        """The store's parts of checkpoints up to `newest`, once it is published there."""
        folder = f"{self.root}/{CHECKPOINT_DIR}"
        for entry in self.fs.ls(folder, detail=False) if self.fs.exists(folder) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(TMP_PREFIX) and name[len(TMP_PREFIX) :][: len(newest)] <= newest:
                self.fs.rm(f"{folder}/{name}", recursive=True)

    def _pull_newest_checkpoint(self, remote: dict[str, int], moved: Transfer) -> None:
        by_checkpoint: dict[str, dict[str, int]] = {}
        for rel, size in remote.items():
            parts = rel.split("/")
            if len(parts) > 2 and parts[0] == CHECKPOINT_DIR and parts[1].startswith(STEP_PREFIX):
                by_checkpoint.setdefault(parts[1], {})["/".join(parts[2:])] = size
        here = published(self.outputs.checkpoints)
        newest_here = here[0].name if here else ""
        for name in sorted(by_checkpoint, reverse=True):
            if name <= newest_here:
                return
            files = by_checkpoint[name]
            if MANIFEST not in files:
                moved.skipped.append(f"{name}: its upload never completed (no {MANIFEST})")
                continue
            tmp = self.outputs.checkpoints / f"{TMP_PREFIX}pull-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            for rel in sorted(files, key=lambda r: r == MANIFEST):  # the manifest last, as when published
                self._download(f"{CHECKPOINT_DIR}/{name}/{rel}", tmp / rel, moved, files[rel])
            problem = verify(tmp)
            if problem is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                moved.skipped.append(f"{name}: {problem}")
                continue
            folder = folder_beneath(self.outputs.root, CHECKPOINT_DIR)
            try:
                os.replace(tmp.name, name, src_dir_fd=folder, dst_dir_fd=folder)
            finally:
                os.close(folder)
            moved.checkpoints.append(name)
            return


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        return None


def _modified(info: dict[str, Any]) -> str:
    """When a store's file last changed, as its fsspec listing says it (each store names it its own way)."""
    for key in ("etag", "ETag", "mtime", "last_modified", "LastModified"):  # an etag changes with every write
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _fail_fast(fs: Any) -> None:
    """Azure's SDK retries an unreachable store for about a minute (at 15, 18 and 24 s) before it says so; the
    uploader tries again on its own schedule, and says so once, so each call gives up after one retry a second
    later."""
    pipeline = getattr(getattr(fs, "service_client", None), "_pipeline", None)
    for policy in getattr(pipeline, "_impl_policies", []):
        if hasattr(policy, "initial_backoff") and hasattr(policy, "total_retries"):
            policy.initial_backoff, policy.increment_base, policy.random_jitter_range = 1, 2, 0.5
            policy.total_retries = policy.connect_retries = policy.read_retries = policy.status_retries = 1


def check_store(url: str, creds: Credentials, deadline_s: float = PREFLIGHT_DEADLINE_S) -> None:
    """Before any worker starts: the store answers these credentials within `deadline_s` and its bucket or
    container exists."""
    answered_within(deadline_s, f"outputs.dir = {public(url)!r}", lambda: _check_store(url, creds))


def _check_store(url: str, creds: Credentials) -> None:
    where = f"outputs.dir = {public(url)!r}"
    try:
        fs, root = open_filesystem(url, creds)
    except StorageError as exc:
        said = str(exc).removeprefix(f"{url}: ")
        raise StorageError(f"{where}: {said}", retryable=exc.retryable) from None
    top = root.strip("/").split("/", 1)[0]
    bucketed = url.split("://", 1)[0].lower() not in ("file", "local", "memory")
    try:
        if bucketed and not fs.exists(top):
            raise StorageError(
                f"{where}: no container or bucket {top!r} in this store; create it, or fix the URL", retryable=False
            )
        fs.exists(root)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - every store's SDK raises its own types
        raise storage_error(where, exc, creds) from None


class Uploader:
    """Pushes every `every_s` seconds on a thread while a job runs; `finish()` pushes once more and waits for it.
    A failed push mid-run is said once and tried again next time: the local copy is whole meanwhile."""

    def __init__(self, mirror: OutputsMirror, every_s: float, log: Callable[[str], None]) -> None:
        self.mirror, self.every_s, self.log = mirror, every_s, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outputs-uploader", daemon=True)
        self._pushing = threading.Lock()  # one push at a time: the thread's, or a caller's push_now()
        self._last_problem: str | None = None
        self.pushed = Transfer()

    def __enter__(self) -> Uploader:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.push_now()

    def push_now(self) -> None:
        """One push now, between the thread's (a launcher's copy reads the nodes' last words back this way)."""
        with self._pushing:
            try:
                self._add(self.mirror.push())
                if self._last_problem is not None:
                    self.log(f"outputs: uploads to {public(self.mirror.url)} work again")
                self._last_problem = None
            except StorageError as exc:
                if str(exc) != self._last_problem:
                    self.log(f"outputs: {exc}; trying again every {self.every_s:g} s (the local copy is whole)")
                self._last_problem = str(exc)

    def _add(self, moved: Transfer) -> None:
        self.pushed.files += moved.files
        self.pushed.bytes += moved.bytes
        self.pushed.seconds += moved.seconds
        self.pushed.checkpoints += moved.checkpoints

    def finish(self) -> Transfer:
        """The last push, tried a few times with pauses; StorageError if the store never took it."""
        self.__exit__()
        for attempt in range(_FINAL_TRIES):
            try:
                with self._pushing:
                    self._add(self.mirror.push())
                return self.pushed
            except StorageError as exc:
                if not exc.retryable or attempt == _FINAL_TRIES - 1:
                    raise
                time.sleep(2**attempt)
        return self.pushed
