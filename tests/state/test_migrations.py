"""One schema, one migration history, on SQLite and PostgreSQL (each test runs on both unless it
says otherwise): fresh databases and databases made by the hand-written migration lists of earlier
releases (`legacy_schema.py`, copied from them) upgrade to exactly `agentenv.state.schema`."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from agentenv.models import ApiKeyRecord, TemplateRecord
from agentenv.state import migrate
from agentenv.state.schema import LEGACY_VERSION, metadata
from legacy_schema import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS
from serverproc import agentenv_executable
from test_store import sandbox

LEGACY = {"sqlite": SQLITE_MIGRATIONS, "postgres": POSTGRES_MIGRATIONS}


async def _legacy_database(backend: str, database: str, version: int, extra: str = "") -> None:
    """A database as an older agentenv left it: its migrations [0, version) applied, then `extra`."""
    scripts = LEGACY[backend][:version] + ([extra] if extra else [])
    head = ["CREATE TABLE schema_version (version INTEGER NOT NULL)",
            f"INSERT INTO schema_version (version) VALUES ({version})"]
    if backend == "sqlite":
        con = sqlite3.connect(database)
        try:
            for stmt in head:
                con.execute(stmt)
            for script in scripts:
                con.executescript(script)
            con.commit()
        finally:
            con.close()
        return
    con = await asyncpg.connect(database)
    try:
        async with con.transaction():
            for stmt in head + scripts:
                await con.execute(stmt)
    finally:
        await con.close()


async def _schema_diff(store) -> list:
    def diff(conn):
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)

    async with store.engine.connect() as conn:
        return await conn.run_sync(diff)


async def _scalar(store, sql: str):
    async with store.engine.connect() as conn:
        return (await conn.execute(text(sql))).scalar()


async def test_fresh_database_is_the_schema_at_head(store):
    assert await store.schema_revision() == migrate.head()
    assert await _schema_diff(store) == []
    # the old counter is a tombstone above anything the hand-written stores knew: they refuse it
    assert await _scalar(store, "SELECT version FROM schema_version") == LEGACY_VERSION
    assert LEGACY_VERSION > max(len(m) for m in LEGACY.values())


@pytest.mark.parametrize("version", [1, 2, 3, 7])
async def test_legacy_database_upgrades_in_place(backend, database, make_store, version):
    """Rows written by the old code survive, the schema becomes exactly the current one, and what the
    old migrations did to data (teams for existing keys) happens once."""
    if version > len(LEGACY[backend]):
        pytest.skip(f"the {backend} store's migration list had {len(LEGACY[backend])} entries")
    await _legacy_database(backend, database, version, extra=(
        "INSERT INTO api_keys (key_id, key_hash, team_id, name, created_at, revoked) "
        "VALUES ('k1', 'aa', 'team-x', 'old key', '2026-01-01T00:00:00.000000+00:00', 0);"
        "INSERT INTO templates (template_id, aliases, cpu_count, memory_mb, disk_mb, image, public, created_at) "
        "VALUES ('t-old', '[\"old\"]', 2, 512, 1024, 'base', 1, '2026-01-01T00:00:00.000000+00:00');"))
    s = make_store()
    async with s:
        assert await s.schema_revision() == migrate.head()
        assert await _schema_diff(s) == []
        assert await _scalar(s, "SELECT version FROM schema_version") == LEGACY_VERSION
        key = await s.find_api_key("aa")
        assert key.key_id == "k1" and key.team_id == "team-x" and not key.revoked
        tpl = await s.get_template("old")
        assert tpl.template_id == "t-old" and tpl.team_id is None and tpl.runtime is None
        if backend == "sqlite" and version < 3:  # the old 2 -> 3 migration made every key's team
            assert [t.team_id for t in await s.list_teams()] == ["team-x"]
        rec = sandbox(7, memory_digest="sha256:" + "0" * 64, layers=["l1"], pause_mode="full")
        await s.put_sandbox(rec)
        assert await s.get_sandbox(rec.sandbox_id) == rec
    async with make_store() as s:  # reopening changes nothing
        assert await s.schema_revision() == migrate.head()
        assert await s.get_sandbox(rec.sandbox_id) == rec


async def test_sqlite_legacy_database_converges_when_a_change_is_already_there(backend, database, make_store):
    """A development build applied a later change under an earlier number (templates.team_id and
    build_cache at version 3): the upgrade adds only what is missing."""
    if backend != "sqlite":
        pytest.skip("the hand-written SQLite store's convergence case")
    await _legacy_database(backend, database, 3, "ALTER TABLE templates ADD COLUMN team_id TEXT;"
                                                 "CREATE TABLE build_cache (key TEXT PRIMARY KEY, template_id TEXT "
                                                 "NOT NULL, data TEXT NOT NULL, created_at TEXT NOT NULL);")
    async with make_store() as s:
        assert await _schema_diff(s) == []
        await s.put_template(TemplateRecord("t1", ["a1"], 2, 512, 1024, "base", team_id="team-y"))
        assert (await s.get_template("a1")).team_id == "team-y"


async def test_refuses_a_database_of_a_newer_agentenv(make_store):
    async with make_store() as s:
        async with s.engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    with pytest.raises(migrate.SchemaTooNew, match="newer than this agentenv"):
        await make_store().open()


async def test_concurrent_opens_of_a_legacy_database_migrate_once(backend, database, make_store):
    await _legacy_database(backend, database, 1, "INSERT INTO api_keys (key_id, key_hash, team_id, name, "
                                                 "created_at, revoked) VALUES ('k1', 'aa', 'team-x', 'k', "
                                                 "'2026-01-01T00:00:00.000000+00:00', 0);")
    stores = [make_store() for _ in range(4)]
    try:
        await asyncio.gather(*(s.open() for s in stores))
        assert {await s.schema_revision() for s in stores} == {migrate.head()}
        assert len(await stores[0].list_teams()) == (1 if backend == "sqlite" else 0)
        assert (await stores[3].find_api_key("aa")).team_id == "team-x"
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_upgrades_of_different_databases_at_once_in_one_process(tmp_path):
    """Alembic keeps its migration context in module globals for the length of a run: two upgrades
    at once in one process (here of different databases, which share no database lock) must not
    tear down each other's."""
    from agentenv.state.sqlite import SQLiteStateStore

    paths = [str(tmp_path / f"state{i}.db") for i in range(4)]
    for i, path in enumerate(paths):
        await _legacy_database("sqlite", path, 1, "INSERT INTO api_keys (key_id, key_hash, team_id, name, "
                                                  f"created_at, revoked) VALUES ('k{i}', 'a{i}', 'team-{i}', 'k', "
                                                  "'2026-01-01T00:00:00.000000+00:00', 0);")
    stores = [SQLiteStateStore(p) for p in paths]
    try:
        results = await asyncio.gather(*(s.open() for s in stores), return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        for i, s in enumerate(stores):
            assert await s.schema_revision() == migrate.head()
            assert (await s.find_api_key(f"a{i}")).team_id == f"team-{i}"
    finally:
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)


async def test_sqlite_reopen_keeps_data_and_wal(tmp_path):
    from agentenv.state.sqlite import SQLiteStateStore

    path = tmp_path / "sub" / "state.db"
    rec = sandbox(1)
    async with SQLiteStateStore(path) as s:
        await s.put_sandbox(rec)
        await s.put_api_key(ApiKeyRecord("k1", "ff" * 32, "default", "boot"))
    async with SQLiteStateStore(path) as s:
        assert await s.get_sandbox(rec.sandbox_id) == rec
        assert (await s.find_api_key("ff" * 32)).key_id == "k1"
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        con.close()


async def test_use_before_open_is_a_clear_error(make_store):
    with pytest.raises(RuntimeError, match="not open"):
        await make_store().get_sandbox("x")


def _db_cli(backend: str, database: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AGENTENV_DATABASE_URL"}
    data_dir = tmp_path / "data"
    if backend == "sqlite":
        data_dir.mkdir(exist_ok=True)
        os.replace(database, data_dir / "state.db") if os.path.exists(database) else None
    else:
        env["AGENTENV_DATABASE_URL"] = database
    return subprocess.run([agentenv_executable(), "db", *args, "--data-dir", str(data_dir), "--json"], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


async def test_db_cli_upgrades_a_legacy_database(backend, database, tmp_path):
    """`agentenv db status` exits 1 on a database that needs upgrading; `db upgrade` converts it."""
    await _legacy_database(backend, database, len(LEGACY[backend]))
    st = _db_cli(backend, database, tmp_path, "status")
    assert st.returncode == 1, st.stderr
    assert json.loads(st.stdout) | {"database": None} == {"database": None, "revision": None,
                                                          "head": migrate.head(), "up_to_date": False}
    up = _db_cli(backend, database, tmp_path, "upgrade")
    assert up.returncode == 0, up.stderr
    out = json.loads(up.stdout)
    assert (out["before"], out["revision"]) == (None, migrate.head())
    assert "password" not in up.stdout and (backend == "sqlite" or "***" in out["database"])
    st = _db_cli(backend, database, tmp_path, "status")
    assert st.returncode == 0 and json.loads(st.stdout)["up_to_date"] is True
