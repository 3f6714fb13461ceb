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


__all__ = ["StateStore", "store_for"]
