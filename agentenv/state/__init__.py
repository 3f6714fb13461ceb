"""State stores: where the control plane keeps sandboxes, templates and API keys.

`StateStore` is the seam; `SQLiteStateStore` is the embedded default. A networked store
(PostgreSQL) implements the same protocol for clusters.
"""

from agentenv.state.base import StateStore


def store_for(settings) -> StateStore:
    """The configured store: PostgreSQL when `database_url` is a postgresql:// URL, else SQLite in
    the data dir (not opened yet)."""
    from agentenv.state.postgres import is_postgres_url

    if is_postgres_url(settings.database_url):
        from agentenv.state.postgres import PostgresStateStore

        return PostgresStateStore(settings.database_url)
    from agentenv.state.sqlite import SQLiteStateStore

    return SQLiteStateStore(settings.paths.state_db)


__all__ = ["StateStore", "store_for"]
