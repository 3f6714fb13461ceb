"""The state store's behaviour, on SQLite and on a real PostgreSQL (each test runs on both: see
conftest.py). Migrations and old databases: test_migrations.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from sqlalchemy import update

from agentenv.models import (ApiKeyRecord, BuildStatus, NodeRecord, SandboxRecord, SandboxState, SnapshotRecord,
                             TeamRecord, TemplateBuildRecord, TemplateRecord, TemplateTag)
from agentenv.state.schema import nodes

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
        node_id="n1",
    )
    base.update(kw)
    return SandboxRecord(**base)


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


async def test_sandbox_filters_by_node_and_keeps_pause_fields(store):
    a = sandbox(1, metadata={"k": "v"}, layers=["l1", "l2"], memory_digest="m1", pause_mode="full",
                state=SandboxState.PAUSED)
    b = sandbox(2, team_id="other", node_id="n2")
    await store.put_sandbox(a)
    await store.put_sandbox(b)
    assert await store.get_sandbox(a.sandbox_id) == a
    assert [r.sandbox_id for r in await store.list_sandboxes(node_id="n1")] == [a.sandbox_id]
    assert [r.sandbox_id for r in await store.list_sandboxes(node_id="n2", team_id="other")] == [b.sandbox_id]
    assert await store.list_sandboxes(node_id="n2", team_id="default") == []


async def test_guarded_writes_and_claim(store):
    rec = sandbox(3, state=SandboxState.PAUSED, memory_digest="m")
    assert await store.put_sandbox_of(rec, "n1")
    assert await store.claim_sandbox(rec.sandbox_id, "n1", "n2")
    assert not await store.claim_sandbox(rec.sandbox_id, "n1", "n3")  # n2 has it now
    # n1's late writes and deletes no longer touch it, and n1 is told so (a resume's claim)
    assert not await store.put_sandbox_of(replace(rec, state=SandboxState.RESUMING), "n1")
    await store.delete_sandbox_of(rec.sandbox_id, "n1")
    got = await store.get_sandbox(rec.sandbox_id)
    assert got is not None and got.node_id == "n2" and got.state == SandboxState.PAUSED and got.slot is None
    # n2 claims its resume: while the store says RESUMING no other node can adopt it
    assert await store.put_sandbox_of(replace(got, state=SandboxState.RESUMING), "n2")
    assert not await store.claim_sandbox(rec.sandbox_id, "n2", "n1")
    assert (await store.get_sandbox(rec.sandbox_id)).node_id == "n2"
    running = sandbox(4)
    await store.put_sandbox_of(running, "n2")
    assert not await store.claim_sandbox(running.sandbox_id, "n2", "n1")  # only paused ones move
    await store.delete_sandbox_of(running.sandbox_id, "n2")
    assert await store.get_sandbox(running.sandbox_id) is None


async def test_keys_teams_snapshots(store):
    key = ApiKeyRecord("k1", "h" * 64, "default", "test")
    await store.put_api_key(key)
    await store.put_api_key(replace(key, name="renamed"))  # same id: replaced
    assert [k.name for k in await store.list_api_keys()] == ["renamed"]
    await store.put_team(TeamRecord("t-a", "Team A", max_sandboxes=3))
    await store.put_team(TeamRecord("t-b", "Team B"))
    assert (await store.get_team("t-a")).max_sandboxes == 3
    assert (await store.get_team("t-b")).max_sandboxes is None
    assert await store.get_team("t-c") is None
    assert sorted(t.team_id for t in await store.list_teams()) == ["t-a", "t-b"]
    assert [k.key_id for k in await store.list_api_keys(team_id="default")] == ["k1"]
    assert await store.list_api_keys(team_id="t-a") == []
    old = SnapshotRecord("s1", "default", ["named", "50%_off"], "i1", "base", "base", ["l"], "m", 2, 512, 1024,
                         size_bytes=6 * 2**30, network={"allowOut": ["x"]}, runtime="gvisor", created_at=T0)
    new = SnapshotRecord("s2", "other", ["named"], None, "base", "base", [], None, 1, 256, 512,
                         created_at=T0 + timedelta(minutes=1))
    await store.put_snapshot(old)
    await store.put_snapshot(new)
    assert await store.get_snapshot("s1") == old  # every field, a size above 32 bits included
    assert (await store.get_snapshot("named")).snapshot_id == "s2"  # the newest carrying the name
    assert (await store.get_snapshot("50%_off")).snapshot_id == "s1"  # LIKE wildcards are literal
    assert await store.get_snapshot("50") is None and await store.get_snapshot("name") is None
    assert [s.snapshot_id for s in await store.list_snapshots(team_id="default")] == ["s1"]
    assert [s.snapshot_id for s in await store.list_snapshots()] == ["s1", "s2"]
    await store.delete_snapshot("s2")
    assert (await store.get_snapshot("named")).snapshot_id == "s1"


async def test_template_aliases_match_whole_names_only(store):
    await store.put_template(TemplateRecord("t1", ['quote"d', "back\\slash", "ünï"], 2, 512, 1024, "base"))
    for alias in ('quote"d', "back\\slash", "ünï"):
        assert (await store.get_template(alias)).template_id == "t1"
    assert await store.get_template("quote") is None and await store.get_template("t") is None


async def test_template_builds_tags_and_cache(store):
    await store.put_template(TemplateRecord("t2", ["t2"], 2, 512, 1024, "base", team_id="default"))
    b = TemplateBuildRecord("b1", "t2", "default", BuildStatus.READY, 2, 512, 1024, layers=["l1"], memory_digest="m")
    await store.put_build(b)
    got = await store.get_build("b1")
    assert got.status == BuildStatus.READY and got.layers == ["l1"] and got.memory_digest == "m"
    assert [x.build_id for x in await store.list_builds("t2")] == ["b1"]
    assert [x.build_id for x in await store.list_builds()] == ["b1"]
    await store.put_tag(TemplateTag("t2", "v1", "b1", T0))
    await store.put_tag(TemplateTag("t2", "v1", "b1", T0))  # idempotent
    assert [t.tag for t in await store.list_tags("t2")] == ["v1"]
    await store.put_cache_entry("k", "t2", {"layer": "l1"})
    await store.put_cache_entry("k", "t2", {"layer": "l2"})
    assert await store.get_cache_entry("k") == {"layer": "l2"}
    assert await store.list_cache_entries() == [{"layer": "l2"}]
    assert await store.delete_tag("t2", "v1") and not await store.delete_tag("t2", "v1")
    await store.put_build(replace(b, build_id="b2"))
    await store.delete_build("b2")
    assert await store.get_build("b2") is None
    await store.delete_template("t2")
    assert await store.get_template("t2") is None and await store.list_builds("t2") == []
    assert await store.get_cache_entry("k") is None


async def _age_heartbeats(store, node_ids: list[str], seconds: float) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(update(nodes).where(nodes.c.node_id.in_(node_ids))
                           .values(heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=seconds)))


async def test_node_heartbeats_expire_and_lose_unsafe_sandboxes(store):
    await store.put_node(NodeRecord("n1", "http://n1", cpu_count=4, cached_layers=["abc"]))
    await store.put_node(NodeRecord("n2", "http://n2"))
    running = sandbox(10)
    safe = sandbox(11, state=SandboxState.PAUSED, memory_digest="m")
    unsafe = sandbox(12, state=SandboxState.PAUSED, pause_mode="full")
    other = sandbox(13, node_id="n2")
    resuming = sandbox(14, state=SandboxState.RESUMING, memory_digest="m2")  # its pause image is still there
    for r in (running, safe, unsafe, other, resuming):
        await store.put_sandbox(r)
    assert await store.expire_nodes(60) == {}
    await _age_heartbeats(store, ["n1"], 30)
    assert await store.expire_nodes(10, spare=["n1"]) == {}  # spared: answers its status route
    gone = await store.expire_nodes(10)
    assert sorted(gone["n1"]) == sorted([running.sandbox_id, unsafe.sandbox_id]) and list(gone) == ["n1"]
    assert (await store.get_node("n1")).state == "dead"
    assert (await store.get_sandbox(running.sandbox_id)).state == SandboxState.LOST
    assert (await store.get_sandbox(safe.sandbox_id)).state == SandboxState.PAUSED
    assert (await store.get_sandbox(resuming.sandbox_id)).state == SandboxState.PAUSED  # resumable elsewhere
    assert (await store.get_sandbox(other.sandbox_id)).state == SandboxState.RUNNING
    assert await store.expire_nodes(10) == {}  # reported once
    n1 = await store.get_node("n1")
    assert n1.cpu_count == 4 and n1.cached_layers == ["abc"]
    assert n1.heartbeat_at.tzinfo is not None and n1.heartbeat_at < datetime.now(timezone.utc) - timedelta(seconds=20)
    # a heartbeat brings it back; draining is the node's own word
    assert await store.put_node(NodeRecord("n1", "http://n1")) == "active"
    assert await store.set_node_state("n1", "draining") and not await store.set_node_state("nx", "draining")
    assert [n.node_id for n in await store.list_nodes()] == ["n1", "n2"]
    assert (await store.get_node("n1")).state == "draining" and await store.get_node("nx") is None


async def test_concurrent_guarded_writers(store):
    await asyncio.gather(*(store.put_sandbox_of(sandbox(100 + i), "n1") for i in range(50)))
    assert len(await store.list_sandboxes(node_id="n1")) == 50


async def test_scheduler_spares_a_late_node_that_still_answers(store):
    """Late heartbeats alone do not kill a node: one that answers its status route is busy (e.g. its
    event loop starved by its sandboxes); one that does not answer is declared dead."""
    from aiohttp import web

    from agentenv.cluster.internal import TOKEN_HEADER
    from agentenv.cluster.scheduler import SchedulerService
    from agentenv.config import Settings
    from serverproc import free_port

    seen: list[str] = []

    async def status(request: web.Request) -> web.Response:
        seen.append(request.headers.get(TOKEN_HEADER, ""))
        return web.json_response({"node_id": "busy"})

    app = web.Application()
    app.router.add_get("/internal/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    svc = SchedulerService(Settings(cluster_token="t0k", node_dead_after_s=5), store)
    try:
        await store.put_node(NodeRecord("busy", f"http://127.0.0.1:{port}"))
        await store.put_node(NodeRecord("gone", f"http://127.0.0.1:{free_port()}"))  # nothing listens there
        await store.put_sandbox(sandbox(20, node_id="busy"))
        await store.put_sandbox(sandbox(21, node_id="gone"))
        await _age_heartbeats(store, ["busy", "gone"], 30)
        lost = await svc.sweep()
        assert lost == {"gone": [sandbox(21).sandbox_id]}
        assert seen == ["t0k"]  # asked once, with the cluster token
        assert (await store.get_node("busy")).state == "active"
        assert (await store.get_sandbox(sandbox(20).sandbox_id)).state == SandboxState.RUNNING
        assert (await store.get_node("gone")).state == "dead"
    finally:
        await svc.stop()
        await runner.cleanup()



async def test_terminate_cuts_the_database_connections(backend, database, make_store):
    """A fenced cluster node cuts its store's connections at once (agentenv/cluster/node.py): the
    PostgreSQL server sees the store's sessions end, and the data stays for a new store."""
    if backend != "postgres":
        pytest.skip("terminate() cuts asyncpg connections (the cluster store); SQLite has none to cut")
    import asyncpg

    async def sessions(watch) -> int:
        return await watch.fetchval("SELECT count(*) FROM pg_stat_activity "
                                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")

    store = make_store()
    await store.open()
    watch = await asyncpg.connect(database)
    try:
        await asyncio.gather(*(store.put_sandbox(sandbox(i)) for i in range(4)))
        assert await sessions(watch) >= 1
        store.terminate()
        for _ in range(50):
            if await sessions(watch) == 0:
                break
            await asyncio.sleep(0.1)
        assert await sessions(watch) == 0, "the store's sessions outlived terminate()"
    finally:
        await watch.close()
        await store.close()
    again = make_store()
    await again.open()
    try:
        assert len(await again.list_sandboxes()) == 4
    finally:
        await again.close()
