"""The state store on both databases: every test taking `store` (or `make_store`) runs once on
SQLite (a file in a temp dir) and once on a real PostgreSQL (a fresh database on the session's
server, the `postgres` fixture of tests/conftest.py)."""

from __future__ import annotations

import contextlib

import pytest

from agentenv.state.postgres import PostgresStateStore
from agentenv.state.sqlite import SQLiteStateStore


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def database(backend, tmp_path, request):
    """A new, empty database of the backend: a SQLite path, or a PostgreSQL URL (dropped after)."""
    if backend == "sqlite":
        yield str(tmp_path / "state.db")
        return
    pg = request.getfixturevalue("postgres")
    url = pg.create_database()
    try:
        yield url
    finally:
        with contextlib.suppress(Exception):
            pg.drop_database(url)


@pytest.fixture
def make_store(backend, database):
    """Unopened stores on the test's database (as many as the test wants: same database)."""

    def make(**kw):
        if backend == "sqlite":
            return SQLiteStateStore(database)
        return PostgresStateStore(database, **kw)

    return make


@pytest.fixture
async def store(make_store):
    s = make_store()
    await s.open()
    try:
        yield s
    finally:
        await s.close()
