"""The web console in headless Chromium (Debian's `chromium`, driven by npm playwright-core).

Scenario through the real SDK: create → fork(4) → pause → resume; the console must list the five
sandboxes (also through its metadata filter), draw the four children under their parent in the
lineage graph, and paint the parent's metric charts; after the kill its event view shows it.
Screenshots go to tests/console/artifacts/ (gitignored); the path is printed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

HERE = Path(__file__).resolve().parent
ARTIFACTS = HERE / "artifacts"
CHROMIUM = os.environ.get("AGENTENV_TEST_CHROMIUM", "/usr/bin/chromium")


def _run_browser(server, parent: str, children: list[str], run: str) -> dict:
    node = shutil.which("node")
    if node is None or not (HERE / "node_modules" / "playwright-core").is_dir():
        pytest.fail("node or tests/console/node_modules missing: run scripts/setup.sh --test")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium; scripts/setup.sh --test does it)")
    ARTIFACTS.mkdir(exist_ok=True)
    env = dict(os.environ, CONSOLE_URL=server.api_url, API_KEY=server.api_key, PARENT=parent,
               CHILDREN=",".join(children), SHOT_DIR=str(ARTIFACTS), CHROMIUM=CHROMIUM, RUN=run)
    p = subprocess.run([node, str(HERE / "console_check.mjs")], cwd=HERE, env=env, capture_output=True, text=True,
                       timeout=240, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"browser run failed ({p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    print(f"\nconsole screenshots: {ARTIFACTS}/console-*.png")
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_console_scenario(server):
    run = secrets.token_hex(4)
    made: list[Sandbox] = []
    try:
        src = Sandbox.create(metadata={"suite": "console", "run": run}, timeout=600)
        made.append(src)
        src.commands.run("python3 -c 'sum(range(3*10**6))'")
        children = src.fork(count=4)
        assert all(isinstance(c, Sandbox) for c in children), children
        made.extend(children)
        src.pause()
        src = Sandbox.connect(src.sandbox_id, timeout=600)
        kids = [c.sandbox_id for c in children]
        src.commands.run("sleep 600", background=True)  # a process the console's detail lists (via envd)
        deadline = time.monotonic() + 60
        while len(src.get_metrics()) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)

        seen = _run_browser(server, src.sandbox_id, kids, run)
        assert not seen["errors"], seen["errors"]
        assert seen["error"] is None
        listed = {r["id"] for r in seen["listed"]}
        assert {src.sandbox_id, *kids} <= listed
        assert sorted(seen["filtered"]) == sorted([src.sandbox_id, *kids])
        assert seen["nodes"] and "sandboxes" in seen["nodes"][0]
        tree = seen["tree"]
        assert sorted(c["id"] for c in tree["children"]) == sorted(kids)
        # drawn as a tree: every child one rank below its parent (top-to-bottom layout)
        assert all(c["y"] > tree["parentY"] for c in tree["children"]), tree
        assert len({round(c["x"]) for c in tree["children"]}) == 4, tree  # side by side, not stacked
        assert tree["parentOf"] == ["template:base"]
        d = seen["detail"]
        assert d["id"] == src.sandbox_id and d["points"] >= 2 and d["state"] == "running"
        assert len(d["canvases"]) == 3 and all(n > 500 for n in d["canvases"]), d["canvases"]
        assert any("sleep 600" in line for line in d["procs"]), d["procs"]
        assert any("paused" in line for line in d["logs"]) and any("resumed" in line for line in d["logs"])
        assert any("base" in t for t in seen["templates"])
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass
    r = requests.get(f"{server.api_url}/events?tail=50", headers={"X-API-KEY": server.api_key}, timeout=30)
    assert [e["type"] for e in r.json()["events"] if e.get("sandboxID") == src.sandbox_id][-1] == "killed"


def test_console_serves_its_libraries_and_needs_no_key_for_the_page(server):
    page = requests.get(f"{server.api_url}/console/", timeout=30)
    assert page.status_code == 200 and "agentenv console" in page.text
    for lib in ("uplot.js", "uplot.css", "cytoscape.js", "cytoscape-dagre.js"):
        r = requests.get(f"{server.api_url}/console/lib/{lib}", timeout=30)
        assert r.status_code == 200 and len(r.content) > 1000, lib
    assert requests.get(f"{server.api_url}/console/lib/..%2fpackage.json", timeout=30).status_code == 404
    # the data behind it needs the key
    assert requests.get(f"{server.api_url}/observability/lineage", timeout=30).status_code == 401
