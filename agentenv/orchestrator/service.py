"""The orchestrator: owns every sandbox on this node, from create to kill or expiry.

It is the boundary: every operation arrives as a typed request (`operations`), is validated once,
traced and observed (`events`: metrics and the event stream subscribe), and runs its handler
here. The handlers compose the parts, each in a module of its own:

- `host`      bring-up, capture (checkpoint + seal), drain, teardown of one sandbox
- `lifecycle` legal transitions, per-sandbox locks, the live records: the only writer of a state
- `admission` node capacity and team quotas
- `pausing`   pause / resume;  `capture`: fork, snapshot and checkpoint captures (never lose the source)
- `timetravel` checkpoints with parents, rollback in place, the checkpoint tree
- `warm`      per-template warm images;  `pool`: ready sandboxes restored from them ahead of demand
- `catalog`   snapshots;  `routing`: the traffic resolver
- `templates` template builds (over the host)

Filesystem chain of every sandbox: base image → read-only layers (content-addressed, top first) →
its own writable upper. Capturing a running sandbox (fork, snapshot) checkpoints its memory, seals
the upper into a new layer, and restores the source in place on a fresh upper: the capture costs
what changed since the previous one, and every child shares the same layers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from agentenv.config import Settings
from agentenv.errors import AgentEnvError, BadRequest, Conflict, RuntimeFailure, Unavailable, sandbox_not_found
from agentenv.models import SandboxRecord, SandboxState, SnapshotRecord, TemplateRecord, utcnow
from agentenv.network.policy import EGRESS_FIELDS, parse_policy
from agentenv.orchestrator import events, operations as ops
from agentenv.orchestrator.admission import Admission
from agentenv.orchestrator.capture import Capture
from agentenv.orchestrator.catalog import SnapshotCatalog
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.ids import new_sandbox_id, new_snapshot_id  # noqa: F401 - public names
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.pausing import PauseResume
from agentenv.orchestrator.pool import SandboxPool
from agentenv.orchestrator.starting import Starts
from agentenv.orchestrator.routing import Route, TrafficResolver, wakeable  # noqa: F401 - Route: public name
from agentenv.orchestrator.templates import TemplateService
from agentenv.orchestrator.timetravel import TimeTravel
from agentenv.orchestrator.warm import WarmImages
from agentenv.runtimes.base import Runtime
from agentenv.state.base import StateStore
from agentenv.storage.artifacts import ArtifactCache

log = logging.getLogger("agentenv.orchestrator")


def _entry(request_type: type[ops.Request]):
    """A public operation method: `orch.kill_sandbox(sid, team_id=...)` is `orch.handle(KillSandbox(...))`."""

    async def method(self: "Orchestrator", *args: Any, **kwargs: Any) -> Any:
        return await self.handle(request_type(*args, **kwargs))

    method.__name__ = method.__qualname__ = f"handle_{request_type.__name__}"
    method.__doc__ = request_type.__doc__
    return method


class Orchestrator:
    def __init__(self, settings: Settings, store: StateStore, images, rootfs, network, runtime: Runtime,
                 artifacts: ArtifactCache, *, extra_runtimes: Iterable[Runtime] = (),
                 publish_paused: bool = False) -> None:
        """`publish_paused` (cluster nodes): a pause seals the sandbox's state into layers + a memory
        image and uploads them to the snapshot store, so that any node can resume it; a template
        build uploads its layers and memory image before it is ready, so that any node can create
        from it."""
        self.settings = settings
        self.store = store
        self.host = SandboxHost(settings, images, rootfs, network, runtime, artifacts, extra_runtimes=extra_runtimes)
        self.lifecycle = Lifecycle(store)
        self.admission = Admission(settings, store, self.lifecycle.records)
        self.events = events.LifecycleEvents()
        self.captures = Capture(self.host, self.lifecycle, lose=self._lose)
        self.pauses = PauseResume(self.host, self.lifecycle, self.admission, self.captures, publish=publish_paused,
                                  lose=self._lose)
        self.warm = WarmImages(self.host, self.gc_artifacts)
        self.pool = SandboxPool(settings, self.host, busy=lambda: self.admission.starting > 0 or any(
            r.state in (SandboxState.CREATING, SandboxState.RESUMING) for r in self.lifecycle.records()))
        self.snapshots = SnapshotCatalog(store, artifacts, self.gc_artifacts)
        self.templates = TemplateService(self.host, store, self.gc_artifacts, publish=publish_paused)
        self.templates.on_deleted.append(self.pool.forget_template)
        self.starts = Starts(settings, store, self.host, self.lifecycle, self.admission, self.warm, self.snapshots,
                             self.templates, self.pool)
        self.warm.on_ready.append(self.starts.pool_template)
        self.timetravel = TimeTravel(self.host, self.lifecycle, self.captures, self.snapshots, self.gc_artifacts)
        self.resolver = TrafficResolver(self.lifecycle.get, self.lifecycle.records, self.host.slots,
                                        self.resume_on_traffic)
        self._reaper: asyncio.Task | None = None
        # Cluster nodes: whether a LOST (or RUNNING but stopped) record is kept on restart, as paused:
        # a fenced node's pause on its disk; the hook sets its pause_mode. None: they are dropped.
        self.recover_fenced: Any = None
        self._handlers: dict[type, Any] = {
            ops.CreateSandbox: self.starts.create, ops.KillSandbox: self._kill, ops.PauseSandbox: self._pause,
            ops.ConnectSandbox: self._connect, ops.WakeSandbox: self._wake, ops.ForkSandbox: self._fork,
            ops.CreateSnapshot: self._snapshot, ops.SetTimeout: self._set_timeout, ops.Refresh: self._refresh,
            ops.UpdateNetwork: self._update_network, ops.GetSandbox: self._get_sandbox,
            ops.ListSandboxes: self._list_sandboxes, ops.ListTemplates: self._list_templates,
            ops.ListSnapshots: lambda r: self.snapshots.list(team_id=r.team_id, sandbox_id=r.sandbox_id,
                                                             name=r.name),
            ops.GetSnapshot: lambda r: self.snapshots.get(r.snapshot_id_or_name, team_id=r.team_id),
            ops.DeleteSnapshot: lambda r: self.snapshots.delete(r.snapshot_id_or_name, team_id=r.team_id),
            ops.AdoptSandbox: self._adopt, ops.ReleaseSandbox: self._release,
            ops.CreateCheckpoint: self.timetravel.checkpoint, ops.RollbackSandbox: self.timetravel.rollback,
            ops.ListCheckpoints: self.timetravel.list_for, ops.CheckpointTree: self.timetravel.tree,
        }

    # The seams, as they were composed (API, observability, CLI and templates read them).
    paths = property(lambda self: self.settings.paths)
    images = property(lambda self: self.host.images)
    rootfs = property(lambda self: self.host.rootfs)
    network = property(lambda self: self.host.network)
    artifacts = property(lambda self: self.host.artifacts)
    runtime = property(lambda self: self.host.runtime)
    runtimes = property(lambda self: self.host.runtimes)
    on_before_stop = property(lambda self: self.host.on_before_stop)

    # ------------------------------------------------------------------ the boundary

    async def handle(self, req: ops.Request) -> Any:
        """Validate `req` once, run its handler, traced, with its lifecycle events."""
        handler = self._handlers[type(req)]

        async def call() -> Any:
            return await handler(req.validated(self.settings))

        return await events.observe(req, call, self.lifecycle.get, self.events.emit)

    # The public operations: each builds its typed request (same signatures as the request types).
    create_sandbox = _entry(ops.CreateSandbox)
    kill_sandbox = _entry(ops.KillSandbox)
    pause_sandbox = _entry(ops.PauseSandbox)
    connect_sandbox = _entry(ops.ConnectSandbox)
    resume_on_traffic = _entry(ops.WakeSandbox)
    fork_sandbox = _entry(ops.ForkSandbox)
    create_snapshot = _entry(ops.CreateSnapshot)
    set_timeout = _entry(ops.SetTimeout)
    refresh = _entry(ops.Refresh)
    update_network = _entry(ops.UpdateNetwork)
    get_sandbox = _entry(ops.GetSandbox)
    list_sandboxes = _entry(ops.ListSandboxes)
    list_templates = _entry(ops.ListTemplates)
    list_snapshots = _entry(ops.ListSnapshots)
    get_snapshot = _entry(ops.GetSnapshot)
    delete_snapshot = _entry(ops.DeleteSnapshot)
    adopt_sandbox = _entry(ops.AdoptSandbox)
    release_sandbox = _entry(ops.ReleaseSandbox)
    create_checkpoint = _entry(ops.CreateCheckpoint)
    rollback_sandbox = _entry(ops.RollbackSandbox)
    list_checkpoints = _entry(ops.ListCheckpoints)
    checkpoint_tree = _entry(ops.CheckpointTree)

    # ------------------------------------------------------------------ runtimes

    def runtime_named(self, name: str | None) -> Runtime:
        return self.host.runtime_named(name)

    def runtime_for(self, sandbox_id: str) -> Runtime:
        """The runtime running (or that ran) `sandbox_id`: the one it was brought up with, else its record's."""
        rec = self.lifecycle.get(sandbox_id)
        return self.host.runtime_for(sandbox_id, rec.runtime if rec is not None else None)

    # ------------------------------------------------------------------ startup / shutdown

    async def start(self) -> None:
        """Reconcile with what survived a restart, then start the TTL reaper."""
        from agentenv.orchestrator.recovery import reconcile

        await self.host.network.setup_host()
        quota = getattr(self.host.rootfs, "quota", None)
        if quota is not None:
            quota.probe()  # disk_quota=loop without its tools fails the start here
        await self._ensure_default_templates()
        await reconcile(self)
        await self.gc_artifacts()
        self._reaper = asyncio.create_task(self._reap_loop(), name="ttl-reaper")
        await self.templates.fail_interrupted()
        self.templates.start_builtins()
        if self.settings.warm_start:
            await self.warm.ensure_all([t for t in await self.store.list_templates()
                                        if t.team_id is None and not await self.store.list_tags(t.template_id)])
        for tmpl in await self.store.list_templates():
            await self.starts.pool_template(tmpl)

    async def stop(self, *, kill_running: bool = True) -> None:
        with events.shutting_down():
            await self.templates.stop()
            await self.warm.stop()
            await self.pool.stop()
            if self._reaper:
                self._reaper.cancel()
                try:
                    await self._reaper
                except asyncio.CancelledError:
                    pass
            if kill_running:
                ids = [r.sandbox_id for r in self.lifecycle.records() if r.state != SandboxState.PAUSED]
                await asyncio.gather(*(self._kill_quietly(sid) for sid in ids))
            await self.host.close()  # stand-downs and teardowns in flight end first: they may keep a slot
            await self.host.network.close()  # the spare slots go; running sandboxes keep theirs

    async def _ensure_default_templates(self) -> None:
        if await self.store.get_template("base") is None:
            await self.store.put_template(TemplateRecord(
                template_id="base", aliases=["base"], cpu_count=self.settings.default_cpu_count,
                memory_mb=self.settings.default_memory_mb, disk_mb=self.settings.default_disk_mb, image="base"))

    async def gc(self, keep: set[str]) -> dict[str, list[str]]:
        """Remove every container, netns, mount and sandbox dir of this data dir not in `keep`."""
        recs = await self.store.list_sandboxes()
        return await self.host.gc(keep, {r.sandbox_id for r in recs}, {r.sandbox_id: r.runtime for r in recs})

    async def gc_artifacts(self) -> dict[str, int]:
        """Drop local layers / memory images that no sandbox, snapshot or restore in flight uses."""
        started = time.time()  # what is sealed after this is spared (its sealer pins it next)
        layers, memory = await self.artifacts_in_use()
        needed_here = (set(layers), set(memory))  # what the size budget never evicts
        for snap in await self.store.list_snapshots():
            layers.update(snap.layers)
            if snap.memory_digest:
                memory.add(snap.memory_digest)
        removed = await self.host.artifacts.gc(layers, memory, fresh_since=started)
        if self.settings.artifact_cache_max_mb:
            evicted = await self.host.artifacts.enforce_budget(self.settings.artifact_cache_max_mb << 20, *needed_here)
            removed["evicted"] = len(evicted)
        return removed

    async def artifacts_in_use(self) -> tuple[set[str], set[str]]:
        """Layers and memory images this node needs: warm images, the pool, restores in flight,
        template builds, live records (also roots of the snapshot store's GC on a single server)."""
        layers, memory = self.warm.artifacts_in_use()
        p_layers, p_memory = self.pool.artifacts_in_use()
        layers |= p_layers | self.host.pinned_layers()
        memory |= p_memory | self.host.pinned()
        t_layers, t_memory = await self.templates.artifacts_in_use()
        layers |= t_layers
        memory |= t_memory
        # The live records too: a capture puts its new layer in the record before the store has it.
        for rec in self.lifecycle.records() + await self.store.list_sandboxes():
            layers.update(rec.layers)
            if rec.memory_digest:
                memory.add(rec.memory_digest)
        memory.discard("")
        return layers, memory

    # ------------------------------------------------------------------ queries (observers: no state change)

    def peek(self, sandbox_id: str) -> SandboxRecord | None:
        """The live record of any team, in any state, or None: for observers (metrics, events,
        console), which must not change it. API callers use get_sandbox (team-checked)."""
        return self.lifecycle.get(sandbox_id)

    def records(self) -> list[SandboxRecord]:
        """Every live record on this node (a copy of the list; observers only, like `peek`)."""
        return self.lifecycle.records()

    def has_slot(self, sandbox_id: str) -> bool:
        return sandbox_id in self.host.slots

    @property
    def starting(self) -> int:
        return self.admission.starting

    def node_active(self) -> int:
        return self.admission.node_active()

    def team_active(self, team_id: str) -> int:
        return self.admission.team_active(team_id)

    def usage(self) -> tuple[int, int, int]:
        """(active sandboxes incl. admitted starts, their vCPUs, their memory MB): node load, counted
        the way admission counts it (`node_active`)."""
        active = [r for r in self.lifecycle.records() if r.state != SandboxState.PAUSED]
        return self.node_active(), sum(r.cpu_count for r in active), sum(r.memory_mb for r in active)

    def paused_ids(self) -> set[str]:
        return {r.sandbox_id for r in self.lifecycle.records() if r.state == SandboxState.PAUSED}

    def running_ids(self) -> set[str]:
        return {r.sandbox_id for r in self.lifecycle.records() if r.state == SandboxState.RUNNING}

    async def resolve(self, sandbox_id: str) -> Route | None:
        return await self.resolver.resolve(sandbox_id)

    def running_routes(self) -> Iterable[Route]:
        return self.resolver.running_routes()

    async def _get_sandbox(self, req: ops.GetSandbox) -> SandboxRecord:
        return self.lifecycle.live(req.sandbox_id, req.team_id)

    async def _list_sandboxes(self, req: ops.ListSandboxes) -> list[SandboxRecord]:
        visible = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PAUSING, SandboxState.RESUMING,
                   SandboxState.SNAPSHOTTING, SandboxState.FORKING)
        return [r for r in self.lifecycle.records() if r.team_id == req.team_id and r.state in visible]

    async def _list_templates(self, req: ops.ListTemplates) -> list[TemplateRecord]:
        return [t for t in await self.store.list_templates() if t.team_id is None or t.team_id == req.team_id]

    # ------------------------------------------------------------------ create
    # ------------------------------------------------------------------ egress rules

    async def _update_network(self, req: ops.UpdateNetwork) -> None:
        """PUT /sandboxes/{id}/network: replace the egress rules (omitted fields are cleared).

        `allow_internet_access` is kept when the update leaves it out. Applied at once to a running
        sandbox; a paused one gets them when it resumes. Forks and snapshots copy the record.
        """
        sandbox_id, update = req.sandbox_id, req.update
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.live(sandbox_id, req.team_id)
            network = {k: v for k, v in (rec.network or {}).items() if k not in EGRESS_FIELDS}
            network.update({k: update[k] for k in EGRESS_FIELDS if update.get(k) is not None})
            allow = rec.allow_internet_access if update.get("allow_internet_access") is None \
                else bool(update["allow_internet_access"])
            policy = parse_policy(allow, network)  # 400 before anything changes
            slot = self.host.slots.get(sandbox_id)
            if rec.state == SandboxState.RUNNING and slot is not None:
                self.host.slots[sandbox_id] = await self.host.network.apply_policy(slot, policy)
            elif rec.state != SandboxState.PAUSED:
                raise Conflict(f"Sandbox {sandbox_id} is {rec.state.value}; try again shortly",
                               error_code="sandbox_changing_state")
            rec.network = network or None
            rec.allow_internet_access = allow
            await self.lifecycle.persist(rec)
        log.info("egress rules of %s updated: allow %s, deny %s, domains %s", sandbox_id, list(policy.allow_cidrs),
                 list(policy.deny_cidrs), list(policy.allow_domains))

    # ------------------------------------------------------------------ kill

    async def _kill(self, req: ops.KillSandbox) -> None:
        sandbox_id = req.sandbox_id
        self.lifecycle.live(sandbox_id, req.team_id)
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.live(sandbox_id, req.team_id)
            self.lifecycle.begin(rec, "kill")
            await self.host.teardown(sandbox_id, rec.runtime)
            await self.lifecycle.remove(rec)
            await self.pauses.drop_paused_memory(rec.memory_digest)
        self.lifecycle.forget(sandbox_id)
        log.info("killed sandbox %s", sandbox_id)
        if rec.layers or rec.memory_digest:
            await self.gc_artifacts()

    async def _kill_quietly(self, sandbox_id: str) -> None:
        try:
            await self.kill_sandbox(sandbox_id, team_id=None)
        except AgentEnvError:
            pass
        except Exception:  # noqa: BLE001
            log.exception("kill of %s failed", sandbox_id)

    async def _lose(self, rec: SandboxRecord, why: Exception) -> RuntimeFailure:
        """A checkpoint or restore failed half-way: the sandbox is gone; clean it up and say so."""
        log.error("sandbox %s lost: %s", rec.sandbox_id, why)
        self.host.keep_logs(rec.sandbox_id, "lost")
        self.lifecycle.fail(rec)
        await asyncio.shield(self.host.teardown(rec.sandbox_id, rec.runtime))
        await asyncio.shield(self.store.delete_sandbox(rec.sandbox_id))
        return RuntimeFailure(f"sandbox {rec.sandbox_id} was lost: {why}", error_code="sandbox_lost")

    # ------------------------------------------------------------------ timeouts

    async def _set_timeout(self, req: ops.SetTimeout) -> None:
        async with self.lifecycle.lock(req.sandbox_id):
            rec = self.lifecycle.live(req.sandbox_id, req.team_id)
            rec.end_at = utcnow() + timedelta(seconds=req.timeout)
            await self.lifecycle.persist(rec)

    async def _refresh(self, req: ops.Refresh) -> None:
        async with self.lifecycle.lock(req.sandbox_id):
            rec = self.lifecycle.live(req.sandbox_id, req.team_id)
            rec.end_at = max(rec.end_at, utcnow() + timedelta(seconds=req.duration))
            await self.lifecycle.persist(rec)

    async def _reap_loop(self) -> None:
        """Kill (or, with autoPause, pause) sandboxes whose endAt has passed."""
        busy: set[str] = set()

        async def expire(rec: SandboxRecord) -> None:
            try:
                if rec.auto_pause:
                    await self.pause_sandbox(rec.sandbox_id, team_id=None, memory=True)
                else:
                    await self._kill_quietly(rec.sandbox_id)
            except AgentEnvError as e:
                log.warning("expiry of %s: %s", rec.sandbox_id, e.message)
                if isinstance(e, Unavailable):  # e.g. connections still closing: retry after the hint
                    await asyncio.sleep(min(float(e.headers.get("Retry-After", 5)), 30.0))
            except Exception:  # noqa: BLE001
                log.exception("expiry of %s failed", rec.sandbox_id)
            finally:
                busy.discard(rec.sandbox_id)

        while True:
            try:
                now = utcnow()
                for r in self.lifecycle.records():
                    if r.state == SandboxState.RUNNING and r.end_at <= now and r.sandbox_id not in busy:
                        log.info("sandbox %s reached its timeout (%s)", r.sandbox_id,
                                 "pausing" if r.auto_pause else "killing")
                        busy.add(r.sandbox_id)
                        asyncio.create_task(expire(r), name=f"expire-{r.sandbox_id}")
            except Exception:  # noqa: BLE001
                log.exception("reaper iteration failed")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ pause / resume

    async def _pause(self, req: ops.PauseSandbox) -> None:
        await self.pauses.pause(req.sandbox_id, req.team_id, req.memory)

    async def _connect(self, req: ops.ConnectSandbox) -> tuple[SandboxRecord, bool]:
        async with self.lifecycle.lock(req.sandbox_id):
            rec = self.lifecycle.live(req.sandbox_id, req.team_id)
            if rec.state == SandboxState.PAUSED:
                await self.pauses.resume_locked(rec, req.timeout)
                return replace(rec), True
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"Sandbox {req.sandbox_id} is {rec.state.value}; try again shortly",
                               error_code="sandbox_changing_state")
            rec.end_at = max(rec.end_at, utcnow() + timedelta(seconds=req.timeout))
            await self.lifecycle.persist(rec)
            return replace(rec), False

    async def _wake(self, req: ops.WakeSandbox) -> bool:
        """The one resume behind a wake on traffic (`routing`); False if there was nothing to do."""
        async with self.lifecycle.lock(req.sandbox_id):
            rec = self.lifecycle.get(req.sandbox_id)
            if rec is None or not wakeable(rec):
                return False  # resumed, killed or changed meanwhile by someone else
            # The sandbox gets the same time to live as its last run had (its create/connect
            # timeout plus any extension), so an auto-pause sandbox keeps its rhythm.
            ran = int((rec.end_at - rec.started_at).total_seconds())
            timeout = min(ran if ran > 0 else self.settings.default_timeout_s, self.settings.max_timeout_s)
            t0 = time.monotonic()
            await self.pauses.resume_locked(rec, timeout)
            log.info("woke sandbox %s on traffic in %.3fs (auto-resume)", req.sandbox_id, time.monotonic() - t0)
            return True

    async def _adopt(self, req: ops.AdoptSandbox) -> SandboxRecord:
        claim = getattr(self.store, "claim_sandbox", None)  # the cluster store's extension of StateStore
        if claim is None:
            raise BadRequest("moving sandboxes between nodes needs the cluster state store")
        async with self.lifecycle.lock(req.sandbox_id):
            if not await claim(req.sandbox_id, req.from_node):
                raise Conflict(f"Sandbox {req.sandbox_id} is not a paused sandbox of node {req.from_node}",
                               error_code="sandbox_changing_state")
            rec = await self.store.get_sandbox(req.sandbox_id)
            if rec is None:
                raise sandbox_not_found(req.sandbox_id)
            rec.slot = None
            self.lifecycle.adopt(rec)
        log.info("adopted paused sandbox %s from node %s", req.sandbox_id, req.from_node)
        return replace(rec)

    async def _release(self, req: ops.ReleaseSandbox) -> None:
        sandbox_id = req.sandbox_id
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.get(sandbox_id)
            if rec is None or rec.state != SandboxState.PAUSED:
                return
            self.lifecycle.drop(sandbox_id)
            await self.host.teardown(sandbox_id, rec.runtime)
        self.lifecycle.forget(sandbox_id)
        await self.gc_artifacts()
        log.info("released sandbox %s (now on another node)", sandbox_id)

    # ------------------------------------------------------------------ capture (fork, snapshot)

    async def _fork(self, req: ops.ForkSandbox) -> list[SandboxRecord | AgentEnvError]:
        """Capture the source once, resume it under the same id, start `count` children from the capture."""
        source = self.lifecycle.live(req.sandbox_id, req.team_id)
        async with self.admission.admit(source.team_id, req.count):
            return await self._fork_admitted(req)

    async def _fork_admitted(self, req: ops.ForkSandbox) -> list[SandboxRecord | AgentEnvError]:
        t0 = time.monotonic()
        # the children restore from the image as taken: no hashing into the page store on their path
        got = await self.captures.locked(req.sandbox_id, req.team_id, "fork", seal_memory=False)
        source_back = time.monotonic() - t0
        try:
            children = [self.starts.child_of(got.view, req.timeout) for _ in range(req.count)]
            mem_dir = got.image or self.host.artifacts.memory_dir(got.memory)

            async def one(child: SandboxRecord) -> SandboxRecord | AgentEnvError:
                try:
                    await self.starts.spawn(child, restore_from=mem_dir, restore_token=got.view.envd_access_token)
                    return child
                except AgentEnvError as e:
                    return e
                except Exception as e:  # noqa: BLE001
                    return RuntimeFailure(f"fork child failed to start: {e}")

            results = await asyncio.gather(*(one(c) for c in children))
        finally:
            self.captures.release(got)
        ok = sum(1 for r in results if isinstance(r, SandboxRecord))
        log.info("forked %s into %d/%d children in %.3fs (source %s %.3fs)", req.sandbox_id, ok, req.count,
                 time.monotonic() - t0, "frozen" if got.frozen_s is not None else "away",
                 got.frozen_s if got.frozen_s is not None else source_back)
        await self.gc_artifacts()
        return list(results)

    async def _snapshot(self, req: ops.CreateSnapshot) -> SnapshotRecord:
        """Commit the sandbox's current state (filesystem layers, + memory unless filesystem-only)."""
        self.lifecycle.live(req.sandbox_id, req.team_id)
        got = await self.captures.locked(req.sandbox_id, req.team_id, "snapshot")
        try:
            snap = await self.snapshots.commit(got.view, got.memory, name=req.name, memory=req.memory)
        finally:
            self.captures.release(got)
        await self.gc_artifacts()
        log.info("snapshot %s of %s committed (%d layers, %s, %d bytes)", snap.snapshot_id, req.sandbox_id,
                 len(snap.layers), "memory" if req.memory else "filesystem only", snap.size_bytes)
        return snap


__all__ = ["Orchestrator", "Route", "new_sandbox_id", "new_snapshot_id"]
