"""The job-service layer: the rules that work on any `JobService` (tested on a fake one), the cursor log reader,
and the two implementations, this machine's store and a real server over HTTP, giving the same answers."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import tiny_job, write_job
from service_server import ServerProcess, make_token

from clusterfit.outputs import (
    JobOutputs,
    MetricsTail,
    MetricsWriter,
    Phase,
    RankBeat,
    RecordKind,
    clear_heartbeats,
    read_heartbeats,
    write_heartbeat,
)
from clusterfit.outputs.metrics import last_record, read_records
from clusterfit.outputs.summary import read_summary
from clusterfit.service.causes import gather_evidence, tail_lines
from clusterfit.service.client import ServiceClient
from clusterfit.service.jobs import JobService, Refused, ServiceError, cancel_and_wait, follow_logs, parse_state
from clusterfit.service.local_jobs import LocalJobs
from clusterfit.service.logview import read_logs
from clusterfit.service.migrate import open_store
from clusterfit.service.states import JobState


# --- rules over any JobService -----------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", [LocalJobs, ServiceClient])
def test_both_implementations_take_the_interface_s_arguments(implementation: type) -> None:
    def parameters(method: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(method).parameters.values()]

    for name in ("submit", "cancel", "list_jobs", "status", "details", "logs", "metrics"):
        assert parameters(getattr(implementation, name)) == parameters(getattr(JobService, name)), name


class ScriptedJobs:
    """A JobService that answers from a script: log chunks in order, and the states a job passes through."""

    def __init__(self, chunks: Sequence[dict[str, Any]] = (), states: Sequence[str] = ()) -> None:
        self.chunks, self.states = list(chunks), list(states)
        self.cursors: list[str | None] = []

    def logs(self, job_id: str, cursor: str | None = None, rank: int | None = None) -> dict[str, Any]:
        self.cursors.append(cursor)
        return self.chunks.pop(0)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.status(job_id)

    def status(self, job_id: str) -> dict[str, Any]:
        """The next state of the script; the last one stays."""
        return {"id": job_id, "state": self.states.pop(0) if len(self.states) > 1 else self.states[0]}


def _chunk(cursor: str, *lines: str, more: bool = False, ended: bool = False) -> dict[str, Any]:
    return {"lines": list(lines), "cursor": cursor, "more": more, "ended": ended, "state": "RUNNING"}


def test_follow_logs_asks_again_at_once_for_more_and_stops_when_the_job_ended() -> None:
    jobs = ScriptedJobs([_chunk("1", "a", more=True), _chunk("2", "b"), _chunk("3"), _chunk("4", "c", ended=True)])
    shown: list[str] = []
    follow_logs(jobs, "job", shown.append, follow=True, poll_s=0)
    assert shown == ["a", "b", "c"] and jobs.cursors == [None, "1", "2", "3"]


def test_logs_without_follow_stop_after_what_is_there() -> None:
    jobs = ScriptedJobs([_chunk("1", "a", more=True), _chunk("2", "b"), _chunk("3", "never asked for")])
    shown: list[str] = []
    follow_logs(jobs, "job", shown.append, poll_s=0)
    assert shown == ["a", "b"]


def test_cancel_waits_for_the_end_and_gives_up_in_one_line() -> None:
    assert cancel_and_wait(ScriptedJobs(states=["RUNNING", "RUNNING", "CANCELLED"]), "j1", 10, poll_s=0) == {
        "id": "j1",
        "state": "CANCELLED",
    }
    with pytest.raises(ServiceError) as still:
        cancel_and_wait(ScriptedJobs(states=["RUNNING"]), "j1", 0.05, poll_s=0.01)
    assert still.value.exit_code == 1
    assert str(still.value) == "job j1 is still RUNNING after 0.05 s; run `clusterfit cancel j1` again"


def test_state_names_are_parsed_once_for_every_caller() -> None:
    assert parse_state(None, "--state") is None
    assert parse_state("Running", "--state") is JobState.RUNNING
    with pytest.raises(Refused) as bad:
        parse_state("sleeping", "state")
    assert (bad.value.status, bad.value.exit_code) == (422, 2)
    assert str(bad.value).startswith("state 'sleeping' is not a job state; use one of: queued, staging, running")


# --- the cursor log reader ---------------------------------------------------------------------------------
def test_log_lines_end_like_a_text_file_and_a_half_line_is_not_more(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"a\r\nb\rc\nd\r")
    first = read_logs(tmp_path, None, 1)
    # The trailing \r waits: a \n may follow it. A line without its end is not "more", or followers would spin.
    assert (first.lines, first.more) == (["[rank0] a", "[rank0] b", "[rank0] c"], False)
    with log.open("ab") as f:
        f.write(b"\nlast")
    second = read_logs(tmp_path, first.cursor, 1)
    assert (second.lines, second.more) == (["[rank0] d"], False)
    assert read_logs(tmp_path, second.cursor, 1, final=True).lines == ["[rank0] last"]


def test_a_cursor_a_client_made_up_reads_from_the_start_and_is_not_echoed(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_text("step 1\n")
    for cursor in ("rank-0.log:" + "9" * 5000, "rank-0.log:" + "9" * 30, "x" * 100 + ":1,rank-0.log:0"):
        chunk = read_logs(tmp_path, cursor, 1)  # int() and seek() raised on the first two: a 500
        assert (chunk.lines, chunk.cursor) == (["[rank0] step 1"], "rank-0.log:7")


def test_one_answer_reads_a_bounded_part_of_many_logs_and_every_log_takes_its_turn(tmp_path: Path) -> None:
    """A job with 600 rank logs of 100 kB each (a large job, or one that made the files to load the server):
    each answer reads at most 4 MiB from at most 256 of them, the files taking turns, and following the cursor
    delivers every line of every file once."""
    expected = {}
    for rank in range(600):
        text = "".join(f"rank {rank} line {n} " + "x" * 80 + "\n" for n in range(1000))
        (tmp_path / f"rank-{rank}.log").write_text(text)
        expected[rank] = text.splitlines()
    got: dict[int, list[str]] = {rank: [] for rank in expected}
    cursor, answers, empty = None, 0, 0
    while empty < 3:  # a whole round of turns with nothing new
        chunk = read_logs(tmp_path, cursor, 600)
        answers += 1
        empty = 0 if chunk.lines else empty + 1
        assert sum(len(line) for line in chunk.lines) <= 4 * 1024 * 1024 + 10 * len(chunk.lines)  # + the labels
        assert len({line.split("]")[0] for line in chunk.lines}) <= 256
        for line in chunk.lines:
            label, _, text = line.partition("] ")
            got[int(label.removeprefix("[rank"))].append(text)
        cursor = chunk.cursor
    assert got == expected and answers < 100


def test_what_the_service_reads_of_a_job_s_folders_is_its_ranks_files_only(tmp_path: Path) -> None:
    """A job may fill its folders with any number of files: 2,000 heartbeats and logs of ranks it does not have
    are not read (one status read all of them: 4.4 s for 200,000 heartbeats), only its 2 ranks' files."""
    outputs = JobOutputs.at(tmp_path / "job")
    outputs.logs.mkdir(parents=True)
    outputs.heartbeats.mkdir()
    for rank in range(2_000):
        write_heartbeat(outputs, RankBeat(rank, Phase.TRAINING.value, 2, 0.0, None, 100 + rank, "node", 1))
        outputs.rank_log(rank).write_text(f"rank {rank} says\n")
        (outputs.logs / f"rank-{rank}.error.json").write_text('{"message": {"message": "boom"}}')
    assert sorted(read_heartbeats(outputs, 2)) == [0, 1]
    assert read_logs(outputs.logs, None, 2, final=True).lines == ["[rank0] rank 0 says", "[rank1] rank 1 says"]
    evidence = gather_evidence(outputs, 2, exit_code=1)
    assert sorted(evidence.log_tails) == [0, 1] and {e.rank for e in evidence.exceptions} == {0, 1}
    clear_heartbeats(outputs, 2)
    assert not outputs.heartbeat(1).exists() and outputs.heartbeat(2).exists()  # the job's own files stay


def test_a_job_s_details_list_at_most_100_checkpoints_and_model_files(tmp_path: Path, service_home: Path) -> None:
    """A job may make any number of checkpoint folders and model files; `show` lists the newest 100 checkpoints
    (checking only those for a manifest) and the first 100 model files, not an answer of every one."""
    from clusterfit.service.records import record_job
    from clusterfit.spec import validate_spec

    store = open_store()
    job = record_job(store, validate_spec(tiny_job(tmp_path / "out")), owner="alice")
    outputs = JobOutputs.at(job.outputs_dir)
    for step in range(300):
        (outputs.checkpoints / f"step-{step:08d}").mkdir(parents=True)
        (outputs.checkpoints / f"step-{step:08d}" / "manifest.json").write_text("{}")
        (outputs.model / f"file-{step:03d}.bin").parent.mkdir(exist_ok=True)
        (outputs.model / f"file-{step:03d}.bin").write_bytes(b"")
    (outputs.checkpoints / "step-99999999").mkdir()  # no manifest: not published, and not counted
    details = LocalJobs(store, start_jobs=False).details(job.id)
    assert [Path(path).name for path in details["checkpoints"]] == [f"step-{s:08d}" for s in range(299, 199, -1)]
    assert [Path(path).name for path in details["model_files"]] == [f"file-{n:03d}.bin" for n in range(100)]


def test_a_job_s_file_that_is_a_link_is_not_read_through(tmp_path: Path) -> None:
    """The server (root) reads the files of jobs that run as other accounts: a job's `rank-1.log -> /etc/shadow`
    must show nothing, in the log API or in a cause read from a log's tail; nor may its metrics, heartbeat or
    summary, each a link to a file of JSON the job may not read, show through the API."""
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash\n")
    secret_json = tmp_path / "secret.json"
    secret_json.write_text(json.dumps({"kind": "train", "step": 1, "time": 1.0, "secret": "root's"}) + "\n")
    outputs = JobOutputs.at(tmp_path / "job")
    outputs.logs.mkdir(parents=True)
    outputs.heartbeats.mkdir()
    (outputs.logs / "rank-0.log").write_text("step 1\n")
    (outputs.logs / "rank-1.log").symlink_to(secret)
    chunk = read_logs(outputs.logs, None, 2, final=True)
    assert chunk.lines == ["[rank0] step 1"]
    assert tail_lines(outputs.logs / "rank-1.log", 10) == [] and tail_lines(outputs.logs / "rank-0.log", 10) == [
        "step 1"
    ]
    follower = MetricsTail(outputs.metrics, from_start=True)
    for path in (outputs.metrics, outputs.summary, outputs.heartbeat(0)):
        path.symlink_to(secret_json)
    assert read_records(outputs.metrics) == [] and last_record(outputs.metrics, RecordKind.TRAIN) is None
    assert follower.read_new() == [] and read_summary(outputs) is None and read_heartbeats(outputs, 2) == {}
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "rank-0.json").write_text("{}")
    for path in outputs.heartbeats.iterdir():
        path.unlink()
    outputs.heartbeats.rmdir()
    outputs.heartbeats.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    clear_heartbeats(outputs, 1)  # before an attempt, as root: nothing outside the folder is deleted
    assert (tmp_path / "elsewhere" / "rank-0.json").exists()


# --- both implementations ----------------------------------------------------------------------------------
@pytest.fixture
def both(tmp_path: Path) -> Iterator[tuple[LocalJobs, ServiceClient]]:
    """This machine's store and a paused server over the same store (the test's home), to compare."""
    with ServerProcess("--paused") as server, ServiceClient(server.url, make_token("submit")) as client:
        yield LocalJobs(open_store(), start_jobs=False), client


def _without_ages(found: Any) -> Any:
    """Heartbeat ages tick between two calls; everything else must be equal."""
    if isinstance(found, dict):
        return {key: _without_ages(value) for key, value in found.items() if key != "seconds_since_heartbeat"}
    if isinstance(found, list):
        return [_without_ages(value) for value in found]
    return found


def test_local_and_http_give_the_same_answers(both: tuple[LocalJobs, ServiceClient], tmp_path: Path) -> None:
    local, remote = both
    out = tmp_path / "out"
    job_id = remote.submit(write_job(tmp_path / "job.yaml", tiny_job(out)), ["trainer.epochs=2"])["id"]
    outputs = JobOutputs.at(out)
    outputs.logs.mkdir(parents=True)
    outputs.rank_log(0).write_text("step 1\nstep 2\n")
    outputs.agent_log.write_text("agent started\n")
    write_heartbeat(outputs, RankBeat(0, "training", 2, 1.0, 5.0, 123, "node-a", 1))
    metrics = MetricsWriter(outputs.metrics)
    metrics.write({"kind": "train", "step": 2, "loss": 2.5, "images_per_s": 5.0})
    metrics.close()

    assert local.list_jobs() == remote.list_jobs() and local.list_jobs()[0]["id"] == job_id
    assert local.list_jobs(JobState.QUEUED, 1) == remote.list_jobs(JobState.QUEUED, 1)
    assert local.list_jobs(JobState.RUNNING) == remote.list_jobs(JobState.RUNNING) == []
    assert _without_ages(local.status(job_id)) == _without_ages(remote.status(job_id[:6]))
    assert _without_ages(local.details(job_id)) == _without_ages(remote.details(job_id))
    assert local.details(job_id)["spec"]["trainer"]["epochs"] == 2
    assert local.metrics(job_id) == remote.metrics(job_id) == [json.loads(outputs.metrics.read_text())]
    chunk = local.logs(job_id)
    assert chunk == remote.logs(job_id)
    assert chunk["lines"] == ["[torchrun] agent started", "[rank0@node-a] step 1", "[rank0@node-a] step 2"]
    assert local.logs(job_id, chunk["cursor"]) == remote.logs(job_id, chunk["cursor"])
    assert local.logs(job_id, rank=0) == remote.logs(job_id, rank=0)


def test_cancel_through_either_ends_the_job_cancelled(both: tuple[LocalJobs, ServiceClient], tmp_path: Path) -> None:
    jobs: dict[str, JobService] = dict(zip(("local", "remote"), both, strict=True))
    submitted = {
        name: service.submit(write_job(tmp_path / f"{name}.yaml", tiny_job(tmp_path / name)))["id"]
        for name, service in jobs.items()
    }
    for name, service in jobs.items():
        assert cancel_and_wait(service, submitted[name], wait_s=30)["state"] == "CANCELLED"
        assert open_store().get(submitted[name]).job_state is JobState.CANCELLED
    for name, service in jobs.items():
        for owner, job_id in submitted.items():
            if (name, owner) == ("remote", "local"):  # a submit token changes only its owner's jobs
                with pytest.raises(Refused, match=f"job {job_id} belongs to") as foreign:
                    service.cancel(job_id)
                assert (foreign.value.status, foreign.value.exit_code) == (403, 2)
                continue
            with pytest.raises(Refused, match="already ended CANCELLED; nothing to cancel") as again:
                service.cancel(job_id)  # this machine's store may cancel any of its jobs
            assert (again.value.status, again.value.exit_code) == (409, 2)
        with pytest.raises(Refused, match="no job 'ffffffff'") as unknown:
            service.status("ffffffff")
        assert unknown.value.status == 404


def test_relative_paths_are_anchored_here_and_refused_over_http(
    both: tuple[LocalJobs, ServiceClient], tmp_path: Path, tiny_imagefolder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This machine's store reads a relative path from the current folder, as `clusterfit run` does; a server
    cannot know the client's folder, so it refuses the path in one line instead of a job that fails in its workers."""
    local, remote = both
    monkeypatch.chdir(tmp_path)
    assert tiny_imagefolder == tmp_path / "data"
    job = tiny_job(tmp_path / "out", data={"train": "data/train", "num_classes": None})
    spec = write_job(tmp_path / "job.yaml", job)
    with pytest.raises(Refused) as refused:
        remote.submit(spec)
    assert refused.value.status == 422
    assert str(refused.value) == (
        f"server refused (422): {spec}: trainer.data.train = 'data/train' is relative to the folder it was sent "
        "from, which this server cannot know; give an absolute path on the server's machine, or a URL"
    )
    assert not open_store().list_jobs()
    queued = local.details(local.submit(spec)["id"])["spec"]
    assert queued["trainer"]["data"]["train"] == str(tmp_path / "data" / "train")
