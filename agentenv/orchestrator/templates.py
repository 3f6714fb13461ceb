"""Template builds (E2B's template API): names, tags, builds; the executor is `builds.py`.

A build resolves its base (an image, or another template's ready build), then runs its steps
(RUN, ENV, WORKDIR, USER, COPY) in a build sandbox of the configured runtime. After each step
that changes files the sandbox's upper is copied into a content-addressed layer and recorded in
the **step cache** under `sha256(parent key + step + files hash)`, so a later build whose prefix is
unchanged starts from the cached layer ("CACHED" in its logs) instead of re-running it.

The last phase boots a fresh sandbox on the final layers, starts the start command, waits for the
ready command to succeed, and checkpoints it: the build's result is layers + a memory image, so
creating a sandbox from the template is a restore with the start command already running.
A fresh sandbox (rather than the one that ran the steps) keeps the TCP connections the steps made
(pip, apt, git) out of the checkpoint, which this gVisor release would refuse.

On a cluster node (`publish`) a finished build uploads its layers and memory image to the shared
snapshot store before it is marked ready, so a create from it on any node pulls what it lacks; the
build records the node that holds its uploaded files and runs it (`spec["node"]`), which the
gateway routes the build's calls to (`cluster/builds.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.errors import AgentEnvError, BadRequest, Conflict, Forbidden, NotFound
from agentenv.models import BuildStatus, TemplateBuildRecord, TemplateRecord, TemplateTag, rfc3339, utcnow
from agentenv.orchestrator.builds import BuildExecutor, BuildLog, StepFailed

if TYPE_CHECKING:
    from agentenv.orchestrator.host import SandboxHost

log = logging.getLogger("agentenv.templates")

DEFAULT_TAG = "default"
# What the SDK sends when no base is chosen (`e2bdev/base`), and names for our own base image.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_template_id() -> str:
    return "t" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(19))


def new_build_id() -> str:
    # The SDK types build IDs as UUIDs (tags endpoints parse them).
    import uuid

    return str(uuid.uuid4())


def split_name(name: str) -> tuple[str, str | None]:
    """'name:tag' -> (name, tag); 'name' -> (name, None)."""
    base, sep, tag = name.rpartition(":")
    if sep and base and "/" not in tag:
        return base, tag
    return name, None


class TemplateService:
    """Template API operations and the build executor (owned by the orchestrator).

    Build sandboxes run on the sandbox host (`host`): brought up, captured and torn down the same way
    as every other sandbox, without a record or a lifecycle state of their own."""

    def __init__(self, host: "SandboxHost", store, gc_artifacts: Callable[[], Awaitable[object]], *,
                 publish: bool = False) -> None:
        self.host = host
        self.publish = publish  # cluster nodes: a ready build's artifacts go to the snapshot store
        self.store = store
        self.paths = host.paths
        self.settings = host.settings
        self._gc_artifacts = gc_artifacts
        self.files_dir = self.paths.root / "template-files"
        self._tasks: dict[str, asyncio.Task] = {}
        # Per build in flight: layers/memory images it holds before its record or cache entry has them.
        self._pins: dict[str, set[str]] = {}
        # Awaited with a template's id when it is deleted, before its artifacts are collected (the pool).
        self.on_deleted: list[Callable[[str], Awaitable[None]]] = []
        self.executor = BuildExecutor(host, store, self._pins, self.files_path, self.resolve_for_create)

    def sign(self, text: str) -> str:
        """HMAC with this data dir's host secret (signed upload URLs)."""
        import hmac

        return hmac.new(self.host.host_token.encode(), text.encode(), hashlib.sha256).hexdigest()

    async def fail_interrupted(self) -> None:
        """Builds a previous server process left running can never finish: end them with a reason."""
        for b in await self.store.list_builds():
            if (b.status == BuildStatus.BUILDING and b.build_id not in self._tasks
                    and b.spec.get("node") == self.settings.node_id):  # other nodes' builds are theirs
                b.status = BuildStatus.ERROR
                b.reason = {"message": "the server restarted during the build; start a new build"}
                b.finished_at = b.updated_at = utcnow()
                b.logs.append({"timestamp": rfc3339(utcnow()), "level": "error", "message": b.reason["message"]})
                await self.store.put_build(b)
                log.warning("build %s of template %s was interrupted by a restart", b.build_id, b.template_id)

    def start_builtins(self) -> None:
        """Build the ready-made templates named in `builtin_templates` (background; skipped when current)."""
        names = [n.strip() for n in (self.settings.builtin_templates or "").split(",") if n.strip()]
        for n in names:
            if n != "code-interpreter":
                log.warning("unknown built-in template %r (known: code-interpreter)", n)
                continue
            task = asyncio.create_task(self._ensure_code_interpreter(), name="builtin-code-interpreter")
            self._tasks["builtin-code-interpreter"] = task
            task.add_done_callback(lambda _t: self._tasks.pop("builtin-code-interpreter", None))

    async def _ensure_code_interpreter(self) -> None:
        from agentenv.templates.code_interpreter import build as ci

        try:
            wheels = await ci.ensure_wheels(self.settings, lambda m: log.info("code-interpreter: %s", m))
            spec, files = await asyncio.to_thread(ci.recipe, wheels)
        except Exception as e:  # noqa: BLE001 - the server runs on without it
            log.error("cannot build the code-interpreter template: %s", e)
            return
        tmpl = await self.store.get_template(ci.NAME)
        if tmpl is not None and tmpl.team_id is not None:
            log.error("template name %s belongs to a team; not building the built-in one", ci.NAME)
            return
        tags = {t.tag: t.build_id for t in await self.store.list_tags(tmpl.template_id)} if tmpl else {}
        current = await self.store.get_build(tags[DEFAULT_TAG]) if DEFAULT_TAG in tags else None
        if current is not None and current.spec.get("recipe") == spec["recipe"] and await self._available(current):
            log.info("code-interpreter template is current (build %s)", current.build_id)
            return
        for digest, data in files.items():
            path = self.files_path("", digest)
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".part")
                tmp.write_bytes(data)
                os.replace(tmp, path)
        s = self.settings
        if tmpl is None:
            tmpl = TemplateRecord(template_id=ci.NAME, aliases=list(ci.ALIASES), cpu_count=s.default_cpu_count,
                                  memory_mb=s.default_memory_mb, disk_mb=s.default_disk_mb, image="base",
                                  public=True, team_id=None)
            await self.store.put_template(tmpl)
        build = TemplateBuildRecord(build_id=new_build_id(), template_id=tmpl.template_id, team_id="",
                                    status=BuildStatus.BUILDING, cpu_count=tmpl.cpu_count, memory_mb=tmpl.memory_mb,
                                    disk_mb=tmpl.disk_mb, spec={**spec, "tags": [DEFAULT_TAG],
                                                                "node": self.settings.node_id})
        await self.store.put_build(build)
        log.info("building the code-interpreter template (build %s)", build.build_id)
        await self._run_build(build)
        if build.status == BuildStatus.ERROR:
            log.error("code-interpreter template build failed: %s", (build.reason or {}).get("message"))
        else:
            for old in await self.store.list_builds(tmpl.template_id):  # superseded builds: GC their layers
                if old.build_id != build.build_id:
                    await self.store.delete_build(old.build_id)
            await self._gc_artifacts()

    async def _available(self, build: TemplateBuildRecord) -> bool:
        """Its layers and memory image are on this node or (a cluster node) in the snapshot store,
        where a create pulls them: a built-in template built and published by another node."""
        arts = self.host.artifacts
        if not build.memory_digest:
            return False
        for kind, digest, local in ([("layers", d, arts.layer_dir(d)) for d in build.layers]
                                    + [("memory", build.memory_digest, arts.memory_dir(build.memory_digest))]):
            here = local.is_dir() or (kind == "memory" and arts.has_recipe(digest))
            if not here and not (self.publish and await arts.store.has_blob(kind, digest)):
                return False
        return True

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # ------------------------------------------------------------------ lookup

    async def find_template(self, name_or_id: str, team_id: str | None) -> TemplateRecord | None:
        tmpl = await self.store.get_template(name_or_id)
        if tmpl is not None and tmpl.team_id is not None and team_id is not None and tmpl.team_id != team_id:
            return None
        return tmpl

    async def resolve_for_create(self, name: str, team_id: str | None) -> tuple[TemplateRecord, TemplateBuildRecord | None] | None:
        """A template name (`name`, `name:tag`, or an ID) -> the template and its build to start from."""
        tmpl = await self.find_template(name, team_id)
        tag = None
        if tmpl is None:
            base, tag = split_name(name)
            if tag is None:
                return None
            tmpl = await self.find_template(base, team_id)
            if tmpl is None:
                return None
        tags = {t.tag: t.build_id for t in await self.store.list_tags(tmpl.template_id)}
        if not tags and tag is None:
            return tmpl, None  # a built-in template without builds: boots the image
        build_id = tags.get(tag or DEFAULT_TAG)
        if build_id is None:
            raise NotFound(f"template '{tmpl.aliases[0] if tmpl.aliases else tmpl.template_id}' has no tag "
                           f"'{tag or DEFAULT_TAG}'")
        build = await self.store.get_build(build_id)
        if build is None or build.status != BuildStatus.READY:
            raise NotFound(f"build {build_id} of template {tmpl.template_id} is not ready")
        return tmpl, build

    async def artifacts_in_use(self) -> tuple[set[str], set[str]]:
        layers: set[str] = set()
        memory: set[str] = set()
        for pins in self._pins.values():
            layers.update(p for p in pins if not p.startswith("memory:"))
            memory.update(p[len("memory:"):] for p in pins if p.startswith("memory:"))
        for b in await self.store.list_builds():
            layers.update(b.layers)
            if b.memory_digest:
                memory.add(b.memory_digest)
        for e in await self.store.list_cache_entries():
            layers.update(e.get("layers", []))
            if e.get("memory"):
                memory.add(e["memory"])
        return layers, memory

    # ------------------------------------------------------------------ API operations

    async def request_build(self, *, team_id: str, name: str, tags: list[str] | None, cpu_count: int | None,
                            memory_mb: int | None) -> tuple[TemplateRecord, TemplateBuildRecord, list[str]]:
        base, tag = split_name(name)
        if not _NAME_RE.match(base):
            raise BadRequest(f"invalid template name {base!r}: use lowercase letters, digits, '.', '_', '-', '/'")
        all_tags = list(dict.fromkeys(([tag] if tag else []) + list(tags or []))) or [DEFAULT_TAG]
        for t in all_tags:
            if not _TAG_RE.match(t):
                raise BadRequest(f"invalid tag {t!r}")
        s = self.settings
        cpu = cpu_count or s.default_cpu_count
        mem = memory_mb or s.default_memory_mb
        if not 1 <= cpu <= 64 or not 128 <= mem <= 262144:
            raise BadRequest("cpuCount must be 1-64 and memoryMB 128-262144")
        tmpl = await self.store.get_template(base)
        if tmpl is not None and tmpl.team_id != team_id:
            raise Forbidden(f"template name '{base}' is taken")
        if tmpl is None:
            tmpl = TemplateRecord(template_id=new_template_id(), aliases=[base], cpu_count=cpu, memory_mb=mem,
                                  disk_mb=s.default_disk_mb, image="base", public=False, team_id=team_id)
        else:
            tmpl.cpu_count, tmpl.memory_mb = cpu, mem
        await self.store.put_template(tmpl)
        build = TemplateBuildRecord(build_id=new_build_id(), template_id=tmpl.template_id, team_id=team_id,
                                    status=BuildStatus.WAITING, cpu_count=cpu, memory_mb=mem, disk_mb=tmpl.disk_mb,
                                    spec={"tags": all_tags, "node": s.node_id})  # its uploads land here
        await self.store.put_build(build)
        return tmpl, build, all_tags

    async def _own_template(self, template_id: str, team_id: str) -> TemplateRecord:
        tmpl = await self.find_template(template_id, team_id)
        if tmpl is None:
            raise NotFound(f"template '{template_id}' not found")
        if tmpl.team_id != team_id:
            raise Forbidden(f"template '{template_id}' is built in and cannot be changed")
        return tmpl

    async def _own_build(self, template_id: str, build_id: str, team_id: str) -> TemplateBuildRecord:
        tmpl = await self._own_template(template_id, team_id)
        build = await self.store.get_build(build_id)
        if build is None or build.template_id != tmpl.template_id:
            raise NotFound(f"build '{build_id}' of template '{template_id}' not found")
        return build

    def files_path(self, team_id: str, files_hash: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", files_hash):
            raise BadRequest("files hash must be 64 lowercase hex digits")
        team = hashlib.sha256(team_id.encode()).hexdigest()[:16]
        return self.files_dir / team / f"{files_hash}.tar"

    async def files_present(self, template_id: str, files_hash: str, team_id: str) -> bool:
        await self._own_template(template_id, team_id)
        return self.files_path(team_id, files_hash).is_file()

    async def store_files(self, team_id: str, files_hash: str, body) -> int:
        """Save an uploaded COPY context (a tar, gzipped or not) under its files hash."""
        dst = self.files_path(team_id, files_hash)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".upload-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    await asyncio.to_thread(f.write, chunk)
            if not await asyncio.to_thread(tarfile.is_tarfile, tmp):
                raise BadRequest("the upload is not a tar archive")
            os.replace(tmp, dst)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return size

    async def start_build(self, template_id: str, build_id: str, team_id: str, spec: dict) -> None:
        build = await self._own_build(template_id, build_id, team_id)
        if build.status != BuildStatus.WAITING:
            raise Conflict(f"build {build_id} was already started ({build.status.value})")
        tags = build.spec.get("tags", [DEFAULT_TAG])
        build.spec = {**spec, "tags": tags, "node": self.settings.node_id}
        build.status = BuildStatus.BUILDING
        build.updated_at = utcnow()
        await self.store.put_build(build)
        task = asyncio.create_task(self._run_build(build), name=f"build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(build_id, None))

    async def build_status(self, template_id: str, build_id: str, team_id: str) -> TemplateBuildRecord:
        return await self._own_build(template_id, build_id, team_id)

    async def wait_build(self, build_id: str) -> None:
        task = self._tasks.get(build_id)
        if task is not None:
            await asyncio.shield(task)

    async def list_templates(self, team_id: str | None) -> list[tuple[TemplateRecord, list[TemplateBuildRecord]]]:
        out = []
        for t in await self.store.list_templates():
            if t.team_id is None or team_id is None or t.team_id == team_id:
                out.append((t, await self.store.list_builds(t.template_id)))
        return out

    async def get_template(self, template_id: str, team_id: str) -> tuple[TemplateRecord, list[TemplateBuildRecord]]:
        tmpl = await self.find_template(template_id, team_id)
        if tmpl is None:
            raise NotFound(f"template '{template_id}' not found")
        return tmpl, await self.store.list_builds(tmpl.template_id)

    async def alias_info(self, alias: str, team_id: str) -> TemplateRecord:
        tmpl = await self.store.get_template(alias)
        if tmpl is None:
            raise NotFound(f"template '{alias}' not found")
        if tmpl.team_id is not None and tmpl.team_id != team_id:
            raise Forbidden(f"template '{alias}' belongs to another team")
        return tmpl

    async def delete_template(self, template_id: str, team_id: str) -> bool:
        """Delete a team's template (builds, tags, cache) and GC its layers. False: no such template."""
        tmpl = await self.find_template(template_id, team_id)
        if tmpl is None:
            return False
        if tmpl.team_id is None:
            raise Forbidden(f"Template {template_id!r} is built in and cannot be deleted")
        if any(b.status == BuildStatus.BUILDING for b in await self.store.list_builds(tmpl.template_id)):
            raise Conflict(f"template {template_id} has a build in progress")
        await self.store.delete_template(tmpl.template_id)
        for cb in self.on_deleted:
            await cb(tmpl.template_id)
        await self._gc_artifacts()
        log.info("deleted template %s (%s)", tmpl.template_id, ",".join(tmpl.aliases))
        return True

    async def assign_tags(self, target: str, tags: list[str], team_id: str) -> tuple[str, list[str]]:
        base, tag = split_name(target)
        tmpl = await self._own_template(base, team_id)
        current = {t.tag: t.build_id for t in await self.store.list_tags(tmpl.template_id)}
        build_id = current.get(tag or DEFAULT_TAG)
        if build_id is None:
            raise NotFound(f"template '{base}' has no tag '{tag or DEFAULT_TAG}'")
        for t in tags:
            if not _TAG_RE.match(t):
                raise BadRequest(f"invalid tag {t!r}")
            await self.store.put_tag(TemplateTag(tmpl.template_id, t, build_id))
        return build_id, tags

    async def remove_tags(self, name: str, tags: list[str], team_id: str) -> None:
        tmpl = await self._own_template(split_name(name)[0], team_id)
        for t in tags:
            if not await self.store.delete_tag(tmpl.template_id, t):
                raise NotFound(f"template '{name}' has no tag '{t}'")
        await self._gc_artifacts()

    async def list_tags(self, template_id: str, team_id: str) -> list[TemplateTag]:
        tmpl = await self.find_template(split_name(template_id)[0], team_id)
        if tmpl is None:
            raise NotFound(f"template '{template_id}' not found")
        return await self.store.list_tags(tmpl.template_id)

    # ------------------------------------------------------------------ the build

    async def _run_build(self, build: TemplateBuildRecord) -> None:
        blog = BuildLog(build, self.store)
        t0 = time.monotonic()
        self._pins[build.build_id] = set()
        try:
            await self.executor.execute(build, blog)
            if self.publish:  # before it is ready: a create on another node pulls them from the store
                blog.add("Publishing the template's layers and memory image to the snapshot store")
                await blog.save()
                t1 = time.monotonic()
                await self.host.artifacts.publish_blobs(build.layers, build.memory_digest)
                blog.add(f"Published in {time.monotonic() - t1:.1f}s")
            build.status = BuildStatus.READY
            blog.add(f"Build finished in {time.monotonic() - t0:.1f}s")
            for t in build.spec.get("tags", [DEFAULT_TAG]):
                await self.store.put_tag(TemplateTag(build.template_id, t, build.build_id))
        except asyncio.CancelledError:
            build.status = BuildStatus.ERROR
            build.reason = {"message": "build cancelled (server shutting down)"}
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends the build with a reason
            step = e.step if isinstance(e, StepFailed) else None
            msg = e.message if isinstance(e, AgentEnvError) else str(e) or type(e).__name__
            if not isinstance(e, (StepFailed, AgentEnvError)):
                log.exception("build %s failed", build.build_id)
            blog.add(msg, "error", step)
            build.status = BuildStatus.ERROR
            build.reason = {"message": msg, **({"step": step} if step is not None else {})}
        finally:
            build.finished_at = utcnow()
            await asyncio.shield(blog.save())
            self._pins.pop(build.build_id, None)
            await asyncio.shield(self._gc_artifacts())
        log.info("build %s of template %s: %s in %.1fs", build.build_id, build.template_id, build.status.value,
                 time.monotonic() - t0)
