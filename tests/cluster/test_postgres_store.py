"""PostgresStateStore against a real PostgreSQL server (initdb'd into a temp dir by the test)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from agentenv.models import ApiKeyRecord, NodeRecord, SandboxRecord, SandboxState, SnapshotRecord, TeamRecord, TemplateRecord
from agentenv.state.postgres import MIGRATIONS, PostgresStateStore

from pgserver import pg_bindir, start_postgres

pytestmark = pytest.mark.skipif(pg_bindir() is None, reason="PostgreSQL server not installed (apt postgresql)")

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def sandbox(i: int, **kw) -> SandboxRecord:
    base = dict(sandbox_id=f"i{i:020d}", template_id="base", team_id="default", state=SandboxState.RUNNING,
                started_at=T0 + timedelta(seconds=i), end_at=T0 + timedelta(seconds=300 + i), cpu_count=2,
                memory_mb=1024, disk_mb=4096, envd_access_token=f"tok{i}", node_id="n1")
    base.update(kw)
    return SandboxRecord(**base)


@pytest.fixture(scope="module")
def pg():
    srv = start_postgres()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def store(pg):
    s = PostgresStateStore(pg.url())
    await s.open()
    try:
        yield s
    finally:
        for t in ("sandboxes", "templates", "api_keys", "snapshots", "nodes", "teams", "template_builds",
                  "template_tags", "build_cache"):
            await s._p.execute(f"DELETE FROM {t}")
        await s.close()


async def test_sandbox_round_trip_and_filters(store):
    a = sandbox(1, metadata={"k": "v"}, env_vars={"A": "1"}, layers=["l1", "l2"], network={"allowOut": ["x"]},
                memory_digest="m1", pause_mode="full", state=SandboxState.PAUSED)
    b = sandbox(2, team_id="other", node_id="n2")
    await store.put_sandbox(a)
    await store.put_sandbox(b)
    assert await store.get_sandbox(a.sandbox_id) == a
    assert [r.sandbox_id for r in await store.list_sandboxes()] == [a.sandbox_id, b.sandbox_id]
    assert [r.sandbox_id for r in await store.list_sandboxes(team_id="other")] == [b.sandbox_id]
    assert [r.sandbox_id for r in await store.list_sandboxes(node_id="n1")] == [a.sandbox_id]
    assert await store.list_sandboxes(states=[]) == []
    assert [r.sandbox_id for r in await store.list_sandboxes(states=[SandboxState.PAUSED])] == [a.sandbox_id]
    await store.delete_sandbox(a.sandbox_id)
    assert await store.get_sandbox(a.sandbox_id) is None
    assert await store.schema_version() == len(MIGRATIONS)


async def test_guarded_writes_and_claim(store):
    rec = sandbox(3, state=SandboxState.PAUSED, memory_digest="m")
    await store.put_sandbox_of(rec, "n1")
    assert await store.claim_sandbox(rec.sandbox_id, "n1", "n2")
    assert not await store.claim_sandbox(rec.sandbox_id, "n1", "n3")  # n2 has it now
    # n1's late writes and deletes no longer touch it
    await store.put_sandbox_of(replace(rec, state=SandboxState.RUNNING), "n1")
    await store.delete_sandbox_of(rec.sandbox_id, "n1")
    got = await store.get_sandbox(rec.sandbox_id)
    assert got is not None and got.node_id == "n2" and got.state == SandboxState.PAUSED
    running = sandbox(4)
    await store.put_sandbox_of(running, "n2")
    assert not await store.claim_sandbox(running.sandbox_id, "n2", "n1")  # only paused ones move


async def test_templates_keys_snapshots(store):
    await store.put_template(TemplateRecord("t1", ["alias1"], 2, 512, 1024, "base"))
    assert (await store.get_template("alias1")).template_id == "t1"
    assert await store.get_template("nope") is None
    key = ApiKeyRecord("k1", "h" * 64, "default", "test")
    await store.put_api_key(key)
    assert await store.find_api_key("h" * 64) == key
    assert await store.revoke_api_key("k1") and (await store.find_api_key("h" * 64)).revoked
    assert not await store.revoke_api_key("missing")
    await store.put_team(TeamRecord("t-a", "Team A", max_sandboxes=3))
    assert (await store.get_team("t-a")).max_sandboxes == 3
    assert [t.team_id for t in await store.list_teams()] == ["t-a"]
    assert [k.key_id for k in await store.list_api_keys(team_id="default")] == ["k1"]
    assert await store.list_api_keys(team_id="t-a") == []
    snap = SnapshotRecord("s1", "default", ["named"], "i1", "base", "base", ["l"], "m", 2, 512, 1024)
    await store.put_snapshot(snap)
    assert (await store.get_snapshot("named")).snapshot_id == "s1"
    assert [s.snapshot_id for s in await store.list_snapshots(team_id="default")] == ["s1"]


async def test_node_heartbeats_expire_and_lose_unsafe_sandboxes(store):
    await store.put_node(NodeRecord("n1", "http://n1", cpu_count=4, cached_layers=["abc"]))
    await store.put_node(NodeRecord("n2", "http://n2"))
    running = sandbox(10)
    safe = sandbox(11, state=SandboxState.PAUSED, memory_digest="m")
    unsafe = sandbox(12, state=SandboxState.PAUSED, pause_mode="full")
    other = sandbox(13, node_id="n2")
    for r in (running, safe, unsafe, other):
        await store.put_sandbox(r)
    assert await store.expire_nodes(60) == {}
    await store._p.execute("UPDATE nodes SET heartbeat_at = now() - interval '30 seconds' WHERE node_id = 'n1'")
    gone = await store.expire_nodes(10)
    assert sorted(gone["n1"]) == sorted([running.sandbox_id, unsafe.sandbox_id]) and list(gone) == ["n1"]
    assert (await store.get_node("n1")).state == "dead"
    assert (await store.get_sandbox(running.sandbox_id)).state == SandboxState.LOST
    assert (await store.get_sandbox(safe.sandbox_id)).state == SandboxState.PAUSED
    assert (await store.get_sandbox(other.sandbox_id)).state == SandboxState.RUNNING
    assert await store.expire_nodes(10) == {}  # reported once
    n1 = await store.get_node("n1")
    assert n1.cpu_count == 4 and n1.cached_layers == ["abc"]
    # a heartbeat brings it back
    assert await store.put_node(NodeRecord("n1", "http://n1")) == "active"


async def test_concurrent_writers(store):
    await asyncio.gather(*(store.put_sandbox_of(sandbox(100 + i), "n1") for i in range(50)))
    assert len(await store.list_sandboxes(node_id="n1")) == 50


async def test_template_builds_tags_and_cache(store):
    from agentenv.models import BuildStatus, TemplateBuildRecord, TemplateTag

    await store.put_template(TemplateRecord("t2", ["t2"], 2, 512, 1024, "base", team_id="default"))
    b = TemplateBuildRecord("b1", "t2", "default", BuildStatus.READY, 2, 512, 1024, layers=["l1"], memory_digest="m")
    await store.put_build(b)
    got = await store.get_build("b1")
    assert got.status == BuildStatus.READY and got.layers == ["l1"] and got.memory_digest == "m"
    assert [x.build_id for x in await store.list_builds("t2")] == ["b1"]
    await store.put_tag(TemplateTag("t2", "v1", "b1", T0))
    await store.put_tag(TemplateTag("t2", "v1", "b1", T0))  # idempotent
    assert [t.tag for t in await store.list_tags("t2")] == ["v1"]
    await store.put_cache_entry("k", "t2", {"layer": "l1"})
    assert await store.get_cache_entry("k") == {"layer": "l1"}
    assert await store.delete_tag("t2", "v1") and not await store.delete_tag("t2", "v1")
    await store.delete_template("t2")
    assert await store.get_template("t2") is None and await store.list_builds("t2") == []
    assert await store.get_cache_entry("k") is None


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
        await store._p.execute("UPDATE nodes SET heartbeat_at = now() - interval '30 seconds' "
                               "WHERE node_id IN ('busy', 'gone')")
        lost = await svc.sweep()
        assert lost == {"gone": [sandbox(21).sandbox_id]}
        assert seen == ["t0k"]  # asked once, with the cluster token
        assert (await store.get_node("busy")).state == "active"
        assert (await store.get_sandbox(sandbox(20).sandbox_id)).state == SandboxState.RUNNING
        assert (await store.get_node("gone")).state == "dead"
    finally:
        await svc.stop()
        await runner.cleanup()
