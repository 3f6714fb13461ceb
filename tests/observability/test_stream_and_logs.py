"""The event stream's long-poll and SSE forms, server JSON logs with request ids, /metrics basics."""

from __future__ import annotations

import json
import threading
import time

import requests
from e2b import Sandbox


def test_long_poll_returns_when_an_event_arrives(server, api):
    since = api.json("/events?tail=1")["lastSeq"]
    got: dict = {}

    def poll():
        t0 = time.monotonic()
        got["page"] = api.json(f"/events?since={since}&wait=50")
        got["took"] = time.monotonic() - t0

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "a long poll with nothing new must wait"
    s = Sandbox.create(metadata={"suite": "observability", "test": "long-poll"}, timeout=120)
    try:
        t.join(60)
        assert not t.is_alive()
        evs = got["page"]["events"]
        assert evs and evs[0]["sandboxID"] == s.sandbox_id and evs[0]["type"] == "created"
        assert got["page"]["lastSeq"] == evs[-1]["seq"] > since
    finally:
        s.kill()
    # nothing new and no wait: an empty page that keeps the cursor
    last = api.json("/events?tail=1")["lastSeq"]
    assert api.json(f"/events?since={last}") == {"events": [], "lastSeq": last}


def test_server_sent_events(server, api):
    since = api.json("/events?tail=1")["lastSeq"]
    events: list[dict] = []
    with requests.get(f"{server.api_url}/events?since={since}", stream=True, timeout=90,
                      headers={"X-API-KEY": server.api_key, "Accept": "text/event-stream"}) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        s = Sandbox.create(metadata={"suite": "observability", "test": "sse"}, timeout=120)
        s.kill()
        block: dict = {}
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith(("id:", "event:", "data:")):
                k, _, v = line.partition(":")
                block[k] = v.strip()
            elif line == "" and block:
                ev = json.loads(block["data"])
                assert int(block["id"]) == ev["seq"] and block["event"] == ev["type"]
                if ev.get("sandboxID") == s.sandbox_id:
                    events.append(ev)
                block = {}
                if [e["type"] for e in events] == ["created", "killed"]:
                    break
    assert [e["type"] for e in events] == ["created", "killed"]
    assert events[1]["reason"] == "request"


def test_events_need_the_api_key(api):
    r = api.get("/events", headers={"X-API-KEY": "e2b_" + "0" * 40})
    assert r.status_code == 401


def test_server_logs_are_json_with_request_ids(server):
    rid = "obs-test-" + str(int(time.time() * 1000))
    r = requests.post(f"{server.api_url}/v2/sandboxes", json={"templateID": "base", "timeout": 60,
                      "metadata": {"suite": "observability"}},
                      headers={"X-API-KEY": server.api_key, "X-Request-Id": rid}, timeout=120)
    assert r.status_code == 201, r.text
    assert r.headers["X-Request-Id"] == rid
    sid = r.json()["sandboxID"]
    requests.delete(f"{server.api_url}/sandboxes/{sid}", headers={"X-API-KEY": server.api_key}, timeout=60)
    records = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))  # every structured line is valid JSON
    assert records and all({"time", "level", "logger", "message"} <= set(rec) for rec in records)
    mine = [rec for rec in records if rec.get("request_id") == rid]
    assert any(sid in rec["message"] for rec in mine), mine
    # a request without an id gets one generated
    r = requests.get(f"{server.api_url}/templates", headers={"X-API-KEY": server.api_key}, timeout=30)
    assert len(r.headers["X-Request-Id"]) >= 8


def test_metrics_scrape_parses_and_counts_api_requests(server, scrape):
    s = scrape()
    for name in ("agentenv_sandboxes", "agentenv_node_sandbox_capacity", "agentenv_sandbox_operation_duration_seconds",
                 "agentenv_proxy_requests", "agentenv_snapshot_store_transfer_bytes", "process_cpu_seconds",
                 "agentenv_warm_pool_images", "agentenv_http_requests"):
        assert s.has(name), name
    key = dict(route="/templates", method="GET", status="200")
    before = s.value("agentenv_http_requests_total", **key)
    for _ in range(3):
        requests.get(f"{server.api_url}/templates", headers={"X-API-KEY": server.api_key}, timeout=30)
    assert scrape().value("agentenv_http_requests_total", **key) == before + 3


def test_refused_operation_counts_as_failure_by_reason(server, scrape):
    key = {"X-API-KEY": server.api_key}
    r = requests.post(f"{server.api_url}/v2/sandboxes", json={"templateID": "base", "timeout": 120}, headers=key,
                      timeout=120)
    sid = r.json()["sandboxID"]
    try:
        assert requests.post(f"{server.api_url}/sandboxes/{sid}/pause", headers=key, timeout=120).status_code == 204
        before = scrape().value("agentenv_sandbox_operation_failures_total", operation="pause")
        again = requests.post(f"{server.api_url}/sandboxes/{sid}/pause", headers=key, timeout=120)
        assert again.status_code == 409
        after = scrape()
        assert after.value("agentenv_sandbox_operation_failures_total", operation="pause") == before + 1
        reasons = {s.labels["reason"] for s in after.samples
                   if s.name == "agentenv_sandbox_operation_failures_total" and s.labels["operation"] == "pause"}
        assert reasons and all(r.replace("_", "").isalnum() for r in reasons), reasons
    finally:
        requests.delete(f"{server.api_url}/sandboxes/{sid}", headers=key, timeout=60)


def test_timeout_expiry_is_an_event(server, api):
    since = api.json("/events?tail=1")["lastSeq"]
    r = requests.post(f"{server.api_url}/v2/sandboxes", json={"templateID": "base", "timeout": 2},
                      headers={"X-API-KEY": server.api_key}, timeout=120)
    sid = r.json()["sandboxID"]
    deadline = time.monotonic() + 60
    types: list[str] = []
    while time.monotonic() < deadline:
        evs = api.json(f"/events?since={since}&sandboxID={sid}")["events"]
        types = [e["type"] for e in evs]
        if "killed" in types:
            break
        time.sleep(0.5)
    assert types == ["created", "expired", "killed"], types
    assert evs[1]["action"] == "kill" and evs[2]["reason"] == "timeout"
