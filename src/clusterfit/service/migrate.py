"""Open the job store, bringing its schema to the newest revision first (Alembic migrations).

Every `clusterfit` command, supervisor and server opens the store, almost always at the newest revision: that is
read with one query, and Alembic (a fifth of a second of imports) is loaded only to migrate."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.engine.url import make_url
from sqlalchemy.exc import SQLAlchemyError

from clusterfit.service.home import DATABASE_ENV, database_url
from clusterfit.service.store import JobStore, make_engine
from clusterfit.storage.redact import redact

if TYPE_CHECKING:
    from alembic.config import Config

_MIGRATIONS = Path(__file__).parent / "migrations"
# The newest revision in migrations/versions (a test holds it to Alembic's own answer).
HEAD_REVISION = "0002"
_PG_MIGRATION_LOCK = 0x636C7573  # any constant: one advisory lock id for "clusterfit migrations"


def alembic_config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    return config


def current_revision(engine: Engine) -> str | None:
    """The store's schema revision; None for a store without one yet (new, or older than migrations)."""
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except SQLAlchemyError:  # no such table
        return None


def migrate(engine: Engine) -> None:
    """Upgrade to head; one query when already there. Concurrent openers wait for one migrator."""
    if current_revision(engine) == HEAD_REVISION:
        return
    from alembic import command

    config = alembic_config()
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
        return
    database = make_url(str(engine.url)).database
    lock = FileLock(f"{database}.migrate.lock", mode=0o600) if database and database != ":memory:" else None
    with lock if lock else contextlib.nullcontext(), engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


class StoreUnavailable(RuntimeError):
    """The job store cannot be opened: a bad URL, a missing driver, or a database that does not answer."""


def open_store(url: str | None = None) -> JobStore:
    url = url or database_url()
    try:
        engine = make_engine(url)
        migrate(engine)
    except (SQLAlchemyError, ImportError, OSError) as exc:
        shown = redact(make_url(url).render_as_string(hide_password=True) if "://" in url else url)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreUnavailable(
            f"job store {shown}: {reason}; check {DATABASE_ENV} (or unset it for the SQLite file in the service home)"
        ) from None
    return JobStore(engine)
