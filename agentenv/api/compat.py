"""E2B control-plane routes beyond the core sandbox lifecycle (see docs/e2b-compatibility.md).

- Template reads the pinned SDKs' generated clients carry: paginated `GET /v2/templates`,
  `GET /default-templates`, build logs (`GET /templates/{id}/builds/{buildID}/logs`) and the tag
  summaries `GET /templates/{id}/tags/count` and `/tags/exists`.
- Volumes and secrets, which this deployment does not have: the lists are truthfully empty, an
  unknown id is a 404, and creating one is a JSON 501 that says so (instead of a bare "no route"),
  so `Volume.create()` / `Secret.create()` fail with a readable SDK exception.

Kept out of app.py so the core handlers stay small; `setup_api` adds these routes like the
observability ones.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
import time
from datetime import datetime
from typing import Any, Awaitable, Callable

from aiohttp import web

from agentenv.api import schemas
from agentenv.errors import AgentEnvError, BadRequest, NotFound
from agentenv.models import BuildStatus, SandboxRecord, TemplateBuildRecord, TemplateRecord

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TeamOf = Callable[[web.Request], str]

LOG_LEVELS = ("debug", "info", "warn", "error")
BUILD_LOGS_LIMIT_MAX = 100
TEMPLATES_LIMIT_MAX = 100
NOT_SUPPORTED = "not_supported"


def _int_param(q: Any, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"Invalid {name} {raw!r}: expected an integer") from None
    if value < lo or (hi is not None and value > hi):
        raise BadRequest(f"Invalid {name} {value}: expected {lo}..{hi if hi is not None else 'inf'}")
    return value


def _choice(q: Any, name: str, allowed: tuple[str, ...]) -> str | None:
    value = q.get(name) or None
    if value is not None and value not in allowed:
        raise BadRequest(f"Invalid {name} {value!r}: expected one of {', '.join(allowed)}")
    return value


def _ms(entry: dict) -> float:
    return datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp() * 1000


def build_log_page(build: TemplateBuildRecord, *, cursor: int | None, limit: int, direction: str,
                   level: str | None) -> list[dict]:
    """`TemplateBuildLogsResponse.logs`: forward = oldest first from `cursor` (ms, inclusive);
    backward = newest first up to `cursor`; `level` is the minimum level."""
    entries = list(build.logs)
    if level is not None:
        floor = LOG_LEVELS.index(level)
        entries = [e for e in entries if LOG_LEVELS.index(e.get("level", "info")) >= floor]
    if direction == "forward":
        if cursor is not None:
            entries = [e for e in entries if _ms(e) >= cursor]
    else:
        if cursor is not None:
            entries = [e for e in entries if _ms(e) <= cursor]
        entries.reverse()
    return [{k: e[k] for k in ("timestamp", "level", "message", "step") if k in e} for e in entries[:limit]]


def _encode_cursor(created_at: datetime, template_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), template_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: str) -> tuple[datetime, str]:
    try:
        created, template_id = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        at = datetime.fromisoformat(created)
        if not isinstance(template_id, str):
            raise ValueError("not a token we issued")
        return at, template_id
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("Invalid nextToken: pass the X-Next-Token value of a previous response") from None


def not_supported(what: str, why: str) -> AgentEnvError:
    return AgentEnvError(f"{what} are not supported by this deployment: {why}", status=501,
                         error_code=NOT_SUPPORTED)


def template_service(orchestrator: Any) -> Any:
    """A node's template service; a cluster gateway has none (it relays the template routes to the
    nodes before they get here: `cluster/builds.py`)."""
    service = getattr(orchestrator, "templates", None)
    if service is None:
        raise not_supported("This template route through the cluster gateway",
                            "call a node's own API (see docs/cluster.md)")
    return service


VOLUMES_WHY = "sandboxes have no persistent volumes here; snapshots keep files"
SECRETS_WHY = "there is no secret store; pass values as environment variables"


class CompatHandlers:
    def __init__(self, orchestrator: Any, team_of: TeamOf) -> None:
        self.orch = orchestrator
        self.team_of = team_of

    # --- templates ---------------------------------------------------------------------------------

    async def _templates(self, team: str) -> list[tuple[TemplateRecord, list[TemplateBuildRecord]]]:
        if not hasattr(self.orch, "templates"):  # an orchestrator without the template service
            return [(t, []) for t in await self.orch.list_templates()]
        return await template_service(self.orch).list_templates(team)

    @staticmethod
    def _template_json(tmpl: TemplateRecord, builds: list[TemplateBuildRecord]) -> dict[str, Any]:
        out = schemas.template_with_builds_json(tmpl, builds)
        out.pop("builds")
        out["isDefault"] = tmpl.team_id is None
        return out

    async def list_templates_v2(self, request: web.Request) -> web.Response:
        q = request.query
        limit = _int_param(q, "limit", TEMPLATES_LIMIT_MAX, 1, TEMPLATES_LIMIT_MAX)
        cursor = _decode_cursor(q["nextToken"]) if q.get("nextToken") else None
        items = sorted(await self._templates(self.team_of(request)),
                       key=lambda tb: (tb[0].created_at, tb[0].template_id))
        if cursor is not None:
            items = [tb for tb in items if (tb[0].created_at, tb[0].template_id) > cursor]
        page = items[:limit]
        resp = web.json_response([self._template_json(t, b) for t, b in page])
        if len(items) > limit:
            resp.headers["X-Next-Token"] = _encode_cursor(page[-1][0].created_at, page[-1][0].template_id)
        return resp

    async def default_templates(self, request: web.Request) -> web.Response:
        items = [(t, b) for t, b in await self._templates(self.team_of(request)) if t.team_id is None]
        items.sort(key=lambda tb: tb[0].template_id)
        return web.json_response([self._template_json(t, b) for t, b in items])

    async def build_logs(self, request: web.Request) -> web.Response:
        q = request.query
        cursor = _int_param(q, "cursor", None, 0)
        limit = _int_param(q, "limit", BUILD_LOGS_LIMIT_MAX, 0, BUILD_LOGS_LIMIT_MAX)
        direction = _choice(q, "direction", ("forward", "backward")) or "forward"
        level = _choice(q, "level", LOG_LEVELS)
        _choice(q, "source", ("temporary", "persistent"))  # one store here: both name the same logs
        build = await template_service(self.orch).build_status(request.match_info["templateID"],
                                                       request.match_info["buildID"], self.team_of(request))
        return web.json_response({"logs": build_log_page(build, cursor=cursor, limit=limit or 0,
                                                          direction=direction, level=level)})

    async def _ready_tags(self, request: web.Request) -> set[str]:
        """Tags of the template that name a ready build (the ones a sandbox can start from)."""
        team = self.team_of(request)
        template_id = request.match_info["templateID"]
        tags = await template_service(self.orch).list_tags(template_id, team)
        _, builds = await template_service(self.orch).get_template(template_id, team)
        ready = {b.build_id for b in builds if b.status == BuildStatus.READY}
        return {t.tag for t in tags if t.build_id in ready}

    async def tags_count(self, request: web.Request) -> web.Response:
        return web.json_response({"total": len(await self._ready_tags(request))})

    async def tag_exists(self, request: web.Request) -> web.Response:
        tag = (request.query.get("tag") or "").strip()
        if not tag:
            raise BadRequest("tag is required")
        return web.json_response({"exists": tag in await self._ready_tags(request), "normalizedTag": tag})

    # --- volumes and secrets: none exist here -------------------------------------------------------

    async def list_empty(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def create_volume(self, request: web.Request) -> web.Response:
        raise not_supported("Volumes", VOLUMES_WHY)

    async def volume_not_found(self, request: web.Request) -> web.Response:
        raise NotFound(f"volume {request.match_info['volumeID']!r} not found ({VOLUMES_WHY})")

    async def create_secret(self, request: web.Request) -> web.Response:
        raise not_supported("Secrets", SECRETS_WHY)

    async def secret_not_found(self, request: web.Request) -> web.Response:
        raise NotFound(f"secret {request.match_info['secretID']!r} not found ({SECRETS_WHY})")


def compat_routes(orchestrator: Any, team_of: TeamOf) -> list[tuple[str, str, Handler]]:
    """(method, path, handler) to register with the API's auth and error middleware."""
    h = CompatHandlers(orchestrator, team_of)
    return [
        ("GET", "/v2/templates", h.list_templates_v2),
        ("GET", "/default-templates", h.default_templates),
        ("GET", "/templates/{templateID}/builds/{buildID}/logs", h.build_logs),
        ("GET", "/templates/{templateID}/tags/count", h.tags_count),
        ("GET", "/templates/{templateID}/tags/exists", h.tag_exists),
        ("GET", "/volumes", h.list_empty),
        ("POST", "/volumes", h.create_volume),
        ("GET", "/volumes/{volumeID}", h.volume_not_found),
        ("DELETE", "/volumes/{volumeID}", h.volume_not_found),
        ("GET", "/secrets", h.list_empty),
        ("POST", "/secrets", h.create_secret),
        ("GET", "/secrets/{secretID}", h.secret_not_found),
        ("POST", "/secrets/{secretID}", h.secret_not_found),
        ("DELETE", "/secrets/{secretID}", h.secret_not_found),
    ]



def refuse_unsupported_create(body: schemas.NewSandboxV2) -> None:
    """A create asking for what this deployment cannot give fails before anything starts (E2B would
    mount the volumes / issue the workload tokens; starting without them would fail later, silently)."""
    if body.volume_mounts:
        raise BadRequest(f"volumeMounts: volumes are not supported by this deployment ({VOLUMES_WHY})",
                         error_code=NOT_SUPPORTED)
    if body.iam and body.iam.get("tokens"):
        raise BadRequest("iam.tokens: workload identity tokens are not supported by this deployment",
                         error_code=NOT_SUPPORTED)


def refuse_memoryless_resume(rec: SandboxRecord) -> None:
    """`memory: false` on connect/resume (the SDK's `on_resume="reboot"`) asks for a cold boot from the
    disk of a sandbox paused with its memory. The orchestrator cannot do that yet; E2B's rule is to refuse
    where the capability is off, never to restore the memory instead. A running sandbox or a
    filesystem-only pause makes it a no-op, as in E2B."""
    if rec.state.public == "paused" and rec.pause_mode != "filesystem":
        raise BadRequest(f"memory=false (resume from disk only, cold boot) is not supported by this deployment for "
                         f"sandbox {rec.sandbox_id}, which was paused with its memory: resume it with its memory",
                         error_code=NOT_SUPPORTED)


IDEMPOTENCY_TTL_S = 24 * 3600
_IDEMPOTENCY_KEY = re.compile(r"^[a-z0-9-]{1,255}$")
IDEMPOTENCY_HEADER = "Idempotency-Key"


class IdempotentCreates:
    """`Idempotency-Key` on sandbox creates (the Python SDK's `idempotency_key`, reused by its retries).

    The first create with a key runs; a repeat within a day with the same request answers that create's
    result (201, same sandbox) instead of starting another, and one that arrives while the first is still
    running waits for it. The same key with a different request is a 422. A failed create frees the key,
    so a retry really retries. Kept in memory: a server restart forgets the keys.
    """

    def __init__(self, ttl_s: float = IDEMPOTENCY_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[tuple[str, str], tuple[float, str, asyncio.Future[tuple[int, bytes]]]] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, (until, _, fut) in self._seen.items() if until < now and fut.done()]:
            del self._seen[k]

    @staticmethod
    def fingerprint(request: web.Request, body: schemas.NewSandboxV2, **effective: Any) -> str:
        """What makes two creates the same request: the path and the parsed body with the defaults the
        handler applied (so an SDK spelling out defaults and a client omitting them match)."""
        fields = {k: v for k, v in body.model_dump().items() if v not in (None, {}, [])}
        raw = json.dumps([request.path, fields, effective], sort_keys=True, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()

    async def run(self, request: web.Request, team: str, fingerprint: str,
                  create: Callable[[], Awaitable[web.Response]]) -> web.Response:
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None:
            return await create()
        if not _IDEMPOTENCY_KEY.match(key):
            raise BadRequest(f"Invalid {IDEMPOTENCY_HEADER}: expected 1-255 lowercase letters, digits or hyphens")
        self._expire()
        seen = self._seen.get((team, key))
        if seen is not None:
            if seen[1] != fingerprint:
                raise AgentEnvError(f"{IDEMPOTENCY_HEADER} {key!r} was already used with a different request",
                                    status=422, error_code="idempotency_key_reused")
            status, body = await asyncio.shield(seen[2])
            return web.Response(status=status, body=body, content_type="application/json",
                                headers={"Idempotent-Replayed": "true"})
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._seen[(team, key)] = (time.monotonic() + self.ttl_s, fingerprint, fut)
        try:
            resp = await create()
        except BaseException as exc:
            del self._seen[(team, key)]
            if isinstance(exc, Exception):
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody waited
            else:
                fut.cancel()
            raise
        fut.set_result((resp.status, bytes(resp.body)))
        return resp
