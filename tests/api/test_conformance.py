"""Control-API conformance against the REAL server (session fixture `server` in tests/conftest.py).

Every response is validated against agentenv/api/openapi.yaml (status, headers, body) by the
`SpecClient` of tests/api/conftest.py, which also checks that every error is a JSON {code, message}
with code == HTTP status. Sandboxes are few (each boots a gVisor sandbox) and killed in teardown.
"""

from __future__ import annotations

import secrets
import time
import urllib.parse
from datetime import datetime, timedelta, timezone

import pytest

from agentenv.constants import CLIENT_ID, ENVD_VERSION

TEMPLATE = "base"
SANDBOX_TIMEOUT = 180
RUN = secrets.token_hex(4)  # isolates this module's sandboxes from any others in the session
OURS = {"suite": "api-conformance", "run": RUN}


def metadata_param(md: dict[str, str]) -> str:
    """The metadata query value as the Python SDK builds it (the HTTP client encodes it once more)."""
    return urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in md.items()})


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.fixture(scope="module")
def api(server, make_spec_client):
    return make_spec_client(server.api_url, server.api_key)


class Calls:
    """Synchronous shorthands (the server is another process, so blocking calls are fine here)."""

    def __init__(self, client):
        self.c = client

    def __call__(self, method: str, path: str, **kw):
        return self.c.request_sync(method, path, **kw)

    def ids(self, **params) -> list[str]:
        r = self("GET", "/v2/sandboxes", params=params)
        assert r.status_code == 200, r.text
        return [s["sandboxID"] for s in r.json()]

    def all_ids(self) -> set[str]:
        ids: set[str] = set()
        token = None
        while True:
            params = {"nextToken": token} if token else {}
            r = self("GET", "/v2/sandboxes", params=params)
            ids |= {s["sandboxID"] for s in r.json()}
            token = r.headers.get("X-Next-Token")
            if not token:
                return ids


@pytest.fixture(scope="module")
def call(api) -> Calls:
    return Calls(api)


@pytest.fixture(scope="module")
def sandboxes(call):
    """Two running sandboxes created one after the other (distinct startedAt), killed on teardown."""
    created: list[dict] = []
    try:
        for i in range(2):
            r = call("POST", "/v2/sandboxes",
                     json={"templateID": TEMPLATE, "timeout": SANDBOX_TIMEOUT,
                           "metadata": {**OURS, "idx": str(i), "odd key": "a&b=c"}, "envVars": {}})
            assert r.status_code == 201, r.text
            created.append(r.json())
            time.sleep(0.01)
        yield created
    finally:
        for s in created:
            call("DELETE", f"/sandboxes/{s['sandboxID']}")  # 204, or 404 if a test killed it


# --- meta, auth, routing --------------------------------------------------------------------------


def test_health_and_spec_are_public(call):
    assert call("GET", "/health", key=None).status_code == 200
    r = call("GET", "/openapi.yaml", key=None)
    assert r.status_code == 200 and r.text.startswith("openapi:")


@pytest.mark.parametrize("key", [None, "e2b_" + "0" * 40, "garbage"])
def test_wrong_or_missing_key_is_401_and_changes_nothing(call, key):
    before = call.all_ids()
    r = call("POST", "/v2/sandboxes", key=key, json={"templateID": TEMPLATE, "timeout": 30})
    assert r.status_code == 401
    assert r.json()["message"].startswith("Invalid API key")
    assert call("GET", "/v2/sandboxes", key=key).status_code == 401
    assert call("GET", "/sandboxes/whatever", key=key).status_code == 401
    assert call.all_ids() == before


def test_unknown_route_and_method_are_json(call):
    assert call("GET", "/definitely/not/a/route", validate=False).status_code == 404
    assert call("PATCH", "/v2/sandboxes", validate=False).status_code == 405


def test_templates_list_base(call):
    r = call("GET", "/templates")
    assert r.status_code == 200
    assert any(TEMPLATE == t["templateID"] or TEMPLATE in t["aliases"] for t in r.json())


# --- create / get / list ----------------------------------------------------------------------------


def test_create_response(sandboxes):
    for s in sandboxes:
        assert s["envdVersion"] == ENVD_VERSION
        assert s["clientID"] == CLIENT_ID
        assert s["envdAccessToken"]  # v2 creates are always secured
    assert sandboxes[0]["sandboxID"] != sandboxes[1]["sandboxID"]


def test_get_detail(call, sandboxes):
    s = sandboxes[0]
    r = call("GET", f"/sandboxes/{s['sandboxID']}")
    assert r.status_code == 200
    d = r.json()
    assert d["sandboxID"] == s["sandboxID"] and d["templateID"] == s["templateID"]
    assert d["state"] == "running"
    assert d["metadata"] == {**OURS, "idx": "0", "odd key": "a&b=c"}
    lifetime = (ts(d["endAt"]) - ts(d["startedAt"])).total_seconds()
    assert SANDBOX_TIMEOUT - 5 <= lifetime <= SANDBOX_TIMEOUT + 5
    assert d["cpuCount"] >= 1 and d["memoryMB"] > 0 and d["diskSizeMB"] > 0


def test_list_metadata_filter(call, sandboxes):
    ours = [s["sandboxID"] for s in sandboxes]
    assert sorted(call.ids(metadata=metadata_param(OURS))) == sorted(ours)
    assert call.ids(metadata=metadata_param({**OURS, "odd key": "a&b=c", "idx": "1"})) == [ours[1]]
    assert call.ids(metadata=metadata_param({**OURS, "odd key": "nope"})) == []
    r = call("GET", "/sandboxes", params={"metadata": metadata_param(OURS)})  # v1: running only
    assert r.status_code == 200 and sorted(s["sandboxID"] for s in r.json()) == sorted(ours)


def test_list_order_state_template_started_after(call, sandboxes):
    ours = [s["sandboxID"] for s in sandboxes]
    md = metadata_param(OURS)
    assert call.ids(metadata=md) == ours[::-1]  # default: newest first
    assert call.ids(metadata=md, order="asc") == ours
    assert call.ids(metadata=md, state="running") == ours[::-1]
    assert call.ids(metadata=md, state="paused") == []
    assert call.ids(metadata=md, state="running,paused") == ours[::-1]
    assert call.ids(metadata=md, template=TEMPLATE) == ours[::-1]
    assert call.ids(metadata=md, template="no-such-template") == []
    first = call("GET", f"/sandboxes/{ours[0]}").json()
    started = ts(first["startedAt"]).astimezone(timezone.utc)
    # "started at or after" (E2B): its own startedAt selects it, a microsecond later does not
    assert call.ids(metadata=md, startedAfter=started.isoformat()) == ours[::-1]  # '+00:00' as the SDKs send it
    assert call.ids(metadata=md, startedAfter=(started + timedelta(microseconds=1)).isoformat()) == [ours[1]]


def test_list_paging(call, sandboxes):
    ours = [s["sandboxID"] for s in sandboxes]
    seen: list[str] = []
    token = None
    for _ in range(3):
        params = {"metadata": metadata_param(OURS), "limit": "1", "order": "asc"}
        if token:
            params["nextToken"] = token
        r = call("GET", "/v2/sandboxes", params=params)
        assert r.status_code == 200
        page = [s["sandboxID"] for s in r.json()]
        assert len(page) <= 1
        seen += page
        token = r.headers.get("X-Next-Token")
        if not token:
            break
    assert seen == ours
    assert token is None


@pytest.mark.parametrize("params", [
    {"limit": "0"}, {"limit": "101"}, {"limit": "ten"}, {"order": "sideways"}, {"state": "zombie"},
    {"startedAfter": "not-a-time"}, {"nextToken": "%%%"},
])
def test_list_bad_query_is_400(call, params):
    assert call("GET", "/v2/sandboxes", params=params).status_code == 400


# --- bad create input: JSON error, right status, no state change -------------------------------------


@pytest.mark.parametrize(
    "body, statuses",
    [
        (b'{"templateID": "no-such-template-%s", "timeout": 30}', {400, 404}),
        (b'{"templateID": "base", "timeout": -1}', {400}),
        (b'{"templateID": "base", "timeout": 100000000}', {400}),
        (b'{"templateID": "base", "timeout": "30"}', {400}),
        (b'{"templateID": ["base"], "timeout": 30}', {400}),
        (b'{"templateID": "base", "timeout": 30, "metadata": {"k": 1}}', {400}),
        (b'{"templateID": "base", "timeout": 30, "envVars": "A=1"}', {400}),
        (b'{"timeout": 30}', {400}),
        (b'{"templateID": "base", "timeout": 30', {400}),
        (b"", {400}),
    ],
)
def test_bad_create_is_rejected_without_state_change(call, body, statuses):
    if b"%s" in body:
        body = body.replace(b"%s", RUN.encode())
    before = call.all_ids()
    r = call("POST", "/v2/sandboxes", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code in statuses, r.text
    assert call.all_ids() == before


def test_huge_timeout_message(call):
    r = call("POST", "/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 100000000})
    assert r.status_code == 400
    assert r.json()["message"].startswith("Timeout cannot be greater than ")


# --- per-sandbox operations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, suffix, body",
    [
        ("GET", "", None),
        ("DELETE", "", None),
        ("POST", "/timeout", {"timeout": 30}),
        ("POST", "/refreshes", {"duration": 30}),
        ("POST", "/connect", {"timeout": 30}),
        ("POST", "/pause", {}),
        ("POST", "/resume", {"timeout": 30}),
    ],
)
def test_unknown_sandbox_is_404(call, method, suffix, body):
    sid = "inosuchsandbox" + RUN
    r = call(method, f"/sandboxes/{sid}{suffix}", json=body)
    assert r.status_code == 404
    assert r.json()["message"] == f"Sandbox \"{sid}\" doesn't exist or you don't have access to it"
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={})
    assert r.status_code == 404


def test_set_timeout(call, sandboxes):
    sid = sandboxes[0]["sandboxID"]
    r = call("POST", f"/sandboxes/{sid}/timeout", json={"timeout": 240})
    assert r.status_code == 204
    end = ts(call("GET", f"/sandboxes/{sid}").json()["endAt"])
    expected = datetime.now(timezone.utc) + timedelta(seconds=240)
    assert abs((end - expected).total_seconds()) < 10
    for bad in ({"timeout": -1}, {"timeout": 100000000}, {"timeout": "60"}, {}):
        assert call("POST", f"/sandboxes/{sid}/timeout", json=bad).status_code == 400, bad
    assert ts(call("GET", f"/sandboxes/{sid}").json()["endAt"]) == end  # rejected calls changed nothing


def test_refresh_only_extends(call, sandboxes):
    sid = sandboxes[0]["sandboxID"]
    before = ts(call("GET", f"/sandboxes/{sid}").json()["endAt"])
    assert call("POST", f"/sandboxes/{sid}/refreshes", json={"duration": 1}).status_code == 204
    assert ts(call("GET", f"/sandboxes/{sid}").json()["endAt"]) == before
    assert call("POST", f"/sandboxes/{sid}/refreshes", json={"duration": 3601}).status_code == 400


def test_connect_running_extends_ttl_only(call, sandboxes):
    sid = sandboxes[1]["sandboxID"]
    before = ts(call("GET", f"/sandboxes/{sid}").json()["endAt"])
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": 1})
    assert r.status_code == 200
    assert r.json()["sandboxID"] == sid and r.json()["envdAccessToken"] == sandboxes[1]["envdAccessToken"]
    assert ts(call("GET", f"/sandboxes/{sid}").json()["endAt"]) == before  # never shortened
    r = call("POST", f"/sandboxes/{sid}/connect", json={"timeout": SANDBOX_TIMEOUT + 60})
    assert r.status_code == 200
    assert ts(call("GET", f"/sandboxes/{sid}").json()["endAt"]) > before
    assert call("POST", f"/sandboxes/{sid}/connect", json={}).status_code == 400  # v1: timeout required
    assert call("POST", f"/sandboxes/{sid}/resume", json={"timeout": 30}).status_code == 409  # running


def test_pause_then_connect_resumes(call, sandboxes):
    sid = sandboxes[1]["sandboxID"]
    r = call("POST", f"/sandboxes/{sid}/pause", json={})
    if r.status_code == 501:
        pytest.skip(f"server does not support pause yet: {r.json()['message']}")
    assert r.status_code == 204
    assert call("POST", f"/sandboxes/{sid}/pause", json={}).status_code == 409
    assert call("GET", f"/sandboxes/{sid}").json()["state"] == "paused"
    assert sid in call.ids(metadata=metadata_param(OURS), state="paused")
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": 60})
    assert r.status_code == 201
    assert call("GET", f"/sandboxes/{sid}").json()["state"] == "running"


def test_kill(call, sandboxes):
    sid = sandboxes[1]["sandboxID"]
    assert call("DELETE", f"/sandboxes/{sid}").status_code == 204
    assert call("GET", f"/sandboxes/{sid}").status_code == 404
    assert call("DELETE", f"/sandboxes/{sid}").status_code == 404
    assert call("POST", f"/sandboxes/{sid}/timeout", json={"timeout": 30}).status_code == 404
    assert sid not in call.all_ids()
    assert call.ids(metadata=metadata_param(OURS)) == [sandboxes[0]["sandboxID"]]


# --- issue 3: pause with memory flag, fork, snapshots ------------------------------------------------


def quote_segment(value: str) -> str:
    """How the SDKs put a snapshot/template ID or name into a path (one segment, '/' and ':' encoded)."""
    return urllib.parse.quote(value, safe="")


class Tracked:
    """Sandboxes and snapshots created by the issue-3 tests; all removed on teardown."""

    def __init__(self, call: Calls):
        self.call = call
        self.sandboxes: list[str] = []
        self.snapshots: list[str] = []

    def create(self, template: str = TEMPLATE, **extra) -> dict:
        r = self.call("POST", "/v2/sandboxes",
                      json={"templateID": template, "timeout": SANDBOX_TIMEOUT, "metadata": {**OURS, "issue": "3"},
                            "envVars": {}, **extra})
        assert r.status_code == 201, r.text
        self.sandboxes.append(r.json()["sandboxID"])
        return r.json()

    def snapshot(self, sandbox_id: str, **body) -> dict:
        r = self.call("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body)
        assert r.status_code == 201, r.text
        self.snapshots.append(r.json()["snapshotID"])
        return r.json()

    def fork(self, sandbox_id: str, body: dict):
        """POST /fork; any sandbox a 201 reports is tracked before the caller asserts anything."""
        r = self.call("POST", f"/sandboxes/{sandbox_id}/fork", json=body)
        if r.status_code == 201:
            self.sandboxes += [item["sandbox"]["sandboxID"] for item in r.json() if "sandbox" in item]
        return r

    def state(self, sandbox_id: str) -> str:
        r = self.call("GET", f"/sandboxes/{sandbox_id}")
        assert r.status_code == 200, r.text
        return r.json()["state"]

    def cleanup(self) -> None:
        for sid in self.sandboxes:
            self.call("DELETE", f"/sandboxes/{sid}")  # 204, or 404 if a test killed it
        for snap_id in self.snapshots:
            self.call("DELETE", f"/snapshots/{quote_segment(snap_id)}")  # 204, or 404 if a test deleted it


@pytest.fixture(scope="module")
def tracked(call):
    t = Tracked(call)
    try:
        yield t
    finally:
        t.cleanup()


def test_pause_twice_list_and_connect_resumes(call, tracked):
    sid = tracked.create()["sandboxID"]
    r = call("POST", f"/sandboxes/{sid}/pause")  # no body, as SDK 2.0 sends it
    assert r.status_code == 204, r.text
    r = call("POST", f"/sandboxes/{sid}/pause", json={})
    assert r.status_code == 409
    assert "paused" in r.json()["message"]
    assert tracked.state(sid) == "paused"
    md = metadata_param({**OURS, "issue": "3"})
    assert sid in call.ids(metadata=md, state="paused")
    assert sid not in call.ids(metadata=md, state="running")
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": SANDBOX_TIMEOUT})
    assert r.status_code == 201, r.text
    assert r.json()["sandboxID"] == sid
    assert tracked.state(sid) == "running"
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": SANDBOX_TIMEOUT})
    assert r.status_code == 200  # running again: plain connect


def test_filesystem_only_pause_and_resume(call, tracked):
    sid = tracked.create()["sandboxID"]
    r = call("POST", f"/sandboxes/{sid}/pause", json={"memory": False, "requireHealthyGuest": False})
    assert r.status_code == 204, r.text
    assert tracked.state(sid) == "paused"
    assert call("POST", f"/sandboxes/{sid}/pause", json={"memory": False}).status_code == 409
    r = call("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": SANDBOX_TIMEOUT})
    assert r.status_code == 201, r.text
    assert tracked.state(sid) == "running"


def test_pause_bad_body_is_400(call, tracked):
    sid = tracked.create()["sandboxID"]
    r = call("POST", f"/sandboxes/{sid}/pause", json={"memory": "no"})
    assert r.status_code == 400
    assert tracked.state(sid) == "running"


@pytest.fixture(scope="module")
def fork_source(tracked) -> dict:
    return tracked.create()


def test_fork_two(call, tracked, fork_source):
    sid = fork_source["sandboxID"]
    before = call("GET", f"/sandboxes/{sid}").json()
    r = tracked.fork(sid, {"count": 2, "timeout": SANDBOX_TIMEOUT})
    assert r.status_code == 201, r.text
    results = r.json()
    assert len(results) == 2
    assert all("sandbox" in item and "error" not in item for item in results), results
    children = [item["sandbox"] for item in results]
    assert len({c["sandboxID"] for c in children} | {sid}) == 3
    for child in children:
        assert child["envdVersion"] == ENVD_VERSION and child["clientID"] == CLIENT_ID
        assert child["envdAccessToken"]
        d = call("GET", f"/sandboxes/{child['sandboxID']}")
        assert d.status_code == 200, d.text
        assert d.json()["state"] == "running"
        lifetime = (ts(d.json()["endAt"]) - ts(d.json()["startedAt"])).total_seconds()
        assert SANDBOX_TIMEOUT - 10 <= lifetime <= SANDBOX_TIMEOUT + 10
    after = call("GET", f"/sandboxes/{sid}").json()
    assert after["state"] == "running" and after["endAt"] == before["endAt"]  # source keeps ID and expiry
    for child in children:
        assert call("DELETE", f"/sandboxes/{child['sandboxID']}").status_code == 204


@pytest.mark.parametrize("body", [{"count": 0}, {"count": 1000}, {"count": "2"}, {"timeout": -1},
                                  {"timeout": 100000000}])
def test_fork_bad_input_is_400_and_forks_nothing(call, tracked, fork_source, body):
    before = call.all_ids()
    r = tracked.fork(fork_source["sandboxID"], body)
    assert r.status_code == 400, r.text
    assert call.all_ids() == before


def test_fork_unknown_is_404(call):
    r = call("POST", f"/sandboxes/inosuchsandbox{RUN}/fork", json={})
    assert r.status_code == 404


def test_fork_of_paused_sandbox_is_409(call, tracked):
    sid = tracked.create()["sandboxID"]
    assert call("POST", f"/sandboxes/{sid}/pause", json={}).status_code == 204
    before = call.all_ids()
    r = tracked.fork(sid, {"count": 1})
    assert r.status_code == 409, r.text
    assert call.all_ids() == before
    assert tracked.state(sid) == "paused"


def test_snapshot_list_create_from_delete(call, tracked):
    sid = tracked.create()["sandboxID"]
    snap = tracked.snapshot(sid, name=f"conformance-{RUN}")
    snap_id = snap["snapshotID"]
    assert snap_id and isinstance(snap["names"], list) and snap["names"]
    assert tracked.state(sid) == "running"  # the source keeps running

    r = call("GET", "/snapshots", params={"sandboxID": sid})
    assert r.status_code == 200
    assert [s["snapshotID"] for s in r.json()] == [snap_id]
    r = call("GET", "/snapshots", params={"name": snap["names"][0]})
    assert r.status_code == 200 and snap_id in [s["snapshotID"] for s in r.json()]
    seen: list[str] = []
    token = None
    while True:  # walk every page of the unfiltered list
        r = call("GET", "/snapshots", params={"limit": "1", **({"nextToken": token} if token else {})})
        assert r.status_code == 200 and len(r.json()) <= 1
        seen += [s["snapshotID"] for s in r.json()]
        token = r.headers.get("X-Next-Token")
        if not token:
            break
    assert snap_id in seen and len(seen) == len(set(seen))
    r = call("GET", f"/snapshots/{quote_segment(snap_id)}")
    assert r.status_code == 200 and r.json()["snapshotID"] == snap_id

    child = tracked.create(template=snap_id)
    assert call("GET", f"/sandboxes/{child['sandboxID']}").json()["state"] == "running"

    assert call("DELETE", f"/snapshots/{quote_segment(snap_id)}").status_code == 204
    assert call("GET", f"/snapshots/{quote_segment(snap_id)}").status_code == 404
    assert call("DELETE", f"/snapshots/{quote_segment(snap_id)}").status_code == 404
    assert call("GET", "/snapshots", params={"sandboxID": sid}).json() == []
    assert call("GET", f"/sandboxes/{child['sandboxID']}").status_code == 200  # unaffected


def test_filesystem_snapshot_and_delete_through_templates_route(call, tracked):
    sid = tracked.create()["sandboxID"]
    snap = tracked.snapshot(sid, memory=False)
    child = tracked.create(template=snap["snapshotID"])
    assert call("GET", f"/sandboxes/{child['sandboxID']}").json()["state"] == "running"
    r = call("DELETE", f"/templates/{quote_segment(snap['snapshotID'])}")  # what Sandbox.delete_snapshot calls
    assert r.status_code == 204, r.text
    assert call("DELETE", f"/templates/{quote_segment(snap['snapshotID'])}").status_code == 404
    assert call("GET", f"/snapshots/{quote_segment(snap['snapshotID'])}").status_code == 404


def test_snapshot_errors(call, tracked):
    assert call("POST", f"/sandboxes/inosuchsandbox{RUN}/snapshots", json={}).status_code == 404
    assert call("GET", f"/snapshots/{quote_segment('no-such/snapshot:' + RUN)}").status_code == 404
    assert call("DELETE", f"/snapshots/nosuchsnapshot{RUN}").status_code == 404
    assert call("DELETE", f"/templates/{quote_segment('no-such/template:' + RUN)}").status_code == 404
    assert call("DELETE", f"/templates/{TEMPLATE}").status_code in (400, 403)
    assert call("GET", "/snapshots", params={"limit": "0"}).status_code == 400
    assert call("GET", "/snapshots", params={"nextToken": "%%%"}).status_code == 400
    sid = tracked.create()["sandboxID"]
    assert call("POST", f"/sandboxes/{sid}/snapshots", json={"memory": "yes"}).status_code == 400
    assert call("GET", "/snapshots", params={"sandboxID": sid}).json() == []
