"""A job's outputs at a URL: the mirror between its local folder and a real Azure Blob Storage emulator (Azurite).
The end-to-end job (a kill, a fresh machine, a resume from the store) is in test_distributed.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from azure.storage.blob import BlobServiceClient
from azurite import Azurite, serving, silent_store
from conftest import wait_for

from clusterfit.errors import OutputsInUse
from clusterfit.outputs import JobOutputs
from clusterfit.outputs.checkpoints import checkpoint_name, publish, published, verify
from clusterfit.storage.filesystems import Credentials, StorageError
from clusterfit.storage.outputs_mirror import MirrorRole, OutputsMirror, StoreWriter, Uploader, check_store

CONTAINER = "outputs"

pytestmark = pytest.mark.xdist_group("staging")  # beside the other Azurite tests: one worker starts the emulators


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    yield from serving(tmp_path_factory.mktemp("azurite"), CONTAINER)


@pytest.fixture
def own_azurite(tmp_path: Path) -> Iterator[Azurite]:
    """For a test that stops the store mid-upload and starts it again on the same data."""
    yield from serving(tmp_path / "azurite", CONTAINER)


def _blobs(azurite: Azurite, prefix: str) -> dict[str, bytes]:
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    return {
        b.name[len(prefix) + 1 :]: container.download_blob(b.name).readall()
        for b in container.list_blobs(name_starts_with=prefix + "/")
    }


def _checkpoint(outputs: JobOutputs, step: int, size: int = 1000, keep: int = 2) -> Path:
    tmp = outputs.checkpoints / f".tmp-{step}"
    tmp.mkdir(parents=True)
    (tmp / "state.pt").write_bytes(os.urandom(size))
    (tmp / "rank-00001.pt").write_bytes(os.urandom(100))
    final = outputs.checkpoints / checkpoint_name(step)
    publish(tmp, final, {"step": step, "world_size": 2}, keep=keep)
    return final


def _job_folder(root: Path) -> JobOutputs:
    outputs = JobOutputs.at(root)
    outputs.logs.mkdir(parents=True)
    outputs.rank_log(0).write_text("rank 0 says hello\n")
    outputs.metrics.write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    outputs.heartbeats.mkdir()
    outputs.heartbeat(0).write_text("{}")
    outputs.lock.write_text("held")
    return outputs


def _folder_store(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob("*") if path.is_file()}


@pytest.mark.parametrize("store", ["azurite", "folder"])
def test_a_push_copies_the_folder_checkpoints_last_and_a_fresh_folder_pulls_it_back(
    request: pytest.FixtureRequest, store: str, tmp_path: Path
) -> None:
    """On a blob store, and on a folder store (file://, a share), whose folders must be made first."""
    if store == "azurite":
        azurite = request.getfixturevalue("azurite")
        url = f"az://{CONTAINER}/job-a"

        def stored_files() -> dict[str, bytes]:
            return _blobs(azurite, "job-a")
    else:
        url = f"file://{tmp_path / 'share' / 'job-a'}"

        def stored_files() -> dict[str, bytes]:
            return _folder_store(tmp_path / "share" / "job-a")

    outputs = _job_folder(tmp_path / "here")
    first = _checkpoint(outputs, 3)
    uploaded: list[str] = []
    mirror = OutputsMirror(outputs, url, Credentials(), on_file=uploaded.append)

    pushed = mirror.push()
    assert pushed.checkpoints == ["step-00000003"] and pushed.bytes > 1000
    assert uploaded[-1] == "checkpoints/step-00000003/manifest.json", "the manifest goes last"
    stored = stored_files()
    assert stored["logs/rank-0.log"] == b"rank 0 says hello\n"
    assert stored["checkpoints/step-00000003/state.pt"] == (first / "state.pt").read_bytes()
    assert not any(name.startswith(("heartbeats/", ".clusterfit-lock")) for name in stored), "this node's own"

    # Only what changed goes again; a checkpoint rotated away here leaves the store once newer ones are there.
    uploaded.clear()
    assert mirror.push().files == 0
    with outputs.rank_log(0).open("a") as log:
        log.write("and again\n")
    _checkpoint(outputs, 6)
    _checkpoint(outputs, 9)
    assert [p.name for p in published(outputs.checkpoints)] == ["step-00000009", "step-00000006"]
    mirror.push()
    assert "logs/rank-0.log" in uploaded and "metrics.jsonl" not in uploaded
    names = {name.split("/")[1] for name in stored_files() if name.startswith("checkpoints/")}
    assert names == {"step-00000006", "step-00000009"}

    # A fresh machine: everything back, the newest checkpoint verified.
    fresh = JobOutputs.at(tmp_path / "fresh")
    pulled = OutputsMirror(fresh, url, Credentials()).pull()
    assert pulled.checkpoints == ["step-00000009"] and pulled.skipped == []
    assert fresh.rank_log(0).read_text() == "rank 0 says hello\nand again\n"
    assert [p.name for p in published(fresh.checkpoints)] == ["step-00000009"]
    assert verify(fresh.checkpoints / "step-00000009") is None
    assert not fresh.heartbeats.exists()


@pytest.mark.parametrize("store", ["azurite", "folder"])
def test_nodes_without_a_shared_folder_share_the_store(
    request: pytest.FixtureRequest, store: str, tmp_path: Path
) -> None:
    """Outputs at a URL on Ray: the launcher's copy and two nodes' own folders. The nodes get the launcher's
    job.yaml, the launcher reads their logs (growing in place) and heartbeats back, and a user script's rank 1
    part reaches rank 0's node through the store, where the checkpoint is published and goes up whole."""
    url = f"az://{CONTAINER}/job-nodes" if store == "azurite" else f"file://{tmp_path / 'share' / 'job-nodes'}"
    if store == "azurite":
        request.getfixturevalue("azurite")
    earlier = JobOutputs.at(tmp_path / "earlier-run")
    earlier.root.mkdir()
    earlier.summary.write_text('{"run": 1}')
    OutputsMirror(earlier, url, Credentials()).push()
    launcher_copy = JobOutputs.at(tmp_path / "launcher")
    launcher_copy.logs.mkdir(parents=True)
    launcher = OutputsMirror(launcher_copy, url, Credentials(), role=MirrorRole.LAUNCHER)
    launcher.pull()  # as the supervisor does before each attempt
    assert launcher_copy.summary.read_text() == '{"run": 1}'
    launcher_copy.resolved_spec.write_text("name: job\n")
    launcher.push(read_back=False)
    node0, node1 = JobOutputs.at(tmp_path / "node0"), JobOutputs.at(tmp_path / "node1")
    mirrors = [OutputsMirror(folder, url, Credentials(), role=MirrorRole.NODE) for folder in (node0, node1)]
    for mirror in mirrors:
        mirror.pull()
    assert node1.resolved_spec.read_text() == "name: job\n"

    node1.resolved_spec.write_text("outputs: {dir: node1}\n")  # each node's own job.yaml stays its own
    node1.logs.mkdir(parents=True, exist_ok=True)
    node1.rank_log(1).write_text("rank 1 starts\n")
    node1.heartbeats.mkdir()
    node1.heartbeat(1).write_text('{"step": 1}')
    node1.summary.write_text('{"run": 2}')  # as long as the earlier run's: read back all the same
    tmp = ".tmp-step-00000004.run1"
    (node1.checkpoints / tmp / "rank-00001").mkdir(parents=True)
    (node1.checkpoints / tmp / "rank-00001" / "weights.bin").write_bytes(b"one" * 100)
    (node1.checkpoints / tmp / "rank-00001.writing").mkdir()  # still being written: not a part yet
    mirrors[1].push()
    launcher.push()
    assert launcher_copy.rank_log(1).read_text() == "rank 1 starts\n"
    assert launcher_copy.heartbeat(1).read_text() == '{"step": 1}'
    assert launcher_copy.summary.read_text() == '{"run": 2}'
    assert launcher_copy.resolved_spec.read_text() == "name: job\n"
    following = launcher_copy.rank_log(1).open()  # as `clusterfit run` follows it
    assert following.read() == "rank 1 starts\n"
    with node1.rank_log(1).open("a") as log:
        log.write("rank 1 at step 4\n")
    node1.heartbeat(1).write_text('{"step": 4}')  # as long as before: the store's time tells it changed
    mirrors[1].push()
    launcher.push()
    assert following.read() == "rank 1 at step 4\n", "new bytes appended to the file its follower has open"
    node1.rank_log(1).write_text("another node's rank 1 writes this log now, and more of it\n")
    mirrors[1].push()
    launcher.push()
    assert launcher_copy.rank_log(1).read_text() == "another node's rank 1 writes this log now, and more of it\n"
    assert launcher_copy.heartbeat(1).read_text() == '{"step": 4}'

    # Rank 0's node: its own part is there, so it fetches rank 1's and publishes.
    here = node0.checkpoints / tmp
    (here / "rank-00000").mkdir(parents=True)
    (here / "rank-00000" / "weights.bin").write_bytes(b"zero" * 100)
    mirrors[0].push()
    assert (here / "rank-00001" / "weights.bin").read_bytes() == b"one" * 100
    assert not (here / "rank-00001.writing").exists()
    publish(
        here,
        node0.checkpoints / checkpoint_name(4),
        {"step": 4, "world_size": 2, "parts": ["rank-00000", "rank-00001"]},
        keep=2,
    )
    assert mirrors[0].push().checkpoints == ["step-00000004"]
    fresh = JobOutputs.at(tmp_path / "fresh")
    assert OutputsMirror(fresh, url, Credentials()).pull().checkpoints == ["step-00000004"]
    assert (fresh.checkpoints / "step-00000004" / "rank-00001" / "weights.bin").read_bytes() == b"one" * 100
    assert not list(fresh.checkpoints.glob(".tmp-*")), "the parts left the store once the checkpoint was there"
    assert fresh.resolved_spec.read_text() == "name: job\n"
    following.close()


def test_an_object_named_to_climb_out_of_the_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """Object names may hold `..` (S3 keys do; Azurite refuses them, a folder store cannot hold them, fsspec's
    in-memory store keeps them as given): whoever can write the store must not write outside the job's folder."""
    import fsspec

    fsspec.filesystem("memory").pipe_file("/job-climb/logs/../../../escaped.txt", b"x")
    here = JobOutputs.at(tmp_path / "deep" / "here")
    for role in (MirrorRole.FOLDER, MirrorRole.LAUNCHER):
        mirror = OutputsMirror(here, "memory://job-climb", Credentials(), role=role)
        with pytest.raises(StorageError, match=r"escaped.txt: this object would land outside .*; refusing it") as e:
            mirror.pull() if role is MirrorRole.FOLDER else mirror.push()
        assert not e.value.retryable
    assert not list(tmp_path.rglob("escaped.txt*"))


def test_a_push_follows_no_link_a_job_made_in_its_folder(tmp_path: Path) -> None:
    """A root job service pushes the folders of jobs that run as other accounts: a job's link to a file (or a
    folder) it may not read must not carry that file into the store, where the job's owner can read it."""
    import fsspec

    secret = tmp_path / "secret"
    (secret / "inside").mkdir(parents=True)
    (secret / "key").write_text("root's\n")
    outputs = JobOutputs.at(tmp_path / "job")
    outputs.logs.mkdir(parents=True)
    (outputs.logs / "rank-0.log").write_text("trained\n")
    (outputs.logs / "rank-1.log").symlink_to(secret / "key")
    (outputs.root / "stolen").symlink_to(secret, target_is_directory=True)
    _checkpoint(outputs, 2)
    (outputs.checkpoints / "step-00000002" / "key.pt").symlink_to(secret / "key")
    (outputs.checkpoints / "step-00000009").symlink_to(secret, target_is_directory=True)
    OutputsMirror(outputs, "memory://job-links", Credentials()).push()
    stored = {name.removeprefix("/job-links/") for name in fsspec.filesystem("memory").find("/job-links")}
    assert {"logs/rank-0.log", "checkpoints/step-00000002/manifest.json"} <= stored
    linked = ["logs/rank-1.log", "checkpoints/step-00000002/key.pt"]
    assert not [name for name in stored if name in linked or name.startswith(("stolen", "checkpoints/step-00000009"))]


def test_a_pull_writes_nothing_through_a_link_swapped_in_after_the_check(tmp_path: Path) -> None:
    """A root job service pulls the store's copy into the folder of a job that runs as another account, whose
    other jobs could swap a folder there for a link (`checkpoints -> /etc/cron.d`) just after each name is
    checked: nothing may land behind the link."""
    outputs = JobOutputs.at(tmp_path / "job")
    outputs.logs.mkdir(parents=True)
    (outputs.logs / "rank-0.log").write_text("trained\n")
    _checkpoint(outputs, 2)
    OutputsMirror(outputs, "memory://job-pull-links", Credentials()).push()
    for top in ("logs", "checkpoints"):
        fresh = JobOutputs.at(tmp_path / f"fresh-{top}")
        (fresh.root / top).mkdir(parents=True)
        elsewhere = tmp_path / f"elsewhere-{top}"
        elsewhere.mkdir()
        mirror = OutputsMirror(fresh, "memory://job-pull-links", Credentials())
        checked = mirror._refuse_outside

        def swap_after_the_check(rel: str, local: Path, top: str = top, checked=checked, fresh=fresh) -> None:
            checked(rel, local)
            if not (fresh.root / top).is_symlink():  # the race won, once
                (fresh.root / top).rename(fresh.root / f"{top}.moved")
                (fresh.root / top).symlink_to(tmp_path / f"elsewhere-{top}", target_is_directory=True)

        mirror._refuse_outside = swap_after_the_check  # type: ignore[method-assign]
        with pytest.raises(StorageError):
            mirror.pull()
        assert not list(elsewhere.iterdir()), top


def test_a_node_s_agent_runs_between_its_folder_filled_from_the_store_and_its_last_copy_to_it(tmp_path: Path) -> None:
    """`python -m clusterfit.backends.node_copy` (a Kubernetes pod's command): the agent finds the store's files,
    what it writes reaches the store while it runs and after it ends, its exit code is the wrapper's, and the
    node's folder is gone."""
    store, folder = tmp_path / "store", tmp_path / "pod-outputs"
    (store / "code").mkdir(parents=True)
    (store / "code" / "train.py").write_text("print('hi')\n")
    folder.mkdir()
    (folder / "left-by-an-earlier-agent.txt").write_text("stale")
    agent = (
        "import json, pathlib, time\n"
        f"out = pathlib.Path({str(folder)!r})\n"
        "assert (out / 'code' / 'train.py').read_text() == \"print('hi')\\n\"\n"
        "assert not (out / 'left-by-an-earlier-agent.txt').exists()\n"
        "(out / 'logs').mkdir()\n"
        "(out / 'logs' / 'rank-0.log').write_text('step 1\\n')\n"
        f"deadline = time.monotonic() + 30\n"
        f"while not pathlib.Path({str(store / 'logs' / 'rank-0.log')!r}).exists():\n"
        "    assert time.monotonic() < deadline, 'not copied while running'\n"
        "    time.sleep(0.05)\n"
        "(out / 'summary.json').write_text(json.dumps({'done': True}))\n"
        "raise SystemExit(3)\n"
    )
    wrapped = subprocess.run(
        [sys.executable, "-m", "clusterfit.backends.node_copy", "--url", f"file://{store}", "--folder", str(folder),
         "--every", "0.1", "--", sys.executable, "-c", agent],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert wrapped.returncode == 3, wrapped.stderr
    assert json.loads((store / "summary.json").read_text()) == {"done": True}, "the last copy, after the end"
    assert (store / "logs" / "rank-0.log").read_text() == "step 1\n"
    assert not folder.exists()
    assert not (store / "left-by-an-earlier-agent.txt").exists()


def test_an_upload_cut_off_by_the_store_going_down_is_never_resumed_from(own_azurite: Azurite, tmp_path: Path) -> None:
    """Azurite is stopped while a checkpoint's files go up (after its first file, before its manifest); once it
    is back, a fresh machine resumes from the previous complete checkpoint, and a push completes the cut one."""
    azurite = own_azurite
    url = f"az://{CONTAINER}/job-b"
    outputs = _job_folder(tmp_path / "here")
    _checkpoint(outputs, 4)
    OutputsMirror(outputs, url, Credentials()).push()
    _checkpoint(outputs, 8, size=3_000_000)

    stopped = threading.Event()

    def stop_the_store_after_the_first_file(rel: str) -> None:
        if rel.startswith("checkpoints/step-00000008/") and not stopped.is_set():
            azurite.stop()
            stopped.set()

    cut = OutputsMirror(outputs, url, Credentials(), on_file=stop_the_store_after_the_first_file)
    with pytest.raises(StorageError) as failure:
        cut.push()
    assert stopped.is_set()
    assert failure.value.retryable, "an unreachable store is worth trying again"
    assert "cannot reach the storage service" in str(failure.value)

    port = azurite.port
    azurite.start()
    assert azurite.port == port
    stored = _blobs(azurite, "job-b")
    assert any(n.startswith("checkpoints/step-00000008/") for n in stored), "the cut upload left a part"
    assert "checkpoints/step-00000008/manifest.json" not in stored

    fresh = JobOutputs.at(tmp_path / "fresh")
    pulled = OutputsMirror(fresh, url, Credentials()).pull()
    assert pulled.checkpoints == ["step-00000004"]
    assert pulled.skipped == ["step-00000008: its upload never completed (no manifest.json)"]

    # The next push of the job finishes what was cut; from then on the newest one is used.
    assert cut.push().checkpoints == ["step-00000008"]
    newer = JobOutputs.at(tmp_path / "newer")
    assert OutputsMirror(newer, url, Credentials()).pull().checkpoints == ["step-00000008"]


def test_a_checkpoint_damaged_in_the_store_is_passed_over(azurite: Azurite, tmp_path: Path) -> None:
    url = f"az://{CONTAINER}/job-c"
    outputs = _job_folder(tmp_path / "here")
    _checkpoint(outputs, 2)
    _checkpoint(outputs, 5)
    OutputsMirror(outputs, url, Credentials()).push()
    container = BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(CONTAINER)
    container.upload_blob("job-c/checkpoints/step-00000005/state.pt", b"damaged", overwrite=True)

    fresh = JobOutputs.at(tmp_path / "fresh")
    pulled = OutputsMirror(fresh, url, Credentials()).pull()
    assert pulled.checkpoints == ["step-00000002"]
    assert pulled.skipped == ["step-00000005: state.pt has 7 bytes, expected 1000"]
    assert [p.name for p in published(fresh.checkpoints)] == ["step-00000002"]
    assert not [p for p in fresh.checkpoints.iterdir() if p.name.startswith(".tmp-")], "no half-pulled folder left"


def test_the_uploader_says_once_that_the_store_is_down_and_catches_up_when_it_is_back(
    own_azurite: Azurite, tmp_path: Path
) -> None:
    azurite = own_azurite
    url = f"az://{CONTAINER}/job-d"
    outputs = _job_folder(tmp_path / "here")
    said: list[str] = []
    mirror = OutputsMirror(outputs, url, Credentials())
    azurite.stop()
    with Uploader(mirror, every_s=0.05, log=said.append) as uploader:
        wait_for(lambda: said, 30, "the uploader to say the store is down")
        azurite.start()
        # The thread says so at its next push; a finish() that came first would push without a word.
        try:
            wait_for(lambda: said[-1].endswith("work again"), 30, "the uploader to reach the store again")
        except AssertionError as late:
            raise AssertionError(f"{late}; it said: {said}") from None
        _checkpoint(outputs, 7)
        pushed = uploader.finish()
    assert pushed.checkpoints == ["step-00000007"]
    down = [line for line in said if "cannot reach the storage service" in line]
    assert len(down) == 1 and "trying again every 0.05 s (the local copy is whole)" in down[0]
    assert said[-1] == f"outputs: uploads to {url} work again"
    assert "checkpoints/step-00000007/manifest.json" in _blobs(azurite, "job-d")


def test_a_store_that_takes_connections_and_never_answers_is_one_line_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a hung proxy or gateway does: the connection is taken and no answer comes. The SDK's own waits and
    retries held this check for 11 minutes before it said anything."""
    with silent_store() as connection_string:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string)
        started = time.monotonic()
        with pytest.raises(StorageError) as unanswered:
            check_store("az://outputs/job", Credentials(), deadline_s=2)
        waited = time.monotonic() - started
    assert str(unanswered.value) == (
        "outputs.dir = 'az://outputs/job': the storage service did not answer in 2 s; check the endpoint and the "
        "network, or run the job again later"
    )
    assert unanswered.value.retryable
    assert waited < 20, waited


def test_a_store_without_the_container_or_refusing_the_key_is_one_line_before_anything_runs(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(StorageError) as missing:
        check_store("az://no-such-container/x", Credentials())
    assert str(missing.value) == (
        "outputs.dir = 'az://no-such-container/x': no container or bucket 'no-such-container' in this store; "
        "create it, or fix the URL"
    )
    assert not missing.value.retryable
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string(key="d3Jvbmc="))
    with pytest.raises(StorageError) as refused:
        check_store(f"az://{CONTAINER}/x", Credentials())
    assert str(refused.value).startswith(f"outputs.dir = 'az://{CONTAINER}/x': access denied")
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with pytest.raises(StorageError) as anonymous:
        check_store(f"az://{CONTAINER}/x", Credentials())
    assert str(anonymous.value) == (
        f"outputs.dir = 'az://{CONTAINER}/x': no credentials for this store: set storage.account_name with "
        "AZURE_STORAGE_ACCOUNT_KEY or storage.sas_token, or AZURE_STORAGE_CONNECTION_STRING (AWS_* for s3://)"
    )


def test_one_job_at_a_time_writes_a_store_copy(azurite: Azurite, tmp_path: Path) -> None:
    """Two machines given one outputs URL: the second job stops in one line while the first lives; a writer
    elsewhere counts as alive until its record is stale, one here while its process runs; a job that lost the
    store to another stops uploading over it."""
    url = f"az://{CONTAINER}/claimed"
    first = OutputsMirror(_job_folder(tmp_path / "a"), url, Credentials())
    first.claim("job-a", ttl_s=60, settle_s=0)
    first.push()
    second = OutputsMirror(_job_folder(tmp_path / "b"), url, Credentials())
    in_use = r"^outputs.dir az://outputs/claimed is in use by job job-a \(pid \d+ on [^,]+, seen \d+ s ago\); wait for"
    with pytest.raises(OutputsInUse, match=in_use):
        second.claim("job-b", ttl_s=60, settle_s=0)
    first.claim("job-a", ttl_s=60, settle_s=0)  # the same job again: a retry

    def recorded(host: str, pid: int, start_time: str, age_s: float) -> None:
        record = StoreWriter("job-c", host, pid, start_time, time.time() - age_s)
        second.fs.pipe_file(f"{second.root}/.clusterfit-writer.json", json.dumps(record.__dict__).encode())

    recorded("another-machine", 1, "1", age_s=30)
    with pytest.raises(OutputsInUse, match="in use by job job-c \\(pid 1 on another-machine, seen 30 s ago\\)"):
        second.claim("job-b", ttl_s=60, settle_s=0)
    recorded("another-machine", 1, "1", age_s=90)  # stale: that machine is gone
    second.claim("job-b", ttl_s=60, settle_s=0)
    # On this machine, and just renewed, but its process is gone (the pid now names a process started later).
    recorded(socket.gethostname(), os.getpid(), "0", age_s=0)
    second.claim("job-b", ttl_s=60, settle_s=0)

    with pytest.raises(StorageError, match=r"took it over; this job stops uploading there") as stopped:
        first.push()
    assert not stopped.value.retryable
    second.push()

    # Two claims at once: both write their record, the last write stands, and the other job stops. job-c's
    # claim is written once job-d's record is in the store, while job-d waits to read it back.
    recorded("another-machine", 1, "1", age_s=90)
    fourth = OutputsMirror(_job_folder(tmp_path / "d"), url, Credentials())
    writer_file = f"{second.root}/.clusterfit-writer.json"
    with ThreadPoolExecutor(1) as pool:
        claiming = pool.submit(fourth.claim, "job-d", ttl_s=60, settle_s=3)
        wait_for(lambda: json.loads(second.fs.cat_file(writer_file))["job"] == "job-d", 3, "job-d's record", 0.02)
        recorded("another-machine", 2, "2", age_s=0)
        with pytest.raises(OutputsInUse, match="in use by job job-c \\(pid 2 on another-machine"):
            claiming.result()
    second.claim("job-b", ttl_s=0.1, settle_s=0)  # job-c's record is stale at a 0.1 s ttl: job-b writes again

    fresh = JobOutputs.at(tmp_path / "fresh")
    OutputsMirror(fresh, url, Credentials()).pull()
    assert not (fresh.root / ".clusterfit-writer.json").exists(), "the record stays in the store"
    second.release()
    assert ".clusterfit-writer.json" not in _blobs(azurite, "claimed")
