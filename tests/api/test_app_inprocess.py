"""In-process unit tests of the HTTP layer (validation, error mapping, auth, paging, metadata decoding).

The app runs on this test session's event loop with a small in-memory orchestrator defined below and
a real SQLite-backed ApiKeyAuth; no sandboxes are booted. This is NOT the conformance test against
the real server (that is test_conformance.py).
"""

from __future__ import annotations

import asyncio
import secrets
import urllib.parse
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from aiohttp import web

from agentenv.api import ApiKeyAuth, setup_api
from agentenv.api.app import decode_page_token, parse_metadata_filter
from agentenv.config import Settings
from agentenv.constants import CLIENT_ID, ENVD_VERSION
from agentenv.errors import BadRequest, Conflict, NotFound, Unavailable, sandbox_not_found
from agentenv.models import SandboxRecord, SandboxState, TemplateRecord
from agentenv.state.sqlite import SQLiteStateStore

TEMPLATE = TemplateRecord("tplbase0001", ["base"], 2, 1024, 4096, "base")


class MemoryOrchestrator:
    """Implements the orchestrator interface the API codes against, in memory."""

    def __init__(self, capacity: int = 50):
        self.capacity = capacity
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.calls: list[tuple] = []
        self.clock = datetime(2026, 1, 1, tzinfo=timezone.utc)
        self.explode = False

    def _now(self) -> datetime:
        self.clock += timedelta(seconds=1)  # distinct, increasing startedAt for paging tests
        return self.clock

    def _get(self, sandbox_id: str, team_id: str) -> SandboxRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None or rec.team_id != team_id:
            raise sandbox_not_found(sandbox_id)
        return rec

    async def create_sandbox(self, *, team_id, template, timeout, metadata, env_vars, secure, auto_pause,
                             auto_resume, allow_internet_access, network) -> SandboxRecord:
        self.calls.append(("create", template, timeout, secure, auto_pause, auto_resume, allow_internet_access,
                           network, env_vars))
        if self.explode:
            raise RuntimeError("secret internal detail")
        if template not in (TEMPLATE.template_id, *TEMPLATE.aliases):
            raise NotFound(f"Template {template!r} not found")
        if len(self.sandboxes) >= self.capacity:
            raise Unavailable("At capacity")
        now = self._now()
        rec = SandboxRecord(
            sandbox_id="i" + secrets.token_hex(10), template_id=TEMPLATE.template_id, team_id=team_id,
            state=SandboxState.RUNNING, started_at=now, end_at=now + timedelta(seconds=timeout),
            cpu_count=2, memory_mb=1024, disk_mb=4096, envd_access_token=secrets.token_hex(8),
            alias="base", metadata=dict(metadata), env_vars=dict(env_vars), auto_pause=auto_pause,
            auto_resume=auto_resume, allow_internet_access=allow_internet_access is not False, network=network,
        )
        self.sandboxes[rec.sandbox_id] = rec
        return rec

    async def get_sandbox(self, sandbox_id, *, team_id):
        return self._get(sandbox_id, team_id)

    async def list_sandboxes(self, *, team_id):
        return [r for r in self.sandboxes.values() if r.team_id == team_id]

    async def kill_sandbox(self, sandbox_id, *, team_id):
        self._get(sandbox_id, team_id)
        del self.sandboxes[sandbox_id]

    async def set_timeout(self, sandbox_id, timeout, *, team_id):
        rec = self._get(sandbox_id, team_id)
        self.sandboxes[sandbox_id] = replace(rec, end_at=self.clock + timedelta(seconds=timeout))

    async def refresh(self, sandbox_id, duration, *, team_id):
        rec = self._get(sandbox_id, team_id)
        self.calls.append(("refresh", sandbox_id, duration))
        self.sandboxes[sandbox_id] = replace(rec, end_at=max(rec.end_at, self.clock + timedelta(seconds=duration)))

    async def connect_sandbox(self, sandbox_id, timeout, *, team_id):
        rec = self._get(sandbox_id, team_id)
        if rec.state is SandboxState.PAUSED:
            now = self._now()
            rec = replace(rec, state=SandboxState.RUNNING, started_at=now, end_at=now + timedelta(seconds=timeout))
            self.sandboxes[sandbox_id] = rec
            return rec, True
        rec = replace(rec, end_at=max(rec.end_at, self.clock + timedelta(seconds=timeout)))
        self.sandboxes[sandbox_id] = rec
        return rec, False

    async def pause_sandbox(self, sandbox_id, *, team_id):
        rec = self._get(sandbox_id, team_id)
        if rec.state is SandboxState.PAUSED:
            raise Conflict(f"Sandbox {sandbox_id} is already paused")
        self.sandboxes[sandbox_id] = replace(rec, state=SandboxState.PAUSED)

    async def list_templates(self):
        return [TEMPLATE]


class Env:
    def __init__(self, orch, client, other_client, settings, auth):
        self.orch, self.client, self.other, self.settings, self.auth = orch, client, other_client, settings, auth


@pytest.fixture
async def env(tmp_path, make_spec_client):
    store = SQLiteStateStore(tmp_path / "state.db")
    await store.open()
    runner = None
    try:
        auth = ApiKeyAuth(store)
        key, _ = await auth.create_key("test")
        other_key, _ = await auth.create_key("other", team_id="other-team")
        settings = Settings(data_dir=tmp_path, domain=None, max_timeout_s=3600)
        orch = MemoryOrchestrator()
        app = web.Application()
        setup_api(app, orch, auth, settings)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}"
        yield Env(orch, make_spec_client(url, key), make_spec_client(url, other_key), settings, auth)
    finally:
        if runner is not None:
            await runner.cleanup()
        await store.close()


async def create(env, **body) -> dict:
    body.setdefault("templateID", "base")
    r = await env.client.post("/v2/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


# --- health, spec, auth, routing ------------------------------------------------------------------


async def test_health_and_openapi_need_no_key(env):
    r = await env.client.get("/health", key=None)
    assert r.status_code == 200
    r = await env.client.get("/openapi.yaml", key=None)
    assert r.status_code == 200 and "openapi:" in r.text


@pytest.mark.parametrize("key", [None, "", "e2b_" + "0" * 40, "not-a-key"])
async def test_bad_api_key_is_401_json(env, key):
    r = await env.client.get("/v2/sandboxes", key=key)
    assert r.status_code == 401
    assert r.json()["message"].startswith("Invalid API key")
    r = await env.client.post("/v2/sandboxes", key=key, json={"templateID": "base"})
    assert r.status_code == 401
    assert env.orch.sandboxes == {}


async def test_revoked_key_is_rejected(env):
    key, rec = await env.auth.create_key("temp")
    assert (await env.client.get("/v2/sandboxes", key=key)).status_code == 200
    await env.auth.revoke(rec.key_id)
    assert (await env.client.get("/v2/sandboxes", key=key)).status_code == 401


async def test_unknown_route_and_wrong_method_are_json(env):
    r = await env.client.get("/nope", validate=False)
    assert r.status_code == 404
    r = await env.client.request("PUT", "/v2/sandboxes", validate=False)
    assert r.status_code == 405
    assert "POST" in r.headers["Allow"]


async def test_cors_headers_and_preflight(env):
    r = await env.client.get("/v2/sandboxes")
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    assert "X-Next-Token" in r.headers["Access-Control-Expose-Headers"]
    r = await env.client.request("OPTIONS", "/v2/sandboxes", key=None, validate=False,
                                 headers={"Origin": "http://x", "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "x-api-key,content-type"})
    assert r.status_code == 204
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "x-api-key,content-type"


async def test_unhandled_error_is_500_without_leak(env):
    env.orch.explode = True
    r = await env.client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 500
    msg = r.json()["message"]
    assert "secret internal detail" not in msg and "Traceback" not in r.text
    assert r.headers["X-Request-Id"] in msg


# --- create ---------------------------------------------------------------------------------------


async def test_create_v2_defaults_and_response_shape(env):
    sbx = await create(env)
    assert sbx["sandboxID"] in env.orch.sandboxes
    assert sbx["envdVersion"] == ENVD_VERSION and sbx["clientID"] == CLIENT_ID
    assert sbx["envdAccessToken"] == env.orch.sandboxes[sbx["sandboxID"]].envd_access_token
    assert sbx["domain"] is None
    call = env.orch.calls[-1]
    assert call[:4] == ("create", "base", env.settings.default_timeout_s, True)


async def test_create_passes_options_and_ignores_unknown_fields(env):
    await create(env, timeout=60, autoPause=True, autoResume={"enabled": True}, allow_internet_access=False,
                 network={"allowOut": ["1.1.1.1"], "allowPublicTraffic": False}, envVars={"A": "1"},
                 metadata={"k": "v"}, someFutureField={"x": 1}, mcp=None)
    _, template, timeout, secure, auto_pause, auto_resume, internet, network, env_vars = env.orch.calls[-1]
    assert (template, timeout, secure, auto_pause, auto_resume, internet) == ("base", 60, True, True, True, False)
    assert network == {"allowOut": ["1.1.1.1"], "allowPublicTraffic": False}
    assert env_vars == {"A": "1"}


async def test_create_v1_default_timeout_and_secure(env):
    r = await env.client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201
    assert env.orch.calls[-1][2:4] == (15, False)


async def test_chunked_request_body(env):
    def chunks():
        yield b'{"templateID":'
        yield b' "base", "timeout": 42}'

    r = await env.client.post("/v2/sandboxes", data=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    assert env.orch.calls[-1][2] == 42


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "Malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "required"),
        (b'{"timeout": 10}', "templateID"),
        (b'{"templateID": 5}', "templateID"),
        (b'{"templateID": "base", "timeout": "10"}', "timeout"),
        (b'{"templateID": "base", "timeout": 1.5}', "timeout"),
        (b'{"templateID": "base", "autoPause": "yes"}', "autoPause"),
        (b'{"templateID": "base", "metadata": {"k": 1}}', "metadata"),
        (b'{"templateID": "base", "envVars": []}', "envVars"),
        (b'{"templateID": "base", "timeout": -1}', "negative"),
        (b'{"templateID": "base", "timeout": 3601}', "Timeout cannot be greater than 1 hours"),
    ],
)
async def test_create_bad_input_is_400_and_changes_nothing(env, body, fragment):
    before = (await env.client.get("/v2/sandboxes")).json()
    r = await env.client.post("/v2/sandboxes", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert fragment in r.json()["message"]
    assert (await env.client.get("/v2/sandboxes")).json() == before
    assert env.orch.sandboxes == {}


async def test_unknown_template_and_capacity_map_to_status(env):
    r = await env.client.post("/v2/sandboxes", json={"templateID": "nope"})
    assert r.status_code == 404
    env.orch.capacity = 0
    r = await env.client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 503


# --- per-sandbox routes ---------------------------------------------------------------------------


async def test_get_detail_and_team_isolation(env):
    sbx = await create(env, metadata={"a": "b"}, autoPause=True)
    r = await env.client.get(f"/sandboxes/{sbx['sandboxID']}")
    assert r.status_code == 200
    d = r.json()
    assert d["state"] == "running" and d["metadata"] == {"a": "b"}
    assert d["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
    assert d["cpuCount"] == 2 and d["memoryMB"] == 1024 and d["diskSizeMB"] == 4096
    r = await env.other.get(f"/sandboxes/{sbx['sandboxID']}")
    assert r.status_code == 404
    assert r.json()["message"] == sandbox_not_found(sbx["sandboxID"]).message
    assert (await env.other.get("/v2/sandboxes")).json() == []


@pytest.mark.parametrize(
    "method, suffix, body",
    [
        ("GET", "", None),
        ("DELETE", "", None),
        ("POST", "/timeout", {"timeout": 10}),
        ("POST", "/refreshes", {"duration": 10}),
        ("POST", "/connect", {"timeout": 10}),
        ("POST", "/pause", {}),
        ("POST", "/resume", {}),
    ],
)
async def test_unknown_sandbox_is_404(env, method, suffix, body):
    r = await env.client.request(method, f"/sandboxes/inotthere{suffix}", json=body)
    assert r.status_code == 404
    assert r.json()["message"] == 'Sandbox "inotthere" doesn\'t exist or you don\'t have access to it'


async def test_timeout_refresh_validation(env):
    sid = (await create(env))["sandboxID"]
    before = env.orch.sandboxes[sid].end_at
    for body in ({}, {"timeout": "5"}, {"timeout": -5}, {"timeout": 10**12}):
        r = await env.client.post(f"/sandboxes/{sid}/timeout", json=body)
        assert r.status_code == 400, body
    assert env.orch.sandboxes[sid].end_at == before
    assert (await env.client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5})).status_code == 204
    assert env.orch.sandboxes[sid].end_at == env.orch.clock + timedelta(seconds=5)
    assert (await env.client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3601})).status_code == 400
    assert (await env.client.post(f"/sandboxes/{sid}/refreshes")).status_code == 204
    assert env.orch.calls[-1] == ("refresh", sid, 15)


async def test_kill_then_everything_404(env):
    sid = (await create(env))["sandboxID"]
    assert (await env.client.delete(f"/sandboxes/{sid}")).status_code == 204
    assert (await env.client.delete(f"/sandboxes/{sid}")).status_code == 404
    assert (await env.client.get(f"/sandboxes/{sid}")).status_code == 404
    assert (await env.client.post(f"/v2/sandboxes/{sid}/connect", json={})).status_code == 404


async def test_pause_connect_resume_statuses(env):
    sid = (await create(env))["sandboxID"]
    assert (await env.client.post(f"/sandboxes/{sid}/resume", json={})).status_code == 409
    assert (await env.client.post(f"/v2/sandboxes/{sid}/connect", json={})).status_code == 200
    assert (await env.client.post(f"/sandboxes/{sid}/pause")).status_code == 204  # no body (SDK 2.0)
    assert (await env.client.post(f"/sandboxes/{sid}/pause", json={})).status_code == 409
    listed = (await env.client.get("/v2/sandboxes")).json()
    assert [s["state"] for s in listed] == ["paused"]
    assert (await env.client.get("/sandboxes")).json() == []  # v1 list: running only
    r = await env.client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30})
    assert r.status_code == 201 and r.json()["sandboxID"] == sid
    assert (await env.client.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    assert (await env.client.post(f"/sandboxes/{sid}/resume", json={"timeout": 30})).status_code == 201
    assert (await env.client.post(f"/sandboxes/{sid}/connect", json={})).status_code == 400  # v1: timeout required
    assert (await env.client.post(f"/sandboxes/{sid}/connect", json={"timeout": 9999})).status_code == 400


# --- list: filters and paging ---------------------------------------------------------------------


def sdk_metadata_param(md: dict[str, str]) -> str:
    """What the Python SDK builds before the HTTP client encodes it once more."""
    return urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in md.items()})


async def test_metadata_filter_triple_encoded(env):
    a = await create(env, metadata={"user id": "a&b=c", "n": "1"})
    await create(env, metadata={"user id": "other", "n": "1"})
    r = await env.client.get("/v2/sandboxes", params={"metadata": sdk_metadata_param({"user id": "a&b=c"})})
    assert [s["sandboxID"] for s in r.json()] == [a["sandboxID"]]
    # the exact wire form from the protocol notes
    r = await env.client.get("/v2/sandboxes?metadata=user%252520id%3Da%252526b%25253Dc")
    assert [s["sandboxID"] for s in r.json()] == [a["sandboxID"]]
    r = await env.client.get("/v2/sandboxes", params={"metadata": sdk_metadata_param({"n": "1"})})
    assert len(r.json()) == 2
    r = await env.client.get("/sandboxes", params={"metadata": sdk_metadata_param({"n": "1", "user id": "x"})})
    assert r.json() == []


def test_parse_metadata_filter_unit():
    assert parse_metadata_filter("user%2520id=a%2526b%253Dc") == {"user id": "a&b=c"}
    with pytest.raises(BadRequest):
        parse_metadata_filter("novalue")


async def test_list_filters_state_template_started_after(env):
    s1 = await create(env)
    s2 = await create(env)
    await env.client.post(f"/sandboxes/{s1['sandboxID']}/pause")
    ids = lambda r: [s["sandboxID"] for s in r.json()]  # noqa: E731
    assert ids(await env.client.get("/v2/sandboxes", params={"state": "paused"})) == [s1["sandboxID"]]
    assert ids(await env.client.get("/v2/sandboxes", params={"state": "running,paused"})) == [
        s2["sandboxID"], s1["sandboxID"]]
    assert ids(await env.client.get("/v2/sandboxes", params={"template": "base"})) == [s2["sandboxID"], s1["sandboxID"]]
    assert ids(await env.client.get("/v2/sandboxes", params={"template": "other"})) == []
    started1 = datetime.fromisoformat(env.orch.sandboxes[s1["sandboxID"]].started_at.isoformat())
    r = await env.client.get("/v2/sandboxes", params={"startedAfter": started1.isoformat()})  # +00:00 offset
    assert ids(r) == [s2["sandboxID"]]
    r = await env.client.get("/v2/sandboxes?startedAfter=" + started1.isoformat())  # raw '+'
    assert ids(r) == [s2["sandboxID"]]
    assert ids(await env.client.get("/v2/sandboxes", params={"order": "asc"})) == [s1["sandboxID"], s2["sandboxID"]]


@pytest.mark.parametrize("params", [
    {"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"order": "up"}, {"state": "dead"},
    {"startedAfter": "yesterday"}, {"nextToken": "!!garbage"}, {"metadata": "novalue"},
    {"nextToken": "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwgImkxIl0"},  # well-formed but naive time: not ours
])
async def test_list_bad_query_is_400(env, params):
    r = await env.client.get("/v2/sandboxes", params=params, validate=False)
    assert r.status_code == 400


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_paging_walks_all_without_duplicates(env, order):
    created = [(await create(env))["sandboxID"] for _ in range(7)]
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"limit": "3", "order": order}
        if token:
            params["nextToken"] = token
        r = await env.client.get("/v2/sandboxes", params=params)
        assert r.status_code == 200
        seen += [s["sandboxID"] for s in r.json()]
        pages += 1
        token = r.headers.get("X-Next-Token")
        if not token:
            break
        decode_page_token(token)  # opaque but well-formed
    assert pages == 3
    assert seen == (created[::-1] if order == "desc" else created)


async def test_templates(env):
    r = await env.client.get("/templates")
    assert r.status_code == 200
    [t] = r.json()
    assert t["templateID"] == TEMPLATE.template_id and t["aliases"] == ["base"]


async def test_concurrent_creates(env):
    results = await asyncio.gather(*(create(env) for _ in range(10)))
    assert len({s["sandboxID"] for s in results}) == 10


# --- the official E2B SDK against the HTTP layer (control-plane calls only; no envd traffic) -------


async def test_e2b_sdk_control_plane_round_trip(env):
    from e2b import AsyncSandbox, SandboxQuery

    opts = dict(api_key=env.client.api_key, api_url=env.client.base_url, sandbox_url=env.client.base_url)
    sbx = await AsyncSandbox.create("base", timeout=120, metadata={"user id": "a&b=c"}, **opts)
    other = await AsyncSandbox.create("base", timeout=120, metadata={"user id": "x"}, **opts)
    assert sbx.sandbox_id in env.orch.sandboxes
    info = await sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"user id": "a&b=c"}
    await sbx.set_timeout(30)
    assert env.orch.sandboxes[sbx.sandbox_id].end_at == env.orch.clock + timedelta(seconds=30)

    found = await AsyncSandbox.list(query=SandboxQuery(metadata={"user id": "a&b=c"}), limit=1, **opts).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    pager = AsyncSandbox.list(limit=1, **opts)
    seen = []
    while pager.has_next:
        seen += [s.sandbox_id for s in await pager.next_items()]
    assert seen == [other.sandbox_id, sbx.sandbox_id]

    again = await AsyncSandbox.connect(sbx.sandbox_id, **opts)
    assert again.sandbox_id == sbx.sandbox_id
    assert await AsyncSandbox.kill(sbx.sandbox_id, **opts) is True
    assert await AsyncSandbox.kill(sbx.sandbox_id, **opts) is False  # 404 JSON -> False, not a crash
    await other.kill()
    assert env.orch.sandboxes == {}
