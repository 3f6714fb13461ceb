"""State stores: where the control plane keeps sandboxes, templates, snapshots, API keys, teams and
(in a cluster) the node registry.

`StateStore` (base.py) is the seam. One implementation, `SQLStateStore` (sql.py, SQLAlchemy Core),
runs on SQLite (sqlite.py: the embedded default in the data dir) and PostgreSQL (postgres.py: a
cluster's shared store), with one schema (schema.py) and one Alembic migration history
(migrations/, run by migrate.py). See docs/state.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentenv.state.base import StateStore

if TYPE_CHECKING:
    from agentenv.state.sql import SQLStateStore


def store_for(settings) -> SQLStateStore:
    """The configured store: PostgreSQL when `database_url` is a postgresql:// URL, else SQLite in
    the data dir (not opened yet)."""
    from agentenv.state.postgres import is_postgres_url

    if is_postgres_url(settings.database_url):
        from agentenv.state.postgres import PostgresStateStore

        return PostgresStateStore(settings.database_url)
    from agentenv.state.sqlite import SQLiteStateStore

    return SQLiteStateStore(settings.paths.state_db)


def store_unavailable(exc: BaseException) -> bool:
    """The state store did not answer: no pooled connection free in time, a lost or refused
    connection, SQLite busy. Worth a retry (the API answers 503 with Retry-After), unlike a bug."""
    from sqlalchemy import exc as sa

    return isinstance(exc, (sa.TimeoutError, sa.OperationalError, sa.InterfaceError)) or \
        (isinstance(exc, sa.DBAPIError) and exc.connection_invalidated)


__all__ = ["StateStore", "store_for", "store_unavailable"]
