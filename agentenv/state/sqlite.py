"""The embedded state store: SQLite in the data dir (the single-node default).

The store itself is `SQLStateStore` (sql.py), shared with PostgreSQL; this module only makes the
engine: aiosqlite (SQLite from asyncio on a thread of its own), one connection per store, WAL (so
another process, e.g. the CLI, reads while the server writes), a busy timeout for the writers of
other processes.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, StaticPool

from agentenv.state.sql import SQLStateStore

_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL", "PRAGMA busy_timeout=5000",
            "PRAGMA foreign_keys=ON")


def _on_connect(dbapi_connection, _record) -> None:
    cur = dbapi_connection.cursor()
    try:
        for pragma in _PRAGMAS:
            cur.execute(pragma)
    finally:
        cur.close()


def sqlite_engine(path: str | Path) -> AsyncEngine:
    memory = str(path) == ":memory:"
    if not memory:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    pool = {"poolclass": StaticPool} if memory else {
        "poolclass": AsyncAdaptedQueuePool, "pool_size": 1, "max_overflow": 0, "pool_timeout": 120}
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}", **pool)
    event.listen(engine.sync_engine, "connect", _on_connect)
    return engine


class SQLiteStateStore(SQLStateStore):
    """`StateStore` on one SQLite file. Call `open()` before use and `close()` when done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        super().__init__(lambda: sqlite_engine(self.path))


__all__ = ["SQLiteStateStore", "sqlite_engine"]
