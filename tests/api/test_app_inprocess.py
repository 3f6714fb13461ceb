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
from agentenv.api.sandbox_list import decode_token
from agentenv.config import Settings
from agentenv.constants import CLIENT_ID, ENVD_VERSION
from agentenv.errors import AgentEnvError, BadRequest, Conflict, NotFound, Unavailable, sandbox_not_found
from agentenv.models import SandboxRecord, SandboxState, SnapshotRecord, TemplateRecord
from agentenv.state.sqlite import SQLiteStateStore

TEMPLATE = TemplateRecord("tplbase0001", ["base"], 2, 1024, 4096, "base")


class MemoryOrchestrator:
    """Implements the orchestrator interface the API codes against, in memory."""

    def __init__(self, capacity: int = 50):
        self.capacity = capacity
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.calls: list[tuple] = []
        self.clock = datetime(2026, 1, 1, tzinfo=timezone.utc)
        self.explode: bool | BaseException = False  # an exception: that one
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.fork_failures: dict[int, AgentEnvError] = {}  # child index -> error for that fork

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
        if isinstance(self.explode, BaseException):
            raise self.explode
        if self.explode:
            raise RuntimeError("secret internal detail")
        snap = self._find_snapshot(template, team_id)
        if snap is None and template not in (TEMPLATE.template_id, *TEMPLATE.aliases):
            raise NotFound(f"Template {template!r} not found")
        if len(self.sandboxes) >= self.capacity:
            raise Unavailable("At capacity")
        return self._new(team_id, timeout, snapshot_id=snap.snapshot_id if snap else None, metadata=metadata,
                         env_vars=env_vars, auto_pause=auto_pause, auto_resume=auto_resume,
                         allow_internet_access=allow_internet_access, network=network)

    def _new(self, team_id, timeout, *, snapshot_id=None, parent_id=None, metadata=None, env_vars=None,
             auto_pause=False, auto_resume=False, allow_internet_access=None, network=None) -> SandboxRecord:
        now = self._now()
        rec = SandboxRecord(
            sandbox_id="i" + secrets.token_hex(10), template_id=TEMPLATE.template_id, team_id=team_id,
            state=SandboxState.RUNNING, started_at=now, end_at=now + timedelta(seconds=timeout),
            cpu_count=2, memory_mb=1024, disk_mb=4096, envd_access_token=secrets.token_hex(8),
            alias="base", metadata=dict(metadata or {}), env_vars=dict(env_vars or {}), auto_pause=auto_pause,
            auto_resume=auto_resume, allow_internet_access=allow_internet_access is not False, network=network,
            snapshot_id=snapshot_id, parent_id=parent_id,
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

    async def pause_sandbox(self, sandbox_id, *, team_id, memory=True):
        rec = self._get(sandbox_id, team_id)
        self.calls.append(("pause", sandbox_id, memory))
        if rec.state is SandboxState.PAUSED:
            raise Conflict(f"Sandbox {sandbox_id} is already paused")
        self.sandboxes[sandbox_id] = replace(rec, state=SandboxState.PAUSED,
                                             pause_mode="full" if memory else "filesystem")

    async def fork_sandbox(self, sandbox_id, *, team_id, count=None, timeout=None):
        rec = self._get(sandbox_id, team_id)
        self.calls.append(("fork", sandbox_id, count, timeout))
        if rec.state is SandboxState.PAUSED:
            raise Conflict(f"Sandbox {sandbox_id} is paused")
        count = 1 if count is None else count
        if not 1 <= count <= 16:
            raise BadRequest("count out of range")
        if len(self.sandboxes) + count > self.capacity:
            raise Unavailable("At capacity")
        out: list[SandboxRecord | AgentEnvError] = []
        for i in range(count):
            if i in self.fork_failures:
                out.append(self.fork_failures[i])
            else:
                out.append(self._new(team_id, 15 if timeout is None else timeout, parent_id=sandbox_id,
                                     metadata=rec.metadata))
        return out

    def _find_snapshot(self, id_or_name, team_id) -> SnapshotRecord | None:
        for snap in self.snapshots.values():
            if snap.team_id == team_id and id_or_name in (snap.snapshot_id, *snap.names):
                return snap
        return None

    def _get_snapshot(self, id_or_name, team_id) -> SnapshotRecord:
        snap = self._find_snapshot(id_or_name, team_id)
        if snap is None:
            raise NotFound(f"Snapshot {id_or_name!r} not found")
        return snap

    async def create_snapshot(self, sandbox_id, *, team_id, name=None, memory=True):
        rec = self._get(sandbox_id, team_id)
        self.calls.append(("snapshot", sandbox_id, name, memory))
        if rec.state is SandboxState.PAUSED:
            raise Conflict(f"Sandbox {sandbox_id} is paused")
        snap = SnapshotRecord(
            snapshot_id=f"snap-{secrets.token_hex(6)}:default", team_id=team_id,
            names=[f"team/{name}:default"] if name else [], source_sandbox_id=sandbox_id,
            template_id=rec.template_id, image="base", layers=["sha256:" + "a" * 64],
            memory_digest=("sha256:" + "b" * 64) if memory else None, cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb, disk_mb=rec.disk_mb, size_bytes=1234, created_at=self._now(),
        )
        self.snapshots[snap.snapshot_id] = snap
        return snap

    async def list_snapshots(self, *, team_id, sandbox_id=None, name=None):
        self.calls.append(("list_snapshots", sandbox_id, name))
        return [s for s in sorted(self.snapshots.values(), key=lambda s: s.created_at)
                if s.team_id == team_id and (sandbox_id is None or s.source_sandbox_id == sandbox_id)
                and (name is None or name in s.names)]

    async def get_snapshot(self, snapshot_id_or_name, *, team_id):
        return self._get_snapshot(snapshot_id_or_name, team_id)

    async def delete_snapshot(self, snapshot_id_or_name, *, team_id):
        snap = self._get_snapshot(snapshot_id_or_name, team_id)
        self.calls.append(("delete_snapshot", snapshot_id_or_name))
        del self.snapshots[snap.snapshot_id]

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


async def test_state_store_not_answering_is_503_with_retry_after(env):
    """A store that did not answer (its pool exhausted under load, a lost connection) is not a bug:
    503 with Retry-After, which the SDKs retry, and a message that says what happened."""
    from sqlalchemy import exc as sa

    env.orch.explode = sa.TimeoutError("QueuePool limit of size 10 overflow 0 reached, connection timed out, "
                                       "timeout 30.00")
    r = await env.client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    body = r.json()
    assert body["error_code"] == "state_store_unavailable" and "state store" in body["message"]
    assert r.headers["X-Request-Id"] in body["message"] and "QueuePool" not in body["message"]
    env.orch.explode = sa.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
    assert (await env.client.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 503
    env.orch.explode = sa.IntegrityError("INSERT", {}, ValueError("duplicate key"))  # a bug: still 500
    assert (await env.client.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 500


# --- create ---------------------------------------------------------------------------------------


async def test_create_v2_defaults_and_response_shape(env):
    sbx = await create(env)
    assert sbx["sandboxID"] in env.orch.sandboxes
    assert sbx["envdVersion"] == ENVD_VERSION and sbx["clientID"] == CLIENT_ID
    assert sbx["envdAccessToken"] == env.orch.sandboxes[sbx["sandboxID"]].envd_access_token
    assert sbx["domain"] == env.settings.sandbox_domain() == "localhost:3000"
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
        ("POST", "/fork", {}),
        ("POST", "/snapshots", {}),
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


# --- pause with memory flag, fork, snapshots -------------------------------------------------------


def quote_segment(value: str) -> str:
    """How the SDK puts a snapshot/template ID into a path (`encode_path_param`)."""
    return urllib.parse.quote(value, safe="")


@pytest.mark.parametrize("kw, memory", [
    ({}, True),  # no body at all (SDK 2.0)
    ({"json": {}}, True),
    ({"json": {"memory": True}}, True),
    ({"json": {"memory": False}}, False),
    ({"json": {"requireHealthyGuest": True, "futureField": 1}}, True),  # accepted, ignored
])
async def test_pause_memory_flag(env, kw, memory):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/pause", **kw)
    assert r.status_code == 204, r.text
    assert env.orch.calls[-1] == ("pause", sid, memory)
    r = await env.client.get(f"/sandboxes/{sid}")
    assert r.json()["state"] == "paused"


@pytest.mark.parametrize("body", [b'{"memory": "no"}', b'{"memory": 0}', b'{"requireHealthyGuest": "yes"}',
                                  b"[true]", b"{bad"])
async def test_pause_bad_body_is_400_and_does_not_pause(env, body):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/pause", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert env.orch.sandboxes[sid].state is SandboxState.RUNNING
    assert not any(c[0] == "pause" for c in env.orch.calls)


async def test_fork_count_two_and_child_shape(env):
    src = await create(env, metadata={"k": "v"})
    r = await env.client.post(f"/sandboxes/{src['sandboxID']}/fork", json={"count": 2, "timeout": 60})
    assert r.status_code == 201, r.text
    assert env.orch.calls[-1] == ("fork", src["sandboxID"], 2, 60)
    results = r.json()
    assert len(results) == 2 and all(set(item) == {"sandbox"} for item in results)
    children = [item["sandbox"] for item in results]
    assert len({c["sandboxID"] for c in children} | {src["sandboxID"]}) == 3
    for child in children:
        rec = env.orch.sandboxes[child["sandboxID"]]
        assert child["envdAccessToken"] == rec.envd_access_token
        assert child["envdVersion"] == ENVD_VERSION and child["clientID"] == CLIENT_ID
        assert child["templateID"] == rec.template_id and child["domain"] == "localhost:3000"
        assert rec.parent_id == src["sandboxID"]
        assert (await env.client.get(f"/sandboxes/{child['sandboxID']}")).status_code == 200


@pytest.mark.parametrize("kw", [{}, {"json": {}}])
async def test_fork_without_body_leaves_defaults_to_orchestrator(env, kw):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/fork", **kw)
    assert r.status_code == 201, r.text
    assert env.orch.calls[-1] == ("fork", sid, None, None)
    assert len(r.json()) == 1


@pytest.mark.parametrize("body, fragment", [
    (b'{"count": 0}', "count"),
    (b'{"count": -1}', "count"),
    (b'{"count": 17}', "from 1 to 16"),
    (b'{"count": "2"}', "count"),
    (b'{"count": true}', "count"),
    (b'{"count": 1.5}', "count"),
    (b'{"timeout": -1}', "negative"),
    (b'{"timeout": 3601}', "Timeout cannot be greater than 1 hours"),
    (b'{"timeout": "60"}', "timeout"),
    (b"[2]", "JSON object"),
    (b'{"count": 2', "Malformed JSON"),
])
async def test_fork_bad_input_is_400_and_forks_nothing(env, body, fragment):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/fork", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert fragment in r.json()["message"]
    assert list(env.orch.sandboxes) == [sid]
    assert not any(c[0] == "fork" for c in env.orch.calls)


async def test_fork_whole_call_errors(env):
    sid = (await create(env))["sandboxID"]
    assert (await env.other.post(f"/sandboxes/{sid}/fork", json={})).status_code == 404  # other team
    await env.client.post(f"/sandboxes/{sid}/pause")
    r = await env.client.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 409
    await env.client.post(f"/v2/sandboxes/{sid}/connect", json={})
    env.orch.capacity = 2
    r = await env.client.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 503
    assert list(env.orch.sandboxes) == [sid]


async def test_fork_per_child_errors_are_listed(env):
    sid = (await create(env))["sandboxID"]
    env.orch.fork_failures = {1: Unavailable("no capacity for this fork"),
                              2: AgentEnvError("guest agent gone", error_code="fork_envd_unresponsive")}
    r = await env.client.post(f"/sandboxes/{sid}/fork", json={"count": 3})
    assert r.status_code == 201
    first, second, third = r.json()
    assert set(first) == {"sandbox"} and first["sandbox"]["sandboxID"] in env.orch.sandboxes
    assert second == {"error": {"code": 503, "message": "no capacity for this fork"}}
    assert third == {"error": {"code": 500, "message": "guest agent gone", "error_code": "fork_envd_unresponsive"}}


async def snapshot(env, sandbox_id: str, **body) -> dict:
    r = await env.client.post(f"/sandboxes/{sandbox_id}/snapshots", json=body)
    assert r.status_code == 201, r.text
    return r.json()


async def test_create_snapshot_shape_and_options(env):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/snapshots")  # no body at all
    assert r.status_code == 201, r.text
    assert env.orch.calls[-1] == ("snapshot", sid, None, True)
    info = r.json()
    assert info["snapshotID"] in env.orch.snapshots and info["names"] == []
    assert info["sourceSandboxID"] == sid and info["memory"] is True and info["sizeBytes"] == 1234
    assert info["createdAt"].endswith("Z")
    named = await snapshot(env, sid, name="my-snap", memory=False)
    assert env.orch.calls[-1] == ("snapshot", sid, "my-snap", False)
    assert named["names"] == ["team/my-snap:default"] and named["memory"] is False
    assert env.orch.sandboxes[sid].state is SandboxState.RUNNING  # the source keeps running


@pytest.mark.parametrize("body", [b'{"name": 5}', b'{"name": ""}', b'{"memory": "yes"}', b'{"name": ["a"]}',
                                  b"[]", b"{"])
async def test_create_snapshot_bad_input_is_400(env, body):
    sid = (await create(env))["sandboxID"]
    r = await env.client.post(f"/sandboxes/{sid}/snapshots", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert env.orch.snapshots == {}


async def test_create_snapshot_errors(env):
    sid = (await create(env))["sandboxID"]
    assert (await env.other.post(f"/sandboxes/{sid}/snapshots", json={})).status_code == 404
    await env.client.post(f"/sandboxes/{sid}/pause")
    assert (await env.client.post(f"/sandboxes/{sid}/snapshots", json={})).status_code == 409
    assert env.orch.snapshots == {}


async def test_snapshot_get_delete_and_create_from_it(env):
    sid = (await create(env))["sandboxID"]
    snap = await snapshot(env, sid, name="keep")
    snap_id = snap["snapshotID"]  # contains ':'; its name contains '/'
    for ref in (snap_id, snap["names"][0]):
        r = await env.client.get(f"/snapshots/{quote_segment(ref)}")
        assert r.status_code == 200, (ref, r.text)
        assert r.json() == snap
    r = await env.client.post("/v2/sandboxes", json={"templateID": snap_id})
    assert r.status_code == 201
    assert env.orch.sandboxes[r.json()["sandboxID"]].snapshot_id == snap_id
    assert (await env.other.get(f"/snapshots/{quote_segment(snap_id)}")).status_code == 404  # other team
    assert (await env.other.delete(f"/snapshots/{quote_segment(snap_id)}")).status_code == 404
    assert (await env.client.delete(f"/snapshots/{quote_segment(snap_id)}")).status_code == 204
    assert (await env.client.get(f"/snapshots/{quote_segment(snap_id)}")).status_code == 404
    assert (await env.client.delete(f"/snapshots/{quote_segment(snap_id)}")).status_code == 404
    assert (await env.client.post("/v2/sandboxes", json={"templateID": snap_id})).status_code == 404


async def test_delete_template_deletes_snapshots_only(env):
    sid = (await create(env))["sandboxID"]
    by_id = await snapshot(env, sid)
    by_name = await snapshot(env, sid, name="named")
    assert ":" in by_id["snapshotID"] and "/" in by_name["names"][0]
    r = await env.client.delete(f"/templates/{quote_segment(by_id['snapshotID'])}")
    assert r.status_code == 204, r.text
    assert env.orch.calls[-1] == ("delete_snapshot", by_id["snapshotID"])
    r = await env.client.delete(f"/templates/{quote_segment(by_name['names'][0])}")  # team%2Fnamed%3Adefault
    assert r.status_code == 204, r.text
    assert env.orch.calls[-1] == ("delete_snapshot", by_name["names"][0])
    assert env.orch.snapshots == {}
    assert (await env.client.delete(f"/templates/{quote_segment(by_id['snapshotID'])}")).status_code == 404
    for builtin in ("base", TEMPLATE.template_id):
        r = await env.client.delete(f"/templates/{builtin}")
        assert r.status_code == 403 and builtin in r.json()["message"]
    assert (await env.client.get("/templates")).json()[0]["templateID"] == TEMPLATE.template_id


async def test_list_snapshots_filters_and_paging(env):
    a = (await create(env))["sandboxID"]
    b = (await create(env))["sandboxID"]
    made = [(await snapshot(env, sid, name=f"s{i}"))["snapshotID"] for i, sid in enumerate([a, b, a, b, a])]
    ids = lambda r: [s["snapshotID"] for s in r.json()]  # noqa: E731
    r = await env.client.get("/snapshots")
    assert r.status_code == 200 and ids(r) == made and "X-Next-Token" not in r.headers
    assert ids(await env.client.get("/snapshots", params={"sandboxID": a})) == made[0::2]
    assert env.orch.calls[-1] == ("list_snapshots", a, None)
    assert ids(await env.client.get("/snapshots", params={"name": "team/s1:default"})) == [made[1]]
    assert env.orch.calls[-1] == ("list_snapshots", None, "team/s1:default")
    assert ids(await env.client.get("/snapshots", params={"sandboxID": "inotthere"})) == []
    assert (await env.other.get("/snapshots")).json() == []
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"limit": "2", **({"nextToken": token} if token else {})}
        r = await env.client.get("/snapshots", params=params)
        assert r.status_code == 200
        seen += ids(r)
        pages += 1
        token = r.headers.get("X-Next-Token")
        if not token:
            break
        decode_page_token(token)
    assert pages == 3 and seen == made


async def test_list_snapshots_ties_on_created_at_are_ordered_by_id(env):
    sid = (await create(env))["sandboxID"]
    made = [(await snapshot(env, sid))["snapshotID"] for _ in range(4)]
    same = env.orch.snapshots[made[0]].created_at
    for snap_id in made:
        env.orch.snapshots[snap_id] = replace(env.orch.snapshots[snap_id], created_at=same)
    seen: list[str] = []
    token = None
    while True:
        r = await env.client.get("/snapshots", params={"limit": "1", **({"nextToken": token} if token else {})})
        seen += [s["snapshotID"] for s in r.json()]
        token = r.headers.get("X-Next-Token")
        if not token:
            break
    assert seen == sorted(made)


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"nextToken": "!!garbage"}])
async def test_list_snapshots_bad_query_is_400(env, params):
    r = await env.client.get("/snapshots", params=params)
    assert r.status_code == 400
    assert not any(c[0] == "list_snapshots" for c in env.orch.calls)


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
    # inclusive: "started at or after" (E2B), a sandbox's own startedAt selects it
    r = await env.client.get("/v2/sandboxes", params={"startedAfter": started1.isoformat()})  # +00:00 offset
    assert ids(r) == [s2["sandboxID"], s1["sandboxID"]]
    just_after = (started1 + timedelta(microseconds=1)).isoformat()
    r = await env.client.get("/v2/sandboxes?startedAfter=" + just_after)  # raw '+'
    assert ids(r) == [s2["sandboxID"]]
    # nanoseconds (Go clients) are cut to microseconds, so the bound stays inclusive
    nanos = started1.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f") + "999Z"
    assert ids(await env.client.get("/v2/sandboxes", params={"startedAfter": nanos})) == [
        s2["sandboxID"], s1["sandboxID"]]
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
        decode_token(token, ascending=order == "asc")  # E2B's keyset cursor for this order
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



async def test_e2b_sdk_pause_fork_snapshot_calls(env):
    from e2b import AsyncSandbox
    from e2b.exceptions import SandboxException, SandboxNotFoundException

    opts = dict(api_key=env.client.api_key, api_url=env.client.base_url, sandbox_url=env.client.base_url)
    sbx = await AsyncSandbox.create("base", timeout=120, **opts)
    sid = sbx.sandbox_id

    forks = await sbx.fork(count=2, timeout=60)
    assert len(forks) == 2 and all(isinstance(f, AsyncSandbox) for f in forks)
    assert all(env.orch.sandboxes[f.sandbox_id].parent_id == sid for f in forks)
    env.orch.fork_failures = {0: Unavailable("busy")}
    [failed] = await AsyncSandbox.fork(sid, **opts)
    assert isinstance(failed, Exception)
    env.orch.fork_failures = {}
    with pytest.raises(SandboxException):
        await sbx.fork(count=17)  # allowed by the SDK (<= 20), above this server's maximum: 400

    info = await sbx.create_snapshot("sdk-snap", mode="filesystem")
    assert env.orch.calls[-1] == ("snapshot", sid, "sdk-snap", False)
    assert info.snapshot_id in env.orch.snapshots and info.names == ["team/sdk-snap:default"]
    await sbx.create_snapshot()
    pager = AsyncSandbox.list_snapshots(sandbox_id=sid, limit=1, **opts)
    listed = []
    while pager.has_next:
        listed += [s.snapshot_id for s in await pager.next_items()]
    assert listed[0] == info.snapshot_id and len(listed) == 2
    assert await AsyncSandbox.delete_snapshot(info.names[0], **opts) is True  # name with '/' and ':'
    assert await AsyncSandbox.delete_snapshot(info.snapshot_id, **opts) is False

    assert await sbx.pause(mode="filesystem") is True
    assert env.orch.calls[-1] == ("pause", sid, False)
    assert await sbx.pause() is False  # 409: already paused
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.create_snapshot("inotthere", **opts)
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.fork("inotthere", **opts)
    for f in forks:
        await f.kill()
    await AsyncSandbox.kill(sid, **opts)


# --- teams and API keys ------------------------------------------------------------------------------


async def test_api_keys_create_list_revoke_scoped_to_team(env):
    r = await env.client.get("/teams")
    assert r.status_code == 200 and [t["teamID"] for t in r.json()] == ["default"]
    assert r.json()[0]["maxSandboxes"] == env.settings.max_sandboxes_per_team
    r = await env.client.post("/api-keys", json={"name": "ci"})
    assert r.status_code == 201
    created = r.json()
    assert created["key"].startswith("e2b_") and created["name"] == "ci"
    # the new key works and belongs to the same team
    r = await env.client.get("/v2/sandboxes", key=created["key"])
    assert r.status_code == 200
    listed = (await env.client.get("/api-keys")).json()
    assert created["id"] in {k["id"] for k in listed} and all("key" not in k for k in listed)
    # the other team sees none of these keys and cannot revoke them (404, no detail)
    assert created["id"] not in {k["id"] for k in (await env.other.get("/api-keys")).json()}
    r = await env.other.delete(f"/api-keys/{created['id']}")
    assert r.status_code == 404 and "default" not in r.json()["message"]
    assert (await env.client.get("/v2/sandboxes", key=created["key"])).status_code == 200
    # revoked by its own team: refused from then on
    assert (await env.client.delete(f"/api-keys/{created['id']}")).status_code == 204
    assert (await env.client.get("/v2/sandboxes", key=created["key"])).status_code == 401
    r = await env.client.post("/api-keys", json={"name": ""})
    assert r.status_code == 400


async def test_list_v2_total_running_header_template_tags_and_token_order(env):
    s1 = (await create(env))["sandboxID"]
    await create(env)
    await create(env, metadata={"k": "v"})
    await env.client.post(f"/sandboxes/{s1}/pause")
    r = await env.client.get("/v2/sandboxes", params={"limit": "1"})
    assert r.headers["X-Total-Running"] == "2" and len(r.json()) == 1  # before paging, running only
    r = await env.client.get("/v2/sandboxes", params={"metadata": sdk_metadata_param({"k": "v"})})
    assert r.headers["X-Total-Running"] == "1"
    r = await env.client.get("/v2/sandboxes", params={"state": "paused"})
    assert [s["sandboxID"] for s in r.json()] == [s1] and "X-Total-Running" not in r.headers
    r = await env.client.get("/v2/sandboxes", params={"template": "base:default"}, validate=False)
    assert r.status_code == 400 and "tag" in r.json()["message"]
    r = await env.client.get("/v2/sandboxes", params={"limit": "1", "order": "asc"})
    token = r.headers["X-Next-Token"]
    r = await env.client.get("/v2/sandboxes", params={"limit": "1", "nextToken": token}, validate=False)
    assert r.status_code == 400 and "order" in r.json()["message"]


async def test_list_v2_ties_on_started_at_ordered_as_e2b(env):
    made = [(await create(env))["sandboxID"] for _ in range(4)]
    same = env.orch.sandboxes[made[0]].started_at
    for sid in made:
        env.orch.sandboxes[sid] = replace(env.orch.sandboxes[sid], started_at=same)
    for order, expected in (("desc", sorted(made)), ("asc", sorted(made, reverse=True))):
        seen: list[str] = []
        token = None
        while True:
            params = {"limit": "1", "order": order, **({"nextToken": token} if token else {})}
            r = await env.client.get("/v2/sandboxes", params=params)
            seen += [s["sandboxID"] for s in r.json()]
            token = r.headers.get("X-Next-Token")
            if not token:
                break
        assert seen == expected, order
