"""Alembic environment of the state store.

`agentenv.state.migrate.upgrade` runs it on the store's own connection (`config.attributes
["connection"]`, inside the store's migration lock and transaction). A developer's `alembic`
command (see docs/state.md) runs it against `sqlalchemy.url` with a synchronous driver, e.g.
`alembic -c agentenv/state/migrations/alembic.ini -x url=sqlite:////tmp/x.db revision --autogenerate -m "..."`.
"""

from alembic import context
from sqlalchemy import create_engine

from agentenv.state.schema import metadata

config = context.config


def _run(connection) -> None:
    # transactional_ddl: SQLite can roll DDL back too; a failed upgrade leaves the old schema whole.
    context.configure(connection=connection, target_metadata=metadata, transactional_ddl=True,
                      compare_type=True, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
