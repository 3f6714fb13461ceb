"""Team quotas counted over every node in the state store (`reserve_team`), on SQLite and on a real
PostgreSQL (each test runs on both: conftest.py). Several store instances on one database stand for
several nodes (processes) admitting at the same time."""

from __future__ import annotations

import asyncio

from agentenv.models import NodeRecord, SandboxState
from test_store import _age_heartbeats, sandbox

TEAM = "quota-team"


async def _nodes(make_store, n: int) -> list:
    stores = [make_store() for _ in range(n)]
    for s in stores:
        await s.open()
    return stores


async def _close(stores) -> None:
    for s in stores:
        await s.close()


async def _burst(stores, tries: int, limit: int) -> list[tuple[str, list[str]]]:
    """`tries` concurrent admissions of one sandbox each, spread over the stores (node i uses store i)."""

    async def one(i: int):
        store = stores[i % len(stores)]
        node = f"n{i % len(stores)}"
        ids, _active = await store.reserve_team(TEAM, node, 1, limit)
        return node, ids

    return await asyncio.gather(*(one(i) for i in range(tries)))


async def test_concurrent_admissions_on_several_nodes_take_exactly_the_quota(make_store):
    stores = await _nodes(make_store, 3)
    try:
        got = await _burst(stores, 20, 3)
        admitted = [(node, ids[0]) for node, ids in got if ids]
        assert len(admitted) == 3, got
        assert await stores[0].team_active(TEAM) == 3
        # each start binds its reservation to its sandbox, writes its record, and releases it when up
        for k, (node, rid) in enumerate(admitted):
            rec = sandbox(k, team_id=TEAM, node_id=node, state=SandboxState.CREATING)
            await stores[k].bind_reservation(rid, rec.sandbox_id)
            await stores[k].put_sandbox_of(rec, node)
            assert await stores[k].team_active(TEAM) == 3  # counted once: record or reservation
            rec.state = SandboxState.RUNNING
            await stores[k].put_sandbox_of(rec, node)
            await stores[k].release_reservations([rid])
        assert await stores[1].team_active(TEAM) == 3
        assert [ids for _, ids in await _burst(stores, 20, 3) if ids] == []
        # a kill frees one place, for exactly one of the next concurrent creates
        await stores[2].delete_sandbox_of(sandbox(0).sandbox_id, admitted[0][0])
        assert len([ids for _, ids in await _burst(stores, 10, 3) if ids]) == 1
        # another team is not affected
        ids, active = await stores[0].reserve_team("other-team", "n0", 2, 2)
        assert len(ids) == 2 and active == 0
    finally:
        await _close(stores)


async def test_a_reservation_counts_until_its_sandbox_does(store):
    # create: unbound -> bound -> record CREATING: counted once throughout
    [rid], active = await store.reserve_team(TEAM, "n1", 1, 2)
    assert active == 0 and await store.team_active(TEAM) == 1
    rec = sandbox(1, team_id=TEAM, state=SandboxState.CREATING)
    await store.bind_reservation(rid, rec.sandbox_id)
    assert await store.team_active(TEAM) == 1
    await store.put_sandbox(rec)
    assert await store.team_active(TEAM) == 1
    # the start failed: its record goes, its reservation counts again until the admission ends
    await store.delete_sandbox(rec.sandbox_id)
    assert await store.team_active(TEAM) == 1
    await store.release_reservations([rid])
    assert await store.team_active(TEAM) == 0
    # resume: the record is PAUSED (not counted) until it runs; the bound reservation stands for it
    paused = sandbox(2, team_id=TEAM, state=SandboxState.PAUSED)
    await store.put_sandbox(paused)
    [rid], _ = await store.reserve_team(TEAM, "n1", 1, 1)
    await store.bind_reservation(rid, paused.sandbox_id)
    assert await store.team_active(TEAM) == 1
    assert (await store.reserve_team(TEAM, "n1", 1, 1)) == ([], 1)
    paused.state = SandboxState.RUNNING
    await store.put_sandbox(paused)
    assert await store.team_active(TEAM) == 1
    await store.release_reservations([rid])
    assert await store.team_active(TEAM) == 1
    # a fork of 2 children needs room for both
    ids, active = await store.reserve_team(TEAM, "n1", 2, 2)
    assert ids == [] and active == 1
    # paused, killed, failed and lost sandboxes do not count
    for i, state in enumerate((SandboxState.PAUSED, SandboxState.KILLED, SandboxState.FAILED, SandboxState.LOST)):
        await store.put_sandbox(sandbox(10 + i, team_id=TEAM, state=state))
    assert await store.team_active(TEAM) == 1


async def test_a_crashed_nodes_reservations_do_not_leak(store):
    await store.put_node(NodeRecord("n1", "http://n1"))
    await store.put_node(NodeRecord("n2", "http://n2"))
    assert len((await store.reserve_team(TEAM, "n1", 2, 4))[0]) == 2
    assert len((await store.reserve_team(TEAM, "n2", 2, 4))[0]) == 2
    assert (await store.reserve_team(TEAM, "n1", 1, 4))[0] == []
    # n1 restarts: none of its starts is in flight any more
    assert await store.clear_reservations("n1") == 2
    assert await store.team_active(TEAM) == 2
    # n2 crashed for good: declared dead, its reservations stop counting (and are removed) at once
    await _age_heartbeats(store, ["n2"], 60)
    assert list(await store.expire_nodes(10)) == ["n2"]
    assert await store.team_active(TEAM) == 0
    assert await store.clear_reservations("n2") == 0


async def test_concurrent_starts_never_exceed_the_quota(make_store):
    """Admissions racing with other starts writing their records (bind, CREATING, RUNNING, release):
    each start is counted exactly once at every moment, so no more than the quota ever run."""
    stores = await _nodes(make_store, 3)
    limit, tries = 3, 24

    async def start(i: int) -> bool:
        store, node = stores[i % 3], f"n{i % 3}"
        ids, _ = await store.reserve_team(TEAM, node, 1, limit)
        if not ids:
            return False
        rec = sandbox(200 + i, team_id=TEAM, node_id=node, state=SandboxState.CREATING)
        await store.bind_reservation(ids[0], rec.sandbox_id)
        await store.put_sandbox_of(rec, node)
        rec.state = SandboxState.RUNNING
        await store.put_sandbox_of(rec, node)
        await store.release_reservations(ids)
        return True

    try:
        for _round in range(3):  # each round: kill what runs, then a burst again
            started = await asyncio.gather(*(start(i) for i in range(tries)))
            running = await stores[0].list_sandboxes(team_id=TEAM, states=[SandboxState.RUNNING])
            assert sum(started) == len(running) == limit, (sum(started), len(running))
            for rec in running:
                await stores[0].delete_sandbox(rec.sandbox_id)
    finally:
        await _close(stores)
