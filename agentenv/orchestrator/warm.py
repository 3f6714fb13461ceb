"""Warm images: per template, a sandbox booted once and checkpointed before `/init`.

A create from the template restores that image and runs `/init` with its own token and env,
which skips envd's cold start (most of a boot under gVisor). An image is built in the background
the first time it is missing; until it is ready, and whenever a restore of it fails, sandboxes boot
cold. The image is a layer + a memory artifact, described by `<data>/warm/<template>.json` and
keyed by everything it depends on (`key`): any change makes it stale.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentenv.models import SandboxRecord, SandboxState, TemplateRecord, utcnow
from agentenv.constants import DEFAULT_USER
from agentenv.errors import NotFound
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.ids import new_id

log = logging.getLogger("agentenv.orchestrator")


class WarmImages:
    def __init__(self, host: SandboxHost, gc_artifacts: Callable[[], Awaitable[object]]) -> None:
        self.host = host
        self.settings = host.settings
        self.paths = host.paths
        self.artifacts = host.artifacts
        self._gc_artifacts = gc_artifacts
        self.building: dict[str, asyncio.Task] = {}
        # Awaited with the template when its image is ready (the pool fills from it).
        self.on_ready: list[Callable[[TemplateRecord], Awaitable[None]]] = []

    def key(self, tmpl: TemplateRecord, tools: Path) -> str:
        """What a warm image depends on: a change to any of these makes it stale."""
        parts = [tools.name, tmpl.template_id, tmpl.image, self._image_revision(tmpl.image),
                 str(tmpl.cpu_count), str(tmpl.memory_mb),
                 str(self.settings.max_upload_bytes), str(self.settings.memory_headroom_mb), self.runtime(tmpl),
                 hashlib.sha256(self.host.host_token.encode()).hexdigest()[:16], "boot_id-mount", "tmp-on-disk", "warm-shell", "fixed-mac"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]

    def _image_revision(self, image: str) -> str:
        """The image's build and in-place revision (a cached base image brought up to date by a newer
        agentenv changes files the warm image's memory may hold)."""
        try:
            m = self.host.images.manifest(image)
        except (NotFound, OSError, ValueError):
            return ""
        return f"{m.get('digest') or m.get('build_id') or m.get('created', '')}@{m.get('revision', 0)}"

    def runtime(self, tmpl: TemplateRecord) -> str:
        """The runtime a template's warm image is made by (its own, when this node serves it)."""
        return tmpl.runtime if tmpl.runtime in self.host.runtimes else self.host.runtime.name

    def _meta_path(self, tmpl: TemplateRecord) -> Path:
        return self.paths.root / "warm" / f"{tmpl.template_id}.json"

    def meta(self, tmpl: TemplateRecord, key: str) -> dict | None:
        try:
            meta = json.loads(self._meta_path(tmpl).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("key") != key or not self.artifacts.has_memory(meta["memory"]) or not all(
                self.artifacts.layer_dir(d).is_dir() for d in meta.get("layers", [])):
            return None
        return meta

    def discard(self, tmpl: TemplateRecord) -> None:
        """The image failed to restore: drop it (it is rebuilt on the next create)."""
        self._meta_path(tmpl).unlink(missing_ok=True)

    async def lookup(self, tmpl: TemplateRecord, runtime: str) -> dict | None:
        """The template's ready image for a sandbox under `runtime`, or None (one is built meanwhile)."""
        if not self.settings.warm_start or runtime != self.runtime(tmpl):
            return None
        tools = await self.host.images.ensure_tools()
        meta = self.meta(tmpl, self.key(tmpl, tools))
        if meta is None:
            self.build_soon(tmpl)
        return meta

    async def ensure_all(self, templates: list[TemplateRecord]) -> None:
        """At server start: build what is missing for the given (public, untagged) templates."""
        tools = await self.host.images.ensure_tools()
        for tmpl in templates:
            if self.meta(tmpl, self.key(tmpl, tools)) is None:
                self.build_soon(tmpl)

    def artifacts_in_use(self) -> tuple[set[str], set[str]]:
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

    def build_soon(self, tmpl: TemplateRecord) -> None:
        if tmpl.template_id in self.building:
            return
        task = asyncio.create_task(self.build(tmpl), name=f"warm-{tmpl.template_id}")
        self.building[tmpl.template_id] = task
        task.add_done_callback(lambda _t: self.building.pop(tmpl.template_id, None))

    async def stop(self) -> None:
        for task in list(self.building.values()):
            task.cancel()
        await asyncio.gather(*self.building.values(), return_exceptions=True)

    @staticmethod
    async def _warm_shell(host_ip: str) -> None:
        """Run the login shell a command runs in once before the checkpoint, as the SDKs' commands do
        (`bash -l -c`): its binaries and profile files are then in the image's page cache, and a
        sandbox's first command costs what its later ones do (about 40 ms less under gVisor)."""
        try:
            await envd_client.warm_login_shell(host_ip, access_token=None, user=DEFAULT_USER)
        except Exception as e:  # noqa: BLE001 - an image without bash works, only colder
            log.info("warm image: no login shell warmed (%s)", e)

    async def build(self, tmpl: TemplateRecord) -> None:
        """Boot a sandbox of `tmpl` (no /init), capture it, keep its layer + memory image."""
        t0 = time.monotonic()
        host = self.host
        tools = await host.images.ensure_tools()
        key = self.key(tmpl, tools)
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=new_id("w"), template_id=tmpl.template_id, team_id="", state=SandboxState.CREATING,
            started_at=now, end_at=now, cpu_count=tmpl.cpu_count, memory_mb=tmpl.memory_mb,
            disk_mb=tmpl.disk_mb, envd_access_token="", image=tmpl.image, runtime=self.runtime(tmpl))
        sid = rec.sandbox_id
        host.runtime_named(rec.runtime)
        host.runtime_of[sid] = rec.runtime
        image = host.sandbox_dir(sid) / "capture"
        try:
            rootfs, slot = await asyncio.gather(
                host.rootfs.prepare(sid, host.lowers(rec)), host.network.allocate(sid, allow_internet=False))
            host.slots[sid] = slot
            await host.launch(rec, rootfs, slot, tools, restore_from=None, new_boot=True)
            await self._warm_shell(slot.host_ip)
            sealed = await host.capture(rec, image)
            meta = {"key": key, "template": tmpl.template_id, "layers": [sealed.layer] if sealed.layer else [],
                    "memory": sealed.memory, "created": utcnow().isoformat()}
            path = self._meta_path(tmpl)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, path)
            log.info("warm image of template %s ready in %.2fs", tmpl.template_id, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - creates keep booting cold
            log.warning("could not build the warm image of template %s: %s", tmpl.template_id, e)
            return
        finally:
            await asyncio.shield(host.teardown(sid))
            await self._gc_artifacts()
        for cb in self.on_ready:
            try:
                await cb(tmpl)
            except Exception:  # noqa: BLE001
                log.exception("warm image ready hook failed for %s", tmpl.template_id)
