"""Starting sandboxes: create (from a template, its warm image, a built template or a snapshot) and
the start of a new record that create and fork children share (`spawn`: all or nothing).

A start is admitted first (`admission`), enters the lifecycle as CREATING, is brought up on the
sandbox host and settles RUNNING; a failed start leaves as FAILED with everything it held released.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta

from agentenv.config import Settings
from agentenv.errors import AgentEnvError, BadRequest, NotFound, RuntimeFailure
from agentenv.models import (SandboxRecord, SandboxState, SnapshotRecord, TemplateBuildRecord, TemplateRecord,
                             utcnow)
from agentenv.network.policy import parse_policy
from agentenv.orchestrator import operations as ops, trace
from agentenv.orchestrator.admission import Admission
from agentenv.orchestrator.catalog import SnapshotCatalog
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.ids import new_sandbox_id
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.pool import Pooled, SandboxPool, Source
from agentenv.orchestrator.templates import TemplateService
from agentenv.orchestrator.warm import WarmImages
from agentenv.runtimes import select as runtime_select

log = logging.getLogger("agentenv.orchestrator")


class Starts:
    def __init__(self, settings: Settings, store, host: SandboxHost, lifecycle: Lifecycle, admission: Admission,
                 warm: WarmImages, snapshots: SnapshotCatalog, templates: TemplateService, pool: SandboxPool) -> None:
        self.settings = settings
        self.store = store
        self.host = host
        self.lifecycle = lifecycle
        self.admission = admission
        self.warm = warm
        self.snapshots = snapshots
        self.templates = templates
        self.pool = pool

    async def choose_runtime(self, requested: str | None, tmpl: TemplateRecord | None,
                              build: TemplateBuildRecord | None, snap: SnapshotRecord | None) -> str:
        """A new sandbox's runtime: the request's choice, else its template's, else the node default.
        A memory image (snapshot, built template) restores only under the runtime that made it."""
        fixed = what = None
        default = self.host.runtime.name
        if snap is not None and snap.memory_digest:
            fixed, what = snap.runtime or default, f"snapshot {snap.snapshot_id}"
        elif build is not None:
            fixed, what = build.runtime or default, f"template {build.template_id}"
        want = runtime_select.normalise(requested)
        if want in (None, "auto"):  # a filesystem-only snapshot boots under its source's runtime by default
            want = fixed or (snap.runtime if snap is not None else None) or (tmpl.runtime if tmpl is not None else None)
        if fixed is not None and want != fixed:
            raise BadRequest(f"{what} holds a memory image made by the {fixed} runtime: its sandboxes run under "
                             f"{fixed}, not {want}")
        return await runtime_select.resolve_request(self.settings, want, list(self.host.runtimes))


    async def create(self, req: ops.CreateSandbox) -> SandboxRecord:
        """A new sandbox from a template (warm image or boot), a built template or a snapshot."""
        found = await self.templates.resolve_for_create(req.template, req.team_id)
        tmpl, build = found if found is not None else (None, None)
        snap = None if tmpl is not None else await self.snapshots.find(req.template, req.team_id)
        if tmpl is None and snap is None:
            raise NotFound(f"template '{req.template}' not found")
        runtime = await self.choose_runtime(req.metadata.get(runtime_select.METADATA_KEY), tmpl, build, snap)
        allow, network = req.allow_internet_access, req.network
        if snap is not None and snap.network is not None:
            # a sandbox started from a snapshot keeps the snapshot's egress rules where the request sets none
            if allow is None:
                allow = snap.network.get("allow_internet_access")
            if network is None:
                network = snap.network.get("network")
        parse_policy(self.settings.allow_internet_access if allow is None else allow, network)  # 400 first
        async with self.admission.admit(req.team_id):
            return await self._create(replace(req, allow_internet_access=allow, network=network), tmpl, build, snap,
                                      runtime)

    async def _create(self, req: ops.CreateSandbox, tmpl: TemplateRecord | None, build: TemplateBuildRecord | None,
                      snap: SnapshotRecord | None, runtime: str) -> SandboxRecord:
        now = utcnow()
        src = snap if snap is not None else build if build is not None else tmpl
        meta = await self.warm.lookup(tmpl, runtime) if snap is None and build is None else None
        pooled = self._take_pooled(req, tmpl, build, meta, runtime) if snap is None else None
        rec = SandboxRecord(
            sandbox_id=pooled.sandbox_id if pooled else new_sandbox_id(),
            template_id=req.template if snap else tmpl.template_id,
            team_id=req.team_id, state=SandboxState.CREATING, started_at=now,
            end_at=now + timedelta(seconds=req.timeout), cpu_count=src.cpu_count, memory_mb=src.memory_mb,
            disk_mb=src.disk_mb, envd_access_token=secrets.token_urlsafe(24), traffic_access_token=None,
            alias=(tmpl.aliases[0] if tmpl and tmpl.aliases else (snap.names[0] if snap and snap.names else None)),
            metadata=dict(req.metadata), env_vars={**(snap.env_vars if snap else {}), **req.env_vars},
            auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            allow_internet_access=(self.settings.allow_internet_access if req.allow_internet_access is None
                                   else req.allow_internet_access),
            network=req.network, runtime=runtime,
            image=(snap.image if snap else build.image if build else tmpl.image),
            layers=list(snap.layers) if snap else list(build.layers) if build else [],
            snapshot_id=snap.snapshot_id if snap else None, checkpoint_id=snap.snapshot_id if snap else None)
        trace.name_sandbox(rec.sandbox_id)
        if req.network and req.network.get("allowPublicTraffic") is False:
            rec.traffic_access_token = secrets.token_urlsafe(24)
        t0 = time.monotonic()
        how = "pool"
        if pooled is not None and await self._spawn_pooled(rec, pooled):
            pass
        elif snap is not None and snap.memory_digest:
            how = "snapshot"
            await self.spawn_restored(rec, snap.memory_digest, restore_token=snap.restore_token)
            if snap.kind == "checkpoint":  # a branch: like a rollback, the image is rebuilt when next needed
                digest = snap.memory_digest
                await self.host.artifacts.drop_extracted(digest, lambda: digest in self.host.pinned())
        elif snap is not None:
            how = "snapshot (boot)"
            await self.spawn(rec)  # a filesystem-only snapshot: boot fresh on its layers
        elif build is not None:  # a built template: restore its committed snapshot (start command running)
            how = "build"
            await self.spawn_restored(rec, build.memory_digest, restore_token=build.restore_token, new_boot=True)
        else:
            how = "warm image" if meta is not None else "boot"
            await self._spawn_from_template(rec, tmpl, meta)
        log.info("created sandbox %s from %s in %.3fs (runtime %s, %s)", rec.sandbox_id, req.template,
                 time.monotonic() - t0, rec.runtime, how)
        return rec

    # ------------------------------------------------------------------ the pool of ready sandboxes

    def _take_pooled(self, req: ops.CreateSandbox, tmpl: TemplateRecord, build: TemplateBuildRecord | None,
                     meta: dict | None, runtime: str) -> Pooled | None:
        """A ready sandbox for this create from the pool (`pool.py`), or None. A create with egress
        rules other than the node's default, or a request for a public-traffic token, bypasses it."""
        if not self.pool.enabled or req.network is not None or req.allow_internet_access not in (
                None, self.settings.allow_internet_access):
            return None
        source = self.pool_source(tmpl, build, meta, runtime)
        return self.pool.take(source) if source is not None else None

    def pool_source(self, tmpl: TemplateRecord, build: TemplateBuildRecord | None, meta: dict | None,
                    runtime: str) -> Source | None:
        """What the template's pooled sandboxes are restored from: its built image, or its warm image."""
        if build is not None and build.memory_digest:
            return Source(tmpl.template_id, runtime, build.image, tuple(build.layers), build.memory_digest,
                          build.restore_token, build.cpu_count, build.memory_mb, build.disk_mb)
        if build is None and meta is not None:
            return Source(tmpl.template_id, runtime, tmpl.image, tuple(meta.get("layers", [])), meta["memory"], None,
                          tmpl.cpu_count, tmpl.memory_mb, tmpl.disk_mb)
        return None

    async def pool_template(self, tmpl: TemplateRecord) -> None:
        """Fill the template's pool when pool_templates names it (at start, and when its warm image is ready)."""
        if not self.pool.wants(tmpl.template_id, tmpl.aliases):
            return
        try:
            found = await self.templates.resolve_for_create(tmpl.template_id, tmpl.team_id)
            if found is None:
                return
            build = found[1]
            runtime = await self.choose_runtime(None, tmpl, build, None)
            meta = None
            if build is None:
                meta = self.warm.meta(tmpl, self.warm.key(tmpl, await self.host.images.ensure_tools()))
            source = self.pool_source(tmpl, build, meta, runtime)
        except AgentEnvError as e:
            log.warning("pool: template %s cannot be pooled: %s", tmpl.template_id, e.message)
            return
        if source is not None:
            self.pool.want(source, named=True)

    async def _spawn_pooled(self, rec: SandboxRecord, pooled: Pooled) -> bool:
        """Make a pooled sandbox this one: `/init` with its token and env (`spawn`). False when the pooled
        sandbox failed (`spawn` tore it down): the caller starts one the ordinary way, same id."""
        rec.layers = list(pooled.source.layers)
        slot = self.host.slots.get(rec.sandbox_id)
        try:
            if slot is None:
                raise RuntimeFailure("the pooled sandbox has no network slot")
            await self.spawn(rec, bring=lambda: self.host.init_envd(rec, slot, pooled.source.restore_token))
            return True
        except Exception as e:  # noqa: BLE001 - spawn released it; start fresh instead
            log.warning("pooled sandbox %s failed (%s); starting it the ordinary way", rec.sandbox_id, e)
            await asyncio.shield(self.host.teardown(rec.sandbox_id, rec.runtime))  # idempotent
            return False

    async def _spawn_from_template(self, rec: SandboxRecord, tmpl: TemplateRecord, meta: dict | None) -> None:
        """Start from the template's warm image (a restore) when there is one, else boot (`warm`)."""
        if meta is None:
            await self.spawn(rec)
            return
        rec.layers = list(meta.get("layers", []))
        try:
            await self.spawn_restored(rec, meta["memory"], restore_token=None, new_boot=True)
        except RuntimeFailure as e:
            log.warning("warm start of %s failed (%s); booting it cold", rec.sandbox_id, e.message[:300])
            self.warm.discard(tmpl)
            rec.layers = []
            await self.spawn(rec)

    async def spawn(self, rec: SandboxRecord, *, restore_from=None, restore_token: str | None = None,
                     new_boot: bool = False, bring: Callable[[], Awaitable[None]] | None = None) -> None:
        """Bring a new sandbox record to RUNNING (boot, or restore from a memory image; `bring`: what
        brings it up instead, e.g. /init of a pooled sandbox); all or nothing."""
        async with self.lifecycle.lock(rec.sandbox_id):
            self.lifecycle.enter(rec)
            reservation = self.admission.bind()
            await self.admission.bind_shared(reservation, rec.sandbox_id)
            await self.lifecycle.persist(rec)
            try:
                if bring is not None:
                    await bring()
                else:
                    await self.host.bring_up(rec, restore_from=restore_from, restore_token=restore_token,
                                             new_boot=new_boot)
            except BaseException as e:
                log.error("start of %s failed: %s", rec.sandbox_id, e)
                self.host.keep_logs(rec.sandbox_id, "failed")  # the runtime's console/VMM logs say why
                self.lifecycle.fail(rec)
                self.admission.unbind(reservation)
                await asyncio.shield(self.host.teardown(rec.sandbox_id, rec.runtime))
                await asyncio.shield(self.store.delete_sandbox(rec.sandbox_id))
                if isinstance(e, AgentEnvError):
                    raise
                if isinstance(e, Exception):
                    raise RuntimeFailure(f"failed to start sandbox: {e}") from e
                raise
            await self.lifecycle.settle(rec, SandboxState.RUNNING)

    async def spawn_restored(self, rec: SandboxRecord, memory_digest: str, *, restore_token: str | None,
                              new_boot: bool = False) -> None:
        """`spawn` from a memory image, which is pulled if missing and kept from GC meanwhile."""
        mem = await self.host.pin_memory(memory_digest)
        try:
            await self.spawn(rec, restore_from=mem, restore_token=restore_token, new_boot=new_boot)
        finally:
            self.host.unpin(memory_digest)

    def child_of(self, rec: SandboxRecord, timeout: int) -> SandboxRecord:
        now = utcnow()
        return replace(
            rec, sandbox_id=new_sandbox_id(), state=SandboxState.CREATING, started_at=now,
            end_at=now + timedelta(seconds=timeout), envd_access_token=secrets.token_urlsafe(24),
            traffic_access_token=secrets.token_urlsafe(24) if rec.traffic_access_token else None,
            metadata=dict(rec.metadata), env_vars=dict(rec.env_vars), layers=list(rec.layers),
            parent_id=rec.sandbox_id, slot=None, pause_mode=None, created_at=now)
