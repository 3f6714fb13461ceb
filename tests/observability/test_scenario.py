"""create → fork(4) → pause → resume → kill through the real SDK, observed three ways.

- Prometheus: values scraped from /metrics and parsed with prometheus_client's parser change by
  exactly what the scenario did (deltas: other modules' sandboxes may exist in the session).
- Events: GET /events?since= returns the scenario's events in order, with lineage and reasons.
- Sandbox logs: v1 and v2 shapes list the source sandbox's lifecycle in order, also after the kill.
Also: the lineage endpoint shows the four children under their parent.
"""

from __future__ import annotations

import json
import secrets

import pytest
from e2b import Sandbox

RUN = secrets.token_hex(4)
OPS = ("create", "fork", "pause", "resume", "kill")


def op_count(s, op: str) -> float:
    return s.value("agentenv_sandbox_operation_duration_seconds_count", operation=op)


def running(s) -> float:
    return s.value("agentenv_sandboxes", state="running", template="base")


def paused(s) -> float:
    return s.value("agentenv_sandboxes", state="paused", template="base")


@pytest.fixture(scope="module")
def scenario(server, scrape, api):
    """Runs the scenario once, recording a scrape after every step."""
    steps: dict[str, object] = {}
    made: list[Sandbox] = []
    try:
        steps["before"] = scrape()
        since = api.json("/events?tail=1")["lastSeq"]
        src = Sandbox.create(metadata={"suite": "observability", "run": RUN}, timeout=600)
        made.append(src)
        steps["created"] = scrape()
        children = src.fork(count=4)
        for c in children:
            assert isinstance(c, Sandbox), c
            made.append(c)
        steps["forked"] = scrape()
        lineage = api.json("/observability/lineage")
        src.pause()
        steps["paused"] = scrape()
        src = Sandbox.connect(src.sandbox_id, timeout=600)
        assert src.commands.run("echo back").stdout.strip() == "back"
        steps["resumed"] = scrape()
        for s in made:
            s.kill()
        steps["killed"] = scrape()
        yield {"steps": steps, "src": src.sandbox_id, "children": [c.sandbox_id for c in children],
               "since": since, "lineage": lineage}
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass


def test_metric_values_follow_the_scenario(scenario):
    st = scenario["steps"]
    before = st["before"]

    def d(step: str, fn, *a) -> float:
        return fn(st[step], *a) - fn(before, *a)

    assert d("created", running) == 1
    assert d("created", op_count, "create") == 1
    assert d("forked", running) == 5
    assert d("forked", op_count, "fork") == 1
    assert st["forked"].value("agentenv_fork_children_total", result="ok") - \
        before.value("agentenv_fork_children_total", result="ok") == 4
    assert d("paused", running) == 4 and d("paused", paused) == 1
    assert d("paused", op_count, "pause") == 1
    assert d("resumed", running) == 5 and d("resumed", paused) == 0
    assert d("resumed", op_count, "resume") == 1
    assert d("killed", running) == 0 and d("killed", paused) == 0
    assert d("killed", op_count, "kill") == 5
    # Lifecycle latencies are real durations: a create takes longer than nothing, and the sums grew.
    for op in OPS:
        assert st["killed"].value("agentenv_sandbox_operation_duration_seconds_sum", operation=op) > \
            before.value("agentenv_sandbox_operation_duration_seconds_sum", operation=op), op
    # events counter, by type
    ev = lambda s, t: s.value("agentenv_sandbox_events_total", type=t)  # noqa: E731
    assert ev(st["killed"], "created") - ev(before, "created") == 5
    assert ev(st["killed"], "killed") - ev(before, "killed") == 5
    # the proxy carried the SDK's envd calls (commands.run after the resume)
    assert st["resumed"].value("agentenv_proxy_requests_total", port="envd") > \
        before.value("agentenv_proxy_requests_total", port="envd")
    # node-wide series carry no sandbox ids
    ids = {scenario["src"], *scenario["children"]}
    for s in st["forked"].samples:
        assert not ids & set(s.labels.values()), s


def test_node_capacity_series(scenario):
    s = scenario["steps"]["forked"]
    assert s.value("agentenv_node_sandbox_capacity") >= 5
    assert s.value("agentenv_node_sandboxes_active") >= 5
    assert s.value("agentenv_node_allocated_memory_bytes") >= 5 * 1024 * 1024
    assert s.value("agentenv_node_memory_bytes") > 0 and s.value("agentenv_node_cpus") >= 1


def test_events_contain_the_scenario_in_order(api, scenario):
    src, children = scenario["src"], scenario["children"]
    page = api.json(f"/events?since={scenario['since']}&limit=5000")
    mine = [e for e in page["events"] if e.get("sandboxID") in {src, *children}]
    seqs = [e["seq"] for e in mine]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    src_types = [e["type"] for e in mine if e["sandboxID"] == src]
    assert src_types == ["created", "forked", "paused", "resumed", "killed"], src_types
    created = next(e for e in mine if e["sandboxID"] == src and e["type"] == "created")
    assert created["origin"] == "template" and created["templateID"] == "base"
    forked = next(e for e in mine if e["type"] == "forked")
    assert sorted(forked["children"]) == sorted(children)
    for c in children:
        types = [e["type"] for e in mine if e["sandboxID"] == c]
        assert types == ["created", "killed"], (c, types)
        ce = next(e for e in mine if e["sandboxID"] == c and e["type"] == "created")
        assert ce["origin"] == "fork" and ce["parentID"] == src
        assert ce["seq"] > forked["seq"]
    paused_ev = next(e for e in mine if e["type"] == "paused")
    assert paused_ev["reason"] == "request" and paused_ev["mode"] == "full"
    assert all(e["reason"] == "request" for e in mine if e["type"] == "killed")
    # timestamps are RFC 3339 and never go backwards
    stamps = [e["timestamp"] for e in mine]
    assert stamps == sorted(stamps)
    # filtered by sandbox: the source's own events (+ its children's creation naming it as parent)
    only = api.json(f"/events?since={scenario['since']}&sandboxID={src}")["events"]
    assert [e["type"] for e in only if e["sandboxID"] == src] == src_types


def test_events_file_is_tailable_jsonl(server, scenario):
    import json

    lines = (server.data_dir / "events" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    mine = [e["type"] for e in events if e.get("sandboxID") == scenario["src"]]
    assert mine == ["created", "forked", "paused", "resumed", "killed"]


def test_sandbox_logs_v1_and_v2(api, scenario):
    src = scenario["src"]
    v2 = api.json(f"/v2/sandboxes/{src}/logs")
    lifecycle = [e for e in v2["logs"] if e["fields"].get("source") == "lifecycle"]
    assert [e["fields"]["type"] for e in lifecycle] == ["created", "forked", "paused", "resumed", "killed"]
    assert all(e["level"] in ("debug", "info", "warn", "error") for e in v2["logs"])
    # server log lines that name the sandbox are there too (e.g. the create timing line)
    assert any(e["fields"].get("source") == "server" for e in v2["logs"]), v2
    back = api.json(f"/v2/sandboxes/{src}/logs?direction=backward&limit=1")["logs"]
    assert len(back) == 1 and back[0]["timestamp"] == v2["logs"][-1]["timestamp"]
    found = api.json(f"/v2/sandboxes/{src}/logs?search=paused")["logs"]
    assert found and all("paused" in e["message"].lower() for e in found)
    v1 = api.json(f"/sandboxes/{src}/logs")
    assert len(v1["logs"]) == len(v1["logEntries"]) == len(v2["logs"])
    # v1 lines are JSON objects (what `e2b sandbox logs` parses) carrying the v2 entry's level and message
    lines = [json.loads(x["line"]) for x in v1["logs"]]
    assert [(x["level"], x["message"]) for x in lines] == [(e["level"], e["message"]) for e in v2["logs"]]
    # start (ms) filters
    last_ms = int(__import__("datetime").datetime.fromisoformat(v2["logs"][-1]["timestamp"].replace("Z", "+00:00"))
                  .timestamp() * 1000)
    assert 1 <= len(api.json(f"/sandboxes/{src}/logs?start={last_ms}")["logs"]) < len(v1["logs"])
    # an id nobody knows is a 404 with the error shape
    r = api.get("/v2/sandboxes/inotasandbox0000000000000/logs")
    assert r.status_code == 404 and r.json()["code"] == 404


def test_lineage_shows_children_under_parent(scenario):
    g = scenario["lineage"]
    src, children = scenario["src"], scenario["children"]
    forks = {e["to"] for e in g["edges"] if e["from"] == src and e["kind"] == "fork"}
    assert forks == set(children)
    assert any(e["to"] == src and e["kind"] == "create" and e["from"] == "template:base" for e in g["edges"])
    kinds = {n["id"]: n for n in g["nodes"]}
    assert kinds[src]["state"] == "running" and all(kinds[c]["kind"] == "sandbox" for c in children)
