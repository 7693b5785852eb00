"""The job store on a real database: migrations, ordering, and state changes that cannot both win."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import cli_command, run_cli
from sqlalchemy import inspect

from clusterfit.service.migrate import open_store
from clusterfit.service.states import IllegalTransition, JobState
from clusterfit.service.store import JobNotFound, JobStore, StateConflict


@pytest.fixture
def store_url(database_url: str) -> str:
    return database_url  # each test runs on SQLite and on a real PostgreSQL (conftest.database_url)


def _add(store: JobStore, name: str = "job", priority: int = 0) -> str:
    return store.add_job(
        name=name, backend="local", ranks=2, outputs_dir="/tmp/out", spec_yaml="name: x\n", priority=priority
    ).id


def test_migrations_create_the_schema_once_and_reopening_keeps_the_jobs(store_url: str) -> None:
    store = open_store(store_url)
    assert {"jobs", "job_events", "api_tokens", "alembic_version"} <= set(inspect(store.engine).get_table_names())
    job_id = _add(store)
    reopened = open_store(store_url)
    assert reopened.get(job_id).state == "QUEUED"


def test_a_store_at_the_newest_revision_opens_without_loading_alembic(store_url: str) -> None:
    from alembic.script import ScriptDirectory

    from clusterfit.service.migrate import HEAD_REVISION, alembic_config, current_revision

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == HEAD_REVISION
    store = open_store(store_url)  # made, or migrated, to the newest revision
    assert current_revision(store.engine) == HEAD_REVISION
    opened = subprocess.run(
        [sys.executable, "-c", f"import sys; from clusterfit.service.migrate import open_store; "
         f"open_store({store_url!r}).count_jobs(); print('alembic' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert opened.stdout.strip() == "False", opened.stderr


def test_a_store_opened_again_in_the_same_process_still_sees_other_processes_writes(tmp_path) -> None:
    """Opening the store again (as a poll loop or a second command in one process does) must not disturb the
    connections already open: another process's transitions stay visible to them."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    held = open_store(url)
    job_id = _add(held)
    assert held.get(job_id).state == "QUEUED"  # the held store now has a connection open on the file
    for state in ("STAGING", "RUNNING", "SUCCEEDED"):
        open_store(url)  # e.g. the next poll of `clusterfit status`
        moved = subprocess.run(
            [sys.executable, "-c", _TRANSITION, url, job_id, state], capture_output=True, text=True, timeout=60
        )
        assert moved.returncode == 0, moved.stderr
        assert held.get(job_id).state == state


_TRANSITION = """
import sys
from clusterfit.service.migrate import open_store
from clusterfit.service.states import JobState
url, job_id, state = sys.argv[1:]
store = open_store(url)
store.transition(job_id, JobState(state), "by another process")
store.engine.dispose()  # the last connection closes, as when a supervisor or a CLI command exits
"""


def test_queue_order_is_priority_then_submission(store_url: str) -> None:
    store = open_store(store_url)
    first_low = _add(store, "a", priority=0)
    time.sleep(0.01)
    high = _add(store, "b", priority=5)
    time.sleep(0.01)
    second_low = _add(store, "c", priority=0)
    assert [job.id for job in store.queued_in_order()] == [high, first_low, second_low]


def test_transitions_record_history_and_refuse_impossible_moves(store_url: str) -> None:
    store = open_store(store_url)
    job_id = _add(store)
    store.transition(job_id, JobState.STAGING, "claimed")
    store.transition(job_id, JobState.RUNNING, "training")
    job = store.transition(job_id, JobState.SUCCEEDED, "done")
    assert job.started_at is not None and job.ended_at is not None and job.ended_at >= job.started_at
    assert [(event.state, event.message) for event in store.events(job_id)] == [
        ("QUEUED", "submitted"),
        ("STAGING", "claimed"),
        ("RUNNING", "training"),
        ("SUCCEEDED", "done"),
    ]
    with pytest.raises(IllegalTransition):
        store.transition(job_id, JobState.RUNNING)
    assert store.get(job_id).state == "SUCCEEDED"


def test_only_one_of_many_racing_claims_wins(store_url: str) -> None:
    store = open_store(store_url)
    job_id = _add(store)

    def claim(_: int) -> bool:
        try:
            open_store(store_url).transition(job_id, JobState.STAGING, "claimed")
            return True
        except (StateConflict, IllegalTransition):
            return False

    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(claim, range(8)))
    assert sum(wins) == 1
    assert [event.state for event in store.events(job_id)].count("STAGING") == 1


def test_one_supervisor_claims_a_job_and_an_unclaimed_one_goes_back_to_the_queue(store_url: str) -> None:
    store = open_store(store_url)
    job_id = _add(store)
    assert not store.claim_supervision(job_id, '{"pid": "1"}')  # queued: the scheduler has not started it
    store.transition(job_id, JobState.STAGING, "started by the scheduler")
    assert store.requeue_unsupervised(job_id, "queued again")  # its starter died before a supervisor began
    job = store.get(job_id)
    assert job.state == "QUEUED" and job.started_at is None and [j.id for j in store.queued_in_order()] == [job_id]
    store.transition(job_id, JobState.STAGING, "started by the scheduler")

    def claim(pid: int) -> bool:
        return open_store(store_url).claim_supervision(job_id, f'{{"pid": "{pid}"}}')

    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(claim, range(8)))
    assert sum(wins) == 1
    assert store.get(job_id).supervisor == f'{{"pid": "{wins.index(True)}"}}'
    assert not store.requeue_unsupervised(job_id, "queued again")  # it has a supervisor: it stays
    assert [(e.state, e.message) for e in store.events(job_id)][1:] == [
        ("STAGING", "started by the scheduler"),
        ("QUEUED", "queued again"),
        ("STAGING", "started by the scheduler"),
    ]


def test_a_job_run_in_the_foreground_is_recorded_started_and_claimed(store_url: str) -> None:
    """No scheduler can start it too, and if its process dies it is not queued again (it is not to run unseen)."""
    store = open_store(store_url)
    mine = '{"pid": "1"}'
    job = store.add_job(name="fg", backend="local", ranks=1, outputs_dir="/o", spec_yaml="name: x\n", supervisor=mine)
    assert job.state == "STAGING" and job.started_at is not None
    assert store.queued_in_order() == []
    assert [(e.state, e.message) for e in store.events(job.id)] == [
        ("QUEUED", "submitted"),
        ("STAGING", "started in the foreground"),
    ]
    assert not store.requeue_unsupervised(job.id, "queued again")
    assert not store.claim_supervision(job.id, '{"pid": "2"}')
    assert store.claim_supervision(job.id, mine)


def test_ids_resolve_by_unique_prefix(store_url: str) -> None:
    store = open_store(store_url)
    job_id = _add(store)
    assert store.get(job_id[:6]).id == job_id
    with pytest.raises(JobNotFound, match="clusterfit list"):
        store.get("zzzzzz")


def test_an_unreachable_store_is_one_line_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERFIT_DATABASE_URL", "postgresql+psycopg://user:hunter2@127.0.0.1:1/jobs")
    result = run_cli("list")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: job store postgresql+psycopg://user:***@127.0.0.1:1/jobs: ")
    assert "hunter2" not in result.stderr and "check CLUSTERFIT_DATABASE_URL" in result.stderr


def test_a_piped_list_prints_every_row_whole_on_one_line() -> None:
    """A script's `clusterfit list | grep NAME` must find the name: without a terminal rich assumes 80 columns and
    cut it (`a-name-that-…`) and wrapped the progress onto a second line."""
    name = "a-job-name-long-enough-to-be-cut-at-eighty-columns"
    _add(open_store(), name=name)
    narrow = {**os.environ, "COLUMNS": "60"}  # a narrow terminal's setting, inherited by the pipe
    listing = subprocess.run(cli_command("list"), env=narrow, capture_output=True, text=True, check=True).stdout
    header, row = listing.splitlines()
    assert header.split() == ["id", "name", "state", "engine", "ranks", "progress", "images/s", "age"]
    assert row.split()[1:6] == [name, "QUEUED", "local", "2", "-"], listing
