"""The sandbox host: what it takes to run one sandbox on this node, and to take it apart.

Every lifecycle operation (create, fork, pause/resume, snapshot) and every builder (warm images,
template builds) brings sandboxes up, captures and tears them down through this one layer:

- bring-up  = rootfs mount + network slot (in parallel) → spec → start or restore → slot up →
              `/init`, sent until envd answers it (`bring_up`; `prepare` + `launch`, which then
              waits for envd's health, + `init_envd` separately: the pool's fill and take)
- capture   = checkpoint (`checkpoint`) + seal (`seal`: unmount → upper into a layer → memory
              image into an artifact); `capture` is both, in that order. Where the runtime can
              (`traits.captures_running`), `checkpoint_running` + `seal_copy` instead: frozen for the
              memory image and a copy of the upper, then thawed: the sandbox keeps running
- teardown  = close host-side connections → runtime stop → slot release → rootfs release
- park      = an idle sandbox frozen whole in the host's cgroup freezer (`park`/`unpark`: the pool's)
- drain     = `quiesce` (the proxy's connections) and the in-sandbox reset before a checkpoint

It knows nothing of sandbox states, teams or quotas: those are the orchestrator's (`lifecycle`,
`admission`). It holds what a running sandbox has on the host: its runtime and network slot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv import constants
from agentenv.constants import DEFAULT_HOME, DEFAULT_USER
from agentenv.errors import AgentEnvError, CaptureRefused, RuntimeFailure, Unavailable
from agentenv.models import SandboxRecord
from agentenv.network.policy import EgressPolicy, parse_policy
from agentenv.network.slots import NetSlot
from agentenv.orchestrator import continuity, envd_client
from agentenv.orchestrator.trace import span, timed
from agentenv.runtimes import cgroups
from agentenv.runtimes import select as runtime_select
from agentenv.runtimes.base import Runtime, SandboxSpec
from agentenv.storage.artifacts import ArtifactCache

log = logging.getLogger("agentenv.orchestrator")


@dataclass
class Sealed:
    """What `seal` made of a stopped sandbox: its upper as a layer (None: nothing changed) and its
    memory image as an artifact (None: no image given)."""

    layer: str | None
    memory: str | None


def policy_of(rec: SandboxRecord) -> EgressPolicy:
    return parse_policy(rec.allow_internet_access, rec.network)


class GcIncomplete(RuntimeFailure):
    """`SandboxHost.gc` removed what it could; these sandboxes' runtime stop failed."""

    def __init__(self, removed: dict[str, list[str]], failed: list[str]) -> None:
        super().__init__(f"gc could not stop {len(failed)} sandbox(es): {'; '.join(failed)[:2000]}")
        self.removed = removed
        self.failed = failed


class SandboxHost:
    def __init__(self, settings: Settings, images, rootfs, network, runtime: Runtime, artifacts: ArtifactCache,
                 *, extra_runtimes: Iterable[Runtime] = ()) -> None:
        """`runtime` runs the sandboxes that ask for nothing else; `extra_runtimes` (by name) those whose
        template or create request names them."""
        self.settings = settings
        self.paths = settings.paths
        self.images = images
        self.rootfs = rootfs
        self.network = network
        self.artifacts = artifacts
        self.runtime = runtime
        self.runtimes: dict[str, Runtime] = {runtime.name: runtime, **{r.name: r for r in extra_runtimes}}
        # sandbox id -> the runtime running it (every sandbox brought up, incl. template-build and
        # warm-image ones that have no record); a sandbox keeps its runtime for life.
        self.runtime_of: dict[str, str] = {}
        self.slots: dict[str, NetSlot] = {}
        self.host_token = self._load_host_token()
        self._pinned_memory: dict[str, int] = {}  # memory digests in use by restores in flight
        self._pinned_layers: dict[str, int] = {}  # layers of captures not committed yet
        self._rules: dict[str, EgressPolicy] = {}   # slots whose egress rules `launch` installs
        # Restored sandboxes' time away, until their next `/init` tells envd (`continuity`).
        self._away: dict[str, float] = {}
        # Awaited with a sandbox id before its connections must be gone (kill, checkpoint).
        self.on_before_stop: list[Callable[[str], Awaitable[None]]] = []
        # Teardowns and stand-downs in flight, by sandbox: they finish even when their caller is
        # cancelled, the next step on the same sandbox waits for them, and `close` too.
        self._background: dict[str, tuple[str, asyncio.Task[None]]] = {}  # id -> (what, task)

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

    def runtime_for(self, sandbox_id: str, recorded: str | None = None) -> Runtime:
        """The runtime running (or that ran) `sandbox_id`: the one it was brought up with, else `recorded`
        (its record's)."""
        return self.runtime_named(self.runtime_of.get(sandbox_id) or recorded)

    def shared_rootfs(self, sandbox_id: str) -> Path | None:
        """The host's view of a brought-up sandbox's root filesystem, where its runtime keeps the two
        coherent (`RuntimeTraits.shares_rootfs`); None otherwise."""
        name = self.runtime_of.get(sandbox_id)
        if name is None or not self.runtime_named(name).traits.shares_rootfs:
            return None
        return self.rootfs.rootfs_path(sandbox_id)

    async def close(self) -> None:
        while self._background:  # e.g. a cancelled caller's teardown (shutdown during a warm build)
            await asyncio.gather(*(t for _, t in self._background.values()), return_exceptions=True)
        for rt in self.runtimes.values():
            await rt.close()   # e.g. Firecracker: API clients, its VM store mount

    # ------------------------------------------------------------------ memory images in use

    def pin(self, digest: str) -> None:
        self._pinned_memory[digest] = self._pinned_memory.get(digest, 0) + 1

    def unpin(self, digest: str) -> None:
        n = self._pinned_memory.get(digest, 0) - 1
        if n <= 0:
            self._pinned_memory.pop(digest, None)
        else:
            self._pinned_memory[digest] = n

    def pinned(self) -> set[str]:
        return set(self._pinned_memory)

    def pin_layer(self, digest: str) -> None:
        """Keep a layer from GC while no record or snapshot names it yet (a capture being committed)."""
        self._pinned_layers[digest] = self._pinned_layers.get(digest, 0) + 1

    def unpin_layer(self, digest: str) -> None:
        n = self._pinned_layers.get(digest, 0) - 1
        if n <= 0:
            self._pinned_layers.pop(digest, None)
        else:
            self._pinned_layers[digest] = n

    def pinned_layers(self) -> set[str]:
        return set(self._pinned_layers)

    async def pin_memory(self, digest: str) -> Path:
        """The memory image `digest` (pulled if this node lacks it), kept from GC until `unpin`."""
        self.pin(digest)
        try:
            return await self.artifacts.ensure_memory(digest)
        except BaseException:
            self.unpin(digest)
            raise

    # ------------------------------------------------------------------ spec

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.paths.sandbox_dir(sandbox_id)

    def checkpoint_dir(self, sandbox_id: str) -> Path:
        """Where a paused sandbox keeps its memory image."""
        return self.sandbox_dir(sandbox_id) / "checkpoint"

    def lowers(self, rec: SandboxRecord) -> list[Path]:
        return [self.artifacts.layer_dir(d) for d in rec.layers] + [self.images.image_rootfs(rec.image)]

    def sandbox_env(self, rec: SandboxRecord) -> dict[str, str]:
        env = {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": rec.sandbox_id, "E2B_TEMPLATE_ID": rec.template_id}
        env.update(rec.env_vars)
        return env

    def spec(self, rec: SandboxRecord, rootfs: Path, slot: NetSlot, tools: Path) -> SandboxSpec:
        env = dict(self.images.envd_env())
        env["AGENTENV_ENVD_HOST_TOKEN"] = self.host_token
        env["AGENTENV_ENVD_MAX_UPLOAD"] = str(self.settings.max_upload_bytes)
        if self.settings.memory_headroom_mb > 0:
            env["AGENTENV_ENVD_MEMORY_LIMIT_MB"] = str(rec.memory_mb)  # envd's OOM guard (envd/oom.py)
        return SandboxSpec(
            sandbox_id=rec.sandbox_id, rootfs=rootfs, tools_dir=tools, slot=slot,
            bundle_dir=self.sandbox_dir(rec.sandbox_id) / "bundle",
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, hostname="sandbox",
            args=list(self.images.envd_argv()), env=env, disk_mb=rec.disk_mb, lowers=self.lowers(rec),
            nofile=self.settings.sandbox_nofile, memory_headroom_mb=self.settings.memory_headroom_mb,
            boot_id_file=self.sandbox_dir(rec.sandbox_id) / continuity.BOOT_ID_FILE)

    async def attach_vm_boot(self, spec: SandboxSpec) -> None:
        """MicroVM runtimes that boot what the spec names (Firecracker) get the guest image here."""
        rt = self.runtime_for(spec.sandbox_id)
        if rt.traits.boots_from_spec and runtime_select.VM_GUEST_IMAGES is not None:
            spec.vm = await runtime_select.VM_GUEST_IMAGES(self.paths.images, spec)

    # ------------------------------------------------------------------ bring-up

    async def prepare(self, rec: SandboxRecord, slot: NetSlot | None = None) -> tuple[Path, NetSlot]:
        """The sandbox's layers present, its rootfs mounted and a network slot (in parallel; `slot`:
        keep that one, a capture's source restored in place). Under a runtime that is not a VM the
        slot's egress rules are installed by `launch`, alongside the start or restore (`_rules`)."""
        sid = rec.sandbox_id
        await timed("host.settled", sid, self.settled(sid))  # a pause's stand-down still in flight
        await timed("host.layers", sid, asyncio.gather(*(self.artifacts.ensure_layer(d) for d in rec.layers)))
        policy, later = policy_of(rec), not self.runtime_named(rec.runtime).traits.vm
        mount = timed("rootfs.mount", sid, self.rootfs.prepare(sid, self.lowers(rec), disk_mb=rec.disk_mb))
        if slot is None:
            rootfs, slot = await asyncio.gather(mount, timed("network.slot", sid, self.network.allocate(
                sid, allow_internet=policy.may_egress, policy=policy, rules=not later)))
            if later:
                self._rules[sid] = policy
        else:
            rootfs = await mount
        self.slots[rec.sandbox_id] = slot
        return rootfs, slot

    async def launch(self, rec: SandboxRecord, rootfs: Path, slot: NetSlot, tools: Path, *,
                     restore_from: Path | None, new_boot: bool, wait: bool = True) -> None:
        """Start (or restore) the sandbox on a prepared rootfs + slot and wait until envd answers
        (`wait`; else the caller's `init_envd`, sent until envd answers, waits for it).

        A start, or `new_boot`, is a new boot_id; a restore continues its image's (`continuity.write_boot_id`)."""
        rt = self.runtime_named(rec.runtime)
        self.runtime_of[rec.sandbox_id] = rt.name
        spec = self.spec(rec, rootfs, slot, tools)
        spec.bundle_dir.mkdir(parents=True, exist_ok=True)
        continuity.write_boot_id(self.sandbox_dir(rec.sandbox_id), None if new_boot else restore_from)
        await self.attach_vm_boot(spec)

        async def run() -> None:
            if restore_from is None:
                with span("runtime.start", rec.sandbox_id):
                    await rt.start(spec)
            else:
                with span("runtime.restore", rec.sandbox_id):
                    await rt.restore(spec, restore_from)
                away = continuity.time_away(restore_from) if rt.traits.restore_advances_clock else None
                if away is not None:
                    self._away[rec.sandbox_id] = away

        async def rules(policy: EgressPolicy) -> None:
            with span("network.rules", rec.sandbox_id):
                await self.network.install_rules(slot, policy)

        policy = self._rules.pop(rec.sandbox_id, None)
        if policy is None:
            await run()
        else:  # nothing leaves the slot before `activate`: its rules go in while the runtime starts
            done = await asyncio.gather(run(), rules(policy), return_exceptions=True)
            for r in done:
                if isinstance(r, BaseException):
                    raise r
        with span("network.activate", rec.sandbox_id):  # gVisor's guest link has eth0's fixed MAC
            await self.network.activate(slot, guest_mac=None if rt.traits.vm else constants.GUEST_MAC)
        if not wait:
            return
        with span("envd.wait_healthy", rec.sandbox_id):
            await envd_client.wait_healthy(slot.host_ip, is_alive=lambda: rt.is_alive(rec.sandbox_id),
                                           timeout=rt.traits.envd_timeout_s)

    async def init_envd(self, rec: SandboxRecord, slot: NetSlot, restore_token: str | None) -> None:
        """`/init`: this sandbox's access token, environment and default user (a restore: re-init, and
        how long it was away: `continuity`). Sent until envd answers it and given up as soon as the
        sandbox is gone: right after `launch(wait=False)` it is the readiness check (no health check's
        round trip before it), and a pooled sandbox may have died while it waited."""
        sid = rec.sandbox_id
        rt = self.runtime_for(sid, rec.runtime)
        with span("envd.init", sid):
            await envd_client.init(slot.host_ip, access_token=rec.envd_access_token, env_vars=self.sandbox_env(rec),
                                   host_token=self.host_token, current_token=restore_token,
                                   default_user=DEFAULT_USER, default_workdir=DEFAULT_HOME,
                                   away_s=self._away.pop(sid, None), timeout=rt.traits.envd_timeout_s,
                                   is_alive=lambda: rt.is_alive(sid))

    async def bring_up(self, rec: SandboxRecord, *, restore_from: Path | None, restore_token: str | None,
                       slot: NetSlot | None = None, new_boot: bool = False) -> None:
        """Mount the rootfs, take a network slot, start or restore, wait for envd, (re)init it."""
        tools = await self.images.ensure_tools()
        with span("host.prepare", rec.sandbox_id):
            rootfs, slot = await self.prepare(rec, slot)
        await self.launch(rec, rootfs, slot, tools, restore_from=restore_from, new_boot=new_boot, wait=False)
        await self.init_envd(rec, slot, restore_token)

    # ------------------------------------------------------------------ drain, capture

    async def quiesce(self, sandbox_id: str) -> None:
        """Close every host-side connection into the sandbox (the proxy's pool, streams).

        Before a checkpoint the runtime resets what the sandbox still holds (`checkpoint`).
        """
        with span("host.quiesce", sandbox_id):
            for cb in self.on_before_stop:
                try:
                    with span(f"quiesce.{getattr(cb, '__name__', 'hook')}", sandbox_id):
                        await cb(sandbox_id)
                except Exception:  # noqa: BLE001
                    log.exception("before-stop hook failed for %s", sandbox_id)

    async def holds_connections(self, sandbox_id: str) -> bool:
        """Whether programs in the sandbox hold TCP connections (envd's view of its /proc/net/tcp).

        gVisor resets them at a checkpoint (`--net-disconnect-ok`); the runtime resets them first,
        while the sandbox runs, so event-loop servers see the reset as an ordinary one. Any doubt
        (envd unreachable) counts as yes: that costs one extra checkpoint, never the sandbox.
        """
        slot = self.slots.get(sandbox_id)
        if slot is None:
            return False
        try:
            conns = await envd_client.blocking_connections(slot.host_ip, host_token=self.host_token)
        except Exception as e:  # noqa: BLE001
            log.warning("envd connection check of %s failed: %s", sandbox_id, e)
            return True
        return any(c["state"] != "TIME_WAIT" for c in conns)

    async def checkpoint(self, rec: SandboxRecord, image_dir: Path, *, leave_frozen: bool = False) -> None:
        """Checkpoint a running sandbox into `image_dir` and stop it (`leave_frozen`: where the runtime
        can, leave it frozen for `stand_down_later` to stop; a pause answers without waiting for that).

        If the runtime cannot take the image and the sandbox still runs, raise Unavailable (503)
        with the reason: nothing happened. Any other error means the sandbox died on the way (the
        caller decides what that costs: `lose` for a user's sandbox).
        """
        sid = rec.sandbox_id
        rt = self.runtime_for(sid, rec.runtime)
        await self.quiesce(sid)
        kwargs = {}
        if leave_frozen and rt.traits.may_stay_frozen:
            kwargs["leave_frozen"] = True
        if rt.traits.resets_connections:  # gVisor >= 20240729 (VMs save TCP state with the guest kernel)
            with span("envd.connections", sid):
                kwargs["reset_connections"] = await self.holds_connections(sid)
        began = time.time()
        try:
            with span("runtime.checkpoint", sid):
                await rt.checkpoint(sid, image_dir, **kwargs)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(image_dir, ignore_errors=True)
            if isinstance(e, CaptureRefused) or await rt.is_alive(sid):
                msg = e.message if isinstance(e, AgentEnvError) else str(e)
                log.warning("checkpoint of %s refused, sandbox untouched: %s", sid, msg)
                raise Unavailable(f"Sandbox {sid} could not be captured: {msg}", error_code="capture_failed",
                                  headers={"Retry-After": "5"}) from e
            raise
        continuity.record(self.sandbox_dir(sid), image_dir, began)

    def captures_running(self, rec: SandboxRecord) -> bool:
        """Whether the sandbox's runtime can capture it and leave it running (`checkpoint_running`)."""
        return self.settings.capture_running and self.runtime_for(rec.sandbox_id, rec.runtime).traits.captures_running

    def unpin_layers(self, digests: Iterable[str]) -> None:
        for d in digests:
            self.unpin_layer(d)

    def unpin_sealed(self, sealed: Sealed) -> None:
        if sealed.layer:
            self.unpin_layer(sealed.layer)
        if sealed.memory:
            self.unpin(sealed.memory)

    async def seal(self, sandbox_id: str, image: Path | None, *, keep_disk: bool = False,
                   on_layer: Callable[[str | None], Awaitable[None]] | None = None) -> Sealed:
        """The one checkpoint → unmount → seal sequence's second half, for a stopped sandbox: unmount
        its rootfs (`keep_disk`: the upper stays readable for a restore in place), seal the upper into
        a content-addressed layer, then the memory image `image` (if any) into an artifact.
        `on_layer` runs between the two (a capture records the new layer before the slow part)."""
        await self.settled(sandbox_id)
        with span("rootfs.unmount", sandbox_id):
            await self.rootfs.unmount(sandbox_id, keep_disk=keep_disk)
        with span("seal.upper", sandbox_id):
            layer = await self.artifacts.seal_upper(self.rootfs.upper_path(sandbox_id))
        # No record names the layer until the caller takes the result: pinned while the memory image
        # is sealed, or a GC in between would find it unclaimed once that seal is over.
        if layer:
            self.pin_layer(layer)
        try:
            if on_layer is not None:
                await on_layer(layer)
            mem = None
            if image is not None:
                with span("seal.memory", sandbox_id):
                    mem = await self.artifacts.seal_memory(image)
        finally:
            if layer:
                self.unpin_layer(layer)  # no await until the caller records it (`gc`'s contract)
        return Sealed(layer, mem)

    async def capture(self, rec: SandboxRecord, image_dir: Path) -> Sealed:
        """Checkpoint + seal a sandbox nobody else uses (warm image, template build): its image is kept
        as artifacts; the caller tears the sandbox down."""
        await self.checkpoint(rec, image_dir)
        return await self.seal(rec.sandbox_id, image_dir)

    # ------------------------------------------------------------------ teardown

    def _in_background(self, sandbox_id: str, work: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=f"{what}-{sandbox_id}")
        self._background[sandbox_id] = (what, task)
        task.add_done_callback(lambda t: self._background.pop(sandbox_id, None)
                               if self._background.get(sandbox_id, ("", None))[1] is t else None)
        return task

    async def settled(self, sandbox_id: str) -> None:
        """Wait for the sandbox's stand-down or teardown in flight, if any (its errors are logged)."""
        _, task = self._background.get(sandbox_id, ("", None))
        if task is not None:
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    def park(self, sandbox_id: str) -> bool:
        """Freeze a running sandbox whole, runtime included, in the host's cgroup freezer (a pooled
        sandbox while it waits): it takes no CPU until `unpark`, and keeps its memory, slot and
        processes. False if its runtime's processes have no freezer (then it runs as before). A
        parked sandbox's stop and teardown thaw it first (`cgroups.kill_sandbox`)."""
        return cgroups.freeze(sandbox_id, True)

    def unpark(self, sandbox_id: str) -> None:
        cgroups.freeze(sandbox_id, False)

    async def teardown(self, sandbox_id: str, recorded_runtime: str | None = None) -> None:
        """Release everything a sandbox holds; each step idempotent and independent of the others.

        The work runs in a task of its own: a caller cancelled meanwhile (a shutdown during a warm
        build) does not cut it short, `close` waits for it, and a second caller joins it."""
        what, task = self._background.get(sandbox_id, ("", None))
        if what != "teardown":  # none in flight (a stand-down may be: the teardown follows it)
            task = self._in_background(sandbox_id, self._teardown(sandbox_id, recorded_runtime, after=task),
                                       "teardown")
        await asyncio.shield(task)

    def stand_down_later(self, sandbox_id: str, recorded_runtime: str | None = None) -> None:
        """A sandbox left frozen by its pause's checkpoint (`checkpoint(..., leave_frozen=True)`):
        stop it, release its slot and unmount its rootfs after the pause has answered. Whatever
        touches the sandbox next (`prepare`, `seal`, `teardown`) waits for this first."""
        self._in_background(sandbox_id, self._stand_down(sandbox_id, recorded_runtime), "stand-down")

    async def _stand_down(self, sandbox_id: str, recorded_runtime: str | None) -> None:
        try:
            with span("runtime.stop", sandbox_id):
                await self.stop(sandbox_id, recorded_runtime)
        except Exception:  # noqa: BLE001 - a resume's restore says so if the container is still there
            log.exception("stopping the paused sandbox %s failed", sandbox_id)
            return  # its rootfs stays mounted under the frozen container; `teardown` stops it again
        await asyncio.gather(self.release_slot(sandbox_id, stopped=self.runtime_for(sandbox_id, recorded_runtime).name),
                             self._unmount_quietly(sandbox_id))

    async def _unmount_quietly(self, sandbox_id: str) -> None:
        try:
            with span("rootfs.unmount", sandbox_id):
                await self.rootfs.unmount(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("rootfs unmount failed for %s", sandbox_id)

    async def _teardown(self, sandbox_id: str, recorded_runtime: str | None,
                        after: asyncio.Task[None] | None = None) -> None:
        if after is not None:  # a stand-down in flight
            await asyncio.gather(after, return_exceptions=True)
        await self.quiesce(sandbox_id)
        stopped: str | None = None
        try:
            with span("runtime.stop", sandbox_id):
                rt = self.runtime_for(sandbox_id, recorded_runtime)
                await rt.stop(sandbox_id)
                stopped = rt.name
        except Exception:  # noqa: BLE001 - teardown must go on
            log.exception("runtime stop failed for %s", sandbox_id)
        self.runtime_of.pop(sandbox_id, None)
        self._away.pop(sandbox_id, None)
        # independent of each other
        await asyncio.gather(self.release_slot(sandbox_id, stopped=stopped), self._unmount_quietly(sandbox_id))
        # The sandbox dir goes last: while it exists, `agentenv gc` after a crash knows the sandbox
        # and removes whatever of it is left (a warm-image sandbox's netns has no record to find it by).
        try:
            with span("rootfs.release", sandbox_id):
                await self.rootfs.release(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("rootfs release failed for %s", sandbox_id)

    async def stop(self, sandbox_id: str, recorded_runtime: str | None = None) -> None:
        """Stop the sandbox's runtime (raises on failure)."""
        await self.runtime_for(sandbox_id, recorded_runtime).stop(sandbox_id)

    async def stop_quietly(self, sandbox_id: str, recorded_runtime: str | None = None) -> None:
        try:
            await self.stop(sandbox_id, recorded_runtime)
        except Exception:  # noqa: BLE001
            log.exception("stop of %s failed", sandbox_id)

    async def release_slot(self, sandbox_id: str, *, stopped: str | None = None) -> None:
        """The sandbox's slot goes, also one a crash left half-released (its netns without its link),
        which would refuse the sandbox's next bring-up. `stopped`: the runtime that has just stopped
        the sandbox; if it is not a VM (whose tap devices live in the slot), the slot may be reused."""
        self._rules.pop(sandbox_id, None)
        slot = self.slots.pop(sandbox_id, None)
        reuse = stopped is not None and not self.runtime_named(stopped).traits.vm
        try:
            with span("network.release", sandbox_id):
                if slot is not None:
                    await self.network.release(slot, reuse=reuse)
                else:
                    await self.network.release_id(sandbox_id)
        except Exception:  # noqa: BLE001
            log.exception("network release failed for %s", sandbox_id)

    async def stand_down(self, sandbox_id: str, recorded_runtime: str | None = None) -> None:
        """Undo a bring-up that failed but leave the sandbox's files (its paused state) as they are."""
        await self.quiesce(sandbox_id)
        await self.stop(sandbox_id, recorded_runtime)
        await self.release_slot(sandbox_id)
        await self.rootfs.unmount(sandbox_id)

    def keep_logs(self, sandbox_id: str, why: str) -> None:
        """Copy a failed sandbox's runtime log to <data>/logs/ before its dir is removed."""
        bundle = self.sandbox_dir(sandbox_id) / "bundle"
        logs = self.paths.root / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            for f in bundle.glob("*.log"):
                shutil.copyfile(f, logs / f"{sandbox_id}-{why}-{f.name}")
        except OSError:
            log.exception("could not keep logs of %s", sandbox_id)

    async def gc(self, keep: set[str], known: set[str], recorded: dict[str, str]) -> dict[str, list[str]]:
        """Remove every container, netns, mount and sandbox dir of this data dir not in `keep`.

        `known`: the ids the state store knows, `recorded`: their runtimes. Only sandboxes this data dir
        knows are candidates: another server (or a test) on the same host keeps its own sandboxes."""
        removed: dict[str, list[str]] = {"containers": [], "netns": [], "rootfs": []}
        known = set(known)
        if self.paths.sandboxes.exists():
            known |= {p.name for p in self.paths.sandboxes.iterdir() if p.is_dir()}
        owner: dict[str, Runtime] = {}
        for rt in self.runtimes.values():
            owner.update({sid: rt for sid in await rt.list_ids()})
        known |= set(owner)
        failed: list[str] = []
        for sid in sorted(known - keep):
            # stop() is idempotent and also removes the sandbox's cgroups (a failed create leaves them).
            rt = owner.get(sid) or self.runtimes.get(recorded.get(sid) or "") or self.runtime
            try:
                await rt.stop(sid)
            except Exception as e:  # noqa: BLE001 - one stray must not keep the rest (or a start) back
                log.error("gc: could not stop %s: %s", sid, e)
                failed.append(f"{sid}: {e}")
                continue
            if sid in owner:
                removed["containers"].append(sid)
        await self.network.discover()
        for sid in sorted(known - keep):
            if await self.network.release_id(sid):
                removed["netns"].append(sid)
        removed["netns"] += await self.network.drop_stale_spares()  # a killed server's spare slots
        removed["rootfs"] = list(await self.rootfs.cleanup_orphans(keep))
        if failed:
            raise GcIncomplete(removed, failed)
        return removed
