"""The orchestrator: owns every sandbox on this node, from create to kill or expiry.

It composes the seams — image store, rootfs manager, network manager, runtime, state store,
artifact cache (snapshot layers + memory images) — and is the only component that changes a
sandbox's state, always through `lifecycle`. The HTTP API and the traffic proxy call into it; it
never speaks HTTP to users itself.

Filesystem chain of every sandbox: base image → read-only layers (content-addressed, top first) →
its own writable upper. Capturing a running sandbox (fork, snapshot) checkpoints its memory, seals
the upper into a new layer, and restores the source in place on a fresh upper: the capture costs
what changed since the previous one, and every child shares the same layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import secrets
import shutil
import string
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from agentenv.config import Settings
from agentenv.constants import DEFAULT_HOME, DEFAULT_USER
from agentenv.errors import (AgentEnvError, BadRequest, CaptureRefused, Conflict, NotFound, RuntimeFailure,
                             TooManyRequests, Unavailable, sandbox_not_found)
from agentenv.models import (SandboxRecord, SandboxState, SnapshotRecord, TemplateBuildRecord, TemplateRecord,
                             utcnow)
from agentenv.network.policy import EGRESS_FIELDS, EgressPolicy, parse_policy
from agentenv.network.slots import NetSlot
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.lifecycle import Lifecycle, check
from agentenv.runtimes.base import Runtime, SandboxSpec
from agentenv.runtimes import select as runtime_select
from agentenv.state.base import StateStore
from agentenv.storage.artifacts import ArtifactCache

log = logging.getLogger("agentenv.orchestrator")

_ID_ALPHABET = string.ascii_lowercase + string.digits
# The sandbox's /proc/sys/kernel/random/boot_id, in its sandbox dir (SandboxSpec.boot_id_file), and the
# boot a memory image continues, in the image dir (`_checkpoint`, `_write_boot_id`).
BOOT_ID_FILE = "boot_id"


def _new_id(prefix: str) -> str:
    """E2B-shaped ids: a letter + 20 chars of [a-z0-9] (the proxy's host routing needs ^[a-z0-9]+$)."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def new_sandbox_id() -> str:
    return _new_id("i")


def new_snapshot_id() -> str:
    return _new_id("s")


# States not counted against a team's quota (CREATING/RESUMING are counted by their reservation).
# States whose sandboxes do not count against a team's quota (starts do: their record stands for them).
_NOT_COUNTED = (SandboxState.PAUSED, SandboxState.KILLED, SandboxState.KILLING, SandboxState.FAILED)
# ... nor against the node's capacity (a dying sandbox still holds the node's resources).
_NOT_ON_NODE = (SandboxState.PAUSED, SandboxState.KILLED, SandboxState.FAILED)


@dataclass
class _Admitted:
    """An admission in flight: `left` of its sandboxes have no record yet (`Orchestrator._bind`)."""

    team_id: str
    left: int


# The admission the current task's starts belong to (fork children: copied into their tasks).
_ADMISSION: contextvars.ContextVar[_Admitted | None] = contextvars.ContextVar("agentenv_admission", default=None)
_TRANSIENT = (SandboxState.CREATING, SandboxState.FORKING, SandboxState.SNAPSHOTTING, SandboxState.RESUMING)


@dataclass
class Route:
    """What the traffic proxy needs to reach a sandbox (duck-types proxy.traffic.SandboxRoute)."""

    sandbox_id: str
    host_ip: str | None
    state: str
    envd_access_token: str | None
    traffic_access_token: str | None


class Orchestrator:
    def __init__(self, settings: Settings, store: StateStore, images, rootfs, network, runtime: Runtime,
                 artifacts: ArtifactCache, *, extra_runtimes: Iterable[Runtime] = (),
                 publish_paused: bool = False) -> None:
        """`runtime` runs the sandboxes that ask for nothing else; `extra_runtimes` (by name) those whose
        template or create request names them. `publish_paused` (cluster nodes): a pause seals the
        sandbox's state into layers + a memory image and uploads them to the snapshot store, so that
        any node can resume it."""
        self.settings = settings
        self.publish_paused = publish_paused
        self.paths = settings.paths
        self.store = store
        self.images = images
        self.rootfs = rootfs
        self.network = network
        self.runtime = runtime
        self.runtimes: dict[str, Runtime] = {runtime.name: runtime, **{r.name: r for r in extra_runtimes}}
        # sandbox id -> the runtime running it (every sandbox brought up, incl. template-build and
        # warm-image ones that have no record here); a sandbox keeps its runtime for life.
        self._runtime_of: dict[str, str] = {}
        self.artifacts = artifacts
        self.lifecycle = Lifecycle()
        # Live view of sandboxes on this node; the store is the durable copy.
        self._records: dict[str, SandboxRecord] = {}
        self._slots: dict[str, NetSlot] = {}
        self._host_token = self._load_host_token()
        self._reaper: asyncio.Task | None = None
        # team -> sandboxes being created/resumed/forked (admitted, not yet settled): counted both by the
        # team's quota and by the node's capacity from the moment they are admitted.
        self._reserved: dict[str, int] = {}
        self._pinned_memory: dict[str, int] = {}  # memory digests in use by restores in flight
        self._warm_building: dict[str, asyncio.Task] = {}
        self._waking: dict[str, asyncio.Task] = {}  # single-flight resumes triggered by traffic
        # Awaited with a sandbox id before its connections must be gone (kill, checkpoint).
        self.on_before_stop: list = []
        from agentenv.orchestrator.templates import TemplateService

        self.templates = TemplateService(self)

    def _load_host_token(self) -> str:
        """A per-data-dir secret envd accepts for re-/init; kept on disk so restores after a restart work."""
        p = self.paths.root / "host-token"
        try:
            return p.read_text().strip()
        except FileNotFoundError:
            self.paths.root.mkdir(parents=True, exist_ok=True)
            tok = secrets.token_hex(24)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(tok + "\n")
            return tok

    # ------------------------------------------------------------------ runtimes

    def runtime_named(self, name: str | None) -> Runtime:
        """The runtime `name` (None: the default); a clear error when this node does not serve it."""
        rt = self.runtimes.get(name or self.runtime.name)
        if rt is None:
            raise RuntimeFailure(f"this node does not serve the {name} runtime (it serves {', '.join(self.runtimes)}); "
                                 "see AGENTENV_RUNTIME / AGENTENV_EXTRA_RUNTIMES")
        return rt

    def runtime_for(self, sandbox_id: str) -> Runtime:
        """The runtime running (or that ran) `sandbox_id`: the one it was brought up with, else its record's."""
        name = self._runtime_of.get(sandbox_id)
        if name is None and (rec := self._records.get(sandbox_id)) is not None:
            name = rec.runtime
        return self.runtime_named(name)

    async def _choose_runtime(self, requested: str | None, tmpl: TemplateRecord | None,
                              build: TemplateBuildRecord | None, snap: SnapshotRecord | None) -> str:
        """A new sandbox's runtime: the request's choice, else its template's, else the node default.
        A memory image (snapshot, built template) restores only under the runtime that made it."""
        fixed = what = None
        if snap is not None and snap.memory_digest:
            fixed, what = snap.runtime or self.runtime.name, f"snapshot {snap.snapshot_id}"
        elif build is not None:
            fixed, what = build.runtime or self.runtime.name, f"template {build.template_id}"
        want = runtime_select.normalise(requested)
        if want in (None, "auto"):  # a filesystem-only snapshot boots under its source's runtime by default
            want = fixed or (snap.runtime if snap is not None else None) or (tmpl.runtime if tmpl is not None else None)
        if fixed is not None and want != fixed:
            raise BadRequest(f"{what} holds a memory image made by the {fixed} runtime: its sandboxes run under "
                             f"{fixed}, not {want}")
        return await runtime_select.resolve_request(self.settings, want, list(self.runtimes))

    # ------------------------------------------------------------------ startup / shutdown

    async def start(self) -> None:
        """Reconcile with what survived a restart, then start the TTL reaper."""
        await self.network.setup_host()
        quota = getattr(self.rootfs, "quota", None)
        if quota is not None:
            quota.probe()  # disk_quota=loop without its tools fails the start here
        await self._ensure_default_templates()
        await self._reconcile()
        await self.gc_artifacts()
        self._reaper = asyncio.create_task(self._reap_loop(), name="ttl-reaper")
        await self.templates.fail_interrupted()
        self.templates.start_builtins()
        if self.settings.warm_start:
            tools = await self.images.ensure_tools()
            for tmpl in await self.store.list_templates():
                if tmpl.team_id is None and not await self.store.list_tags(tmpl.template_id) and \
                        self._warm_meta(tmpl, self._warm_key(tmpl, tools)) is None:
                    self._build_warm_soon(tmpl)

    async def stop(self, *, kill_running: bool = True) -> None:
        await self.templates.stop()
        for task in list(self._warm_building.values()):
            task.cancel()
        await asyncio.gather(*self._warm_building.values(), return_exceptions=True)
        if self._reaper:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        if kill_running:
            ids = [sid for sid, r in self._records.items() if r.state != SandboxState.PAUSED]
            await asyncio.gather(*(self._kill_quietly(sid) for sid in ids))
        egress = getattr(self.network, "egress", None)
        if egress is not None:
            await egress.close_all()  # running sandboxes kept: their listeners come back on the next start
        for rt in self.runtimes.values():
            await rt.close()   # e.g. Firecracker: API clients, its VM store mount

    async def _ensure_default_templates(self) -> None:
        if await self.store.get_template("base") is None:
            await self.store.put_template(TemplateRecord(
                template_id="base", aliases=["base"], cpu_count=self.settings.default_cpu_count,
                memory_mb=self.settings.default_memory_mb, disk_mb=self.settings.default_disk_mb, image="base"))

    async def _reconcile(self) -> None:
        """Re-adopt sandboxes still alive after a server restart; tear down everything else.

        Running sandboxes survive only if their container is alive and their network slot exists;
        paused ones live on disk and stay resumable; anything half-made is removed.
        """
        keep: set[str] = set()
        await self.network.discover()
        for rec in await self.store.list_sandboxes():
            if rec.state in (SandboxState.FORKING, SandboxState.SNAPSHOTTING):
                # a capture the old process did not finish (it records the source's new layers
                # half-way): the source still runs (frozen at worst), or its capture journal holds it
                rec.state = SandboxState.RUNNING
            if rec.state == SandboxState.RUNNING and await self._recover_capture(rec):
                # its journal: the source was stopped after its image was written; a container
                # restored from that image may have come up half-way: the image is the truth
                keep.add(rec.sandbox_id)
                continue
            slot = self.network.slot_for(rec.sandbox_id)
            rt = self.runtimes.get(rec.runtime)
            if rt is None and rec.state == SandboxState.RUNNING:
                log.warning("sandbox %s runs under %s, which this node no longer serves", rec.sandbox_id, rec.runtime)
            alive = rec.state == SandboxState.RUNNING and slot is not None and rt is not None \
                and await rt.is_alive(rec.sandbox_id)
            if alive and rt.traits.may_stay_frozen and await rt.state(rec.sandbox_id) == "paused":
                # frozen by a capture the old process did not finish: the sandbox runs on
                log.warning("sandbox %s was frozen by an interrupted capture; thawing it", rec.sandbox_id)
                await rt.resume(rec.sandbox_id)
            if alive:
                self._records[rec.sandbox_id] = rec
                self._runtime_of[rec.sandbox_id] = rec.runtime
                try:
                    # the egress proxy's listener died with the old process; the nft rules did not
                    slot = await self.network.apply_policy(slot, self._policy(rec))
                except Exception:  # noqa: BLE001 - the slot keeps the rules it had
                    log.exception("could not re-apply the egress policy of %s", rec.sandbox_id)
                self._slots[rec.sandbox_id] = slot
                keep.add(rec.sandbox_id)
                log.info("re-adopted running sandbox %s", rec.sandbox_id)
            elif rec.state == SandboxState.PAUSED:
                self._records[rec.sandbox_id] = rec
                keep.add(rec.sandbox_id)
                log.info("paused sandbox %s is resumable", rec.sandbox_id)
            else:
                log.warning("dropping sandbox %s (state %s) that did not survive the restart", rec.sandbox_id,
                            rec.state.value)
                await self._teardown(rec.sandbox_id)
                await self.store.delete_sandbox(rec.sandbox_id)
        await self.gc(keep)
        for sid, rec in self._records.items():
            if rec.state == SandboxState.PAUSED:
                await self.rootfs.unmount(sid)

    async def _recover_capture(self, rec: SandboxRecord) -> bool:
        """A server killed mid-capture left the source stopped with a complete image (its journal):
        keep it as a paused sandbox with that image. True if it was recovered."""
        sid = rec.sandbox_id
        try:
            journal = json.loads(self._capture_journal(sid).read_text())
        except (OSError, ValueError):
            return False
        image = Path(journal["image"]) if journal.get("image") else None
        if not journal.get("memory") and not (image and image.is_dir()):
            return False
        try:
            await self._image_as_pause(sid, image, journal.get("memory"))
        except OSError as e:
            log.error("could not recover the interrupted capture of %s: %s", sid, e)
            return False
        rec.layers = list(journal.get("layers") or rec.layers)
        rec.state, rec.pause_mode, rec.slot = SandboxState.PAUSED, "full", None
        await self._stop_quietly(sid)
        slot = self.network.slot_for(sid)
        if slot is not None:
            await self.network.release(slot)
        self._capture_journal(sid).unlink(missing_ok=True)
        await self.store.put_sandbox(rec)
        self._records[sid] = rec
        log.warning("sandbox %s: its capture was interrupted by a restart; it is paused with its full state", sid)
        return True

    async def gc(self, keep: set[str]) -> dict[str, list[str]]:
        """Remove every container, netns, mount and sandbox dir of this data dir not in `keep`."""
        removed: dict[str, list[str]] = {"containers": [], "netns": [], "rootfs": []}
        # Only sandboxes this data dir knows are candidates: another server (or a test) on the same
        # host keeps its own sandboxes.
        known: set[str] = {r.sandbox_id for r in await self.store.list_sandboxes()}
        if self.paths.sandboxes.exists():
            known |= {p.name for p in self.paths.sandboxes.iterdir() if p.is_dir()}
        recorded = {r.sandbox_id: r.runtime for r in await self.store.list_sandboxes()}
        owner: dict[str, Runtime] = {}
        for rt in self.runtimes.values():
            owner.update({sid: rt for sid in await rt.list_ids()})
        known |= set(owner)
        for sid in sorted(known - keep):
            # stop() is idempotent and also removes the sandbox's cgroups (a failed create leaves them).
            rt = owner.get(sid) or self.runtimes.get(recorded.get(sid) or "") or self.runtime
            await rt.stop(sid)
            if sid in owner:
                removed["containers"].append(sid)
        await self.network.discover()
        for sid in sorted(known - keep):
            slot = self.network.slot_for(sid)
            if slot is not None:
                await self.network.release(slot)
                removed["netns"].append(sid)
        removed["rootfs"] = list(await self.rootfs.cleanup_orphans(keep))
        return removed

    async def gc_artifacts(self) -> dict[str, int]:
        """Drop local layers / memory images that no sandbox, snapshot or restore in flight uses."""
        layers, memory = self.warm_artifacts()
        memory |= set(self._pinned_memory)
        t_layers, t_memory = await self.templates.artifacts_in_use()
        layers |= t_layers
        memory |= t_memory
        # The live records too: a capture puts its new layer in the record before the store has it.
        for rec in list(self._records.values()) + await self.store.list_sandboxes():
            layers.update(rec.layers)
            if rec.memory_digest:
                memory.add(rec.memory_digest)
        for snap in await self.store.list_snapshots():
            layers.update(snap.layers)
            if snap.memory_digest:
                memory.add(snap.memory_digest)
        return await self.artifacts.gc(layers, memory)

    # ------------------------------------------------------------------ queries

    def _get_live(self, sandbox_id: str, team_id: str | None) -> SandboxRecord:
        rec = self._records.get(sandbox_id)
        if rec is None or (team_id is not None and rec.team_id != team_id) or rec.state in (
                SandboxState.KILLED, SandboxState.KILLING):
            raise sandbox_not_found(sandbox_id)
        return rec

    def peek(self, sandbox_id: str) -> SandboxRecord | None:
        """The live record of any team, in any state, or None: for observers (metrics, events,
        console), which must not change it. API callers use get_sandbox (team-checked)."""
        return self._records.get(sandbox_id)

    def records(self) -> list[SandboxRecord]:
        """Every live record on this node (a copy of the list; observers only, like `peek`)."""
        return list(self._records.values())

    def has_slot(self, sandbox_id: str) -> bool:
        return sandbox_id in self._slots

    async def get_sandbox(self, sandbox_id: str, *, team_id: str) -> SandboxRecord:
        return self._get_live(sandbox_id, team_id)

    async def list_sandboxes(self, *, team_id: str) -> list[SandboxRecord]:
        visible = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PAUSING, SandboxState.RESUMING,
                   SandboxState.SNAPSHOTTING, SandboxState.FORKING)
        return [r for r in self._records.values() if r.team_id == team_id and r.state in visible]

    async def list_templates(self, team_id: str | None = None) -> list[TemplateRecord]:
        return [t for t in await self.store.list_templates() if t.team_id is None or t.team_id == team_id]

    # ------------------------------------------------------------------ create

    @property
    def starting(self) -> int:
        """Admitted sandbox starts (creates, resumes, fork children) that have no record yet."""
        return sum(self._reserved.values())

    def node_active(self) -> int:
        """Sandboxes that hold (or are about to hold) this node's resources: every record that is not
        paused (starting, running, dying) plus admitted starts without a record yet. A start counts
        once: its admission stands for it until its record exists (`_bind`)."""
        return sum(1 for r in self._records.values() if r.state not in _NOT_ON_NODE) + self.starting

    def _bind(self) -> None:
        """A start of the current admission now has a counted record (CREATING, or RESUMING): the
        record counts for it from here on, not the admission. Called with no await between the
        record change and this call, so nothing counts it twice or not at all."""
        adm = _ADMISSION.get()
        if adm is not None and adm.left > 0:
            adm.left -= 1
            self._unreserve(adm.team_id, 1)

    def _unbind(self) -> None:
        """Undo `_bind` for a start whose record went away while its admission still stands."""
        adm = _ADMISSION.get()
        if adm is not None:
            adm.left += 1
            self._reserved[adm.team_id] = self._reserved.get(adm.team_id, 0) + 1

    def _unreserve(self, team_id: str, n: int) -> None:
        left = self._reserved.get(team_id, 0) - n
        if left > 0:
            self._reserved[team_id] = left
        else:
            self._reserved.pop(team_id, None)

    def _admit(self, n: int = 1) -> None:
        if self.node_active() + n > self.settings.max_sandboxes:
            raise Unavailable(f"node is at capacity ({self.settings.max_sandboxes} sandboxes); retry later",
                              error_code="capacity_exhausted")

    async def _team_limit(self, team_id: str) -> int:
        team = await self.store.get_team(team_id)
        if team is not None and team.max_sandboxes is not None:
            return team.max_sandboxes
        return self.settings.max_sandboxes_per_team

    def team_active(self, team_id: str) -> int:
        """Sandboxes counted against the team's quota: not paused (nor dying), plus admitted starts
        without a record yet."""
        settled = sum(1 for r in self._records.values() if r.team_id == team_id and r.state not in _NOT_COUNTED)
        return settled + self._reserved.get(team_id, 0)

    @contextlib.asynccontextmanager
    async def _admission(self, team_id: str, n: int = 1) -> AsyncIterator[None]:
        """Node capacity + the team's concurrent-sandbox quota for `n` more sandboxes, held until they
        are up (or failed). The check and the reservation happen with no await in between, so
        concurrent creates cannot both take the last place."""
        limit = await self._team_limit(team_id)
        self._admit(n)
        active = self.team_active(team_id)
        if active + n > limit:
            raise TooManyRequests(
                f"Team sandbox limit reached: at most {limit} concurrent sandboxes "
                f"({active} running{f', {n} requested' if n > 1 else ''}). Kill or pause one first.",
                error_code="team_sandbox_limit", headers={"Should-Retry": "false"})
        self._reserved[team_id] = self._reserved.get(team_id, 0) + n
        adm = _Admitted(team_id, n)
        token = _ADMISSION.set(adm)
        try:
            yield
        finally:
            _ADMISSION.reset(token)
            self._unreserve(team_id, adm.left)

    async def create_sandbox(self, *, team_id: str, template: str, timeout: int, metadata: dict[str, str],
                             env_vars: dict[str, str], secure: bool = True, auto_pause: bool = False,
                             auto_resume: bool = False, allow_internet_access: bool | None = None,
                             network: dict | None = None) -> SandboxRecord:
        self._check_timeout(timeout)
        found = await self.templates.resolve_for_create(template, team_id)
        tmpl, build = found if found is not None else (None, None)
        snap = None if tmpl is not None else await self._find_snapshot(template, team_id)
        if tmpl is None and snap is None:
            raise NotFound(f"template '{template}' not found")
        runtime = await self._choose_runtime(metadata.get(runtime_select.METADATA_KEY), tmpl, build, snap)
        if snap is not None and snap.network is not None:
            # a sandbox started from a snapshot keeps the snapshot's egress rules where the request sets none
            if allow_internet_access is None:
                allow_internet_access = snap.network.get("allow_internet_access")
            if network is None:
                network = snap.network.get("network")
        parse_policy(self.settings.allow_internet_access if allow_internet_access is None else allow_internet_access,
                     network)  # 400 before anything starts
        async with self._admission(team_id):
            return await self._create(team_id=team_id, template=template, tmpl=tmpl, build=build, snap=snap,
                                      timeout=timeout, runtime=runtime,
                                      metadata=metadata, env_vars=env_vars, auto_pause=auto_pause,
                                      auto_resume=auto_resume, allow_internet_access=allow_internet_access,
                                      network=network)

    async def _create(self, *, team_id: str, template: str, tmpl: TemplateRecord | None,
                      build: TemplateBuildRecord | None, snap: SnapshotRecord | None, timeout: int, metadata: dict[str, str],
                      env_vars: dict[str, str], auto_pause: bool, auto_resume: bool,
                      allow_internet_access: bool | None, network: dict | None, runtime: str) -> SandboxRecord:
        now = utcnow()
        src = snap if snap is not None else build if build is not None else tmpl
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=template if snap else tmpl.template_id, team_id=team_id,
            state=SandboxState.CREATING, started_at=now, end_at=now + timedelta(seconds=timeout),
            cpu_count=src.cpu_count, memory_mb=src.memory_mb, disk_mb=src.disk_mb,
            envd_access_token=secrets.token_urlsafe(24), traffic_access_token=None,
            alias=(tmpl.aliases[0] if tmpl and tmpl.aliases else (snap.names[0] if snap and snap.names else None)),
            metadata=dict(metadata), env_vars={**(snap.env_vars if snap else {}), **env_vars},
            auto_pause=auto_pause, auto_resume=auto_resume,
            allow_internet_access=(self.settings.allow_internet_access if allow_internet_access is None
                                   else allow_internet_access),
            network=network, runtime=runtime,
            image=(snap.image if snap else build.image if build else tmpl.image),
            layers=list(snap.layers) if snap else list(build.layers) if build else [],
            snapshot_id=snap.snapshot_id if snap else None)
        if network and network.get("allowPublicTraffic") is False:
            rec.traffic_access_token = secrets.token_urlsafe(24)
        t0 = time.monotonic()
        if snap is not None and snap.memory_digest:
            await self._spawn_restored(rec, snap.memory_digest, restore_token=snap.restore_token)
        elif snap is not None:
            await self._spawn(rec)  # a filesystem-only snapshot: boot fresh on its layers
        elif build is not None:  # a built template: restore its committed snapshot (start command running)
            await self._spawn_restored(rec, build.memory_digest, restore_token=build.restore_token, new_boot=True)
        else:
            await self._spawn_from_template(rec, tmpl)
        log.info("created sandbox %s from %s in %.3fs (runtime %s)", rec.sandbox_id, template,
                 time.monotonic() - t0, rec.runtime)
        return rec

    # ------------------------------------------------------------------ warm start

    def _warm_key(self, tmpl: TemplateRecord, tools: Path) -> str:
        """What a warm image depends on: a change to any of these makes it stale."""
        parts = [tools.name, tmpl.template_id, tmpl.image, str(tmpl.cpu_count), str(tmpl.memory_mb),
                 str(self.settings.max_upload_bytes), str(self.settings.memory_headroom_mb), self._warm_runtime(tmpl),
                 hashlib.sha256(self._host_token.encode()).hexdigest()[:16], "boot_id-mount"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]

    def _warm_runtime(self, tmpl: TemplateRecord) -> str:
        """The runtime a template's warm image is made by (its own, when this node serves it)."""
        return tmpl.runtime if tmpl.runtime in self.runtimes else self.runtime.name

    def _warm_meta_path(self, tmpl: TemplateRecord) -> Path:
        return self.paths.root / "warm" / f"{tmpl.template_id}.json"

    def _warm_meta(self, tmpl: TemplateRecord, key: str) -> dict | None:
        try:
            meta = json.loads(self._warm_meta_path(tmpl).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("key") != key or not self.artifacts.memory_dir(meta["memory"]).is_dir() or not all(
                self.artifacts.layer_dir(d).is_dir() for d in meta.get("layers", [])):
            return None
        return meta

    def warm_artifacts(self) -> tuple[set[str], set[str]]:
        """Layers and memory images the warm images use (kept by GC)."""
        layers: set[str] = set()
        memory: set[str] = set()
        for f in (self.paths.root / "warm").glob("*.json"):
            try:
                meta = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            layers.update(meta.get("layers", []))
            memory.add(meta.get("memory", ""))
        return layers, memory

    async def _spawn_from_template(self, rec: SandboxRecord, tmpl: TemplateRecord) -> None:
        """Start from the template's warm image (a restore) when there is one, else boot.

        A warm image is a sandbox of the template booted once and checkpointed before /init:
        restoring it and then running /init with this sandbox's token and env skips envd's cold
        start (most of a boot under gVisor). Building one happens in the background; until it is
        ready, and whenever a restore fails, sandboxes boot cold.
        """
        meta = None
        if self.settings.warm_start and rec.runtime == self._warm_runtime(tmpl):
            tools = await self.images.ensure_tools()
            key = self._warm_key(tmpl, tools)
            meta = self._warm_meta(tmpl, key)
            if meta is None:
                self._build_warm_soon(tmpl)
        if meta is None:
            await self._spawn(rec)
            return
        rec.layers = list(meta.get("layers", []))
        try:
            await self._spawn_restored(rec, meta["memory"], restore_token=None, new_boot=True)
        except RuntimeFailure as e:
            log.warning("warm start of %s failed (%s); booting it cold", rec.sandbox_id, e.message[:300])
            self._warm_meta_path(tmpl).unlink(missing_ok=True)
            rec.layers, rec.state = [], SandboxState.CREATING
            await self._spawn(rec)

    def _build_warm_soon(self, tmpl: TemplateRecord) -> None:
        if tmpl.template_id in self._warm_building:
            return
        task = asyncio.create_task(self._build_warm(tmpl), name=f"warm-{tmpl.template_id}")
        self._warm_building[tmpl.template_id] = task
        task.add_done_callback(lambda _t: self._warm_building.pop(tmpl.template_id, None))

    async def _build_warm(self, tmpl: TemplateRecord) -> None:
        """Boot a sandbox of `tmpl` (no /init), checkpoint it, keep its layer + memory image."""
        t0 = time.monotonic()
        tools = await self.images.ensure_tools()
        key = self._warm_key(tmpl, tools)
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=_new_id("w"), template_id=tmpl.template_id, team_id="", state=SandboxState.CREATING,
            started_at=now, end_at=now, cpu_count=tmpl.cpu_count, memory_mb=tmpl.memory_mb,
            disk_mb=tmpl.disk_mb, envd_access_token="", image=tmpl.image, runtime=self._warm_runtime(tmpl))
        sid = rec.sandbox_id
        rt = self.runtime_named(rec.runtime)
        self._runtime_of[sid] = rec.runtime
        image = self.paths.sandbox_dir(sid) / "capture"
        try:
            rootfs, slot = await asyncio.gather(
                self.rootfs.prepare(sid, self._lowers(rec)), self.network.allocate(sid, allow_internet=False))
            self._slots[sid] = slot
            spec = self._spec(rec, rootfs, slot, tools)
            spec.bundle_dir.mkdir(parents=True, exist_ok=True)
            self._write_boot_id(sid, None)
            await self._attach_vm_boot(spec)
            await rt.start(spec)
            await self.network.activate(slot)
            await envd_client.wait_healthy(slot.host_ip, is_alive=lambda: rt.is_alive(sid),
                                           timeout=rt.traits.envd_timeout_s)
            await self._checkpoint(rec, image)
            await self.rootfs.unmount(sid)
            layer = await self.artifacts.seal_upper(self.rootfs.upper_path(sid))
            mem = await self.artifacts.seal_memory(image)
            meta = {"key": key, "template": tmpl.template_id, "layers": [layer] if layer else [], "memory": mem,
                    "created": utcnow().isoformat()}
            path = self._warm_meta_path(tmpl)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, path)
            log.info("warm image of template %s ready in %.2fs", tmpl.template_id, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - creates keep booting cold
            log.warning("could not build the warm image of template %s: %s", tmpl.template_id, e)
        finally:
            await asyncio.shield(self._teardown(sid))
            await self.gc_artifacts()

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

    def _lowers(self, rec: SandboxRecord) -> list[Path]:
        return [self.artifacts.layer_dir(d) for d in rec.layers] + [self.images.image_rootfs(rec.image)]

    def _spec(self, rec: SandboxRecord, rootfs: Path, slot: NetSlot, tools: Path) -> SandboxSpec:
        env = dict(self.images.envd_env())
        env["AGENTENV_ENVD_HOST_TOKEN"] = self._host_token
        env["AGENTENV_ENVD_MAX_UPLOAD"] = str(self.settings.max_upload_bytes)
        if self.settings.memory_headroom_mb > 0:
            env["AGENTENV_ENVD_MEMORY_LIMIT_MB"] = str(rec.memory_mb)  # envd's OOM guard (envd/oom.py)
        return SandboxSpec(
            sandbox_id=rec.sandbox_id, rootfs=rootfs, tools_dir=tools, slot=slot,
            bundle_dir=self.paths.sandbox_dir(rec.sandbox_id) / "bundle",
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, hostname="sandbox",
            args=list(self.images.envd_argv()), env=env, disk_mb=rec.disk_mb, lowers=self._lowers(rec),
            nofile=self.settings.sandbox_nofile, memory_headroom_mb=self.settings.memory_headroom_mb,
            boot_id_file=self.paths.sandbox_dir(rec.sandbox_id) / BOOT_ID_FILE)

    def _write_boot_id(self, sandbox_id: str, image: Path | None) -> None:
        """Write the sandbox's /proc/sys/kernel/random/boot_id (bind-mounted from its sandbox dir).

        gVisor fixes its own boot_id when its kernel boots and keeps it in a checkpoint, so every
        sandbox warm-started from one template image would share it. A boot, and a create from a
        template (its warm or built image is ours, not the user's), is a new boot; a restore of
        `image` continues the boot the image recorded (`_checkpoint` copies the file in): a full
        pause/resume (also on another node), a capture's source, fork children and sandboxes created
        from a memory snapshot. An image without one (taken before the mount existed) restores its
        own mount table, so the file it gets here is unused.
        """
        boot = None
        if image is not None:
            try:
                boot = str(uuid.UUID((image / BOOT_ID_FILE).read_text().strip()))
            except (OSError, ValueError):
                boot = None
        path = self.paths.sandbox_dir(sandbox_id) / BOOT_ID_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{boot or uuid.uuid4()}\n")
        os.replace(tmp, path)

    async def _attach_vm_boot(self, spec: SandboxSpec) -> None:
        """MicroVM runtimes that boot what the spec names (Firecracker) get the guest image here."""
        rt = self.runtime_for(spec.sandbox_id)
        if rt.traits.boots_from_spec and runtime_select.VM_GUEST_IMAGES is not None:
            spec.vm = await runtime_select.VM_GUEST_IMAGES(self.paths.images, spec)

    async def _spawn(self, rec: SandboxRecord, *, restore_from: Path | None = None,
                     restore_token: str | None = None, new_boot: bool = False) -> None:
        """Bring a new sandbox record to RUNNING (boot, or restore from a memory image); all or nothing."""
        async with self.lifecycle.lock(rec.sandbox_id):
            self._records[rec.sandbox_id] = rec
            self._bind()
            await self.store.put_sandbox(rec)
            try:
                await self._bring_up(rec, restore_from=restore_from, restore_token=restore_token,
                                     new_boot=new_boot)
            except BaseException as e:
                log.error("start of %s failed: %s", rec.sandbox_id, e)
                self._keep_logs(rec.sandbox_id, "failed")  # the runtime's console/VMM logs say why
                self._records.pop(rec.sandbox_id, None)
                self._unbind()
                await asyncio.shield(self._teardown(rec.sandbox_id))
                await asyncio.shield(self.store.delete_sandbox(rec.sandbox_id))
                if isinstance(e, AgentEnvError):
                    raise
                if isinstance(e, Exception):
                    raise RuntimeFailure(f"failed to start sandbox: {e}") from e
                raise
            rec.state = SandboxState.RUNNING
            await self.store.put_sandbox(rec)

    async def _spawn_restored(self, rec: SandboxRecord, memory_digest: str, *, restore_token: str | None,
                              new_boot: bool = False) -> None:
        """_spawn from a memory image, which is pulled if missing and kept from GC meanwhile."""
        mem = await self._pin_memory(memory_digest)
        try:
            await self._spawn(rec, restore_from=mem, restore_token=restore_token, new_boot=new_boot)
        finally:
            self._unpin_memory(memory_digest)

    async def _bring_up(self, rec: SandboxRecord, *, restore_from: Path | None, restore_token: str | None,
                        slot: NetSlot | None = None, new_boot: bool = False) -> None:
        """Mount the rootfs, take a network slot, start or restore, wait for envd, (re)init it.

        A start, or `new_boot`, is a new boot_id; a restore continues its image's (`_write_boot_id`)."""
        tools = await self.images.ensure_tools()
        for digest in rec.layers:
            await self.artifacts.ensure_layer(digest)
        if slot is None:
            policy = self._policy(rec)
            rootfs, slot = await asyncio.gather(
                self.rootfs.prepare(rec.sandbox_id, self._lowers(rec), disk_mb=rec.disk_mb),
                self.network.allocate(rec.sandbox_id, allow_internet=policy.may_egress, policy=policy))
        else:
            rootfs = await self.rootfs.prepare(rec.sandbox_id, self._lowers(rec), disk_mb=rec.disk_mb)
        self._slots[rec.sandbox_id] = slot
        rt = self.runtime_named(rec.runtime)
        self._runtime_of[rec.sandbox_id] = rt.name
        spec = self._spec(rec, rootfs, slot, tools)
        spec.bundle_dir.mkdir(parents=True, exist_ok=True)
        self._write_boot_id(rec.sandbox_id, None if new_boot else restore_from)
        await self._attach_vm_boot(spec)
        if restore_from is None:
            await rt.start(spec)
        else:
            await rt.restore(spec, restore_from)
        await self.network.activate(slot)
        await envd_client.wait_healthy(slot.host_ip, is_alive=lambda: rt.is_alive(rec.sandbox_id),
                                       timeout=rt.traits.envd_timeout_s)
        await envd_client.init(slot.host_ip, access_token=rec.envd_access_token, env_vars=self._sandbox_env(rec),
                               host_token=self._host_token, current_token=restore_token,
                               default_user=DEFAULT_USER, default_workdir=DEFAULT_HOME)

    # ------------------------------------------------------------------ egress rules

    def _policy(self, rec: SandboxRecord) -> EgressPolicy:
        return parse_policy(rec.allow_internet_access, rec.network)

    async def update_network(self, sandbox_id: str, update: dict, *, team_id: str) -> None:
        """PUT /sandboxes/{id}/network: replace the egress rules (omitted fields are cleared).

        `allow_internet_access` is kept when the update leaves it out. Applied at once to a running
        sandbox; a paused one gets them when it resumes. Forks and snapshots copy the record.
        """
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            network = {k: v for k, v in (rec.network or {}).items() if k not in EGRESS_FIELDS}
            network.update({k: update[k] for k in EGRESS_FIELDS if update.get(k) is not None})
            allow = rec.allow_internet_access if update.get("allow_internet_access") is None \
                else bool(update["allow_internet_access"])
            policy = parse_policy(allow, network)  # 400 before anything changes
            slot = self._slots.get(sandbox_id)
            if rec.state == SandboxState.RUNNING and slot is not None:
                self._slots[sandbox_id] = await self.network.apply_policy(slot, policy)
            elif rec.state != SandboxState.PAUSED:
                raise Conflict(f"Sandbox {sandbox_id} is {rec.state.value}; try again shortly",
                               error_code="sandbox_changing_state")
            rec.network = network or None
            rec.allow_internet_access = allow
            await self.store.put_sandbox(rec)
        log.info("egress rules of %s updated: allow %s, deny %s, domains %s", sandbox_id, list(policy.allow_cidrs),
                 list(policy.deny_cidrs), list(policy.allow_domains))

    # ------------------------------------------------------------------ kill / teardown

    async def _teardown(self, sandbox_id: str) -> None:
        """Release everything a sandbox holds; each step idempotent and independent of the others."""
        await self._quiesce(sandbox_id)
        try:
            await self.runtime_for(sandbox_id).stop(sandbox_id)
        except Exception:  # noqa: BLE001 - teardown must go on
            log.exception("runtime stop failed for %s", sandbox_id)
        self._runtime_of.pop(sandbox_id, None)
        await self._release_slot(sandbox_id)
        try:
            await self.rootfs.release(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("rootfs release failed for %s", sandbox_id)

    async def _release_slot(self, sandbox_id: str) -> None:
        slot = self._slots.pop(sandbox_id, None) or self.network.slot_for(sandbox_id)
        if slot is not None:
            try:
                await self.network.release(slot)
            except Exception:  # noqa: BLE001
                log.exception("network release failed for %s", sandbox_id)

    async def _quiesce(self, sandbox_id: str) -> None:
        """Close every host-side connection into the sandbox (the proxy's pool, streams).

        Before a checkpoint the runtime resets what the sandbox still holds (`_checkpoint`).
        """
        for cb in self.on_before_stop:
            try:
                await cb(sandbox_id)
            except Exception:  # noqa: BLE001
                log.exception("before-stop hook failed for %s", sandbox_id)

    async def _holds_connections(self, rec: SandboxRecord) -> bool:
        """Whether programs in the sandbox hold TCP connections (envd's view of its /proc/net/tcp).

        gVisor resets them at a checkpoint (`--net-disconnect-ok`); the runtime resets them first,
        while the sandbox runs, so event-loop servers see the reset as an ordinary one. Any doubt
        (envd unreachable) counts as yes: that costs one extra checkpoint, never the sandbox.
        """
        slot = self._slots.get(rec.sandbox_id)
        if slot is None:
            return False
        try:
            conns = await envd_client.blocking_connections(slot.host_ip, host_token=self._host_token)
        except Exception as e:  # noqa: BLE001
            log.warning("envd connection check of %s failed: %s", rec.sandbox_id, e)
            return True
        return any(c["state"] != "TIME_WAIT" for c in conns)

    async def _checkpoint(self, rec: SandboxRecord, image_dir: Path) -> None:
        """Checkpoint a running sandbox into `image_dir` and stop it.

        If the runtime cannot take the image and the sandbox still runs, raise Unavailable (503)
        with the reason: nothing happened. Any other error means the sandbox died on the way (the
        caller decides what that costs: `_lose` for a user's sandbox).
        """
        sid = rec.sandbox_id
        rt = self.runtime_for(sid)
        await self._quiesce(sid)
        kwargs = {}
        if rt.traits.resets_connections:  # gVisor >= 20240729 (VMs save TCP state with the guest kernel)
            kwargs["reset_connections"] = await self._holds_connections(rec)
        try:
            await rt.checkpoint(sid, image_dir, **kwargs)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(image_dir, ignore_errors=True)
            if isinstance(e, CaptureRefused) or await rt.is_alive(sid):
                msg = e.message if isinstance(e, AgentEnvError) else str(e)
                log.warning("checkpoint of %s refused, sandbox untouched: %s", sid, msg)
                raise Unavailable(f"Sandbox {sid} could not be captured: {msg}", error_code="capture_failed",
                                  headers={"Retry-After": "5"}) from e
            raise
        boot_id = self.paths.sandbox_dir(sid) / BOOT_ID_FILE
        try:  # the boot this image continues (`_write_boot_id`); without it a restore is a new boot_id
            if boot_id.is_file():
                shutil.copyfile(boot_id, image_dir / BOOT_ID_FILE)
        except OSError as e:
            log.warning("could not record the boot_id of %s in its image: %s", sid, e)

    async def kill_sandbox(self, sandbox_id: str, *, team_id: str | None) -> None:
        self._get_live(sandbox_id, team_id)
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            check(rec.state, "kill", sandbox_id)
            rec.state = SandboxState.KILLING
            await self._teardown(sandbox_id)
            self._records.pop(sandbox_id, None)
            await self.store.delete_sandbox(sandbox_id)
            await self._drop_paused_memory(rec)
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
        self._keep_logs(rec.sandbox_id, "lost")
        self._records.pop(rec.sandbox_id, None)
        await asyncio.shield(self._teardown(rec.sandbox_id))
        await asyncio.shield(self.store.delete_sandbox(rec.sandbox_id))
        return RuntimeFailure(f"sandbox {rec.sandbox_id} was lost: {why}", error_code="sandbox_lost")

    def _keep_logs(self, sandbox_id: str, why: str) -> None:
        """Copy a failed sandbox's runtime log to <data>/logs/ before its dir is removed."""
        bundle = self.paths.sandbox_dir(sandbox_id) / "bundle"
        logs = self.paths.root / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            for f in bundle.glob("*.log"):
                shutil.copyfile(f, logs / f"{sandbox_id}-{why}-{f.name}")
        except OSError:
            log.exception("could not keep logs of %s", sandbox_id)

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
                for r in list(self._records.values()):
                    if r.state == SandboxState.RUNNING and r.end_at <= now and r.sandbox_id not in busy:
                        log.info("sandbox %s reached its timeout (%s)", r.sandbox_id,
                                 "pausing" if r.auto_pause else "killing")
                        busy.add(r.sandbox_id)
                        asyncio.create_task(expire(r), name=f"expire-{r.sandbox_id}")
            except Exception:  # noqa: BLE001
                log.exception("reaper iteration failed")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ pause / resume

    def _checkpoint_dir(self, sandbox_id: str) -> Path:
        return self.paths.sandbox_dir(sandbox_id) / "checkpoint"

    async def pause_sandbox(self, sandbox_id: str, *, team_id: str | None, memory: bool = True) -> None:
        """Checkpoint memory (unless filesystem-only) and release CPU, memory and the network slot.

        The upper layer and the checkpoint stay in the sandbox dir, so a paused sandbox survives a
        server restart (or kill -9) and resumes with the same processes, PIDs and files.
        """
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            transient, final = check(rec.state, "pause", sandbox_id)
            rec.state = transient
            ckpt = self._checkpoint_dir(sandbox_id)
            shutil.rmtree(ckpt, ignore_errors=True)
            try:
                if memory:
                    await self._checkpoint(rec, ckpt)
                else:
                    await self._quiesce(sandbox_id)
                    await self.runtime_for(sandbox_id).stop(sandbox_id)
            except Unavailable:
                rec.state = SandboxState.RUNNING
                raise
            except Exception as e:  # noqa: BLE001
                raise await self._lose(rec, e) from e
            await self._release_slot(sandbox_id)
            await self.rootfs.unmount(sandbox_id)
            if self.publish_paused:
                try:
                    await self._publish_paused(rec, ckpt if memory else None)
                except Exception as e:  # noqa: BLE001
                    await self._unpause_after_failed_publish(rec, e)
            rec.state = final
            rec.pause_mode = "full" if memory else "filesystem"
            await self.store.put_sandbox(rec)
        log.info("paused sandbox %s (%s)", sandbox_id, rec.pause_mode)

    async def _publish_paused(self, rec: SandboxRecord, ckpt: Path | None) -> None:
        """Seal the paused sandbox's upper (and checkpoint) into artifacts and upload them."""
        layer = await self.artifacts.seal_upper(self.rootfs.upper_path(rec.sandbox_id))
        if layer:
            rec.layers = [layer] + rec.layers
        if ckpt is not None:
            rec.memory_digest = await self.artifacts.seal_memory(ckpt)
        await self.artifacts.publish_blobs(rec.layers, rec.memory_digest)

    async def _unpause_after_failed_publish(self, rec: SandboxRecord, why: Exception) -> None:
        """Publishing a pause failed (snapshot store down): bring the sandbox back from its local
        image and answer 503; if even that fails it stays paused with its full state on this node."""
        sid = rec.sandbox_id
        log.error("publishing the pause of %s failed (%s); resuming it", sid, why)
        rec.state, rec.pause_mode = SandboxState.PAUSED, "full"
        try:
            # its own remaining time (at least 10 s: an expired autoPause sandbox retries the pause)
            await self._resume_admitted(rec, max(10, int((rec.end_at - utcnow()).total_seconds())))
        except Exception as e:  # noqa: BLE001 - `_resume_admitted` left it PAUSED with its image
            await self.store.put_sandbox(rec)
            raise RuntimeFailure(f"Sandbox {sid} is paused on this node only (its state could not be "
                                 f"published: {why}; resuming it failed: {e})", error_code="publish_failed") from e
        raise Unavailable(f"Sandbox {sid} was not paused: the snapshot store is unreachable ({why}); "
                          "it keeps running", error_code="snapshot_store_unavailable",
                          headers={"Retry-After": "5"}) from why

    async def _drop_paused_memory(self, rec: SandboxRecord) -> None:
        """A published pause image is used once: after the resume (or kill) it goes from the store."""
        digest, rec.memory_digest = rec.memory_digest, None
        if digest:
            try:
                await self.artifacts.store.delete_blob("memory", digest)
            except Exception as e:  # noqa: BLE001 - an orphan blob is only wasted space
                log.warning("could not delete memory image %s from the store: %s", digest[:12], e)

    async def adopt_sandbox(self, sandbox_id: str, *, from_node: str) -> SandboxRecord:
        """Cluster: take over a paused sandbox of another node (its state is in the snapshot store)."""
        claim = getattr(self.store, "claim_sandbox", None)
        if claim is None:
            raise BadRequest("moving sandboxes between nodes needs the cluster state store")
        async with self.lifecycle.lock(sandbox_id):
            if not await claim(sandbox_id, from_node):
                raise Conflict(f"Sandbox {sandbox_id} is not a paused sandbox of node {from_node}",
                               error_code="sandbox_changing_state")
            rec = await self.store.get_sandbox(sandbox_id)
            if rec is None:
                raise sandbox_not_found(sandbox_id)
            rec.slot = None
            self._records[sandbox_id] = rec
        log.info("adopted paused sandbox %s from node %s", sandbox_id, from_node)
        return replace(rec)

    async def release_sandbox(self, sandbox_id: str) -> None:
        """Cluster: forget a paused sandbox another node took over (its local files are stale)."""
        async with self.lifecycle.lock(sandbox_id):
            rec = self._records.get(sandbox_id)
            if rec is None or rec.state != SandboxState.PAUSED:
                return
            self._records.pop(sandbox_id, None)
            await self._teardown(sandbox_id)
        self.lifecycle.forget(sandbox_id)
        await self.gc_artifacts()
        log.info("released sandbox %s (now on another node)", sandbox_id)

    def usage(self) -> tuple[int, int, int]:
        """(active sandboxes incl. admitted starts, their vCPUs, their memory MB): node load, counted
        the way admission counts it (`node_active`)."""
        active = [r for r in self._records.values() if r.state != SandboxState.PAUSED]
        return self.node_active(), sum(r.cpu_count for r in active), sum(r.memory_mb for r in active)

    def paused_ids(self) -> set[str]:
        return {sid for sid, r in self._records.items() if r.state == SandboxState.PAUSED}

    def running_ids(self) -> set[str]:
        return {sid for sid, r in self._records.items() if r.state == SandboxState.RUNNING}

    async def connect_sandbox(self, sandbox_id: str, timeout: int, *, team_id: str) -> tuple[SandboxRecord, bool]:
        self._check_timeout(timeout)
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            if rec.state == SandboxState.PAUSED:
                await self._resume_locked(rec, timeout)
                return replace(rec), True
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"Sandbox {sandbox_id} is {rec.state.value}; try again shortly",
                               error_code="sandbox_changing_state")
            rec.end_at = max(rec.end_at, utcnow() + timedelta(seconds=timeout))
            await self.store.put_sandbox(rec)
            return replace(rec), False

    async def _resume_locked(self, rec: SandboxRecord, timeout: int) -> None:
        check(rec.state, "resume", rec.sandbox_id)
        async with self._admission(rec.team_id):
            await self._resume_admitted(rec, timeout)

    async def _resume_admitted(self, rec: SandboxRecord, timeout: int) -> None:
        transient, final = check(rec.state, "resume", rec.sandbox_id)
        rec.state = transient
        self._bind()  # the resuming record counts from here on
        ckpt = self._checkpoint_dir(rec.sandbox_id)
        full = rec.pause_mode != "filesystem" and ckpt.is_dir() and any(ckpt.iterdir())
        pinned = rec.memory_digest if rec.pause_mode != "filesystem" else None
        try:
            if pinned:  # published pause: pulled from the snapshot store if this node lacks it
                ckpt, full = await self._pin_memory(pinned), True
            await self._bring_up(rec, restore_from=ckpt if full else None,
                                 restore_token=rec.envd_access_token if full else None)
        except Exception as e:  # noqa: BLE001
            # The paused state on disk is intact: undo what the attempt set up and stay paused.
            log.error("resume of %s failed: %s", rec.sandbox_id, e)
            await self._quiesce(rec.sandbox_id)
            await self.runtime_for(rec.sandbox_id).stop(rec.sandbox_id)
            await self._release_slot(rec.sandbox_id)
            await self.rootfs.unmount(rec.sandbox_id)
            rec.state = SandboxState.PAUSED
            raise RuntimeFailure(f"resume of sandbox {rec.sandbox_id} failed: {e}") from e
        finally:
            if pinned:
                self._unpin_memory(pinned)
        if pinned:
            await self._drop_paused_memory(rec)
        else:
            shutil.rmtree(ckpt, ignore_errors=True)
        now = utcnow()
        rec.state = final
        rec.pause_mode = None
        rec.started_at = now
        rec.end_at = now + timedelta(seconds=timeout)
        await self.store.put_sandbox(rec)
        log.info("resumed sandbox %s", rec.sandbox_id)

    # ------------------------------------------------------------------ capture (fork, snapshot)

    def _capture_journal(self, sandbox_id: str) -> Path:
        return self.paths.sandbox_dir(sandbox_id) / "capture.json"

    def _journal(self, rec: SandboxRecord, **state: object) -> None:
        """Where a capture stands, so a server killed half-way finds the source's state (`_reconcile`)."""
        path = self._capture_journal(rec.sandbox_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"layers": rec.layers, **state}))
        os.replace(tmp, path)

    async def _capture(self, rec: SandboxRecord) -> str:
        """Checkpoint a running sandbox, seal its upper into a layer, restore it in place.

        Returns the memory artifact's digest. The caller holds the sandbox's lock and has set its
        transient state. A checkpoint the runtime refuses leaves the source running (Unavailable);
        once the checkpoint exists the source is never lost: if bringing it back fails it is parked
        as a paused sandbox with its full state (`_park`).
        """
        sid = rec.sandbox_id
        tmp_image = self.paths.sandbox_dir(sid) / "capture"
        shutil.rmtree(tmp_image, ignore_errors=True)
        slot = self._slots[sid]
        t0 = time.monotonic()
        try:
            await self._checkpoint(rec, tmp_image)
        except Unavailable:  # nothing happened: the caller resets the state
            raise
        except Exception as e:  # noqa: BLE001 - the source died under the checkpoint
            raise await self._lose(rec, e) from e
        t_ckpt = time.monotonic() - t0
        mem: str | None = None
        try:
            self._journal(rec, image=str(tmp_image))
            await self.rootfs.unmount(sid, keep_disk=True)  # the upper is sealed from the disk image
            layer = await self.artifacts.seal_upper(self.rootfs.upper_path(sid))
            if layer:
                rec.layers = [layer] + rec.layers
                self._journal(rec, image=str(tmp_image))
                await self.store.put_sandbox(rec)
            mem = await self.artifacts.seal_memory(tmp_image)
            self._pin(mem)
            self._journal(rec, memory=mem)
            t_seal = time.monotonic() - t0 - t_ckpt
            # Same id, same slot (guest addressing is identical anyway), fresh upper on the new chain.
            await self.network.deactivate(slot)
            await self._bring_up(rec, restore_from=self.artifacts.memory_dir(mem),
                                 restore_token=rec.envd_access_token, slot=slot)
            log.info("captured %s: checkpoint %.3fs, seal %.3fs, source back after %.3fs (layer %s)", sid,
                     t_ckpt, t_seal, time.monotonic() - t0, layer[:12] if layer else "-")
        except Exception as e:  # noqa: BLE001
            if mem is not None:
                self._unpin_memory(mem)
            raise await self._park(rec, tmp_image, mem, e) from e
        finally:
            self._capture_journal(sid).unlink(missing_ok=True)
        await self.store.put_sandbox(rec)
        return mem

    async def _park(self, rec: SandboxRecord, image: Path, mem: str | None, why: Exception) -> AgentEnvError:
        """The source was checkpointed but could not be brought back: keep it as a paused sandbox with
        that image (its memory, processes and files), resumable like any pause. Never LOST."""
        sid = rec.sandbox_id
        log.error("sandbox %s could not be restored after its capture (%s); parking it paused", sid, why)
        self._keep_logs(sid, "capture")
        await asyncio.shield(self._stop_quietly(sid))
        await self._release_slot(sid)
        try:
            await self.rootfs.unmount(sid)
        except Exception:  # noqa: BLE001
            log.exception("unmount of %s failed", sid)
        try:
            await self._image_as_pause(sid, image, mem)
        except OSError as e:
            raise await self._lose(rec, e) from e
        rec.state, rec.pause_mode = SandboxState.PAUSED, "full"
        await self.store.put_sandbox(rec)
        return RuntimeFailure(f"Sandbox {sid} was captured but could not be restarted ({why}); it is paused "
                              "with its full state: resume it", error_code="sandbox_parked")

    async def _image_as_pause(self, sandbox_id: str, image: Path | None, mem: str | None) -> None:
        """Make a capture's image the sandbox's pause checkpoint: the sealed memory artifact `mem`
        (it stays in the cache: hard-linked) or else the unsealed image dir (moved)."""
        ckpt = self._checkpoint_dir(sandbox_id)
        shutil.rmtree(ckpt, ignore_errors=True)
        if mem is not None:
            await asyncio.to_thread(shutil.copytree, self.artifacts.memory_dir(mem), ckpt, copy_function=os.link)
        else:
            assert image is not None
            os.replace(image, ckpt)

    async def _stop_quietly(self, sandbox_id: str) -> None:
        try:
            await self.runtime_for(sandbox_id).stop(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("stop of %s failed", sandbox_id)

    async def _locked_capture(self, sandbox_id: str, team_id: str | None, op: str) -> tuple[SandboxRecord, str]:
        """Under the sandbox's lock: check `op` is legal, capture, and land in its final state.

        A refusal before anything happened (open TCP connections) leaves the sandbox as it was.
        Returns the record and the pinned memory digest (the caller unpins it).
        """
        async with self.lifecycle.lock(sandbox_id):
            rec = self._get_live(sandbox_id, team_id)
            transient, final = check(rec.state, op, sandbox_id)
            before = rec.state
            rec.state = transient
            try:
                mem = await self._capture(rec)
            except Unavailable:  # refused before anything happened
                rec.state = before
                raise
            rec.state = final
            await self.store.put_sandbox(rec)
            return rec, mem

    def _pin(self, digest: str) -> None:
        self._pinned_memory[digest] = self._pinned_memory.get(digest, 0) + 1

    def _unpin_memory(self, digest: str) -> None:
        n = self._pinned_memory.get(digest, 0) - 1
        if n <= 0:
            self._pinned_memory.pop(digest, None)
        else:
            self._pinned_memory[digest] = n

    async def _pin_memory(self, digest: str) -> Path:
        self._pin(digest)
        try:
            return await self.artifacts.ensure_memory(digest)
        except BaseException:
            self._unpin_memory(digest)
            raise

    async def fork_sandbox(self, sandbox_id: str, *, team_id: str, count: int | None = None,
                           timeout: int | None = None) -> list[SandboxRecord | AgentEnvError]:
        """Capture the source once, resume it under the same id, start `count` children from the capture."""
        count = 1 if count is None else count
        if not 1 <= count <= self.settings.fork_max_count:
            raise BadRequest(f"count must be between 1 and {self.settings.fork_max_count}")
        timeout = self.settings.default_timeout_s if timeout is None else timeout
        self._check_timeout(timeout)
        source = self._get_live(sandbox_id, team_id)
        async with self._admission(source.team_id, count):
            return await self._fork_admitted(sandbox_id, team_id, count, timeout)

    async def _fork_admitted(self, sandbox_id: str, team_id: str, count: int,
                             timeout: int) -> list[SandboxRecord | AgentEnvError]:
        t0 = time.monotonic()
        rec, mem = await self._locked_capture(sandbox_id, team_id, "fork")
        source_back = time.monotonic() - t0
        try:
            children = [self._child_of(rec, timeout) for _ in range(count)]
            mem_dir = self.artifacts.memory_dir(mem)

            async def one(child: SandboxRecord) -> SandboxRecord | AgentEnvError:
                try:
                    await self._spawn(child, restore_from=mem_dir, restore_token=rec.envd_access_token)
                    return child
                except AgentEnvError as e:
                    return e
                except Exception as e:  # noqa: BLE001
                    return RuntimeFailure(f"fork child failed to start: {e}")

            results = await asyncio.gather(*(one(c) for c in children))
        finally:
            self._unpin_memory(mem)
        ok = sum(1 for r in results if isinstance(r, SandboxRecord))
        log.info("forked %s into %d/%d children in %.3fs (source paused %.3fs)", sandbox_id, ok, count,
                 time.monotonic() - t0, source_back)
        await self.gc_artifacts()
        return list(results)

    def _child_of(self, rec: SandboxRecord, timeout: int) -> SandboxRecord:
        now = utcnow()
        return replace(
            rec, sandbox_id=new_sandbox_id(), state=SandboxState.CREATING, started_at=now,
            end_at=now + timedelta(seconds=timeout), envd_access_token=secrets.token_urlsafe(24),
            traffic_access_token=secrets.token_urlsafe(24) if rec.traffic_access_token else None,
            metadata=dict(rec.metadata), env_vars=dict(rec.env_vars), layers=list(rec.layers),
            parent_id=rec.sandbox_id, slot=None, pause_mode=None, created_at=now)

    # ------------------------------------------------------------------ snapshots

    async def create_snapshot(self, sandbox_id: str, *, team_id: str, name: str | None = None,
                              memory: bool = True) -> SnapshotRecord:
        """Commit the sandbox's current state (filesystem layers, + memory unless filesystem-only)."""
        if name is not None and not (0 < len(name) <= 128 and name.isprintable()):
            raise BadRequest("snapshot name must be 1-128 printable characters")
        self._get_live(sandbox_id, team_id)
        rec, mem = await self._locked_capture(sandbox_id, team_id, "snapshot")
        try:
            size = sum(self.artifacts.local.blob_path("layers", d).stat().st_size for d in rec.layers)
            if memory:
                size += self.artifacts.local.blob_path("memory", mem).stat().st_size
            snap = SnapshotRecord(
                snapshot_id=new_snapshot_id(), team_id=rec.team_id, names=[name] if name else [],
                source_sandbox_id=sandbox_id, template_id=rec.template_id, image=rec.image,
                layers=list(rec.layers), memory_digest=mem if memory else None, cpu_count=rec.cpu_count,
                memory_mb=rec.memory_mb, disk_mb=rec.disk_mb, env_vars=dict(rec.env_vars),
                metadata=dict(rec.metadata), size_bytes=size, restore_token=rec.envd_access_token,
                network={"allow_internet_access": rec.allow_internet_access, "network": rec.network},
                runtime=rec.runtime)
            try:
                await self.artifacts.publish(snap)
            except Exception as e:  # noqa: BLE001 - the manifest goes last: nothing half-published is visible
                log.error("publishing snapshot of %s failed: %s", sandbox_id, e)
                raise Unavailable(f"Snapshot of sandbox {sandbox_id} was not taken: the snapshot store is "
                                  f"unreachable ({e}); the sandbox keeps running",
                                  error_code="snapshot_store_unavailable", headers={"Retry-After": "5"}) from e
            await self.store.put_snapshot(snap)
        finally:
            self._unpin_memory(mem)
        await self.gc_artifacts()
        log.info("snapshot %s of %s committed (%d layers, %s, %d bytes)", snap.snapshot_id, sandbox_id,
                 len(snap.layers), "memory" if memory else "filesystem only", snap.size_bytes)
        return snap

    async def _find_snapshot(self, id_or_name: str, team_id: str | None) -> SnapshotRecord | None:
        """The snapshot store's manifest is the truth (other nodes may have deleted or added one);
        the local catalog is only a cache of it."""
        snap = await self.store.get_snapshot(id_or_name)
        if snap is not None and await self.artifacts.store.get_manifest(snap.snapshot_id) is None:
            log.info("snapshot %s was deleted from the store elsewhere; dropping it here", snap.snapshot_id)
            await self.store.delete_snapshot(snap.snapshot_id)
            snap = None
        if snap is None:
            snap = await self.artifacts.find_manifest(id_or_name)
            if snap is not None:
                await self.store.put_snapshot(snap)  # catalog it on this node
        if snap is not None and team_id is not None and snap.team_id != team_id:
            return None
        return snap

    async def list_snapshots(self, *, team_id: str, sandbox_id: str | None = None,
                             name: str | None = None) -> list[SnapshotRecord]:
        by_id: dict[str, SnapshotRecord] = {}
        for m in await self.artifacts.store.list_manifests():
            s = SnapshotRecord.from_manifest(m)
            if s.team_id == team_id:
                by_id[s.snapshot_id] = s
        for s in await self.store.list_snapshots(team_id=team_id):
            if s.snapshot_id not in by_id:  # deleted from the store by another node
                await self.store.delete_snapshot(s.snapshot_id)
        out = [s for s in by_id.values()
               if (sandbox_id is None or s.source_sandbox_id == sandbox_id)
               and (name is None or name == s.snapshot_id or name in s.names)]
        return sorted(out, key=lambda s: (s.created_at, s.snapshot_id))

    async def get_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> SnapshotRecord:
        snap = await self._find_snapshot(snapshot_id_or_name, team_id)
        if snap is None:
            raise NotFound(f"snapshot '{snapshot_id_or_name}' not found")
        return snap

    async def delete_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> None:
        snap = await self.get_snapshot(snapshot_id_or_name, team_id=team_id)
        others = [s for s in await self.list_snapshots(team_id=team_id) if s.snapshot_id != snap.snapshot_id]
        # Other teams' snapshots may share layers too (content addressing): keep those blobs.
        for m in await self.artifacts.store.list_manifests():
            if m.get("teamID") != team_id and m.get("snapshotID") != snap.snapshot_id:
                others.append(SnapshotRecord.from_manifest(m))
        await self.artifacts.delete_from_store(snap, others)
        await self.store.delete_snapshot(snap.snapshot_id)
        await self.gc_artifacts()
        log.info("deleted snapshot %s", snap.snapshot_id)

    # ------------------------------------------------------------------ resolver for the traffic proxy

    async def resolve(self, sandbox_id: str) -> Route | None:
        """Where traffic for a sandbox goes; wakes it first when it is paused with auto-resume on.

        Raises AgentEnvError when a wake was attempted and failed (the proxy answers 503).
        """
        rec = self._records.get(sandbox_id)
        if rec is None:
            return None
        # Traffic arriving during a short capture/resume waits for it rather than failing; during
        # the pause of an auto-resume sandbox it waits for the pause, then wakes it.
        deadline = time.monotonic() + 60
        while (rec.state in _TRANSIENT or (rec.state == SandboxState.PAUSING and rec.auto_resume)) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            rec = self._records.get(sandbox_id)
            if rec is None:
                return None
        if self._wakeable(rec):
            await self.wake_sandbox(sandbox_id)
            rec = self._records.get(sandbox_id)
            if rec is None:
                return None
        slot = self._slots.get(sandbox_id)
        running = rec.state == SandboxState.RUNNING
        return Route(sandbox_id, slot.host_ip if (slot and running) else None,
                     "running" if running else rec.state.value, rec.envd_access_token, rec.traffic_access_token)

    @staticmethod
    def _wakeable(rec: SandboxRecord) -> bool:
        """Paused with its memory (a filesystem-only pause cannot be woken transparently: it reboots)."""
        return rec.state == SandboxState.PAUSED and rec.auto_resume and rec.pause_mode != "filesystem"

    async def wake_sandbox(self, sandbox_id: str) -> None:
        """Resume a paused auto-resume sandbox because traffic arrived for it (single flight).

        Every request that finds the sandbox paused awaits the same resume task; the task is
        shielded, so a client that gives up does not cancel the resume for the others.
        """
        task = self._waking.get(sandbox_id)
        if task is None:
            task = asyncio.create_task(self.resume_on_traffic(sandbox_id), name=f"wake-{sandbox_id}")
            self._waking[sandbox_id] = task
            task.add_done_callback(lambda t: self._waking.pop(sandbox_id, None) if self._waking.get(
                sandbox_id) is t else None)
        await asyncio.shield(task)

    async def resume_on_traffic(self, sandbox_id: str) -> bool:
        """The one resume behind a wake (run by `wake_sandbox`); False if there was nothing to do.

        Public so observability can wrap it (a `resumed` event with reason `traffic`)."""
        async with self.lifecycle.lock(sandbox_id):
            rec = self._records.get(sandbox_id)
            if rec is None or not self._wakeable(rec):
                return False  # resumed, killed or changed meanwhile by someone else
            # The sandbox gets the same time to live as its last run had (its create/connect
            # timeout plus any extension), so an auto-pause sandbox keeps its rhythm.
            ran = int((rec.end_at - rec.started_at).total_seconds())
            timeout = min(ran if ran > 0 else self.settings.default_timeout_s, self.settings.max_timeout_s)
            t0 = time.monotonic()
            await self._resume_locked(rec, timeout)
            log.info("woke sandbox %s on traffic in %.3fs (auto-resume)", sandbox_id, time.monotonic() - t0)
            return True

    def running_routes(self) -> Iterable[Route]:
        for sid, rec in self._records.items():
            slot = self._slots.get(sid)
            if rec.state == SandboxState.RUNNING and slot is not None:
                yield Route(sid, slot.host_ip, "running", rec.envd_access_token, rec.traffic_access_token)
