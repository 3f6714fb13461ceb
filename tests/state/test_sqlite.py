"""SQLiteStateStore against a real SQLite file in a temp dir."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from agentenv.models import ApiKeyRecord, SandboxRecord, SandboxState, TemplateRecord
from agentenv.state.sqlite import MIGRATIONS, SQLiteStateStore

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def sandbox(i: int, **kw) -> SandboxRecord:
    base = dict(
        sandbox_id=f"i{i:020d}",
        template_id="base",
        team_id="default",
        state=SandboxState.RUNNING,
        started_at=T0 + timedelta(seconds=i),
        end_at=T0 + timedelta(seconds=300 + i),
        cpu_count=2,
        memory_mb=1024,
        disk_mb=4096,
        envd_access_token=f"tok{i}",
    )
    base.update(kw)
    return SandboxRecord(**base)


@pytest.fixture
async def store(tmp_path):
    s = SQLiteStateStore(tmp_path / "state.db")
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_sandbox_round_trip_keeps_every_field(store):
    rec = sandbox(
        1,
        traffic_access_token="traffic",
        alias="base",
        metadata={"user id": "a&b=c", "ü": "✓"},
        env_vars={"A": "1"},
        auto_pause=True,
        auto_resume=True,
        allow_internet_access=False,
        network={"allowOut": ["1.1.1.1"], "allowPublicTraffic": False},
        slot=7,
        parent_id="iparent",
        snapshot_id="snap",
        # a non-UTC offset must come back as the same instant
        created_at=datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2))),
    )
    await store.put_sandbox(rec)
    got = await store.get_sandbox(rec.sandbox_id)
    assert got == rec
    assert got.state is SandboxState.RUNNING
    assert await store.get_sandbox("nope") is None


async def test_put_replaces_and_delete_removes(store):
    rec = sandbox(1)
    await store.put_sandbox(rec)
    await store.put_sandbox(replace(rec, state=SandboxState.PAUSED, slot=None))
    got = await store.get_sandbox(rec.sandbox_id)
    assert got.state is SandboxState.PAUSED and got.slot is None
    assert len(await store.list_sandboxes()) == 1
    await store.delete_sandbox(rec.sandbox_id)
    assert await store.get_sandbox(rec.sandbox_id) is None
    await store.delete_sandbox(rec.sandbox_id)  # idempotent


async def test_naive_datetime_is_rejected(store):
    with pytest.raises(ValueError, match="naive"):
        await store.put_sandbox(sandbox(1, started_at=datetime(2026, 1, 1)))


async def test_list_filters_by_team_and_state(store):
    recs = [
        sandbox(1, team_id="a"),
        sandbox(2, team_id="a", state=SandboxState.PAUSED),
        sandbox(3, team_id="b"),
        sandbox(4, team_id="a", state=SandboxState.KILLED),
    ]
    for r in reversed(recs):
        await store.put_sandbox(r)
    ids = lambda rs: [r.sandbox_id for r in rs]  # noqa: E731
    assert ids(await store.list_sandboxes()) == ids(recs)  # ordered by startedAt
    assert ids(await store.list_sandboxes(team_id="a")) == ids([recs[0], recs[1], recs[3]])
    assert ids(await store.list_sandboxes(states=[SandboxState.RUNNING])) == ids([recs[0], recs[2]])
    assert ids(await store.list_sandboxes(team_id="a", states=[SandboxState.RUNNING, SandboxState.PAUSED])) == ids(
        recs[:2]
    )
    assert await store.list_sandboxes(states=[]) == []
    assert await store.list_sandboxes(team_id="zzz") == []


async def test_templates_by_id_or_alias(store):
    t1 = TemplateRecord("tpl1", ["base", "default"], 2, 1024, 4096, "base")
    t2 = TemplateRecord("base", ["other"], 1, 512, 2048, "img2", public=False)
    await store.put_template(t1)
    await store.put_template(t2)
    assert await store.get_template("tpl1") == t1
    assert await store.get_template("default") == t1
    assert await store.get_template("base") == t2  # exact id wins over another template's alias
    assert await store.get_template("missing") is None
    assert {t.template_id for t in await store.list_templates()} == {"tpl1", "base"}
    await store.delete_template("tpl1")
    assert await store.get_template("default") is None


async def test_api_keys_find_list_revoke(store):
    k = ApiKeyRecord("k1", "ab" * 32, "team", "ci")
    await store.put_api_key(k)
    assert await store.find_api_key("ab" * 32) == k
    assert await store.find_api_key("cd" * 32) is None
    assert await store.list_api_keys() == [k]
    assert await store.revoke_api_key("k1") is True
    assert (await store.find_api_key("ab" * 32)).revoked is True
    assert await store.revoke_api_key("missing") is False


async def test_concurrent_writers_and_readers(store):
    n = 200

    async def writer(i: int) -> None:
        await store.put_sandbox(sandbox(i))
        assert (await store.get_sandbox(f"i{i:020d}")).envd_access_token == f"tok{i}"

    await asyncio.gather(*(writer(i) for i in range(n)), *(store.list_sandboxes() for _ in range(20)))
    assert len(await store.list_sandboxes()) == n


async def test_reopen_keeps_data_wal_and_schema_version(tmp_path):
    path = tmp_path / "sub" / "state.db"
    rec = sandbox(1)
    async with SQLiteStateStore(path) as s:
        await s.put_sandbox(rec)
        await s.put_api_key(ApiKeyRecord("k1", "ff" * 32, "default", "boot"))
        assert await s.schema_version() == len(MIGRATIONS)
    async with SQLiteStateStore(path) as s:
        assert await s.get_sandbox(rec.sandbox_id) == rec
        assert (await s.find_api_key("ff" * 32)).key_id == "k1"
        assert await s.schema_version() == len(MIGRATIONS)
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        con.close()


async def test_refuses_newer_schema(tmp_path):
    path = tmp_path / "state.db"
    async with SQLiteStateStore(path):
        pass
    con = sqlite3.connect(path)
    con.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS) + 1,))
    con.commit()
    con.close()
    with pytest.raises(RuntimeError, match="newer"):
        await SQLiteStateStore(path).open()


async def test_use_before_open_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="not open"):
        await SQLiteStateStore(tmp_path / "x.db").get_sandbox("x")


def _old_database(path, version: int, extra: str = "") -> None:
    """A database as an older agentenv left it: migrations [0, version) applied, plus `extra` SQL."""
    con = sqlite3.connect(path)
    try:
        con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        con.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        for script in MIGRATIONS[:version]:
            con.executescript(script)
        if extra:
            con.executescript(extra)
        con.commit()
    finally:
        con.close()


async def test_upgrade_keeps_rows_and_reaches_current_schema(tmp_path):
    path = tmp_path / "state.db"
    _old_database(path, 1, "INSERT INTO api_keys VALUES ('k1', 'aa', 'team-x', 'old key', '2026-01-01T00:00:00', 0);")
    async with SQLiteStateStore(path) as s:
        assert await s.schema_version() == len(MIGRATIONS)
        assert (await s.find_api_key("aa")).team_id == "team-x"
        # migration 2 -> 3 created the team of every existing key
        assert (await s.get_team("team-x")) is not None
        rec = sandbox(7, memory_digest="sha256:" + "0" * 64)
        await s.put_sandbox(rec)
        assert await s.get_sandbox(rec.sandbox_id) == rec


async def test_upgrade_converges_when_a_change_is_already_there(tmp_path):
    """A development build applied a later change under an earlier number (here: templates.team_id
    at version 3): opening must not fail with 'duplicate column' but finish the remaining steps."""
    path = tmp_path / "state.db"
    _old_database(path, 3, "ALTER TABLE templates ADD COLUMN team_id TEXT;"
                           "CREATE TABLE build_cache (key TEXT PRIMARY KEY, template_id TEXT NOT NULL, "
                           "data TEXT NOT NULL, created_at TEXT NOT NULL);")
    async with SQLiteStateStore(path) as s:
        assert await s.schema_version() == len(MIGRATIONS)
        await s.put_template(TemplateRecord("t1", ["a1"], 2, 512, 1024, "base", team_id="team-y"))
        assert (await s.get_template("a1")).team_id == "team-y"
    con = sqlite3.connect(path)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(sandboxes)")}
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()
    assert {"memory_digest", "layers", "pause_mode"} <= cols
    assert {"template_builds", "template_tags", "build_cache", "teams", "snapshots"} <= tables


async def test_concurrent_opens_of_an_old_database_migrate_once(tmp_path):
    path = tmp_path / "state.db"
    _old_database(path, 1)
    stores = [SQLiteStateStore(path) for _ in range(4)]
    try:
        await asyncio.gather(*(s.open() for s in stores))
        assert {await s.schema_version() for s in stores} == {len(MIGRATIONS)}
    finally:
        await asyncio.gather(*(s.close() for s in stores))
