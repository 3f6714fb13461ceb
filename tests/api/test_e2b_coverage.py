"""E2B routes beyond the core (agentenv/api/compat.py), through the Python SDK and its generated client.

Checked against the REAL server (session fixture `server`); HTTP answers are validated against
openapi.yaml by the `SpecClient` of tests/api/conftest.py. One small template is built per module.
See docs/e2b-compatibility.md for the audit these close gaps of.
"""

from __future__ import annotations

import secrets
from datetime import datetime

import pytest
import requests
from e2b import InvalidArgumentException, Sandbox, Secret, Template, Volume
from e2b.api import ApiClient
from e2b.api.client.api.tags import get_templates_template_id_tags_count, get_templates_template_id_tags_exists
from e2b.api.client.api.templates import (get_default_templates, get_templates_template_id_builds_build_id_logs,
                                          get_v2_templates)
from e2b.api.client.models import LogLevel, LogsDirection
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import SandboxException

pytestmark = pytest.mark.timeout(600)


def _ms(ts: datetime) -> int:
    return int(ts.timestamp() * 1000)


@pytest.fixture(scope="module")
def api(server, make_spec_client):
    return make_spec_client(server.api_url, server.api_key)


@pytest.fixture(scope="module")
def sdk_client(server) -> ApiClient:
    return ApiClient(ConnectionConfig(api_key=server.api_key, api_url=server.api_url))


@pytest.fixture(scope="module")
def built(server):
    """A template built through the SDK with a second tag; deleted afterwards."""
    name = f"cov-{secrets.token_hex(4)}"
    marker = secrets.token_hex(6)
    template = Template().from_base_image().run_cmd(f"echo coverage-{marker}").run_cmd("echo second-step")
    info = Template.build(template, name, tags=["default", "v1"])
    yield {"name": name, "marker": marker, "info": info}
    requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                    timeout=60)


# --- template build logs ------------------------------------------------------------------------------


def test_build_logs_match_the_status_entries(built, sdk_client, api):
    info = built["info"]
    status = api.request_sync("GET", f"/templates/{info.template_id}/builds/{info.build_id}/status").json()
    res = get_templates_template_id_builds_build_id_logs.sync_detailed(info.template_id, info.build_id,
                                                                       client=sdk_client)
    assert res.status_code == 200, res.content
    logs = res.parsed.logs
    assert 0 < len(logs) <= 100
    assert [e.message for e in logs] == [e["message"] for e in status["logEntries"][:100]]
    assert any(f"coverage-{built['marker']}" in e.message for e in logs), [e.message for e in logs]
    stamps = [e.timestamp for e in logs]
    assert stamps == sorted(stamps)


def test_build_logs_backward_limit_cursor_and_level(built, sdk_client):
    info = built["info"]

    def page(**kw):
        res = get_templates_template_id_builds_build_id_logs.sync_detailed(info.template_id, info.build_id,
                                                                           client=sdk_client, **kw)
        assert res.status_code == 200, res.content
        return res.parsed.logs

    forward = page()
    backward = page(direction=LogsDirection.BACKWARD, limit=3)
    assert [e.message for e in backward] == [e.message for e in reversed(forward)][:3]
    last = forward[-1]
    after = page(cursor=_ms(last.timestamp))
    assert after and all(_ms(e.timestamp) >= _ms(last.timestamp) for e in after)
    assert after[-1].message == last.message
    assert page(limit=0) == []
    errors = page(level=LogLevel.ERROR)
    assert all(e.level.value == "error" for e in errors)


def test_build_logs_bad_query_and_unknown_build(built, api):
    info = built["info"]
    base = f"/templates/{info.template_id}/builds"
    for params in ({"direction": "sideways"}, {"level": "loud"}, {"limit": "101"}, {"cursor": "-1"},
                   {"source": "cloud"}):
        r = api.request_sync("GET", f"{base}/{info.build_id}/logs", params=params)
        assert r.status_code == 400, (params, r.text)
    r = api.request_sync("GET", f"{base}/00000000-0000-4000-8000-000000000000/logs")
    assert r.status_code == 404, r.text


# --- tags -----------------------------------------------------------------------------------------


def test_tag_count_and_exists(built, sdk_client, api):
    info = built["info"]
    count = get_templates_template_id_tags_count.sync_detailed(info.template_id, client=sdk_client)
    assert count.status_code == 200, count.content
    listed = api.request_sync("GET", f"/templates/{info.template_id}/tags").json()
    assert {t["tag"] for t in listed} == {"default", "v1"}
    assert count.parsed.total == 2

    def exists(tag: str) -> bool:
        res = get_templates_template_id_tags_exists.sync_detailed(info.template_id, client=sdk_client, tag=tag)
        assert res.status_code == 200, res.content
        assert res.parsed.normalized_tag == tag
        return res.parsed.exists

    assert exists("v1") is True
    assert exists("default") is True
    assert exists("v2") is False
    # the count follows tag changes made through the SDK
    Template.assign_tags(f"{built['name']}:v1", "v2")
    assert exists("v2") is True
    assert get_templates_template_id_tags_count.sync_detailed(info.template_id, client=sdk_client).parsed.total == 3
    assert api.request_sync("GET", f"/templates/{info.template_id}/tags/exists").status_code == 400
    assert api.request_sync("GET", f"/templates/nope-{secrets.token_hex(3)}/tags/count").status_code == 404


# --- template lists -------------------------------------------------------------------------------


def test_v2_templates_pages_cover_the_v1_list(built, sdk_client, api):
    everything = {t["templateID"] for t in api.request_sync("GET", "/templates").json()}
    assert built["info"].template_id in everything
    seen: list[str] = []
    token = None
    while True:
        res = get_v2_templates.sync_detailed(client=sdk_client, limit=1, **({"next_token": token} if token else {}))
        assert res.status_code == 200, res.content
        assert len(res.parsed) <= 1
        seen += [t.template_id for t in res.parsed]
        token = res.headers.get("X-Next-Token")
        if not token:
            break
    assert len(seen) == len(set(seen)) and set(seen) == everything
    assert api.request_sync("GET", "/v2/templates", params={"nextToken": "garbage!"}).status_code == 400
    api.request_sync("GET", "/v2/templates", params={"limit": 2})  # validated against the spec


def test_default_templates_are_the_built_in_ones(built, sdk_client):
    res = get_default_templates.sync_detailed(client=sdk_client)
    assert res.status_code == 200, res.content
    ids = [t.template_id for t in res.parsed]
    assert ids == sorted(ids)
    assert any("base" in t.aliases for t in res.parsed)
    assert built["info"].template_id not in ids
    assert all(t.is_default is True for t in res.parsed)
    # and a sandbox starts from the first of them
    sbx = Sandbox.create(res.parsed[0].template_id, timeout=60)
    try:
        assert sbx.commands.run("echo up").stdout.strip() == "up"
    finally:
        sbx.kill()


# --- volumes and secrets: honest answers ----------------------------------------------------------


def test_volumes_list_empty_create_is_501_unknown_is_404(server, api):
    opts = {"api_key": server.api_key, "api_url": server.api_url}
    assert Volume.list(**opts) == []
    with pytest.raises(Exception) as exc:
        Volume.create(f"vol-{secrets.token_hex(3)}", **opts)
    assert "501" in str(exc.value) and "volumes are not supported" in str(exc.value).lower()
    r = api.request_sync("POST", "/volumes", json={"name": "x"})
    assert r.status_code == 501 and r.json()["error_code"] == "not_supported"
    assert api.request_sync("GET", "/volumes/vol123").status_code == 404
    assert api.request_sync("DELETE", "/volumes/vol123").status_code == 404


def test_secrets_list_empty_create_is_501_unknown_is_404(server, api):
    opts = {"api_key": server.api_key, "api_url": server.api_url}
    pages = Secret.list(**opts)
    assert pages.next_items() == [] and not pages.has_next
    with pytest.raises(Exception) as exc:
        Secret.create(f"sec-{secrets.token_hex(3)}", "value", **opts)
    assert "501" in str(exc.value) and "secrets are not supported" in str(exc.value).lower()
    for method in ("GET", "POST", "DELETE"):
        assert api.request_sync(method, "/secrets/sec_123", json={"value": "v"}).status_code == 404


def test_create_with_volume_mounts_or_iam_tokens_is_refused_before_starting(api):
    before = {s["sandboxID"] for s in api.request_sync("GET", "/v2/sandboxes").json()}
    with pytest.raises((InvalidArgumentException, SandboxException)) as exc:
        Sandbox.create("base", timeout=60, volume_mounts={"/data": "my-volume"})
    assert "volumes are not supported" in str(exc.value)
    r = api.request_sync("POST", "/v2/sandboxes", json={
        "templateID": "base", "iam": {"tokens": {"gcp": {"audience": "x", "tokenType": "id"}}}})
    assert r.status_code == 400 and r.json()["error_code"] == "not_supported", r.text
    after = {s["sandboxID"] for s in api.request_sync("GET", "/v2/sandboxes").json()}
    assert after <= before


def test_mcp_field_is_accepted(api):
    r = api.request_sync("POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 60,
                                                        "mcp": {"exa": {"apiKey": "k"}}})
    assert r.status_code == 201, r.text
    api.request_sync("DELETE", f"/sandboxes/{r.json()['sandboxID']}")


# --- pause mode and resume without memory -------------------------------------------------------------


def test_pause_mode_and_memoryless_resume(api, server):
    sid = api.request_sync("POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 180}).json()["sandboxID"]
    try:
        assert "pauseMode" not in api.request_sync("GET", f"/sandboxes/{sid}").json()
        # running: memory=false is a no-op, as in E2B
        r = api.request_sync("POST", f"/v2/sandboxes/{sid}/connect", json={"timeout": 180, "memory": False})
        assert r.status_code == 200, r.text
        assert api.request_sync("POST", f"/sandboxes/{sid}/pause").status_code == 204
        detail = api.request_sync("GET", f"/sandboxes/{sid}").json()
        assert detail["state"] == "paused" and detail["pauseMode"] == "full"
        # paused with memory: a cold boot from disk is refused, never silently replaced by a memory restore
        with pytest.raises(Exception) as exc:
            Sandbox.connect(sid, on_resume="reboot", api_key=server.api_key, api_url=server.api_url)
        assert "not supported" in str(exc.value), exc.value
        for path, body in ((f"/sandboxes/{sid}/connect", {"timeout": 180, "memory": False}),
                           (f"/sandboxes/{sid}/resume", {"memory": False})):
            r = api.request_sync("POST", path, json=body)
            assert r.status_code == 400 and r.json()["error_code"] == "not_supported", r.text
        assert api.request_sync("GET", f"/sandboxes/{sid}").json()["state"] == "paused"
        # a plain resume restores it with its memory
        sbx = Sandbox.connect(sid, api_key=server.api_key, api_url=server.api_url)
        sbx.commands.run("echo kept > /home/user/kept.txt")
        # a filesystem-only pause: memory=false is then what the resume does anyway
        assert api.request_sync("POST", f"/sandboxes/{sid}/pause", json={"memory": False}).status_code == 204
        assert api.request_sync("GET", f"/sandboxes/{sid}").json()["pauseMode"] == "filesystem"
        sbx = Sandbox.connect(sid, on_resume="reboot", api_key=server.api_key, api_url=server.api_url)
        assert sbx.files.read("/home/user/kept.txt").strip() == "kept"
        assert "pauseMode" not in api.request_sync("GET", f"/sandboxes/{sid}").json()
    finally:
        api.request_sync("DELETE", f"/sandboxes/{sid}")


# --- Idempotency-Key --------------------------------------------------------------------------------


def _running(api) -> set[str]:
    return {s["sandboxID"] for s in api.request_sync("GET", "/v2/sandboxes").json()}


def test_idempotency_key_returns_the_same_sandbox(api, server):
    key = f"cov-{secrets.token_hex(8)}"
    opts = {"api_key": server.api_key, "api_url": server.api_url}
    before = _running(api)
    first = Sandbox.create("base", timeout=120, idempotency_key=key, **opts)
    try:
        again = Sandbox.create("base", timeout=120, idempotency_key=key, **opts)
        assert again.sandbox_id == first.sandbox_id
        assert again.commands.run("echo same").stdout.strip() == "same"
        assert _running(api) - before == {first.sandbox_id}
        body = {"templateID": "base", "timeout": 120}
        r = api.request_sync("POST", "/v2/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.json()["sandboxID"] == first.sandbox_id
        assert r.headers.get("Idempotent-Replayed") == "true"
        r = api.request_sync("POST", "/v2/sandboxes", json={**body, "timeout": 121}, headers={"Idempotency-Key": key})
        assert r.status_code == 422 and r.json()["error_code"] == "idempotency_key_reused", r.text
        r = api.request_sync("POST", "/v2/sandboxes", json=body, headers={"Idempotency-Key": "Not_Valid"})
        assert r.status_code == 400, r.text
        assert _running(api) - before == {first.sandbox_id}
    finally:
        first.kill()


def test_idempotency_key_of_a_failed_create_can_be_retried(api):
    key = f"cov-{secrets.token_hex(8)}"
    bad = {"templateID": f"nope-{secrets.token_hex(3)}", "timeout": 60}
    r = api.request_sync("POST", "/v2/sandboxes", json=bad, headers={"Idempotency-Key": key})
    assert r.status_code in (400, 404), r.text
    r = api.request_sync("POST", "/v2/sandboxes", json=bad, headers={"Idempotency-Key": key})
    assert r.status_code in (400, 404) and "Idempotent-Replayed" not in r.headers, r.text


def test_idempotency_key_concurrent_duplicates_start_one_sandbox(api):
    from concurrent.futures import ThreadPoolExecutor

    key = f"cov-{secrets.token_hex(8)}"
    body = {"templateID": "base", "timeout": 120}
    before = _running(api)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: api.request_sync("POST", "/v2/sandboxes", json=body,
                                                           headers={"Idempotency-Key": key}), range(3)))
    ids = {r.json()["sandboxID"] for r in answers}
    try:
        assert [r.status_code for r in answers] == [201, 201, 201]
        assert len(ids) == 1 and _running(api) - before == ids
        assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in answers) == 2
    finally:
        for sid in ids:
            api.request_sync("DELETE", f"/sandboxes/{sid}")


# --- sandbox logs v2 ------------------------------------------------------------------------------


def test_logs_v2_search_is_case_sensitive(api):
    sid = api.request_sync("POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()["sandboxID"]
    try:
        path = f"/v2/sandboxes/{sid}/logs"
        logs = api.request_sync("GET", path).json()["logs"]
        word = next(w for e in logs for w in e["message"].split() if any(c.isalpha() for c in w))
        swapped = word.swapcase()
        found = api.request_sync("GET", path, params={"search": word}).json()["logs"]
        assert found and all(word in e["message"] for e in found)
        other = api.request_sync("GET", path, params={"search": swapped}).json()["logs"]
        assert all(swapped in e["message"] for e in other), (word, other)
        assert len(other) < len(logs)
    finally:
        api.request_sync("DELETE", f"/sandboxes/{sid}")


# --- the same answers through the JS SDK -------------------------------------------------------------


def test_js_sdk_gets_clear_errors(api, server):
    import json
    import shutil
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    js_sdk = here.parent / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"
    node = shutil.which("node")
    if node is None or not js_sdk.exists():
        pytest.fail("node or the JS e2b SDK is missing (run scripts/setup.sh --test)")
    sid = api.request_sync("POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        assert api.request_sync("POST", f"/sandboxes/{sid}/pause").status_code == 204
        before = _running(api)
        proc = subprocess.run([node, str(here / "js_e2b_coverage.mjs"), js_sdk.as_uri(), sid],
                              env=server.sdk_env(), capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        got = json.loads(lines[-1][len("RESULT "):])
        assert got["volumes"] == [] and got["secrets"] == [] and got["secretsHasNext"] is False
        assert "volumes are not supported" in got["volumeCreate"].lower(), got
        assert got["volumeInfo"] and "not found" in got["volumeInfo"].lower(), got
        assert "secrets are not supported" in got["secretCreate"].lower(), got
        assert "volumes are not supported" in got["mount"], got
        assert "not supported" in got["reboot"], got
        assert _running(api) <= before  # the refused create started nothing
        assert api.request_sync("GET", f"/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        api.request_sync("DELETE", f"/sandboxes/{sid}")
