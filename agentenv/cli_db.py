"""`agentenv db`: the state database's schema (status, upgrade). The store also upgrades itself when
a server or any command opens it; `db upgrade` lets an operator do it first, on its own (e.g. once
before rolling out a new release to a cluster's nodes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import click


def _where(settings) -> str:
    from sqlalchemy.engine import make_url

    from agentenv.state.postgres import is_postgres_url

    if is_postgres_url(settings.database_url):
        return make_url(settings.database_url).render_as_string(hide_password=True)
    return str(settings.paths.state_db)


async def _status(settings, *, upgrade: bool) -> dict:
    from agentenv.state import migrate, store_for

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    before, after = await store_for(settings).migrate(upgrade=upgrade)
    return {"database": _where(settings), "before": before, "revision": after, "head": migrate.head(),
            "up_to_date": after == migrate.head()}


def register(main: click.Group, settings_for: Callable) -> None:
    @main.group()
    def db() -> None:
        """The state database's schema (SQLite in the data dir, or AGENTENV_DATABASE_URL)."""

    @db.command("status")
    @click.option("--data-dir", default=None)
    @click.option("--json", "as_json", is_flag=True, help="{database, revision, head, up_to_date}")
    def db_status(data_dir: str | None, as_json: bool) -> None:
        """The schema revision the database is at, and this agentenv's newest (changes nothing).
        Exit 1 when the database needs `agentenv db upgrade`."""
        st = asyncio.run(_status(settings_for(data_dir), upgrade=False))
        st.pop("before")
        click.echo(json.dumps(st) if as_json else
                   f"{st['database']}: revision {st['revision'] or 'none'} (head {st['head']})")
        raise SystemExit(0 if st["up_to_date"] else 1)

    @db.command("upgrade")
    @click.option("--data-dir", default=None)
    @click.option("--json", "as_json", is_flag=True, help="{database, before, revision, head}")
    def db_upgrade(data_dir: str | None, as_json: bool) -> None:
        """Migrate the database to this agentenv's schema (also done when a server starts). Databases
        of releases before the Alembic history are converted in place. Exit 1 when the database is
        newer than this agentenv."""
        from agentenv.state.migrate import SchemaTooNew

        try:
            st = asyncio.run(_status(settings_for(data_dir), upgrade=True))
        except SchemaTooNew as e:
            raise click.ClickException(str(e)) from None
        st.pop("up_to_date")
        click.echo(json.dumps(st) if as_json else
                   f"{st['database']}: revision {st['before'] or 'none'} -> {st['revision']}")
