"""Template builds (E2B's template API) through the cluster gateway.

A build runs on one node: its build sandboxes, the COPY contexts the SDK uploads and the step
cache live there. The gateway relays the template routes to the nodes' own public API (the same
handlers, validation and errors as a single node; the node authenticates the same API key):

- `POST /v3/templates` (request a build): placed by the scheduler (`kind: build`), relayed to the
  chosen node, which records itself as the build's node (`spec["node"]`, in PostgreSQL);
- `GET /templates/{id}/files/{hash}`: to the node of the template's newest waiting build; the
  upload URL it signs is rewritten to point at this gateway and names that node (`node=`);
- `PUT /template-files/{hash}?…&node=`: the upload streamed to that node (its signature is checked
  there);
- `POST /v2/templates/{id}/builds/{buildID}` (start) and the status / logs polls: to the build's
  node. A build whose node was declared dead while it ran is ended with a reason (its status is
  then answered by any node);
- every other template route (list, get, aliases, tags, delete, publish) reads or changes only the
  shared catalog: relayed to any live node.

A node publishes a finished build's layers and memory image to the S3 snapshot store before it
marks it ready, so a create from the template on any node pulls what it lacks.
"""

from __future__ import annotations

import json
import logging
import re
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from agentenv.errors import BadRequest, Unavailable
from agentenv.models import BuildStatus, NodeRecord, TemplateBuildRecord, TemplateRecord, rfc3339, utcnow
from agentenv.proxy.haproxy_conf import public_scheme

log = logging.getLogger("agentenv.cluster.builds")

_TEMPLATES = re.compile(r"^/(?:v[23]/)?templates(?:/|$)")
_REQUEST = re.compile(r"^/v3/templates$")
_FILES = re.compile(r"^/templates/([^/]+)/files/([^/]+)$")
_UPLOAD = re.compile(r"^/template-files/([^/]+)$")
_START = re.compile(r"^/v2/templates/([^/]+)/builds/([^/]+)$")
_POLL = re.compile(r"^/templates/([^/]+)/builds/([^/]+)/(?:status|logs)$")
_RELAYED_HEADERS = ("Retry-After", "Should-Retry", "X-Next-Token", "X-Request-Id")


async def template_build(store, name: str) -> tuple[TemplateRecord | None, TemplateBuildRecord | None]:
    """A create's template (`name`, `name:tag` or an ID) and the build it starts from (None: not a
    built template), for placement: the scheduler prefers nodes that cache the build's layers and
    needs a node serving the runtime of its memory image. The node resolves it again, with checks."""
    from agentenv.orchestrator.templates import DEFAULT_TAG, split_name

    tmpl, tag = await store.get_template(name), None
    if tmpl is None:
        base, tag = split_name(name)
        tmpl = await store.get_template(base) if tag is not None else None
        if tmpl is None:
            return None, None
    tags = {t.tag: t.build_id for t in await store.list_tags(tmpl.template_id)}
    build_id = tags.get(tag or DEFAULT_TAG)
    build = await store.get_build(build_id) if build_id else None
    return tmpl, (build if build is not None and build.status == BuildStatus.READY else None)


class BuildRouter:
    """Relays the template routes of the gateway's public API to the right node."""

    def __init__(self, orch, auth) -> None:
        self.orch = orch  # cluster.gateway.ClusterOrchestrator: store, client, nodes, placement
        self.auth = auth

    def matches(self, request: web.Request) -> bool:
        return request.method != "OPTIONS" and bool(_TEMPLATES.match(request.path) or _UPLOAD.match(request.path))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        if method == "PUT" and _UPLOAD.match(path):  # public: the signed URL is the credential
            return await self._forward(request, await self._upload_node(request), stream=True)
        await self.auth.authenticate(request.headers.get("X-API-KEY"))
        if method == "POST" and _REQUEST.match(path):
            return await self._request_build(request)
        if method == "GET" and (m := _FILES.match(path)):
            return await self._files(request, m.group(1), m.group(2))
        if method == "POST" and (m := _START.match(path)):
            node = await self._build_node(m.group(2), for_start=True)
            return await self._forward(request, node or await self.orch._any_node())
        if method == "GET" and (m := _POLL.match(path)):
            node = await self._build_node(m.group(2), for_start=False)
            return await self._forward(request, node or await self.orch._any_node())
        return await self._forward(request, await self.orch._any_node())

    # ------------------------------------------------------------------ the routes

    async def _request_build(self, request: web.Request) -> web.StreamResponse:
        """Placed like a sandbox of the build's size, under the runtime builds need (gVisor)."""
        body = await request.read()
        try:
            req = json.loads(body or b"{}")
            req = req if isinstance(req, dict) else {}
        except ValueError:
            req = {}  # the node answers the 400
        s = self.orch.settings
        cpu = req.get("cpuCount") if isinstance(req.get("cpuCount"), int) else s.default_cpu_count
        mem = req.get("memoryMB") if isinstance(req.get("memoryMB"), int) else s.default_memory_mb
        placed = await self.orch._place(kind="build", cpu=cpu, memory_mb=mem, layers=[], runtime="gvisor",
                                        wait_s=s.admission_wait_s)
        try:
            node = await self.orch._alive(placed["node_id"])
            if node is None:
                raise Unavailable(f"node {placed['node_id']} is not responding", error_code="node_unreachable",
                                  headers={"Retry-After": "2"})
            resp = await self._forward(request, node, body=body)
        finally:
            self.orch._release(placed["reservation"])
        if resp.status < 300:
            log.info("template build requested on node %s", node.node_id)
        return resp

    async def _files(self, request: web.Request, template: str, files_hash: str) -> web.StreamResponse:
        """The node of the template's newest waiting build keeps its uploads; the upload URL it
        signs is rewritten to point here, naming that node."""
        node = await self._waiting_node(template)
        resp = await self._forward(request, node or await self.orch._any_node())
        if node is None or resp.status >= 300:
            return resp
        data = json.loads(resp.body)
        if data.get("url"):
            _, _, query = data["url"].partition("?")
            data["url"] = (f"{public_scheme(request)}://{request.host}/template-files/{files_hash}?{query}&"
                           + urlencode({"node": node.node_id}))
        return web.json_response(data, status=resp.status)

    async def _upload_node(self, request: web.Request) -> NodeRecord:
        node_id = request.query.get("node")
        if not node_id:
            raise BadRequest("this upload URL names no node: request a new one through the gateway")
        node = await self.orch._alive(node_id)
        if node is None:
            raise Unavailable(f"node {node_id}, which runs this build, is not responding; retry later or start a "
                              "new build", error_code="node_unreachable", headers={"Retry-After": "2"})
        return node

    async def _waiting_node(self, template: str) -> NodeRecord | None:
        tmpl = await self.orch.store.get_template(template)
        if tmpl is None:
            return None
        waiting = [b for b in await self.orch.store.list_builds(tmpl.template_id)
                   if b.status == BuildStatus.WAITING and b.spec.get("node")]
        if not waiting:
            return None
        newest = max(waiting, key=lambda b: b.created_at)
        return await self._alive_or_unavailable(newest)

    async def _build_node(self, build_id: str, *, for_start: bool) -> NodeRecord | None:
        """The node that holds (or runs) the build; None: any node can answer (no such build, a
        finished one, or one whose node is gone: ended here with a reason)."""
        build = await self.orch.store.get_build(build_id)
        if build is None or not build.spec.get("node"):
            return None
        node = await self.orch._alive(build.spec["node"])
        if node is not None:
            return node
        if build.status == BuildStatus.BUILDING:
            await self._fail_lost(build)
        elif for_start and build.status == BuildStatus.WAITING:
            await self._alive_or_unavailable(build)
        return None

    async def _alive_or_unavailable(self, build: TemplateBuildRecord) -> NodeRecord:
        node = await self.orch._alive(build.spec["node"])
        if node is None:
            raise Unavailable(f"node {build.spec['node']}, which holds build {build.build_id} and its uploaded "
                              "files, is not responding; retry later or start a new build",
                              error_code="node_unreachable", headers={"Retry-After": "2"})
        return node

    async def _fail_lost(self, build: TemplateBuildRecord) -> None:
        """The cluster declared the build's node dead while it ran: the build can never finish."""
        msg = f"the node that ran this build ({build.spec['node']}) was lost; start a new build"
        build.status = BuildStatus.ERROR
        build.reason = {"message": msg}
        build.finished_at = build.updated_at = utcnow()
        build.logs.append({"timestamp": rfc3339(utcnow()), "level": "error", "message": msg})
        await self.orch.store.put_build(build)
        log.warning("build %s of template %s: its node %s is dead", build.build_id, build.template_id,
                    build.spec["node"])

    # ------------------------------------------------------------------ relaying

    async def _forward(self, request: web.Request, node: NodeRecord, *, body: bytes | None = None,
                       stream: bool = False) -> web.Response:
        """The request, as it came, to `node`'s public API; its answer, as it came."""
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("x-api-key", "authorization", "content-type", "accept")}
        if stream:
            data = request.content.iter_chunked(1 << 20)
        else:
            data = body if body is not None else await request.read()
        try:
            async with self.orch.client.session.request(request.method, f"{node.url}{request.rel_url}",
                                                        headers=headers, data=data or None) as resp:
                payload = await resp.read()
                out = web.Response(body=payload, status=resp.status,
                                   content_type=resp.content_type if payload else None)
                out.headers.update({h: resp.headers[h] for h in _RELAYED_HEADERS if h in resp.headers})
                return out
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise Unavailable(f"node {node.node_id} is unreachable: {e or type(e).__name__}",
                              error_code="node_unreachable", headers={"Retry-After": "2"}) from e

