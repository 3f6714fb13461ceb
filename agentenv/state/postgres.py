"""The cluster's shared state store: PostgreSQL through asyncpg (pooled, binary protocol).

Why PostgreSQL (and not Redis): the cluster's state is relational and must stay consistent under
concurrent writers — a sandbox belongs to exactly one node (`claim_sandbox` is a compare-and-set
UPDATE), a node's death turns its sandboxes LOST in the same transaction that marks it dead, and
only one scheduler runs that sweep at a time (an advisory lock). See docs/cluster.md.

The store itself is `SQLStateStore` (sql.py), the same code and schema as SQLite's; this module
only makes the engine from a `postgresql://` URL.
"""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from agentenv.state.sql import SQLStateStore


def is_postgres_url(url: str | None) -> bool:
    """postgresql:// (or postgres://, postgresql+asyncpg://)."""
    return bool(url) and url.split(":", 1)[0].split("+", 1)[0] in ("postgres", "postgresql")


def postgres_engine(dsn: str, *, min_size: int = 1, max_size: int = 10) -> AsyncEngine:
    """Connections open lazily up to `max_size` and stay pooled (`min_size` is kept for the callers
    of the asyncpg-pool era; SQLAlchemy's pool has no minimum)."""
    url = make_url(dsn).set(drivername="postgresql+asyncpg")
    return create_async_engine(url, pool_size=max(1, max_size), max_overflow=0, pool_pre_ping=True)


class PostgresStateStore(SQLStateStore):
    """`ClusterStateStore` on PostgreSQL. `open()` creates the connection pool and migrates."""

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 10) -> None:
        self.dsn = dsn
        super().__init__(lambda: postgres_engine(dsn, min_size=min_size, max_size=max_size))


__all__ = ["PostgresStateStore", "is_postgres_url", "postgres_engine"]
