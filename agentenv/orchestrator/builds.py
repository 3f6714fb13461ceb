"""The template build executor: steps in a build sandbox over envd, a step cache, one commit.

Each step runs in a build sandbox on the sandbox host (RUN/WORKDIR/USER through envd's process
API, COPY/ADD as an uploaded tar); a step that changed files seals the sandbox's upper into a
content-addressed layer, cached by the chain of step keys. The commit boots the final layers,
runs the start command, waits for the ready command, and captures the sandbox (checkpoint + seal,
`SandboxHost.capture`): the build becomes a restorable snapshot. See docs/templates.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from agentenv.constants import DEFAULT_HOME, DEFAULT_USER
from agentenv.errors import BadRequest, RuntimeFailure
from agentenv.models import SandboxRecord, SandboxState, TemplateBuildRecord, TemplateRecord, rfc3339, utcnow
from agentenv.orchestrator import envd_client
from agentenv.runtimes import select as runtime_select

if TYPE_CHECKING:
    from agentenv.orchestrator.host import SandboxHost

log = logging.getLogger("agentenv.templates")

STEP_TIMEOUT_S = 30 * 60
READY_TIMEOUT_S = 5 * 60
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class StepState:
    """What a build carries from step to step besides files."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = DEFAULT_HOME
    user: str = DEFAULT_USER

    def to_json(self) -> dict:
        return {"env": self.env, "workdir": self.workdir, "user": self.user}

    @classmethod
    def from_json(cls, d: dict) -> "StepState":
        return cls(env=dict(d.get("env", {})), workdir=d.get("workdir", DEFAULT_HOME), user=d.get("user", DEFAULT_USER))


@dataclass
class Chain:
    """A filesystem to build on: image + layers (top first) + carried state + its cache key."""

    image: str
    layers: list[str]
    state: StepState
    key: str


def describe(step: dict) -> str:
    args = step.get("args") or []
    t = step.get("type", "?")
    if t == "COPY":
        return f"COPY {args[0] if args else ''} {args[1] if len(args) > 1 else ''}".strip()
    if t == "ENV":
        return "ENV " + " ".join(f"{args[i]}={args[i + 1]}" for i in range(0, len(args) - 1, 2))
    return f"{t} {' '.join(args[:1])}".strip()


class BuildLog:
    """Build log entries in E2B's shape, persisted with the build (polled by the SDK)."""

    def __init__(self, build: TemplateBuildRecord, store) -> None:
        self.build = build
        self.store = store
        self._partial: dict[str, str] = {}

    def add(self, message: str, level: str = "info", step: str | None = None) -> None:
        entry = {"timestamp": rfc3339(utcnow()), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.build.logs.append(entry)
        log.debug("build %s: %s", self.build.build_id, message)

    def output(self, step: str, stream: str, text: str) -> None:
        """Command output, one entry per line (partial lines wait for their end)."""
        buf = self._partial.get(stream, "") + text
        *lines, rest = buf.split("\n")
        self._partial[stream] = rest
        for line in lines:
            self.add(line, "info" if stream == "stdout" else "warn", step)

    def flush(self, step: str) -> None:
        for stream, rest in list(self._partial.items()):
            if rest:
                self.add(rest, "info" if stream == "stdout" else "warn", step)
        self._partial.clear()

    async def save(self) -> None:
        self.build.updated_at = utcnow()
        await self.store.put_build(self.build)


class StepFailed(Exception):
    def __init__(self, message: str, step: str | None) -> None:
        super().__init__(message)
        self.step = step


class BuildExecutor:
    """Runs one build at a time per call (`execute`); the template service owns builds and pins."""

    def __init__(self, host: "SandboxHost", store, pins: dict[str, set[str]],
                 files_path: Callable[[str, str], Path],
                 resolve_for_create: Callable[[str, str | None],
                                              Awaitable[tuple[TemplateRecord, TemplateBuildRecord | None] | None]]
                 ) -> None:
        self.host = host
        self.store = store
        self.paths = host.paths
        self.settings = host.settings
        self._pins = pins
        self.files_path = files_path
        self._resolve_for_create = resolve_for_create

    async def _resolve_base(self, spec: dict, team_id: str, blog: BuildLog) -> Chain:
        if spec.get("fromTemplate"):
            name = spec["fromTemplate"]
            found = await self._resolve_for_create(name, team_id)
            if found is None:
                raise BadRequest(f"fromTemplate: template '{name}' not found")
            tmpl, parent = found
            if parent is None:
                blog.add(f"FROM template {name} (image {tmpl.image})")
                return Chain(tmpl.image, [], StepState(), _h("image", tmpl.image))
            blog.add(f"FROM template {name} (build {parent.build_id})")
            state = StepState.from_json(parent.spec.get("finalState", {}))
            return Chain(parent.image, list(parent.layers), state, _h("build", *parent.layers, parent.image))
        ref = spec.get("fromImage") or "e2bdev/base"
        if spec.get("fromImageRegistry") and spec["fromImageRegistry"].get("type") not in (None, "registry"):
            raise BadRequest(f"fromImageRegistry type {spec['fromImageRegistry'].get('type')!r} is not supported")
        image = await self.host.images.resolve_image_ref(ref, registry=spec.get("fromImageRegistry"),
                                                         progress=lambda m, _f: blog.add(m))
        blog.add(f"FROM image {ref} -> {image}")
        state = StepState()
        m = self.host.images.manifest(image)
        for item in m.get("env") or []:  # the image config's Env and WorkingDir (imported OCI images)
            k, sep, v = str(item).partition("=")
            if sep and _ENV_RE.match(k):
                state.env[k] = v
        if m.get("workdir"):
            state.workdir = m["workdir"]
        return Chain(image, [], state, _h("image", image, self.host.images.image_digest(image)))

    async def execute(self, build: TemplateBuildRecord, blog: BuildLog) -> None:
        """Run the build's steps (cached ones skipped) and commit its snapshot; raises on failure."""
        spec = build.spec
        tmpl = await self.store.get_template(build.template_id)
        want = tmpl.runtime if tmpl else None
        if want is None and "gvisor" in self.host.runtimes:
            want = "gvisor"  # a node that also serves gVisor builds there (microVM builds are not supported)
        build.runtime = await runtime_select.resolve_request(self.settings, want, list(self.host.runtimes))
        if runtime_select.is_vm(build.runtime):
            raise BadRequest(f"template builds need the gvisor runtime, not {build.runtime}: a microVM keeps its file "
                             "changes in its VM disk, which build steps cannot commit as layers yet")
        steps: list[dict] = list(spec.get("steps") or [])
        for i, st in enumerate(steps):
            if st.get("type") not in ("RUN", "ENV", "WORKDIR", "USER", "COPY", "ADD"):
                raise StepFailed(f"step {i + 1}: unsupported step type {st.get('type')!r}", str(i + 1))
        blog.add(f"Building template {build.template_id} (build {build.build_id}), {len(steps)} steps")
        await blog.save()
        chain = await self._resolve_base(spec, build.team_id, blog)
        keys, k = [], chain.key
        for st in steps:
            ident = {"type": st.get("type"), "args": st.get("args") or [], "filesHash": st.get("filesHash")}
            k = _h(k, json.dumps(ident, sort_keys=True))
            keys.append(k)
        done = 0
        if not spec.get("force"):
            for i, st in enumerate(steps):
                if st.get("force"):
                    break
                entry = await self.store.get_cache_entry(keys[i])
                if entry is None or not all(self.host.artifacts.layer_dir(d).is_dir() for d in entry["layers"]):
                    break
                chain = Chain(entry["image"], list(entry["layers"]), StepState.from_json(entry["state"]), keys[i])
                done = i + 1
                blog.add(f"CACHED [{i + 1}/{len(steps)}] {describe(st)}", step=str(i + 1))
        await blog.save()
        self._pins[build.build_id].update(chain.layers)
        if done < len(steps):
            chain = await self._run_steps(build, blog, chain, steps, keys, done)
        spec["finalState"] = chain.state.to_json()
        # The commit too is cached: same final filesystem + start/ready command + resources -> the
        # same snapshot (unless forced). Its key includes the tools layer, whose envd the memory holds.
        tools = (await self.host.images.ensure_tools()).name
        commit_key = "commit:" + _h(chain.key, spec.get("startCmd") or "", spec.get("readyCmd") or "",
                                    str(build.cpu_count), str(build.memory_mb), tools, build.runtime or "")
        forced = bool(spec.get("force")) or any(st.get("force") for st in steps)
        entry = None if forced else await self.store.get_cache_entry(commit_key)
        if entry is not None and self.host.artifacts.has_memory(entry["memory"]) and all(
                self.host.artifacts.layer_dir(d).is_dir() for d in entry["layers"]):
            build.image, build.layers, build.memory_digest = entry["image"], list(entry["layers"]), entry["memory"]
            build.restore_token = entry["restoreToken"]
            await self.store.put_build(build)
            blog.add("CACHED commit: the start command's snapshot of an identical build is reused", step="finalize")
            return
        await self._commit(build, blog, chain)
        await self.store.put_cache_entry(commit_key, build.template_id, {
            "image": build.image, "layers": list(build.layers), "memory": build.memory_digest,
            "restoreToken": build.restore_token, "state": chain.state.to_json()})

    async def _boot(self, build: TemplateBuildRecord, chain: Chain, prefix: str, env: dict[str, str],
                    *, internet: bool) -> SandboxRecord:
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=f"{prefix}{secrets.token_hex(10)}", template_id=build.template_id, team_id=build.team_id,
            state=SandboxState.CREATING, started_at=now, end_at=now, cpu_count=build.cpu_count,
            memory_mb=build.memory_mb, disk_mb=build.disk_mb, envd_access_token=secrets.token_urlsafe(24),
            env_vars=dict(env), allow_internet_access=internet, runtime=build.runtime or self.host.runtime.name,
            image=chain.image, layers=list(chain.layers))
        try:
            await self.host.bring_up(rec, restore_from=None, restore_token=None)
        except BaseException:
            await asyncio.shield(self.host.teardown(rec.sandbox_id))
            raise
        return rec

    def _shell(self, rec: SandboxRecord) -> str:
        return "/bin/bash" if (self.host.rootfs.rootfs_path(rec.sandbox_id) / "bin/bash").exists() else "/bin/sh"

    async def _exec(self, rec: SandboxRecord, cmd: str, *, user: str, cwd: str | None, env: dict[str, str],
                    blog: BuildLog | None, step: str | None, timeout: float = STEP_TIMEOUT_S) -> int:
        slot = self.host.slots[rec.sandbox_id]
        on_output = (lambda stream, text: blog.output(step or "", stream, text)) if blog is not None else None
        try:
            code = await envd_client.run_process(slot.host_ip, access_token=rec.envd_access_token, cmd=cmd,
                                                 user=user, cwd=cwd, envs=env, shell=self._shell(rec),
                                                 on_output=on_output, timeout=timeout)
        except asyncio.TimeoutError:
            raise StepFailed(f"step {step}: command timed out after {timeout:.0f}s", step) from None
        if blog is not None:
            blog.flush(step or "")
        return code if code is not None else 0

    async def _run_steps(self, build: TemplateBuildRecord, blog: BuildLog, chain: Chain, steps: list[dict],
                         keys: list[str], start: int) -> Chain:
        state = StepState(dict(chain.state.env), chain.state.workdir, chain.state.user)
        rec = await self._boot(build, chain, "b", {}, internet=True)
        sid = rec.sandbox_id
        boot_layers = list(chain.layers)
        changed = False
        try:
            for i in range(start, len(steps)):
                st = steps[i]
                n = str(i + 1)
                args = [str(a) for a in (st.get("args") or [])]
                blog.add(f"[{i + 1}/{len(steps)}] {describe(st)}", step=n)
                await blog.save()
                t = st["type"]
                if t == "ENV":
                    for j in range(0, len(args) - 1, 2):
                        if not _ENV_RE.match(args[j]):
                            raise StepFailed(f"step {n}: invalid environment variable name {args[j]!r}", n)
                        state.env[args[j]] = args[j + 1]
                elif t == "WORKDIR":
                    path = str(PurePosixPath(state.workdir, args[0])) if args else state.workdir
                    code = await self._exec(rec, f"mkdir -p {shlex.quote(path)}", user="root", cwd="/",
                                            env={}, blog=blog, step=n)
                    if code:
                        raise StepFailed(f"step {n}: cannot create workdir {path}", n)
                    await self._exec(rec, f"chown {shlex.quote(state.user)} {shlex.quote(path)} 2>/dev/null; true",
                                     user="root", cwd="/", env={}, blog=None, step=n)
                    state.workdir = path
                    changed = True
                elif t == "USER":
                    if not args:
                        raise StepFailed(f"step {n}: USER needs a user name", n)
                    code = await self._exec(rec, f"id -u {shlex.quote(args[0])} >/dev/null", user="root", cwd="/",
                                            env={}, blog=blog, step=n)
                    if code:
                        raise StepFailed(f"step {n}: user {args[0]!r} does not exist in the image", n)
                    state.user = args[0]
                elif t == "RUN":
                    if not args:
                        raise StepFailed(f"step {n}: RUN needs a command", n)
                    user = args[1] if len(args) > 1 and args[1] else state.user
                    code = await self._exec(rec, args[0], user=user, cwd=state.workdir, env=state.env, blog=blog,
                                            step=n)
                    if code != 0:
                        raise StepFailed(f"step {n} ({describe(st)}) failed with exit code {code}", n)
                    changed = True
                else:  # COPY / ADD
                    await self._copy(rec, st, state, build.team_id, blog, n)
                    changed = True
                layers = boot_layers
                if changed:
                    layers = await self._seal_live_upper(rec, build) + boot_layers
                await self.store.put_cache_entry(keys[i], build.template_id, {
                    "image": chain.image, "layers": layers, "state": state.to_json()})
                chain = Chain(chain.image, layers, StepState(dict(state.env), state.workdir, state.user), keys[i])
            return chain
        finally:
            await asyncio.shield(self.host.teardown(sid))

    async def _seal_live_upper(self, rec: SandboxRecord, build: TemplateBuildRecord) -> list[str]:
        """Copy the running build sandbox's upper (after a sync inside) into a layer: [digest] or []."""
        await self._exec(rec, "sync", user="root", cwd="/", env={}, blog=None, step=None, timeout=300)
        upper = self.host.rootfs.upper_path(rec.sandbox_id)
        tmp = self.paths.sandbox_dir(rec.sandbox_id) / f"step-{secrets.token_hex(4)}"
        proc = await asyncio.create_subprocess_exec("cp", "-a", "--reflink=auto", "--", str(upper), str(tmp),
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeFailure(f"copying the build sandbox's files failed: {err.decode(errors='replace')[-300:]}")
        digest = await self.host.artifacts.seal_upper(tmp)
        if digest:
            self._pins[build.build_id].add(digest)
        return [digest] if digest else []

    async def _copy(self, rec: SandboxRecord, st: dict, state: StepState, team_id: str, blog: BuildLog,
                    n: str) -> None:
        args = [str(a) for a in (st.get("args") or [])]
        if len(args) < 2 or not st.get("filesHash"):
            raise StepFailed(f"step {n}: COPY needs a source, a destination and a files hash", n)
        src, dest = args[0], args[1]
        owner = args[2] if len(args) > 2 and args[2] else state.user
        mode = args[3] if len(args) > 3 and args[3] else ""
        archive = self.files_path(team_id, st["filesHash"])
        if not archive.is_file():
            raise StepFailed(f"step {n}: the files of COPY {src} were not uploaded (hash {st['filesHash'][:12]})", n)
        if not dest.startswith("/"):
            dest = str(PurePosixPath(state.workdir, dest))
        work = self.paths.sandbox_dir(rec.sandbox_id) / f"copy-{n}"
        try:
            out, targets = await asyncio.to_thread(_restage, archive, src, dest, work)
            inside = f"/tmp/.agentenv-copy-{n}.tar"
            slot = self.host.slots[rec.sandbox_id]
            await envd_client.upload_file(slot.host_ip, access_token=rec.envd_access_token, path=inside, src=out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        quoted = " ".join(shlex.quote(t) for t in targets)
        script = f"tar -x -f {inside} -C / && rm -f {inside}"
        if owner:
            script += f" && chown -R {shlex.quote(owner)} {quoted}"
        if mode:
            script += f" && chmod -R {shlex.quote(mode)} {quoted}"
        code = await self._exec(rec, script, user="root", cwd="/", env={}, blog=blog, step=n)
        if code != 0:
            raise StepFailed(f"step {n}: COPY {src} {dest} failed (exit code {code})", n)

    async def _commit(self, build: TemplateBuildRecord, blog: BuildLog, chain: Chain) -> None:
        """Boot on the final layers, start + ready, checkpoint: the build becomes a restorable snapshot."""
        spec = build.spec
        start_cmd, ready_cmd = spec.get("startCmd"), spec.get("readyCmd")
        blog.add("Committing the template snapshot" + (f" (start command: {start_cmd})" if start_cmd else ""))
        await blog.save()
        rec = await self._boot(build, chain, "f", chain.state.env, internet=True)
        sid = rec.sandbox_id
        image_dir = self.paths.sandbox_dir(sid) / "capture"
        try:
            if start_cmd:
                slot = self.host.slots[sid]
                await envd_client.run_process(slot.host_ip, access_token=rec.envd_access_token, cmd=start_cmd,
                                              user=chain.state.user, cwd=chain.state.workdir, envs=chain.state.env,
                                              shell=self._shell(rec), background=True)
                blog.add(f"Started: {start_cmd}", step="finalize")
            if ready_cmd or start_cmd:
                await self._wait_ready(rec, ready_cmd or "sleep 1", chain.state, blog)
            sealed = await self.host.capture(rec, image_dir)
            top, mem = sealed.layer, sealed.memory
            layers = ([top] if top else []) + list(chain.layers)
            self._pins[build.build_id].update([*layers, f"memory:{mem}"])
            build.image, build.layers, build.memory_digest = chain.image, layers, mem
            build.restore_token = rec.envd_access_token
            build.env_vars = {}
            await self.store.put_build(build)
        except BaseException:
            self.host.keep_logs(sid, "template-build")  # runsc's own log says why a checkpoint failed
            raise
        finally:
            await asyncio.shield(self.host.teardown(sid))

    async def _wait_ready(self, rec: SandboxRecord, ready_cmd: str, state: StepState, blog: BuildLog) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        blog.add(f"Waiting for ready command: {ready_cmd}", step="finalize")
        await blog.save()
        while True:
            code = await self._exec(rec, ready_cmd, user=state.user, cwd=state.workdir, env=state.env, blog=None,
                                    step="finalize", timeout=60)
            if code == 0:
                blog.add("Template is ready", step="finalize")
                return
            if time.monotonic() > deadline:
                raise StepFailed(f"ready command did not succeed within {READY_TIMEOUT_S}s: {ready_cmd}", "finalize")
            await asyncio.sleep(0.5)


def _h(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _restage(archive: Path, src: str, dest: str, work: Path) -> tuple[Path, list[str]]:
    """Rewrite the SDK's COPY tar (paths relative to the build context) into one rooted at `/`.

    Docker semantics: a directory source copies its contents into `dest`; a file goes to
    `dest/<name>` when `dest` ends with '/' (or several files match), else to `dest` itself.
    """
    import fnmatch

    work.mkdir(parents=True, exist_ok=True)
    src_norm = os.path.normpath(src).lstrip("/") if src not in (".", "./") else ""  # ".env" keeps its dot
    out = work / "restaged.tar"
    targets: set[str] = set()
    with tarfile.open(archive, "r:*") as tin:
        members = tin.getmembers()
        names = [os.path.normpath(m.name) for m in members]
        is_glob = any(c in src for c in "*?[")
        if is_glob:
            roots = {nm for nm in names if fnmatch.fnmatch(nm, src_norm)}
        else:
            roots = {src_norm} if src_norm else {""}
        many = is_glob and len(roots) > 1
        with tarfile.open(out, "w") as tout:
            for m, nm in zip(members, names):
                root = next((r for r in roots if r == "" or nm == r or nm.startswith(r + "/")), None)
                if root is None:
                    continue
                rel = nm[len(root):].lstrip("/") if root else nm
                root_is_dir = root == "" or any(x.startswith(root + "/") for x in names) or (m.isdir() and nm == root)
                if root_is_dir:
                    target = PurePosixPath(dest, rel) if rel else PurePosixPath(dest)
                elif dest.endswith("/") or many:
                    target = PurePosixPath(dest, PurePosixPath(root).name)
                else:
                    target = PurePosixPath(dest)
                if ".." in target.parts:
                    raise BadRequest(f"COPY path escapes the destination: {nm}")
                top = str(target) if not rel else str(PurePosixPath(dest))
                targets.add(top)
                m2 = tarfile.TarInfo(str(target).lstrip("/") or ".")
                m2.type, m2.mode, m2.size, m2.mtime = m.type, m.mode, m.size, m.mtime
                m2.linkname = m.linkname
                f = tin.extractfile(m) if m.isreg() else None
                tout.addfile(m2, f)
    if not targets:
        raise BadRequest(f"COPY {src}: no files in the upload match")
    return out, sorted(targets)
