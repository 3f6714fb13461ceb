"""A node's lease (`cluster/fence.py`) against a state store that is slow, not gone: a heartbeat that
takes longer than one heartbeat interval still renews the lease, and a store that never answers
still fences the node within `Settings.fence_timing`.

One real node agent (`NodeAgent`, its heartbeat loop and lease watch) on a real PostgreSQL; what is
not started is the orchestrator (no sandboxes: the agent needs only its counts). The store's
heartbeat write is held back as a store under load would answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from agentenv.cluster.node import NodeAgent, NodeScopedStore
from agentenv.config import Settings
from agentenv.state.postgres import PostgresStateStore

HEARTBEAT_S = 0.2
DEAD_AFTER_S = 5.0  # lease: 0.6 x = 3 s


class SlowStore(PostgresStateStore):
    """Heartbeats land `delay` seconds late; `delay=None`: they never do."""

    def __init__(self, dsn: str, delay: float | None) -> None:
        super().__init__(dsn)
        self.delay = delay
        self.landed = 0

    async def put_node(self, rec):
        if self.delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        state = await super().put_node(rec)
        self.landed += 1
        return state


@pytest.fixture
def database(postgres):
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@contextlib.asynccontextmanager
async def _running_agent(tmp_path, store: SlowStore) -> AsyncIterator[NodeAgent]:
    """A started node agent (heartbeat loop + lease watch) on `store`; stopped and closed after."""
    settings = Settings(data_dir=tmp_path, node_id="lease-test", heartbeat_interval_s=HEARTBEAT_S,
                        node_dead_after_s=DEAD_AFTER_S, node_url="http://127.0.0.1:1")
    settings.fence_timing()  # valid lease settings
    await store.open()
    orch = SimpleNamespace(usage=lambda: (0, 0, 0), artifacts=SimpleNamespace(root=tmp_path), runtimes={},
                           running_ids=lambda: [], records=lambda: [])
    agent = NodeAgent(settings, SimpleNamespace(orchestrator=orch, store=NodeScopedStore(store, "lease-test"),
                                                proxy=None))
    agent.start()
    try:
        yield agent
    finally:
        await agent.stop()
        await agent.client.close()
        await store.close()


async def test_a_store_slower_than_the_heartbeat_interval_keeps_the_lease(tmp_path, database):
    store = SlowStore(database, delay=2.5 * HEARTBEAT_S)
    async with _running_agent(tmp_path, store) as agent:
        await asyncio.sleep(2.5 * agent.fence.fence_after)
        assert not agent.fence.fenced, "a slow store fenced the node"
        assert store.landed >= 3
        rec = await store.get_node("lease-test")
        assert rec is not None and rec.state == "active"


async def test_a_store_that_never_answers_fences_in_time(tmp_path, database):
    async with _running_agent(tmp_path, SlowStore(database, delay=None)) as agent:
        stop_by, _ = agent.settings.fence_timing()
        lapse_from = agent.fence.renewed_at
        deadline = time.monotonic() + 3 * stop_by
        while not agent.fence.fenced and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert agent.fence.fenced
        assert agent.fence.fenced_at - lapse_from <= stop_by + 0.3, (agent.fence.fenced_at - lapse_from, stop_by)


class SlowToOpen(SlowStore):
    """A store that answers again but takes `open_s` to connect (a loaded host's first connection
    and migration check after the network came back)."""

    def __init__(self, dsn: str, open_s: float) -> None:
        super().__init__(dsn, delay=0.0)
        self.open_s = open_s

    async def open(self, **kw) -> None:
        await asyncio.sleep(self.open_s)
        await super().open(**kw)


async def test_a_fenced_node_rejoins_when_reconnecting_takes_longer_than_a_heartbeat(tmp_path, database):
    """Once fenced, each heartbeat attempt has one interval, and the store is reopened first. A reopen
    slower than that interval used to be cancelled with every attempt, so the node never rejoined
    although the store was back; the reopen now goes on beside the attempts."""
    healed = asyncio.Event()
    opened: list[SlowToOpen] = []

    def factory():
        store = SlowToOpen(database, open_s=4 * HEARTBEAT_S) if healed.is_set() else SlowStore(database, None)
        opened.append(store)
        return store

    async with _running_agent(tmp_path, SlowStore(database, delay=None)) as agent:
        agent.store._factory = factory
        deadline = time.monotonic() + 10
        while not agent.fence.fenced and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert agent.fence.fenced
        healed.set()
        deadline = time.monotonic() + 10
        while agent.fence.fenced and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not agent.fence.fenced, "the node never rejoined although the store answered again"
        deadline = time.monotonic() + 5  # the next heartbeat writes the node back as active
        while (rec := await agent.store.inner.get_node("lease-test")).state != "active":
            assert time.monotonic() < deadline, rec
            await asyncio.sleep(0.05)
    for store in opened:
        await store.close()
