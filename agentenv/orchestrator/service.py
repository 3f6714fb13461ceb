"""The orchestrator: owns every sandbox on this node, from create to kill or expiry.

It composes the seams — image store, rootfs manager, network manager, runtime, state store — and
is the only component that changes a sandbox's state (through `lifecycle`). The HTTP API and the
traffic proxy call into it; it never speaks HTTP to users itself.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import string
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from agentenv.config import Settings
from agentenv.constants import DEFAULT_HOME, DEFAULT_USER
from agentenv.errors import AgentEnvError, BadRequest, NotFound, RuntimeFailure, Unavailable, sandbox_not_found
from agentenv.models import SandboxRecord, SandboxState, TemplateRecord, utcnow
from agentenv.network.slots import NetSlot
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.lifecycle import Lifecycle, check
from agentenv.runtimes.base import Runtime, SandboxSpec
from agentenv.state.base import StateStore

log = logging.getLogger("agentenv.orchestrator")

_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    """E2B-shaped ids: 'i' + 20 chars of [a-z0-9] (the proxy's host routing needs ^[a-z0-9]+$)."""
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


@dataclass
class Route:
    """What the traffic proxy needs to reach a sandbox (duck-types proxy.traffic.SandboxRoute)."""

    sandbox_id: str
    host_ip: str | None
    state: str
    envd_access_token: str | None
    traffic_access_token: str | None


class Orchestrator:
    def __init__(self, settings: Settings, store: StateStore, images, rootfs, network, runtime: Runtime) -> None:
        self.settings = settings
        self.paths = settings.paths
        self.store = store
        self.images = images
        self.rootfs = rootfs
        self.network = network
        self.runtime = runtime
        self.lifecycle = Lifecycle()
        # Live view of sandboxes on this node; the store is the durable copy.
        self._records: dict[str, SandboxRecord] = {}
        self._slots: dict[str, NetSlot] = {}
        self._host_token = secrets.token_hex(16)
        self._reaper: asyncio.Task | None = None
        self._creating = 0
        # Called before a sandbox's connections must be gone (kill, checkpoint); set by the server.
        self.on_before_stop: list = []

    # ------------------------------------------------------------------ startup / shutdown

    async def start(self) -> None:
        """Reconcile with what survived a restart, then start the TTL reaper."""
        await self.network.setup_host()
        await self._ensure_default_templates()
        await self._reconcile()
        self._reaper = asyncio.create_task(self._reap_loop(), name="ttl-reaper")

    async def stop(self, *, kill_running: bool = True) -> None:
        if self._reaper:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        if kill_running:
            ids = [sid for sid, r in self._records.items() if r.state != SandboxState.PAUSED]
            await asyncio.gather(*(self._kill_quietly(sid) for sid in ids))

    async def _ensure_default_templates(self) -> None:
        if await self.store.get_template("base") is None:
            await self.store.put_template(TemplateRecord(
                template_id="base", aliases=["base"], cpu_count=self.settings.default_cpu_count,
                memory_mb=self.settings.default_memory_mb, disk_mb=self.settings.default_disk_mb, image="base"))

    async def _reconcile(self) -> None:
        """Re-adopt sandboxes still alive after a server restart; tear down everything else.

        A sandbox survives only if its runtime container is alive and its network slot exists;
        anything half-made (crash mid-create) is removed, so nothing is leaked across restarts.
        """
        keep: set[str] = set()
        for rec in await self.store.list_sandboxes():
            slot = self.network.slot_for(rec.sandbox_id)
            alive = rec.state == SandboxState.RUNNING and slot is not None and await self.runtime.is_alive(rec.sandbox_id)
            if alive:
                self._records[rec.sandbox_id] = rec
                self._slots[rec.sandbox_id] = slot
                keep.add(rec.sandbox_id)
                log.info("re-adopted running sandbox %s", rec.sandbox_id)
            elif rec.state == SandboxState.PAUSED:
                self._records[rec.sandbox_id] = rec
                keep.add(rec.sandbox_id)
            else:
                log.warning("dropping sandbox %s (state %s) that did not survive the restart", rec.sandbox_id, rec.state.value)
                await self._teardown(rec.sandbox_id)
                await self.store.delete_sandbox(rec.sandbox_id)
        await self.gc(keep)

    async def gc(self, keep: set[str]) -> dict[str, list[str]]:
        """Remove every container, netns, mount and sandbox dir of this data dir not in `keep`."""
        removed: dict[str, list[str]] = {"containers": [], "netns": [], "rootfs": []}
        for sid in await self.runtime.list_ids():
            if sid not in keep:
                await self.runtime.stop(sid)
                removed["containers"].append(sid)
        removed["netns"] = list(await self.network.cleanup_orphans(keep))
        removed["rootfs"] = list(await self.rootfs.cleanup_orphans(keep))
        return removed

    # ------------------------------------------------------------------ queries

    def _get_live(self, sandbox_id: str, team_id: str | None) -> SandboxRecord:
        rec = self._records.get(sandbox_id)
        if rec is None or (team_id is not None and rec.team_id != team_id) or rec.state in (
                SandboxState.KILLED, SandboxState.KILLING):
            raise sandbox_not_found(sandbox_id)
        return rec

    async def get_sandbox(self, sandbox_id: str, *, team_id: str) -> SandboxRecord:
        return self._get_live(sandbox_id, team_id)

    async def list_sandboxes(self, *, team_id: str) -> list[SandboxRecord]:
        visible = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PAUSING, SandboxState.RESUMING,
                   SandboxState.SNAPSHOTTING, SandboxState.FORKING)
        return [r for r in self._records.values() if r.team_id == team_id and r.state in visible]

    async def list_templates(self) -> list[TemplateRecord]:
        return await self.store.list_templates()

    # ------------------------------------------------------------------ create

    async def create_sandbox(self, *, team_id: str, template: str, timeout: int, metadata: dict[str, str],
                             env_vars: dict[str, str], secure: bool = True, auto_pause: bool = False,
                             auto_resume: bool = False, allow_internet_access: bool | None = None,
                             network: dict | None = None) -> SandboxRecord:
        tmpl = await self.store.get_template(template)
        if tmpl is None:
            raise NotFound(f"template '{template}' not found")
        self._check_timeout(timeout)
        active = sum(1 for r in self._records.values() if r.state != SandboxState.PAUSED) + self._creating
        if active >= self.settings.max_sandboxes:
            raise Unavailable(f"node is at capacity ({self.settings.max_sandboxes} sandboxes); retry later",
                              error_code="capacity_exhausted")
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=tmpl.template_id, team_id=team_id,
            state=SandboxState.CREATING, started_at=now, end_at=now + timedelta(seconds=timeout),
            cpu_count=tmpl.cpu_count, memory_mb=tmpl.memory_mb, disk_mb=tmpl.disk_mb,
            envd_access_token=secrets.token_urlsafe(24),
            traffic_access_token=None, alias=(tmpl.aliases[0] if tmpl.aliases else None),
            metadata=dict(metadata), env_vars=dict(env_vars), auto_pause=auto_pause, auto_resume=auto_resume,
            allow_internet_access=(self.settings.allow_internet_access if allow_internet_access is None
                                   else allow_internet_access),
            network=network, runtime=self.runtime.name)
        if network and network.get("allowPublicTraffic") is False:
            rec.traffic_access_token = secrets.token_urlsafe(24)
        self._creating += 1
        t0 = time.monotonic()
        try:
            async with self.lifecycle.lock(rec.sandbox_id):
                self._records[rec.sandbox_id] = rec
                await self.store.put_sandbox(rec)
                try:
                    await self._boot(rec, tmpl)
                except BaseException as e:
                    log.error("create of %s failed: %s", rec.sandbox_id, e)
                    self._records.pop(rec.sandbox_id, None)
                    await asyncio.shield(self._teardown(rec.sandbox_id))
                    await self.store.delete_sandbox(rec.sandbox_id)
                    if isinstance(e, AgentEnvError):
                        raise
                    if isinstance(e, Exception):
                        raise RuntimeFailure(f"failed to start sandbox: {e}") from e
                    raise
                rec.state = SandboxState.RUNNING
                await self.store.put_sandbox(rec)
        finally:
            self._creating -= 1
        log.info("created sandbox %s from %s in %.3fs", rec.sandbox_id, tmpl.template_id, time.monotonic() - t0)
        return rec

    def _check_timeout(self, timeout: int) -> None:
        if timeout < 0:
            raise BadRequest("timeout must be >= 0 seconds")
        if timeout > self.settings.max_timeout_s:
            hours = self.settings.max_timeout_s // 3600
            raise BadRequest(f"Timeout cannot be greater than {hours} hours")

    def _sandbox_env(self, rec: SandboxRecord) -> dict[str, str]:
        env = {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": rec.sandbox_id, "E2B_TEMPLATE_ID": rec.template_id}
        env.update(rec.env_vars)
        return env

    def _spec(self, rec: SandboxRecord, rootfs: Path, slot: NetSlot, tools: Path) -> SandboxSpec:
        env = dict(self.images.envd_env())
        env["AGENTENV_ENVD_HOST_TOKEN"] = self._host_token
        env["AGENTENV_ENVD_MAX_UPLOAD"] = str(self.settings.max_upload_bytes)
        return SandboxSpec(
            sandbox_id=rec.sandbox_id, rootfs=rootfs, tools_dir=tools, slot=slot,
            bundle_dir=self.paths.sandbox_dir(rec.sandbox_id) / "bundle",
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, hostname="sandbox",
            args=list(self.images.envd_argv()), env=env)

    async def _boot(self, rec: SandboxRecord, tmpl: TemplateRecord) -> None:
        tools = await self.images.ensure_tools()
        base = self.images.image_rootfs(tmpl.image)
        rootfs, slot = await asyncio.gather(
            self.rootfs.prepare(rec.sandbox_id, [base]),
            self.network.allocate(rec.sandbox_id, allow_internet=rec.allow_internet_access))
        self._slots[rec.sandbox_id] = slot
        spec = self._spec(rec, rootfs, slot, tools)
        spec.bundle_dir.mkdir(parents=True, exist_ok=True)
        await self.runtime.start(spec)
        await self.network.activate(slot)
        await envd_client.wait_healthy(slot.host_ip, is_alive=lambda: self.runtime.is_alive(rec.sandbox_id))
        await envd_client.init(slot.host_ip, access_token=rec.envd_access_token, env_vars=self._sandbox_env(rec),
                               host_token=self._host_token, default_user=DEFAULT_USER,
                               default_workdir=DEFAULT_HOME)

    # ------------------------------------------------------------------ kill / teardown

    async def _teardown(self, sandbox_id: str) -> None:
        """Release everything a sandbox holds; each step idempotent and independent of the others."""
        for cb in self.on_before_stop:
            try:
                await cb(sandbox_id)
            except Exception:  # noqa: BLE001 - teardown must go on
                log.exception("before-stop hook failed for %s", sandbox_id)
        steps = [
            ("runtime", self.runtime.stop(sandbox_id)),
        ]
        for name, coro in steps:
            try:
                await coro
            except Exception:  # noqa: BLE001
                log.exception("teardown step %s failed for %s", name, sandbox_id)
        slot = self._slots.pop(sandbox_id, None) or self.network.slot_for(sandbox_id)
        if slot is not None:
            try:
                await self.network.release(slot)
            except Exception:  # noqa: BLE001
                log.exception("network release failed for %s", sandbox_id)
        try:
            await self.rootfs.release(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("rootfs release failed for %s", sandbox_id)

    async def kill_sandbox(self, sandbox_id: str, *, team_id: str | None) -> None:
        self._get_live(sandbox_id, team_id)
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            check(rec.state, "kill", sandbox_id)
            rec.state = SandboxState.KILLING
            await self._teardown(sandbox_id)
            self._records.pop(sandbox_id, None)
            await self.store.delete_sandbox(sandbox_id)
        self.lifecycle.forget(sandbox_id)
        log.info("killed sandbox %s", sandbox_id)

    async def _kill_quietly(self, sandbox_id: str) -> None:
        try:
            await self.kill_sandbox(sandbox_id, team_id=None)
        except AgentEnvError:
            pass
        except Exception:  # noqa: BLE001
            log.exception("kill of %s failed", sandbox_id)

    # ------------------------------------------------------------------ timeouts

    async def set_timeout(self, sandbox_id: str, timeout: int, *, team_id: str) -> None:
        self._check_timeout(timeout)
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            rec.end_at = utcnow() + timedelta(seconds=timeout)
            await self.store.put_sandbox(rec)

    async def refresh(self, sandbox_id: str, duration: int, *, team_id: str) -> None:
        if duration < 0 or duration > 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            rec.end_at = max(rec.end_at, utcnow() + timedelta(seconds=duration))
            await self.store.put_sandbox(rec)

    async def connect_sandbox(self, sandbox_id: str, timeout: int, *, team_id: str) -> tuple[SandboxRecord, bool]:
        self._check_timeout(timeout)
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            if rec.state == SandboxState.PAUSED:
                raise await self._resume_locked(rec, timeout)
            rec.end_at = max(rec.end_at, utcnow() + timedelta(seconds=timeout))
            await self.store.put_sandbox(rec)
            return replace(rec), False

    async def _resume_locked(self, rec: SandboxRecord, timeout: int) -> AgentEnvError:
        # Pause/resume with memory state arrive with the snapshot work (issue 3).
        return AgentEnvError("resuming paused sandboxes is not supported yet", status=501)

    async def pause_sandbox(self, sandbox_id: str, *, team_id: str) -> None:
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            check(rec.state, "pause", sandbox_id)
            raise AgentEnvError("pause is not supported yet on this server", status=501,
                                error_code="not_implemented")

    async def _reap_loop(self) -> None:
        """Kill (or, with autoPause, pause) sandboxes whose endAt has passed."""
        while True:
            try:
                now = utcnow()
                due = [r.sandbox_id for r in list(self._records.values())
                       if r.state == SandboxState.RUNNING and r.end_at <= now]
                for sid in due:
                    log.info("sandbox %s reached its timeout", sid)
                    asyncio.create_task(self._kill_quietly(sid), name=f"expire-{sid}")
            except Exception:  # noqa: BLE001
                log.exception("reaper iteration failed")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ resolver for the traffic proxy

    async def resolve(self, sandbox_id: str) -> Route | None:
        rec = self._records.get(sandbox_id)
        if rec is None:
            return None
        slot = self._slots.get(sandbox_id)
        running = rec.state in (SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.FORKING)
        return Route(sandbox_id, slot.host_ip if (slot and running) else None, rec.state.public if running
                     else rec.state.value, rec.envd_access_token, rec.traffic_access_token)

    def running_routes(self) -> Iterable[Route]:
        for sid, rec in self._records.items():
            slot = self._slots.get(sid)
            if rec.state == SandboxState.RUNNING and slot is not None:
                yield Route(sid, slot.host_ip, "running", rec.envd_access_token, rec.traffic_access_token)
