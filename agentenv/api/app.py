"""The E2B-compatible control API on aiohttp.

`setup_api()` adds the routes plus one middleware to any aiohttp app, so the server can share a
listener with the traffic proxy. The middleware only touches requests that resolved to one of the
routes added here, or that matched no route at all (JSON 404/405); anything else passes untouched.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from typing import Any, Awaitable, Callable, Protocol, TypeVar
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute
from pydantic import BaseModel, ValidationError

from agentenv.api import sandbox_list, schemas
from agentenv.api.auth import ApiKeyAuth
from agentenv.api.compat import (IdempotentCreates, compat_routes, refuse_memoryless_resume,
                                 refuse_unsupported_create, template_service)
from agentenv.api.sandbox_list import parse_metadata_filter
from agentenv.config import Settings
from agentenv.errors import AgentEnvError, BadRequest, Conflict, Forbidden
from agentenv.models import SandboxRecord, SnapshotRecord, TemplateRecord, rfc3339
from agentenv.observability.logs import REQUEST_ID
from agentenv.proxy.haproxy_conf import public_scheme
from agentenv.state import store_unavailable

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Expose-Headers": "X-Next-Token, X-Total-Running, X-Request-Id",
}
CORS_PREFLIGHT_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, PUT, DELETE, OPTIONS",
    "Access-Control-Max-Age": "86400",
}


class Orchestrator(Protocol):
    """What the API needs from the orchestrator (agentenv.orchestrator implements it)."""

    async def create_sandbox(self, *, team_id: str, template: str, timeout: int, metadata: dict[str, str],
                             env_vars: dict[str, str], secure: bool, auto_pause: bool, auto_resume: bool,
                             allow_internet_access: bool | None, network: dict | None) -> SandboxRecord: ...
    async def get_sandbox(self, sandbox_id: str, *, team_id: str) -> SandboxRecord: ...
    async def list_sandboxes(self, *, team_id: str) -> list[SandboxRecord]: ...
    async def kill_sandbox(self, sandbox_id: str, *, team_id: str) -> None: ...
    async def set_timeout(self, sandbox_id: str, timeout: int, *, team_id: str) -> None: ...
    async def update_network(self, sandbox_id: str, update: dict, *, team_id: str) -> None: ...
    async def refresh(self, sandbox_id: str, duration: int, *, team_id: str) -> None: ...
    async def connect_sandbox(self, sandbox_id: str, timeout: int, *,
                              team_id: str) -> tuple[SandboxRecord, bool]: ...
    async def pause_sandbox(self, sandbox_id: str, *, team_id: str, memory: bool = True) -> None: ...
    async def fork_sandbox(self, sandbox_id: str, *, team_id: str, count: int | None = None,
                           timeout: int | None = None) -> list[SandboxRecord | AgentEnvError]: ...
    async def create_snapshot(self, sandbox_id: str, *, team_id: str, name: str | None = None,
                              memory: bool = True) -> SnapshotRecord: ...
    async def list_snapshots(self, *, team_id: str, sandbox_id: str | None = None,
                             name: str | None = None) -> list[SnapshotRecord]: ...
    async def get_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> SnapshotRecord: ...
    async def delete_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> None: ...
    async def create_checkpoint(self, sandbox_id: str, *, team_id: str, name: str | None = None,
                                metadata: dict[str, str] | None = None) -> SnapshotRecord: ...
    async def rollback_sandbox(self, sandbox_id: str, checkpoint_id: str, *, team_id: str) -> SandboxRecord: ...
    async def list_checkpoints(self, sandbox_id: str, *, team_id: str) -> list[SnapshotRecord]: ...
    async def checkpoint_tree(self, checkpoint_id: str, *, team_id: str) -> tuple[str, list[SnapshotRecord]]: ...
    async def list_templates(self, team_id: str | None = None) -> list[TemplateRecord]: ...
    templates: Any  # agentenv.orchestrator.templates.TemplateService: builds, tags, names


@dataclass
class ApiContext:
    orchestrator: Orchestrator
    auth: ApiKeyAuth
    settings: Settings
    routes: set[AbstractRoute] = field(default_factory=set)
    public_routes: set[AbstractRoute] = field(default_factory=set)
    observability: Any = None  # agentenv.observability.Observability, set by the server


API_CONTEXT = web.AppKey("agentenv_api", ApiContext)
_TEAM = web.RequestKey("agentenv_team_id", str)
_REQUEST_ID = web.RequestKey("agentenv_request_id", str)


@functools.cache
def openapi_text() -> str:
    """The spec shipped as package data (the single source the request models were written from)."""
    return resources.files("agentenv.api").joinpath("openapi.yaml").read_text(encoding="utf-8")


# --- helpers --------------------------------------------------------------------------------------


def _error_response(status: int, body: dict[str, Any], request_id: str | None = None) -> web.Response:
    resp = web.json_response(body, status=status)
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


async def _body(request: web.Request, model: type[M], *, required: bool) -> M:
    """Parses a JSON object body into `model`; an absent body counts as `{}` unless required."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("Request body is required (a JSON object)")
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"Malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"Request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(f"Invalid request body: {_describe(e)}") from None


def _check_timeout(timeout: int, settings: Settings, name: str = "timeout") -> int:
    if timeout < 0:
        raise BadRequest(f"{name} must not be negative (got {timeout})")
    if timeout > settings.max_timeout_s:
        raise BadRequest(f"Timeout cannot be greater than {settings.max_timeout_s / 3600:g} hours")
    return timeout


def _encode_cursor(at: datetime, item_id: str) -> str:
    raw = json.dumps([at.astimezone(timezone.utc).isoformat(), item_id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str]:
    try:
        started, sandbox_id = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        at = datetime.fromisoformat(started)
        if at.tzinfo is None or not isinstance(sandbox_id, str):
            raise ValueError("not a token we issued")
        return at, sandbox_id
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("Invalid nextToken: pass the X-Next-Token value of a previous response") from None


def _snapshot_sort_key(rec: SnapshotRecord) -> tuple[datetime, str]:
    return rec.created_at, rec.snapshot_id


def _page(recs: list, key, cursor: tuple[datetime, str] | None, limit: int, *, desc: bool, to_json) -> web.Response:
    """One page of `recs` in `key` order after `cursor`; X-Next-Token when more follow."""
    recs = sorted(recs, key=key, reverse=desc)
    if cursor is not None:
        recs = [r for r in recs if (key(r) < cursor if desc else key(r) > cursor)]
    page = recs[:limit]
    resp = web.json_response([to_json(r) for r in page])
    if len(recs) > limit:
        resp.headers["X-Next-Token"] = _encode_cursor(*key(page[-1]))
    return resp


# --- handlers -------------------------------------------------------------------------------------


class _Handlers:
    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.orch = ctx.orchestrator
        self.settings = ctx.settings
        self.creates = IdempotentCreates()

    @property
    def templates(self) -> Any:
        return template_service(self.orch)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(text=openapi_text(), content_type="application/yaml")

    async def list_templates(self, request: web.Request) -> web.Response:
        if not hasattr(self.orch, "templates"):
            return web.json_response([schemas.template_json(t) for t in await self.orch.list_templates()])
        items = await self.templates.list_templates(request[_TEAM])
        return web.json_response([{k: v for k, v in schemas.template_with_builds_json(t, b).items() if k != "builds"}
                                  for t, b in items])

    # --- template builds (E2B's template API; see orchestrator/templates.py) ---------------------

    async def request_template_build(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.TemplateBuildRequestV3, required=True)
        name = body.name or body.alias
        if not name:
            raise BadRequest("name is required")
        tmpl, build, tags = await self.templates.request_build(
            team_id=request[_TEAM], name=name, tags=body.tags, cpu_count=body.cpu_count, memory_mb=body.memory_mb)
        return web.json_response({"templateID": tmpl.template_id, "buildID": build.build_id, "public": tmpl.public,
                                  "names": list(tmpl.aliases), "tags": tags, "aliases": list(tmpl.aliases)},
                                 status=202)

    def _files_signature(self, team: str, files_hash: str, expires: int) -> str:
        return self.templates.sign(f"{team}:{files_hash}:{expires}")

    async def template_files(self, request: web.Request) -> web.Response:
        team = request[_TEAM]
        files_hash = request.match_info["hash"]
        if await self.templates.files_present(request.match_info["templateID"], files_hash, team):
            return web.json_response({"present": True}, status=201)
        expires = int(time.time()) + 3600
        query = urlencode({"team": team, "expires": expires,
                           "signature": self._files_signature(team, files_hash, expires)})
        url = f"{public_scheme(request)}://{request.host}/template-files/{files_hash}?{query}"
        return web.json_response({"present": False, "url": url}, status=201)

    async def upload_template_files(self, request: web.Request) -> web.Response:
        q = request.query
        files_hash = request.match_info["hash"]
        try:
            team, expires, sig = q["team"], int(q["expires"]), q["signature"]
        except (KeyError, ValueError):
            raise BadRequest("team, expires and signature are required") from None
        # bytes: compare_digest refuses non-ASCII str (a TypeError, i.e. a 500, found by the API fuzzer)
        if expires < time.time() or not hmac.compare_digest(
                sig.encode(), self._files_signature(team, files_hash, expires).encode()):
            raise Forbidden("invalid or expired upload signature")
        await self.templates.store_files(team, files_hash, request.content.iter_chunked(1 << 20))
        return web.Response(status=200)

    async def start_template_build(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.TemplateBuildStartV2, required=True)
        await self.templates.start_build(request.match_info["templateID"], request.match_info["buildID"],
                                              request[_TEAM], body.spec())
        return web.Response(status=202)

    async def template_build_status(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            offset = int(q.get("logsOffset", 0))
            limit = int(q.get("limit", 100))
        except ValueError:
            raise BadRequest("logsOffset and limit must be integers") from None
        if offset < 0 or not 0 <= limit <= 100:
            raise BadRequest("logsOffset must be >= 0 and limit 0-100")
        level = q.get("level") or None
        if level not in (None, "debug", "info", "warn", "error"):
            raise BadRequest(f"invalid level {level!r}")
        build = await self.templates.build_status(request.match_info["templateID"],
                                                       request.match_info["buildID"], request[_TEAM])
        return web.json_response(schemas.build_status_json(build, offset, limit, level))

    async def get_template(self, request: web.Request) -> web.Response:
        tmpl, builds = await self.templates.get_template(request.match_info["templateID"], request[_TEAM])
        return web.json_response(schemas.template_with_builds_json(tmpl, builds))

    async def template_alias(self, request: web.Request) -> web.Response:
        tmpl = await self.templates.alias_info(request.match_info["alias"], request[_TEAM])
        return web.json_response({"templateID": tmpl.template_id, "public": tmpl.public})

    async def assign_tags(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.AssignTemplateTagsRequest, required=True)
        build_id, tags = await self.templates.assign_tags(body.target, body.tags, request[_TEAM])
        return web.json_response({"tags": tags, "buildID": build_id}, status=201)

    async def delete_tags(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.DeleteTemplateTagsRequest, required=True)
        await self.templates.remove_tags(body.name, body.tags, request[_TEAM])
        return web.Response(status=204)

    async def list_tags(self, request: web.Request) -> web.Response:
        tags = await self.templates.list_tags(request.match_info["templateID"], request[_TEAM])
        return web.json_response([{"tag": t.tag, "buildID": t.build_id, "createdAt": rfc3339(t.created_at)}
                                  for t in tags])

    async def _create(self, request: web.Request, body: schemas.NewSandboxV2, *, timeout: int,
                      secure: bool) -> web.Response:
        refuse_unsupported_create(body)
        fingerprint = self.creates.fingerprint(request, body, timeout=timeout, secure=secure)
        return await self.creates.run(request, request[_TEAM], fingerprint, functools.partial(
            self._start_sandbox, request, body, timeout=timeout, secure=secure))

    async def _start_sandbox(self, request: web.Request, body: schemas.NewSandboxV2, *, timeout: int,
                             secure: bool) -> web.Response:
        rec = await self.orch.create_sandbox(
            team_id=request[_TEAM],
            template=body.template_id,
            timeout=_check_timeout(timeout, self.settings),
            metadata=body.metadata or {},
            env_vars=body.env_vars or {},
            secure=secure,
            auto_pause=body.auto_pause,
            auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
            allow_internet_access=body.allow_internet_access,
            network=body.network.wire() if body.network is not None else None,
        )
        return web.json_response(schemas.sandbox_json(rec, self.settings), status=201)

    async def create_v1(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.NewSandbox, required=True)
        timeout = schemas.V1_DEFAULT_TIMEOUT if body.timeout is None else body.timeout
        return await self._create(request, body, timeout=timeout, secure=body.secure)

    async def create_v2(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.NewSandboxV2, required=True)
        timeout = self.settings.default_timeout_s if body.timeout is None else body.timeout
        return await self._create(request, body, timeout=timeout, secure=True)

    async def list_v1(self, request: web.Request) -> web.Response:
        """Running sandboxes only, newest first (E2B's deprecated list)."""
        wanted = parse_metadata_filter(request.query["metadata"]) if "metadata" in request.query else None
        recs = [r for r in await self.orch.list_sandboxes(team_id=request[_TEAM]) if r.state.public == "running"]
        recs = sandbox_list.in_order(sandbox_list.match_metadata(recs, wanted), ascending=False)
        return web.json_response([schemas.listed_sandbox_json(r) for r in recs])

    async def list_v2(self, request: web.Request) -> web.Response:
        query = sandbox_list.parse_query(request.query)  # every parameter, before the orchestrator
        team_id = request[_TEAM]

        async def template_id(name: str) -> str | None:
            templates = getattr(self.orch, "templates", None)  # absent on a cluster gateway
            tmpl = await templates.find_template(name, team_id) if templates is not None else None
            return tmpl.template_id if tmpl is not None else None

        page = await sandbox_list.list_page(await self.orch.list_sandboxes(team_id=team_id), query, template_id)
        resp = web.json_response([schemas.listed_sandbox_json(r) for r in page.items])
        if page.next_token is not None:
            resp.headers[sandbox_list.NEXT_TOKEN_HEADER] = page.next_token
        if page.total_running is not None:
            resp.headers[sandbox_list.TOTAL_RUNNING_HEADER] = str(page.total_running)
        return resp

    async def get_sandbox(self, request: web.Request) -> web.Response:
        rec = await self.orch.get_sandbox(request.match_info["sandboxID"], team_id=request[_TEAM])
        return web.json_response(schemas.sandbox_detail_json(rec, self.settings))

    async def kill_sandbox(self, request: web.Request) -> web.Response:
        await self.orch.kill_sandbox(request.match_info["sandboxID"], team_id=request[_TEAM])
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.SandboxTimeoutRequest, required=True)
        timeout = _check_timeout(body.timeout, self.settings)
        await self.orch.set_timeout(request.match_info["sandboxID"], timeout, team_id=request[_TEAM])
        return web.Response(status=204)

    async def update_network(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.NetworkUpdate, required=True)
        await self.orch.update_network(request.match_info["sandboxID"], body.wire(), team_id=request[_TEAM])
        return web.Response(status=204)

    async def refresh(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.SandboxRefreshRequest, required=False)
        await self.orch.refresh(request.match_info["sandboxID"], body.duration, team_id=request[_TEAM])
        return web.Response(status=204)

    async def _connect(self, request: web.Request, timeout: int, memory: bool | None = None) -> web.Response:
        if memory is False:
            refuse_memoryless_resume(await self.orch.get_sandbox(request.match_info["sandboxID"], team_id=request[_TEAM]))
        rec, resumed = await self.orch.connect_sandbox(
            request.match_info["sandboxID"], _check_timeout(timeout, self.settings), team_id=request[_TEAM]
        )
        return web.json_response(schemas.sandbox_json(rec, self.settings), status=201 if resumed else 200)

    async def connect_v1(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.ConnectSandbox, required=True)
        return await self._connect(request, body.timeout, body.memory)

    async def connect_v2(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.ConnectSandboxV2, required=False)
        return await self._connect(request, self.settings.default_timeout_s if body.timeout is None else body.timeout,
                                   body.memory)

    async def resume(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.ResumedSandbox, required=False)
        timeout = _check_timeout(body.timeout, self.settings)
        sandbox_id = request.match_info["sandboxID"]
        rec = await self.orch.get_sandbox(sandbox_id, team_id=request[_TEAM])
        if rec.state.public == "running":
            raise Conflict(f"Sandbox {sandbox_id} is already running")
        if body.memory is False:
            refuse_memoryless_resume(rec)
        rec, _ = await self.orch.connect_sandbox(sandbox_id, timeout, team_id=request[_TEAM])
        return web.json_response(schemas.sandbox_json(rec, self.settings), status=201)

    async def pause(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.SandboxPauseRequest, required=False)  # SDK 2.0 sends no body
        await self.orch.pause_sandbox(request.match_info["sandboxID"], team_id=request[_TEAM], memory=body.memory)
        return web.Response(status=204)

    async def fork(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.SandboxForkRequest, required=False)
        timeout = None if body.timeout is None else _check_timeout(body.timeout, self.settings)
        if body.count is not None and not 1 <= body.count <= self.settings.fork_max_count:
            raise BadRequest(f"count must be an integer from 1 to {self.settings.fork_max_count} (got {body.count})")
        results = await self.orch.fork_sandbox(request.match_info["sandboxID"], team_id=request[_TEAM],
                                               count=body.count, timeout=timeout)
        return web.json_response([schemas.fork_result_json(item, self.settings) for item in results], status=201)

    async def create_snapshot(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.SandboxSnapshotRequest, required=False)
        rec = await self.orch.create_snapshot(request.match_info["sandboxID"], team_id=request[_TEAM],
                                              name=body.name, memory=body.memory)
        return web.json_response(schemas.snapshot_info_json(rec), status=201)

    async def create_checkpoint(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.CheckpointRequest, required=False)
        rec = await self.orch.create_checkpoint(request.match_info["sandboxID"], team_id=request[_TEAM],
                                                name=body.name, metadata=body.metadata)
        return web.json_response(schemas.checkpoint_json(rec), status=201)

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        recs = await self.orch.list_checkpoints(request.match_info["sandboxID"], team_id=request[_TEAM])
        return web.json_response([schemas.checkpoint_json(r) for r in recs])

    async def checkpoint_tree(self, request: web.Request) -> web.Response:
        root, recs = await self.orch.checkpoint_tree(request.match_info["checkpointID"], team_id=request[_TEAM])
        return web.json_response({"rootID": root, "checkpoints": [schemas.checkpoint_json(r) for r in recs]})

    async def rollback(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.RollbackRequest, required=True)
        rec = await self.orch.rollback_sandbox(request.match_info["sandboxID"], body.checkpointID,
                                               team_id=request[_TEAM])
        return web.json_response({"sandboxID": rec.sandbox_id, "checkpointID": rec.checkpoint_id})

    async def list_snapshots(self, request: web.Request) -> web.Response:
        q = request.query
        limit = sandbox_list.parse_limit(q)
        cursor = decode_page_token(q["nextToken"]) if q.get("nextToken") else None
        recs = await self.orch.list_snapshots(team_id=request[_TEAM], sandbox_id=q.get("sandboxID") or None,
                                              name=q.get("name") or None)
        # oldest first, ties broken by id
        return _page(recs, _snapshot_sort_key, cursor, limit, desc=False, to_json=schemas.snapshot_info_json)

    async def get_snapshot(self, request: web.Request) -> web.Response:
        rec = await self.orch.get_snapshot(request.match_info["snapshotID"], team_id=request[_TEAM])
        return web.json_response(schemas.snapshot_info_json(rec))

    async def delete_snapshot(self, request: web.Request) -> web.Response:
        await self.orch.delete_snapshot(request.match_info["snapshotID"], team_id=request[_TEAM])
        return web.Response(status=204)

    # --- teams and keys: a key manages its own team only -------------------------------------------

    async def list_teams(self, request: web.Request) -> web.Response:
        team = await self.ctx.auth.ensure_team(request[_TEAM])
        limit = self.settings.max_sandboxes_per_team if team.max_sandboxes is None else team.max_sandboxes
        return web.json_response([schemas.team_json(team, limit)])

    async def list_api_keys(self, request: web.Request) -> web.Response:
        recs = await self.ctx.auth.list_keys(team_id=request[_TEAM])
        return web.json_response([schemas.api_key_json(r) for r in recs])

    async def create_api_key(self, request: web.Request) -> web.Response:
        body = await _body(request, schemas.NewTeamAPIKey, required=True)
        key, rec = await self.ctx.auth.create_key(body.name, team_id=request[_TEAM])
        return web.json_response(schemas.api_key_json(rec, key), status=201)

    async def delete_api_key(self, request: web.Request) -> web.Response:
        await self.ctx.auth.revoke(request.match_info["apiKeyID"], team_id=request[_TEAM])
        return web.Response(status=204)

    async def delete_template(self, request: web.Request) -> web.Response:
        """What the SDK's `Sandbox.delete_snapshot(id)` calls: snapshots are the only deletable templates."""
        template_id = request.match_info["templateID"]
        if hasattr(self.orch, "templates") and await self.templates.delete_template(template_id, request[_TEAM]):
            return web.Response(status=204)
        for t in await self.orch.list_templates():
            if template_id == t.template_id or template_id in t.aliases:
                raise Forbidden(f"Template {template_id!r} is built in and cannot be deleted")
        await self.orch.delete_snapshot(template_id, team_id=request[_TEAM])
        return web.Response(status=204)

    async def update_template(self, request: web.Request) -> web.Response:
        """E2B's template update (`e2b template publish`/`unpublish`): only `public: false` can be honoured.

        Templates are private to the team that built them (built-in ones are public to all); sharing a
        built template with other teams is not supported, so publishing is refused with a clear error.
        """
        body = await _body(request, schemas.TemplateUpdateRequest, required=True)
        tmpl, _ = await self.templates.get_template(request.match_info["templateID"], request[_TEAM])
        if tmpl.team_id is None:
            raise Forbidden(f"template '{tmpl.template_id}' is built in (public to every team) and cannot be changed")
        if body.public:
            raise BadRequest("publishing a template is not supported by agentenv: a built template is private to "
                             "the team that built it (see docs/limitations.md)", error_code="template_publish_unsupported")
        return web.json_response({"names": list(tmpl.aliases)})


# --- middleware -----------------------------------------------------------------------------------


def _make_middleware(ctx: ApiContext):
    @web.middleware
    async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        match = request.match_info
        routing_error = match.http_exception
        if routing_error is None and match.route not in ctx.routes:
            return await handler(request)  # someone else's route: not ours to touch
        request_id = REQUEST_ID.get() or uuid.uuid4().hex[:16]  # the observability middleware's, if any
        request[_REQUEST_ID] = request_id
        resp: web.StreamResponse
        if routing_error is not None:
            if request.method == "OPTIONS" and routing_error.status == 405:
                resp = web.Response(status=204, headers=CORS_PREFLIGHT_HEADERS)
                wanted = request.headers.get("Access-Control-Request-Headers")
                if wanted:
                    resp.headers["Access-Control-Allow-Headers"] = wanted
            else:
                message = (f"Method {request.method} not allowed on {request.path}" if routing_error.status == 405
                           else f"No route {request.method} {request.path}")
                resp = _error_response(routing_error.status, {"code": routing_error.status, "message": message},
                                       request_id)
                if routing_error.status == 405 and "Allow" in routing_error.headers:
                    resp.headers["Allow"] = routing_error.headers["Allow"]
        else:
            try:
                if match.route not in ctx.public_routes:
                    key = await ctx.auth.authenticate(request.headers.get("X-API-KEY"))
                    request[_TEAM] = key.team_id
                resp = await handler(request)
            except AgentEnvError as e:
                if e.status >= 500:
                    log.error("request %s %s %s failed: %s", request_id, request.method, request.path, e.message)
                resp = _error_response(e.status, e.to_json(), request_id)
                resp.headers.update(e.headers)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                resp = _error_response(e.status, {"code": e.status, "message": e.reason}, request_id)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception as e:
                if store_unavailable(e):  # not a bug: busy or unreachable; the SDKs retry a 503
                    log.error("request %s %s %s: the state store did not answer: %s", request_id, request.method,
                              request.path, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                    resp = _error_response(503, {"code": 503, "error_code": "state_store_unavailable",
                                                 "message": "The state store is busy or unreachable; retry "
                                                 f"shortly (request id {request_id})"}, request_id)
                    resp.headers["Retry-After"] = "1"
                else:
                    log.exception("request %s %s %s: unhandled error", request_id, request.method, request.path)
                    resp = _error_response(
                        500, {"code": 500, "message": f"Internal server error (request id {request_id})"}, request_id
                    )
        resp.headers.update(CORS_HEADERS)
        return resp

    return api_middleware


# --- public entry points --------------------------------------------------------------------------


def setup_api(app: web.Application, orchestrator: Orchestrator, auth: ApiKeyAuth, settings: Settings) -> ApiContext:
    """Adds the control-API routes and its error/auth/CORS middleware to `app` (before it starts)."""
    ctx = ApiContext(orchestrator=orchestrator, auth=auth, settings=settings)
    h = _Handlers(ctx)
    r = app.router

    def add(method: str, path: str, handler: Handler, *, public: bool = False) -> None:
        route = r.add_route(method, path, handler)
        ctx.routes.add(route)
        if public:
            ctx.public_routes.add(route)
        if method == "GET":  # aiohttp's implicit HEAD route for GET handlers
            head = r.add_route("HEAD", path, handler)
            ctx.routes.add(head)
            if public:
                ctx.public_routes.add(head)

    add("GET", "/health", h.health, public=True)
    add("GET", "/openapi.yaml", h.openapi, public=True)
    add("GET", "/templates", h.list_templates)
    add("GET", "/sandboxes", h.list_v1)
    add("POST", "/sandboxes", h.create_v1)
    add("GET", "/v2/sandboxes", h.list_v2)
    add("POST", "/v2/sandboxes", h.create_v2)
    from agentenv.observability.api import api_routes  # before /sandboxes/{sandboxID}: /sandboxes/metrics

    for method, path, handler in api_routes(ctx, lambda request: request[_TEAM]):
        add(method, path, handler)
    add("GET", "/sandboxes/{sandboxID}", h.get_sandbox)
    add("DELETE", "/sandboxes/{sandboxID}", h.kill_sandbox)
    add("POST", "/sandboxes/{sandboxID}/timeout", h.set_timeout)
    add("POST", "/sandboxes/{sandboxID}/refreshes", h.refresh)
    add("PUT", "/sandboxes/{sandboxID}/network", h.update_network)
    add("POST", "/sandboxes/{sandboxID}/connect", h.connect_v1)
    add("POST", "/v2/sandboxes/{sandboxID}/connect", h.connect_v2)
    add("POST", "/sandboxes/{sandboxID}/resume", h.resume)
    add("POST", "/sandboxes/{sandboxID}/pause", h.pause)
    add("POST", "/sandboxes/{sandboxID}/fork", h.fork)
    add("POST", "/sandboxes/{sandboxID}/snapshots", h.create_snapshot)
    add("POST", "/sandboxes/{sandboxID}/checkpoints", h.create_checkpoint)
    add("GET", "/sandboxes/{sandboxID}/checkpoints", h.list_checkpoints)
    add("POST", "/sandboxes/{sandboxID}/rollback", h.rollback)
    add("GET", "/checkpoints/{checkpointID}/tree", h.checkpoint_tree)
    add("GET", "/snapshots", h.list_snapshots)
    # Path parameters are matched percent-encoded, so IDs/names with an encoded '/' or ':' (the SDK
    # quotes them with safe="") stay one segment and arrive decoded in match_info.
    add("GET", "/snapshots/{snapshotID}", h.get_snapshot)
    add("DELETE", "/snapshots/{snapshotID}", h.delete_snapshot)
    # Literal /templates/tags before /templates/{templateID}: aiohttp matches in registration order.
    add("POST", "/templates/tags", h.assign_tags)
    add("DELETE", "/templates/tags", h.delete_tags)
    add("DELETE", "/templates/{templateID}", h.delete_template)
    add("PATCH", "/templates/{templateID}", h.update_template)
    add("PATCH", "/v2/templates/{templateID}", h.update_template)
    add("GET", "/teams", h.list_teams)
    add("GET", "/api-keys", h.list_api_keys)
    add("POST", "/api-keys", h.create_api_key)
    add("DELETE", "/api-keys/{apiKeyID}", h.delete_api_key)
    add("GET", "/templates/{templateID}", h.get_template)
    add("POST", "/v3/templates", h.request_template_build)
    add("GET", "/templates/{templateID}/files/{hash}", h.template_files)
    add("PUT", "/template-files/{hash}", h.upload_template_files, public=True)
    add("POST", "/v2/templates/{templateID}/builds/{buildID}", h.start_template_build)
    add("GET", "/templates/{templateID}/builds/{buildID}/status", h.template_build_status)
    add("GET", "/templates/aliases/{alias}", h.template_alias)
    add("GET", "/templates/{templateID}/tags", h.list_tags)
    # E2B routes beyond the core (docs/e2b-compatibility.md)
    for method, path, handler in compat_routes(orchestrator, lambda request: request[_TEAM]):
        add(method, path, handler)

    app[API_CONTEXT] = ctx
    app.middlewares.append(_make_middleware(ctx))
    return ctx


def create_api_app(orchestrator: Orchestrator, auth: ApiKeyAuth, settings: Settings) -> web.Application:
    """A standalone aiohttp app serving only the control API."""
    app = web.Application()
    setup_api(app, orchestrator, auth, settings)
    return app
