"""Fencing: a node cut off from the cluster stops serving before the cluster declares its sandboxes
lost, and rejoins cleanly.

The lease. Every heartbeat that gets through renews it: written to the state store, or — when the
store is out of reach — relayed by the scheduler (`POST /internal/heartbeat`, which writes it for
the node). The renewal counts from the moment the heartbeat was *sent*, so the node's view of its
last heartbeat is never newer than the store's `heartbeat_at`. A heartbeat may take what is left of
the lease (a store slow under load still renews it); once the lease lapsed, one last attempt gets
one heartbeat interval per way. The timeline after the last
heartbeat that got through (`Settings.fence_timing` refuses settings that break the order):

    0 ── node_fence_after_s ── + FENCE_CHECK_S + one last attempt ── ... ── node_dead_after_s
         lease lapsed           fenced: nothing answers                      the scheduler may
                                                                             declare it dead

Fenced, the node answers every request (public API, sandbox traffic, internal RPC, the scheduler's
status probe) with 503 `node_fenced`, closes the sandboxes' proxied connections, and pauses each
running sandbox onto its own disk (memory + files; files only if the runtime cannot checkpoint it)
— a fenced node cannot count on the snapshot store in time. Writes to the state store are dropped
while fenced (the store is the cluster's truth; the node reconciles with it when it is back).
Meanwhile it keeps trying to heartbeat (reporting state `fenced`) and to upload those pauses.

Rejoin, on the first heartbeat the state store accepts again: the fence's pauses are uploaded
(until that works the node stays fenced), then for every sandbox the node holds:
- its record is gone (the lost sandbox was killed meanwhile): removed here;
- it belongs to another node now (a paused sandbox resumed elsewhere): released here;
- still this node's (running, or `lost` after the scheduler declared the node dead): written back as
  `paused` — resumable on any node, with its files and processes;
and records of this node it no longer holds (killed while fenced) are deleted. Then it heartbeats
`active` again. A node declared dead while it was not fenced (its event loop starved past every
deadline) finds its running sandboxes `lost` on its next heartbeat and goes through the same fence
and rejoin, so a sandbox the cluster gave up never runs on unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from agentenv.cluster import codec
from agentenv.config import FENCE_CHECK_S
from agentenv.errors import AgentEnvError, Unavailable
from agentenv.models import SandboxState

if TYPE_CHECKING:
    from agentenv.cluster.node import NodeAgent

log = logging.getLogger("agentenv.cluster.fence")

FENCED_MARKER = "fenced-pause"
# How long a fresh connection to the state store may take to open. It runs beside the heartbeats,
# not inside one: a heartbeat attempt gets one interval, and a reconnect cancelled with every
# attempt that ran out (pool, migration check, first connection on a loaded host) never finished.
RECONNECT_TIMEOUT_S = 30.0


class Fence:
    """The lease of one node, its fence and its rejoin."""

    def __init__(self, agent: "NodeAgent") -> None:
        self.agent = agent
        self.settings = agent.settings
        self.fence_after = self.settings.fence_after_s()
        self.attempt_s = self.settings.heartbeat_interval_s
        self.renewed_at = time.monotonic()
        self.fenced = False
        self.fenced_at: float | None = None
        self._local_only: set[str] = set()  # paused by the fence, not yet uploaded
        self._store_suspect = False  # its connections were cut (fence): reconnect before the next heartbeat
        self._store_failing_since: float | None = None
        self._reconnecting: asyncio.Task | None = None  # a fresh store opening (`_store_heartbeat`)
        self._holding: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        # Awaited with each running sandbox's id when the node is fenced, after the Python proxy
        # closed its connections: the HAProxy data plane takes it off the fast path and resets its own.
        self.on_fenced: list[Callable[[str], Awaitable[None]]] = []

    # ------------------------------------------------------------------ the lease

    def _attempt_timeout(self, way: str) -> float:
        """How long one way of a regular heartbeat may take. A store or scheduler that answers slowly
        under load must still renew the lease (a slow answer is not a partition), so a heartbeat may
        take what is left of the lease: the store half of it (all of it would leave no time for the
        relay when the store is cut off; one interval once it has been failing), the scheduler the
        rest. Never less than one heartbeat interval. The watch's last attempt after the lease
        lapsed gets one interval per way: that bounds the moment a cut-off node stops serving
        (`Settings.fence_timing`)."""
        left = self.fence_after - (time.monotonic() - self.renewed_at)
        if way == "store":
            left = 0.0 if self._store_failing_since is not None else left / 2
        return max(self.attempt_s, left)

    async def renew(self, *, last: bool = False) -> str | None:
        """One heartbeat: into the state store, else relayed by the scheduler. Returns the way it
        went ('store', 'scheduler') or None. `last`: the lease has lapsed; one interval per way."""
        t0 = time.monotonic()
        rec = self.agent.status()  # state "fenced" while fenced
        try:
            timeout = self.attempt_s if last else self._attempt_timeout("store")
            await asyncio.wait_for(self._store_heartbeat(rec), timeout)
            self._renewed(t0, "the state store")
            self._store_failing_since = None
            return "store"
        except Exception as e:  # noqa: BLE001 - unreachable, timed out, refused: all the same here
            if self._store_failing_since is None:
                self._store_failing_since = t0
            log.warning("heartbeat to the state store failed: %s", str(e) or type(e).__name__)
        url = (self.settings.scheduler_url or "").rstrip("/")
        if url:
            try:
                timeout = self.attempt_s if last else self._attempt_timeout("scheduler")
                await asyncio.wait_for(self.agent.client.post(f"{url}/internal/heartbeat", codec.encode(rec),
                                                              what="the scheduler"), timeout)
                self._renewed(t0, "the scheduler")
                return "scheduler"
            except Exception as e:  # noqa: BLE001
                log.warning("heartbeat relayed by the scheduler failed: %s", str(e) or type(e).__name__)
        return None

    def _renewed(self, t0: float, way: str) -> None:
        took = time.monotonic() - t0
        if took > self.attempt_s:  # slow, not lost: worth seeing before it ever comes close to a fence
            log.warning("heartbeat through %s took %.1fs (the lease had %.1fs left)", way, took,
                        self.fence_after - (t0 - self.renewed_at))
        self.renewed_at = max(self.renewed_at, t0)

    async def _store_heartbeat(self, rec) -> None:
        store = self.agent.store
        # Failing for a while (not one slow answer under load): its pooled connections may hang on a
        # peer the network lost, for minutes. Start afresh (the old pool closes in the background).
        failing = self._store_failing_since is not None and \
            time.monotonic() - self._store_failing_since > self.fence_after / 2
        if (self._store_suspect or failing) and self._reconnecting is None:
            self._reconnecting = asyncio.create_task(self._reconnect(failing), name="store-reconnect")
            self._reconnecting.add_done_callback(self._reconnected)
        if self._reconnecting is not None:  # this attempt may run out; the reconnect goes on
            await asyncio.shield(self._reconnecting)
        await store.heartbeat(rec)

    async def _reconnect(self, failing: bool) -> None:
        await asyncio.wait_for(self.agent.store.reconnect(), RECONNECT_TIMEOUT_S)
        self._store_suspect = False
        if failing:  # the next fresh start only after as long again
            self._store_failing_since = time.monotonic()

    def _reconnected(self, task: asyncio.Task) -> None:
        self._reconnecting = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("reconnecting to the state store failed: %s", str(task.exception()) or
                        type(task.exception()).__name__)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(FENCE_CHECK_S)
            try:
                if not self.fenced and time.monotonic() - self.renewed_at > self.fence_after:
                    # one last attempt: a starved event loop is not a partition
                    if await self.renew(last=True) is None:
                        await self.fence(f"no heartbeat reached the state store or the scheduler for "
                                         f"{time.monotonic() - self.renewed_at:.1f}s")
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("lease check failed")

    def start(self) -> None:
        self.renewed_at = max(self.renewed_at, time.monotonic() - self.fence_after / 2)
        self._monitor = asyncio.create_task(self._watch(), name="lease")
        if self.fenced and self._holding is None:  # restarted with fenced pauses (`recover`)
            log.warning("node %s starts fenced: it holds %d sandbox(es) paused while it was cut off",
                        self.agent.node_id, len(self._local_only))
            self._holding = asyncio.create_task(self._hold(), name="fenced")

    async def stop(self) -> None:
        for t in (self._monitor, self._holding, self._reconnecting):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (self._monitor, self._holding, self._reconnecting) if t is not None),
                             return_exceptions=True)

    # ------------------------------------------------------------------ fenced

    async def fence(self, why: str) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.fenced_at = time.monotonic()
        self.agent.store.fenced = True
        self.agent.store.abandon()
        self._store_suspect = True
        log.error("node %s FENCED: %s; it stops serving its sandboxes until it is back in the cluster",
                  self.agent.node_id, why)
        orch = self.agent.orch
        for sid in orch.running_ids():
            for hook in (self.agent.c.proxy.close_sandbox_connections, *self.on_fenced):
                try:
                    await hook(sid)
                except Exception:  # noqa: BLE001 - the pause closes them too
                    log.exception("closing the connections of %s", sid)
        self._holding = asyncio.create_task(self._hold(), name="fenced")

    async def _hold(self) -> None:
        """While fenced: pause whatever runs (a start may finish meanwhile), upload those pauses."""
        while self.fenced:
            try:
                await self.pause_running()
                await self.upload_pauses()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("fenced node housekeeping failed")
            await asyncio.sleep(1.0)

    async def pause_running(self) -> None:
        orch = self.agent.orch
        sem = asyncio.Semaphore(4)

        async def one(sid: str) -> None:
            async with sem:
                try:
                    await orch.pauses.pause(sid, None, True, publish=False)
                except Unavailable as e:  # the runtime cannot checkpoint it now: stop it, keep its files
                    log.warning("fence: memory pause of %s refused (%s); pausing its files only", sid, e.message)
                    await orch.pauses.pause(sid, None, False, publish=False)
                self._local_only.add(sid)
                self._mark(sid)
                log.warning("fence: sandbox %s paused on this node's disk", sid)

        ids = sorted(orch.running_ids())
        results = await asyncio.gather(*(one(s) for s in ids), return_exceptions=True)
        for sid, res in zip(ids, results):
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                log.error("fence: could not pause %s: %s", sid, res)

    # A marker in the sandbox dir: a restart before the rejoin keeps the sandbox (`recover`).
    def _marker(self, sid: str):
        return self.agent.orch.host.sandbox_dir(sid) / FENCED_MARKER

    def _mark(self, sid: str, sealed=None) -> None:
        """What a restart needs to take the sandbox back: its pause mode and, once sealing began
        (the upper and checkpoint then live on as artifacts), its layer chain and memory image."""
        rec = sealed or self.agent.orch.peek(sid)
        mark = {"pause_mode": (rec.pause_mode if rec is not None else None) or "full"}
        if sealed is not None:
            mark.update(layers=list(sealed.layers), memory_digest=sealed.memory_digest)
        try:
            tmp = self._marker(sid).with_suffix(".tmp")
            tmp.write_text(json.dumps(mark))
            os.replace(tmp, self._marker(sid))
        except OSError as e:
            log.warning("fence: cannot mark %s for a restart: %s", sid, e)

    def recover(self, rec) -> bool:
        """Restart hook (`Orchestrator.recover_fenced`): a record (LOST, or RUNNING if the cluster had
        not declared it lost yet) this node paused while fenced is kept (paused, with its pause
        mode), and the node starts fenced so that it rejoins with it."""
        try:
            mark = json.loads(self._marker(rec.sandbox_id).read_text())
        except (OSError, ValueError):
            return False
        mode = mark.get("pause_mode")
        rec.pause_mode = mode if mode in ("full", "filesystem") else "full"
        rec.memory_digest = mark.get("memory_digest")
        if "layers" in mark:  # sealed before the crash: the artifacts hold its upper and checkpoint
            rec.layers = list(mark["layers"])
        rec.slot = None
        self._local_only.add(rec.sandbox_id)
        self.fenced = self.agent.store.fenced = True
        self.fenced_at = time.monotonic()
        return True

    async def upload_pauses(self) -> bool:
        """Upload the fence's pauses to the snapshot store; True when none is left."""
        for sid in sorted(self._local_only):
            try:
                rec = await asyncio.wait_for(
                    self.agent.orch.pauses.publish_local(sid, on_sealed=lambda r, s=sid: self._mark(s, r)), 300)
            except Exception as e:  # noqa: BLE001 - the snapshot store may be out of reach too
                log.warning("fence: upload of paused %s failed: %s", sid, str(e) or type(e).__name__)
                return False
            self._local_only.discard(sid)
            if rec is not None:
                log.info("fence: paused sandbox %s uploaded to the snapshot store", sid)
        return True

    # ------------------------------------------------------------------ back in the cluster

    async def reconcile(self) -> None:
        """After a heartbeat the state store accepted: notice being declared dead; rejoin if fenced."""
        store = self.agent.store.inner
        node_id = self.agent.node_id
        mine = {r.sandbox_id: r for r in await store.list_sandboxes(node_id=node_id)}
        local = {r.sandbox_id: r for r in self.agent.orch.records()}
        if not self.fenced:
            lost = [sid for sid, r in local.items()
                    if r.state == SandboxState.RUNNING and sid in mine and mine[sid].state == SandboxState.LOST]
            if lost:
                await self.fence(f"the cluster declared this node dead (its sandboxes {', '.join(lost[:5])} are lost)")
                return
            # paused sandboxes another node took over (while this one was away, or without a release call)
            for sid, r in local.items():
                if r.state == SandboxState.PAUSED and sid not in mine:
                    await self._gone_or_moved(store, sid, r)
            return
        await self._rejoin(store, mine)

    async def _rejoin(self, store, mine: dict) -> None:
        if self._holding is not None and not self._holding.done():
            self.fenced = False  # stop the housekeeping loop between two rounds, then finish by hand
            self._holding.cancel()
            await asyncio.gather(self._holding, return_exceptions=True)
            self.fenced = True
        await self.pause_running()
        orch = self.agent.orch
        if orch.running_ids() or not await self.upload_pauses():
            log.warning("node %s stays fenced: %s", self.agent.node_id,
                        "sandboxes still running" if orch.running_ids() else "pauses not uploaded yet")
            self._holding = asyncio.create_task(self._hold(), name="fenced")
            return
        self.agent.store.fenced = False  # from here on this node writes its truth back
        local = {r.sandbox_id: r for r in orch.records()}  # after the pauses (one that failed is gone)
        for sid, rec in local.items():
            db = mine.get(sid)
            try:
                if db is None:
                    await self._gone_or_moved(store, sid, rec)
                elif rec.state == SandboxState.PAUSED:
                    await orch.lifecycle.persist(rec)
                    self._marker(sid).unlink(missing_ok=True)
                    log.info("rejoin: sandbox %s is paused (was %s in the cluster)", sid, db.state.value)
            except AgentEnvError as e:
                log.warning("rejoin: %s: %s", sid, e.message)
        for sid, db in mine.items():
            if sid not in local and db.state != SandboxState.PAUSED:
                await store.delete_sandbox_of(sid, self.agent.node_id)
                log.info("rejoin: record of %s (%s) deleted: the sandbox is no longer on this node", sid,
                         db.state.value)
        self.fenced = False
        self._holding = None
        log.warning("node %s rejoined the cluster after %.1fs fenced", self.agent.node_id,
                    time.monotonic() - (self.fenced_at or time.monotonic()))

    async def _gone_or_moved(self, store, sid: str, rec) -> None:
        now = await store.get_sandbox(sid)
        orch = self.agent.orch
        if now is None:
            log.warning("rejoin: sandbox %s was removed from the cluster meanwhile: removing it here", sid)
            await orch.kill_sandbox(sid, team_id=None)
        elif now.node_id != self.agent.node_id:
            log.warning("rejoin: sandbox %s is on node %s now: releasing it here", sid, now.node_id)
            await orch.release_sandbox(sid)

    # ------------------------------------------------------------------ the door

    def middleware(self):
        @web.middleware
        async def fenced(request: web.Request, handler):
            # /health stays up: the process is fine, and a supervisor restarting a fenced node
            # (Kubernetes' liveness probe) would throw away what it keeps for its rejoin
            if self.fenced and not (request.path == "/health" and not self.agent.c.proxy.matches(request)):
                return web.json_response(
                    {"code": 503, "error_code": "node_fenced",
                     "message": f"node {self.agent.node_id} is fenced (cut off from the cluster); retry later"},
                    status=503, headers={"Retry-After": "5"})
            return await handler(request)

        return fenced
