"""Schema migrations of the state store: one Alembic history (`migrations/`) for SQLite and PostgreSQL.

`upgrade(engine)` runs at every store `open()` (and `agentenv db upgrade`): under a lock that
serialises concurrently starting processes (PostgreSQL: a transaction-scoped advisory lock; SQLite:
`BEGIN IMMEDIATE`, the database's write lock), in one transaction, it refuses a database whose
revision this agentenv does not know (a newer release migrated it), then upgrades to head.
Databases made by the hand-written migration lists of earlier releases have no Alembic revision:
the baseline revision converges them (see `versions/0001_baseline.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from functools import cache
from pathlib import Path

# Alembic narrates its plugin set-up (on import) and every context it makes at INFO; we log the
# upgrades themselves. Set before the imports below.
for _name in ("alembic.runtime.plugins", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from alembic.util.exc import CommandError  # noqa: E402
from sqlalchemy import Connection, text  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncEngine  # noqa: E402

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_MIGRATE_LOCK = 0x61676E7400000001  # the advisory lock key the hand-written PostgreSQL store used too
log = logging.getLogger(__name__)
# Alembic's `command.upgrade` installs its `context`/`op` proxies as module globals for the length of
# the run and deletes them after: two upgrades at once in one process (two stores opening together;
# their greenlets interleave on the driver's awaits) would remove each other's. One at a time.
_ALEMBIC_TURN = threading.Lock()


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer agentenv."""


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest revision this agentenv knows."""
    rev = _script().get_current_head()
    assert rev is not None
    return rev


def current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _check_known(conn: Connection) -> None:
    rev = current(conn)
    if rev is None:
        return
    try:
        _script().get_revision(rev)
    except CommandError:
        raise SchemaTooNew(f"state database schema revision {rev!r} is newer than this agentenv supports "
                           f"(head {head()!r}); upgrade agentenv") from None


def _upgrade_sync(conn: Connection) -> str:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATE_LOCK})
    elif conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    _check_known(conn)
    before = current(conn)
    if before != head():
        cfg = _config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    rev = current(conn)
    if rev != before:
        log.info("state database (%s) upgraded from revision %s to %s", conn.dialect.name, before, rev)
    conn.commit()
    return rev or ""


@contextlib.asynccontextmanager
async def _alembic_turn() -> AsyncIterator[None]:
    """Hold `_ALEMBIC_TURN` without blocking the event loop (other loops and threads wait too)."""
    if not _ALEMBIC_TURN.acquire(blocking=False):
        waiting = asyncio.get_running_loop().run_in_executor(None, _ALEMBIC_TURN.acquire)
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:  # the turn still comes: hand it straight back
            waiting.add_done_callback(lambda _: _ALEMBIC_TURN.release())
            raise
    try:
        yield
    finally:
        _ALEMBIC_TURN.release()


async def upgrade(engine: AsyncEngine) -> str:
    """Bring the database to head; returns the revision it is at."""
    async with _alembic_turn(), engine.connect() as conn:
        return await conn.run_sync(_upgrade_sync)


async def revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(current)
