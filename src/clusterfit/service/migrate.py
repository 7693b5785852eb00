"""Open the job store, bringing its schema to the newest revision first (Alembic migrations)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from filelock import FileLock
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.engine.url import make_url

from clusterfit.service.home import database_url
from clusterfit.service.store import JobStore, make_engine

_MIGRATIONS = Path(__file__).parent / "migrations"
_PG_MIGRATION_LOCK = 0x636C7573  # any constant: one advisory lock id for "clusterfit migrations"


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    return config


def _current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def migrate(engine: Engine) -> None:
    """Upgrade to head; cheap when already there. Concurrent openers wait for one migrator."""
    config = _alembic_config()
    head = ScriptDirectory.from_config(config).get_current_head()
    if _current_revision(engine) == head:
        return
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
        return
    database = make_url(str(engine.url)).database
    lock = FileLock(f"{database}.migrate.lock") if database and database != ":memory:" else None
    with lock if lock else contextlib.nullcontext(), engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def open_store(url: str | None = None) -> JobStore:
    engine = make_engine(url or database_url())
    migrate(engine)
    return JobStore(engine)
