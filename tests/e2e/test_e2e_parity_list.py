"""E2B parity of the sandbox list filters (issue 14, item 2), through the Python and JS SDKs.

As E2B's API does (spec/openapi.yml and the list handler of e2b-dev/infra): `startedAfter` is
"started at or after", compared in whole microseconds (Python sends microseconds, JS milliseconds);
state, metadata and template (ID or alias) filters combine with AND; order is by start time, desc
by default; `limit`/`nextToken` page through without duplicates; `X-Total-Running` counts the
matching running sandboxes before paging.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, SandboxQuery, SandboxState

from e2e_util import new_tag

HERE = Path(__file__).resolve().parent
JS_SDK = HERE.parent / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"


@pytest.fixture(scope="module")
def trio(sandbox_factory):
    """Three sandboxes of one fresh tag, created one after the other; the first one paused."""
    tag = new_tag()
    sbxs = [sandbox_factory.create(metadata={"parity": tag, "n": str(i)}) for i in range(3)]
    sbxs[0].pause()
    return tag, sbxs


def _ids(paginator) -> list[str]:
    out: list[str] = []
    while paginator.has_next:
        out += [s.sandbox_id for s in paginator.next_items()]
    return out


def test_started_after_is_inclusive_python(trio):
    tag, sbxs = trio
    for sbx in sbxs:
        started = Sandbox.get_info(sbx.sandbox_id).started_at
        own = _ids(Sandbox.list(query=SandboxQuery(metadata={"parity": tag}, started_after=started)))
        assert sbx.sandbox_id in own
        later = _ids(Sandbox.list(query=SandboxQuery(metadata={"parity": tag},
                                                     started_after=started + timedelta(seconds=1))))
        assert sbx.sandbox_id not in later
    first = Sandbox.get_info(sbxs[0].sandbox_id).started_at
    everything = _ids(Sandbox.list(query=SandboxQuery(metadata={"parity": tag}, started_after=first)))
    assert sorted(everything) == sorted(s.sandbox_id for s in sbxs)


def test_state_metadata_template_and_order_python(trio):
    tag, sbxs = trio
    ids = [s.sandbox_id for s in sbxs]
    md = {"parity": tag}
    assert _ids(Sandbox.list(query=SandboxQuery(metadata=md))) == ids[::-1]  # newest first
    assert _ids(Sandbox.list(query=SandboxQuery(metadata=md), order="asc")) == ids
    assert _ids(Sandbox.list(query=SandboxQuery(metadata=md, state=[SandboxState.PAUSED]))) == [ids[0]]
    assert _ids(Sandbox.list(query=SandboxQuery(metadata=md, state=[SandboxState.RUNNING]))) == ids[:0:-1]
    assert _ids(Sandbox.list(query=SandboxQuery(metadata={**md, "n": "1"}))) == [ids[1]]
    assert _ids(Sandbox.list(query=SandboxQuery(metadata={**md, "n": "9"}))) == []
    template_id = Sandbox.get_info(ids[1]).template_id
    for name in ("base", template_id):
        assert _ids(Sandbox.list(query=SandboxQuery(metadata=md, template=name))) == ids[::-1], name
    assert _ids(Sandbox.list(query=SandboxQuery(metadata=md, template=f"nosuch{tag}"))) == []


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_paging_python(trio, order):
    tag, sbxs = trio
    paginator = Sandbox.list(query=SandboxQuery(metadata={"parity": tag}), limit=1, order=order)
    pages = []
    while paginator.has_next:
        pages.append([s.sandbox_id for s in paginator.next_items()])
    ids = [s.sandbox_id for s in sbxs]
    assert pages == [[i] for i in (ids if order == "asc" else ids[::-1])]


def test_total_running_header_and_bad_queries(server, trio):
    tag, _ = trio
    url = f"{server.api_url}/v2/sandboxes"
    key = {"X-API-KEY": server.api_key}
    metadata = f"parity={tag}"
    r = requests.get(url, params={"metadata": metadata, "limit": "1"}, headers=key, timeout=30)
    assert r.status_code == 200 and len(r.json()) == 1
    assert r.headers["X-Total-Running"] == "2" and r.headers.get("X-Next-Token")
    r = requests.get(url, params={"metadata": metadata, "state": "paused"}, headers=key, timeout=30)
    assert r.status_code == 200 and "X-Total-Running" not in r.headers
    for bad in ({"order": "sideways"}, {"template": "base:default"}, {"limit": "0"}, {"limit": "101"},
                {"startedAfter": "yesterday"}, {"nextToken": "!!"}):
        r = requests.get(url, params=bad, headers=key, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["code"] == 400 and r.json()["message"]
    # a token only continues the order it was issued for
    r = requests.get(url, params={"metadata": metadata, "limit": "1", "order": "asc"}, headers=key, timeout=30)
    r = requests.get(url, params={"metadata": metadata, "limit": "1", "nextToken": r.headers["X-Next-Token"]},
                     headers=key, timeout=30)
    assert r.status_code == 400 and "order" in r.json()["message"]


def test_list_filters_js(server, trio):
    tag, sbxs = trio
    node = shutil.which("node")
    if node is None or not JS_SDK.exists():
        pytest.fail("node or the JS e2b SDK is missing (run scripts/setup.sh --test)")
    proc = subprocess.run([node, str(HERE / "js_parity_list.mjs"), JS_SDK.as_uri(), tag],
                          env=server.sdk_env(), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    got = json.loads(lines[-1][len("RESULT "):])
    ids = [s.sandbox_id for s in sbxs]
    for sid in ids:
        assert sid in got["ownStartedAt"][sid], got
        assert sid not in got["plusOneSecond"][sid], got
    assert got["desc"] == ids[::-1] and got["asc"] == ids
    assert got["paused"] == [ids[0]] and got["running"] == ids[:0:-1]
    assert got["byTemplate"] == ids[::-1] and got["n1"] == [ids[1]]
    assert got["pagesDesc"] == [[i] for i in ids[::-1]]
