"""The job store: jobs, their state history and API tokens in a real database through SQLAlchemy.

SQLite (a file in the service home) by default, PostgreSQL by URL. Every state change is one conditional
UPDATE (`... WHERE state = <the state we checked>`), so two processes racing to move the same job cannot
both win, on either database, without holding locks across calls."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.types import TypeDecorator

from clusterfit.service.states import FailureCause, JobState, check_transition


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UtcDateTime(TypeDecorator[datetime]):
    """SQLite forgets time zones; every time read back is UTC again."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    backend: Mapped[str] = mapped_column(String(32))
    ranks: Mapped[int] = mapped_column(Integer)
    outputs_dir: Mapped[str] = mapped_column(Text)
    spec_yaml: Mapped[str] = mapped_column(Text)  # resolved, without secrets
    owner: Mapped[str] = mapped_column(String(64), default="")
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # attempts started so far
    max_retries: Mapped[int] = mapped_column(Integer, default=0)
    submitted_at: Mapped[datetime] = mapped_column(UtcDateTime(), index=True)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())
    engine_ref: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON of backends.EngineRef
    supervisor: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: host, pid, start time
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    cause: Mapped[str | None] = mapped_column(String(32), nullable=True)
    cause_detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    images_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)

    @property
    def failure_cause(self) -> FailureCause | None:
        return FailureCause(self.cause) if self.cause else None


class JobEvent(Base):
    """One row per state change (with its time) and per notable event: the job's history."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(16), ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    state: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text, default="")


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(64), default="")  # whose jobs it submits, cancels and sees as its own
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; the token itself is never kept
    scopes: Mapped[str] = mapped_column(String(64))  # comma-separated: read, submit, admin
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)


class JobNotFound(LookupError):
    pass


class StateConflict(RuntimeError):
    """The job changed state between reading and writing it (another process moved it first)."""


def new_job_id() -> str:
    return secrets.token_hex(5)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        _private_sqlite_file(url)
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(connection: Any, _record: Any) -> None:
            # NOTE: WAL lets readers (status, the dashboard) run while a writer commits; the busy timeout
            # makes concurrent writers (supervisors, the server) wait instead of failing.
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=60000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def _private_sqlite_file(url: str) -> None:
    """The database file exists, 0600, before SQLite opens it: SQLite gives its -wal and -shm files the
    database file's permissions, so all three are their owner's only."""
    path = make_url(url).database
    if not path or path == ":memory:":
        return
    # NOTE: never open an existing database file here. Closing any descriptor of it drops every POSIX lock this
    # process holds on it, SQLite's included: another process then resets the WAL under this process's open
    # connections, which go on reading an old snapshot (a job seen STAGING for minutes after it ran).
    with suppress(FileExistsError):
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)


class JobStore:
    """All reads and writes of the job service's database. Open with `open_store` (runs migrations)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # --- jobs -------------------------------------------------------------------------------------------
    def add_job(
        self,
        *,
        name: str,
        backend: str,
        ranks: int,
        outputs_dir: str,
        spec_yaml: str,
        priority: int = 0,
        max_retries: int = 0,
        owner: str = "",
        supervisor: str | None = None,
    ) -> Job:
        """A new job, QUEUED for the scheduler; or, with the `supervisor` (JSON) that runs it itself, STAGING and
        already claimed, so that no scheduler starts it too and a supervisor that dies leaves it failed, never
        queued again."""
        started = supervisor is not None
        now = utcnow()
        job = Job(
            id=new_job_id(),
            name=name,
            state=(JobState.STAGING if started else JobState.QUEUED).value,
            priority=priority,
            backend=backend,
            ranks=ranks,
            outputs_dir=outputs_dir,
            spec_yaml=spec_yaml,
            owner=owner,
            attempt=0,
            max_retries=max_retries,
            submitted_at=now,
            started_at=now if started else None,
            supervisor=supervisor,
            updated_at=now,
        )
        with self.session() as session:
            session.add(job)
            session.add(JobEvent(job_id=job.id, at=now, state=JobState.QUEUED.value, message="submitted"))
            if started:  # one history for every job: QUEUED, then STAGING
                session.add(JobEvent(job_id=job.id, at=now, state=job.state, message="started in the foreground"))
        return job

    def get(self, job_id: str) -> Job:
        with self.session() as session:
            job = session.get(Job, job_id)
            if job is None:
                # NOTE: autoescape: `%` and `_` in what a client sent are characters, not LIKE wildcards.
                matches = session.scalars(select(Job).where(Job.id.startswith(job_id, autoescape=True)).limit(2)).all()
                job = matches[0] if len(matches) == 1 and len(job_id) >= 4 else None
            if job is None:
                raise JobNotFound(f"no job {job_id!r}; `clusterfit list` shows the jobs")
            return job

    def list_jobs(self, state: JobState | None = None, limit: int = 200) -> list[Job]:
        query = select(Job).order_by(Job.submitted_at.desc()).limit(limit)
        if state is not None:
            query = query.where(Job.state == state.value)
        with self.session() as session:
            return list(session.scalars(query))

    def count_jobs(self) -> int:
        with self.session() as session:
            return session.scalar(select(func.count()).select_from(Job)) or 0

    def count_queued(self, owner: str) -> int:
        query = select(func.count()).select_from(Job).where(Job.state == JobState.QUEUED.value, Job.owner == owner)
        with self.session() as session:
            return session.scalar(query) or 0

    def queued_in_order(self) -> list[Job]:
        """Queued jobs, the one to start first first: higher priority, then earlier submission."""
        query = select(Job).where(Job.state == JobState.QUEUED.value)
        with self.session() as session:
            return list(session.scalars(query.order_by(Job.priority.desc(), Job.submitted_at, Job.id)))

    def active_jobs(self) -> list[Job]:
        active = [state.value for state in JobState if state.is_active]
        with self.session() as session:
            return list(session.scalars(select(Job).where(Job.state.in_(active))))

    def transition(self, job_id: str, target: JobState, message: str = "", **fields: Any) -> Job:
        """Move a job to `target` if its current state allows it; raise IllegalTransition or StateConflict."""
        job = self.get(job_id)
        check_transition(job.job_state, target)
        now = utcnow()
        values: dict[str, Any] = {"state": target.value, "updated_at": now, **fields}
        if target is JobState.STAGING and job.started_at is None:
            values["started_at"] = now
        if target.is_terminal:
            values["ended_at"] = now
        with self.session() as session:
            result = session.execute(update(Job).where(Job.id == job.id, Job.state == job.state).values(**values))
            if result.rowcount != 1:
                raise StateConflict(f"job {job.id} changed state while becoming {target.value}; read it again")
            session.add(JobEvent(job_id=job.id, at=now, state=target.value, message=message))
        return self.get(job.id)

    def update(self, job_id: str, **fields: Any) -> None:
        """Fields that are not the state: progress, engine reference, supervisor."""
        with self.session() as session:
            session.execute(update(Job).where(Job.id == job_id).values(updated_at=utcnow(), **fields))

    def claim_supervision(self, job_id: str, supervisor: str) -> bool:
        """Record `supervisor` (JSON) as the staging job's one supervisor (it may have been recorded with the job);
        False when another process claimed it first or the job was queued again (`requeue_unsupervised`): the
        caller must then leave it alone."""
        unclaimed_or_mine = or_(Job.supervisor.is_(None), Job.supervisor == supervisor)
        with self.session() as session:
            result = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == JobState.STAGING.value, unclaimed_or_mine)
                .values(supervisor=supervisor, updated_at=utcnow())
            )
            return result.rowcount == 1

    def requeue_unsupervised(self, job_id: str, message: str) -> bool:
        """A staging job that no supervisor ever claimed (whoever started it died first) goes back to the queue,
        as if never started; False when a supervisor claimed it meanwhile."""
        now = utcnow()
        with self.session() as session:
            result = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == JobState.STAGING.value, Job.supervisor.is_(None))
                .values(state=JobState.QUEUED.value, started_at=None, updated_at=now)
            )
            if result.rowcount != 1:
                return False
            session.add(JobEvent(job_id=job_id, at=now, state=JobState.QUEUED.value, message=message))
        return True

    def request_cancel(self, job_id: str) -> Job:
        with self.session() as session:
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.cancel_requested_at.is_(None))
                .values(cancel_requested_at=utcnow())
            )
        return self.get(job_id)

    def events(self, job_id: str) -> list[JobEvent]:
        with self.session() as session:
            query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.at, JobEvent.id)
            return list(session.scalars(query))

    def add_event(self, job_id: str, state: JobState, message: str) -> None:
        with self.session() as session:
            session.add(JobEvent(job_id=job_id, at=utcnow(), state=state.value, message=message))

    # --- tokens -----------------------------------------------------------------------------------------
    def add_token(
        self, name: str, token_hash: str, scopes: list[str], ttl: timedelta | None, owner: str = ""
    ) -> ApiToken:
        now = utcnow()
        token = ApiToken(
            name=name,
            owner=owner or name,
            token_hash=token_hash,
            scopes=",".join(sorted(scopes)),
            created_at=now,
            expires_at=now + ttl if ttl else None,
        )
        with self.session() as session:
            session.add(token)
        return token

    def token_by_hash(self, token_hash: str) -> ApiToken | None:
        with self.session() as session:
            return session.scalars(select(ApiToken).where(ApiToken.token_hash == token_hash)).first()

    def token_by_id(self, token_id: int) -> ApiToken | None:
        with self.session() as session:
            return session.get(ApiToken, token_id)

    def list_tokens(self) -> list[ApiToken]:
        with self.session() as session:
            return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))

    def revoke_token(self, token_id: int) -> ApiToken | None:
        """Revoke a token for good (the first revocation time is kept); None if there is no such token."""
        with self.session() as session:
            session.execute(
                update(ApiToken)
                .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            return session.get(ApiToken, token_id)


def dump_json(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True)
