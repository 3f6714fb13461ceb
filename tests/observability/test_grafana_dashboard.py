"""deploy/grafana/agentenv-dashboard.json is a valid dashboard whose queries use only real metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "agentenv-dashboard.json"
# Metric names in PromQL: identifiers that are ours or the client library's process_* series.
METRIC = re.compile(r"\b((?:agentenv|process)_[a-zA-Z0-9_]+)\b")


def _exprs(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append(t["expr"])
        for sub in p.get("panels", []):
            out.extend(t["expr"] for t in sub.get("targets", []))
    return out


def test_dashboard_is_valid_json_with_panels():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for p in graphs:
        assert p["targets"] and p["datasource"]["type"] == "prometheus", p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance"}


def test_every_queried_metric_exists_in_a_real_scrape(scrape):
    dash = json.loads(DASHBOARD.read_text())
    s = scrape()
    queried = {name for e in _exprs(dash) for name in METRIC.findall(e)}
    queried |= set(METRIC.findall(json.dumps(dash["templating"])))
    assert len(queried) >= 25
    def family(n: str) -> str:
        for suffix in ("_bucket", "_count", "_sum", "_total"):
            if n.endswith(suffix) and n.removesuffix(suffix) in s.families:
                return n.removesuffix(suffix)
        return n

    # A sample, or the family's HELP/TYPE (labelled series without children yet have no samples).
    missing = sorted(n for n in queried if n not in s.names and family(n) not in s.families)
    assert not missing, f"the dashboard queries metrics /metrics does not expose: {missing}"
    # and it covers every agentenv family the server exposes (nothing measured goes unseen)
    families = {f for f in s.families if f.startswith("agentenv_")}
    shown = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_total")
             for n in queried}
    assert families <= shown, sorted(families - shown)
