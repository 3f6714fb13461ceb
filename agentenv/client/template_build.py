"""`agentenv template build`: a Dockerfile (subset) or the E2B SDK's template JSON -> E2B's build API.

The server speaks the E2B SDK's `Template` builder definition (`Template.to_json()`):
`{fromImage | fromTemplate, steps: [{type, args, filesHash?, force?}], startCmd?, readyCmd?, force?}`
with step types RUN, ENV, WORKDIR, USER, COPY. A Dockerfile is translated to that:

| Dockerfile | build step |
| --- | --- |
| `FROM image [AS x]` | `fromImage` (one stage only) |
| `RUN cmd` / `RUN ["a", "b"]` | `RUN [cmd]` |
| `COPY [--chown=u] [--chmod=m] src... dest`, `ADD` (local files only) | one `COPY [src, dest, u, m]` per source, its files uploaded as a tar |
| `ENV k=v ...` / `ENV k v`, `ARG k=v` | `ENV [k, v, ...]` (build time, as in E2B) |
| `WORKDIR d`, `USER u` | `WORKDIR [d]`, `USER [u]` |
| `CMD`, `ENTRYPOINT` | `startCmd` (Docker's rules for combining them) |
| `EXPOSE`, `LABEL`, `VOLUME`, `MAINTAINER`, `STOPSIGNAL`, `HEALTHCHECK` | ignored (a warning) |

`$VAR` / `${VAR}` from earlier `ARG`/`ENV` lines are expanded in FROM, COPY, ENV, WORKDIR and USER,
as Docker does (RUN lines see them as environment variables).
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import os
import re
import shlex
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.client.api import ApiClient, ApiError

IGNORED = {"EXPOSE", "LABEL", "VOLUME", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK"}
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
POLL_S = 0.5


class DockerfileError(ValueError):
    """A Dockerfile line this translator cannot turn into a build step (message names the line)."""


@dataclass
class CopySource:
    """A COPY step's local files: paths relative to the build context."""

    step: int  # index into BuildPlan.steps
    src: str
    paths: list[str]


@dataclass
class BuildPlan:
    spec: dict[str, Any]          # the body of POST /v2/templates/{id}/builds/{buildID}, minus filesHash
    copies: list[CopySource] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# --- Dockerfile -> plan ----------------------------------------------------------------------------


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with continuations joined, comments and blanks dropped."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        stripped = line.lstrip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        out.append((start, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _expand(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        return m.group(2) or ""

    return _VAR.sub(sub, value)


def _json_form(rest: str) -> list[str] | None:
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _command(rest: str) -> tuple[str, bool]:
    """(command line, exec form?) of RUN/CMD/ENTRYPOINT."""
    argv = _json_form(rest)
    return (shlex.join(argv), True) if argv is not None else (rest, False)


def _env_pairs(rest: str, where: str) -> list[tuple[str, str]]:
    words = shlex.split(rest)
    if not words:
        raise DockerfileError(f"{where}: ENV needs a name and a value")
    if "=" not in words[0]:  # legacy `ENV name value with spaces`
        name, _, value = rest.partition(" ")
        return [(name, value.strip())]
    pairs = []
    for w in words:
        name, eq, value = w.partition("=")
        if not eq or not name:
            raise DockerfileError(f"{where}: expected name=value, got {w!r}")
        pairs.append((name, value))
    return pairs


def _copy_args(rest: str, where: str) -> tuple[dict[str, str], list[str], str]:
    words = _json_form(rest)
    flags: dict[str, str] = {}
    if words is None:
        words = shlex.split(rest)
        while words and words[0].startswith("--"):
            name, _, value = words.pop(0)[2:].partition("=")
            flags[name] = value
    if len(words) < 2:
        raise DockerfileError(f"{where}: COPY needs at least one source and a destination")
    for name in flags:
        if name not in ("chown", "chmod"):
            raise DockerfileError(f"{where}: COPY --{name} is not supported (only --chown and --chmod)")
    return flags, words[:-1], words[-1]


def _local_paths(context: Path, src: str, where: str) -> list[str]:
    """The context-relative paths a COPY source names (a glob may name several)."""
    ctx = context.resolve()
    if re.match(r"^[a-z]+://", src):
        raise DockerfileError(f"{where}: remote sources ({src}) are not supported; download them in a RUN step")
    matches = sorted(glob.glob(src, root_dir=ctx)) if any(c in src for c in "*?[") else [src]
    out = []
    for m in matches:
        full = (ctx / m).resolve()
        if full != ctx and ctx not in full.parents:
            raise DockerfileError(f"{where}: {src} is outside the build context {ctx}")
        if not full.exists():
            raise DockerfileError(f"{where}: {src} does not exist in the build context {ctx}")
        out.append(os.path.relpath(full, ctx))
    if not out:
        raise DockerfileError(f"{where}: {src} matches nothing in the build context {ctx}")
    return out


def _start_cmd(entrypoint: tuple[str, bool] | None, cmd: tuple[str, bool] | None) -> str | None:
    """Docker's rules: exec-form ENTRYPOINT + CMD as arguments; shell-form ENTRYPOINT ignores CMD."""
    if entrypoint is None:
        return cmd[0] if cmd else None
    line, exec_form = entrypoint
    if exec_form and cmd:
        return f"{line} {cmd[0]}" if cmd[1] else f"{line} /bin/sh -c {shlex.quote(cmd[0])}"
    return line


def parse_dockerfile(text: str, context: Path, build_args: dict[str, str] | None = None) -> BuildPlan:
    """Translate a Dockerfile into a build plan; unsupported instructions raise DockerfileError."""
    env: dict[str, str] = {}
    args_given = dict(build_args or {})
    plan = BuildPlan(spec={"steps": []})
    steps: list[dict[str, Any]] = plan.spec["steps"]
    entrypoint: tuple[str, bool] | None = None
    cmd: tuple[str, bool] | None = None
    seen_from = False
    for n, line in _logical_lines(text):
        where = f"line {n}"
        word, _, rest = line.partition(" ")
        kw, rest = word.upper(), rest.strip()
        if kw != "FROM" and kw != "ARG" and not seen_from:
            raise DockerfileError(f"{where}: {kw} before FROM")
        if kw == "FROM":
            if seen_from:
                raise DockerfileError(f"{where}: multi-stage builds are not supported (a second FROM)")
            words = _expand(rest, env).split()
            if not words or any(w.startswith("--") for w in words):
                raise DockerfileError(f"{where}: expected FROM <image> [AS <name>]")
            plan.spec["fromImage"] = words[0]
            seen_from = True
        elif kw == "ARG":
            name, eq, default = rest.partition("=")
            value = args_given.get(name, _expand(default, env) if eq else None)
            if value is None:
                continue  # an ARG without a value: nothing to pass on
            env[name] = value
            if seen_from:
                steps.append({"type": "ENV", "args": [name, value]})
        elif kw == "RUN":
            if rest.startswith("--"):
                raise DockerfileError(f"{where}: RUN flags ({rest.split()[0]}) are not supported")
            if "<<" in rest and re.search(r"<<-?\s*['\"]?[A-Za-z_]+['\"]?\s*$", rest):
                raise DockerfileError(f"{where}: heredocs are not supported")
            steps.append({"type": "RUN", "args": [_command(rest)[0]]})
        elif kw == "ENV":
            flat: list[str] = []
            for name, value in _env_pairs(rest, where):
                value = _expand(value, env)
                env[name] = value
                flat += [name, value]
            steps.append({"type": "ENV", "args": flat})
        elif kw == "WORKDIR":
            steps.append({"type": "WORKDIR", "args": [_expand(rest, env)]})
        elif kw == "USER":
            steps.append({"type": "USER", "args": [_expand(rest, env).split(":", 1)[0]]})
        elif kw in ("COPY", "ADD"):
            flags, sources, dest = _copy_args(_expand(rest, env), where)
            if len(sources) > 1 and not dest.endswith("/"):
                dest += "/"
            for src in sources:
                plan.copies.append(CopySource(len(steps), src, _local_paths(context, src, where)))
                steps.append({"type": "COPY", "args": [src, dest, flags.get("chown", ""), flags.get("chmod", "")]})
        elif kw == "CMD":
            cmd = _command(rest)
        elif kw == "ENTRYPOINT":
            entrypoint = _command(rest)
        elif kw in IGNORED:
            plan.warnings.append(f"{where}: {kw} has no effect in a template (ignored)")
        else:
            raise DockerfileError(f"{where}: {kw} is not supported")
    if not seen_from:
        raise DockerfileError("no FROM line")
    start = _start_cmd(entrypoint, cmd)
    if start:
        plan.spec["startCmd"] = start
    return plan


def parse_template_json(text: str, context: Path) -> BuildPlan:
    """The E2B SDK's `Template.to_json(t)` output; COPY sources are read from `context`."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise DockerfileError(f"not valid JSON: {e}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("steps", []), list):
        raise DockerfileError("expected an object with a steps array (the SDK's Template.to_json)")
    plan = BuildPlan(spec={k: v for k, v in spec.items() if v is not None})
    for i, st in enumerate(plan.spec.setdefault("steps", [])):
        if not isinstance(st, dict) or "type" not in st:
            raise DockerfileError(f"step {i + 1}: expected an object with a type")
        st.pop("filesHash", None)
        if st["type"] in ("COPY", "ADD"):
            src = str((st.get("args") or [""])[0])
            plan.copies.append(CopySource(i, src, _local_paths(context, src, f"step {i + 1}")))
    return plan


def load_plan(path: Path, context: Path, build_args: dict[str, str] | None = None) -> BuildPlan:
    text = path.read_text()
    if path.suffix == ".json":
        return parse_template_json(text, context)
    return parse_dockerfile(text, context, build_args)


# --- COPY files ------------------------------------------------------------------------------------


def pack_sources(context: Path, copy: CopySource, out: Path) -> str:
    """Write a COPY source's files as a tar of context-relative paths; returns its files hash.

    The hash covers the step's source name and the tar (names, modes, mtimes, contents), so
    unchanged files hit the server's step cache and are not uploaded again.
    """
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel in copy.paths:
            tar.add(context / rel, arcname=rel, recursive=True, filter=clean)
    h = hashlib.sha256(f"COPY\0{copy.src}\0".encode())
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, 1 << 20):
            yield chunk


async def upload_copies(api: ApiClient, template_id: str, plan: BuildPlan, context: Path,
                        note: Callable[[str], None]) -> None:
    """Hash, and upload when the server lacks them, the files of every COPY step (sets filesHash)."""
    with tempfile.TemporaryDirectory(prefix="agentenv-build-") as tmp:
        for i, copy in enumerate(plan.copies):
            tar = Path(tmp) / f"copy-{i}.tar"
            files_hash = await asyncio.to_thread(pack_sources, context, copy, tar)
            plan.spec["steps"][copy.step]["filesHash"] = files_hash
            if await api.upload_files(template_id, files_hash, _file_chunks(tar)):
                note(f"uploaded {copy.src} ({tar.stat().st_size} bytes)")


# --- the build -------------------------------------------------------------------------------------


async def build(api: ApiClient, plan: BuildPlan, name: str, context: Path, *, cpu_count: int | None = None,
                memory_mb: int | None = None, force: bool = False, ready_cmd: str | None = None,
                start_cmd: str | None = None, on_log: Callable[[dict], None] = lambda e: None,
                note: Callable[[str], None] = lambda m: None) -> dict:
    """Request, upload, start and follow a build to its end; returns the final build status."""
    if start_cmd:
        plan.spec["startCmd"] = start_cmd
    if ready_cmd:
        plan.spec["readyCmd"] = ready_cmd
    if force:
        plan.spec["force"] = True
    req = await api.request_build(name, cpu_count=cpu_count, memory_mb=memory_mb)
    template_id, build_id = req["templateID"], req["buildID"]
    note(f"template {template_id}, build {build_id}")
    await upload_copies(api, template_id, plan, context, note)
    await api.start_build(template_id, build_id, plan.spec)
    offset = 0
    while True:
        status = await api.build_status(template_id, build_id, offset)
        entries = status.get("logEntries") or []
        for entry in entries:
            on_log(entry)
        offset += len(entries)
        if status.get("status") in ("ready", "error") and not entries:
            return {**status, "names": req.get("names") or [name]}
        if not entries:
            await asyncio.sleep(POLL_S)


__all__ = ["ApiError", "BuildPlan", "DockerfileError", "build", "load_plan", "parse_dockerfile",
           "parse_template_json"]
