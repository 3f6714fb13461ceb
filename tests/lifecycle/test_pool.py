"""The pool of ready sandboxes: creates take a sandbox restored ahead of demand and only `/init` it.

One extra server with `AGENTENV_POOL_SIZE=2` (the session server runs without a pool, which covers
the disabled pool: every other test creates through it). What is observed from outside: the
`agentenv_sandbox_pool_*` metrics, the SDK, and the host's containers / netns / mounts at the end.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, Template

from leftovers import runsc_containers, runsc_root
from serverproc import new_data_dir, remove_data_dir, run_gc, start_extra_server

pytestmark = pytest.mark.timeout(600)

SIZE = 2


def _metric(srv, name: str, template: str) -> float:
    text = requests.get(f"{srv.url}/metrics", timeout=10).text
    m = re.search(rf'^{name}(?:_total)?{{template="{re.escape(template)}"}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait(pred, what: str, limit: float = 180.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"gave up waiting for {what}")


@pytest.fixture(scope="module")
def pool_server():
    d = new_data_dir("pool")
    srv = start_extra_server(d, env={"AGENTENV_POOL_SIZE": str(SIZE), "AGENTENV_POOL_MIN_AVAILABLE_MB": "0"})
    try:
        yield srv
    finally:
        if not srv.stopped:
            srv.stop(check_leftovers=False)
        run_gc(d, srv.env)
        remove_data_dir(d)


def _ready(srv, template: str = "base") -> float:
    return _metric(srv, "agentenv_sandbox_pool_ready", template)


def _taken(srv, template: str = "base") -> float:
    return _metric(srv, "agentenv_sandbox_pool_taken", template)


def test_create_from_the_pool_keeps_every_promise_of_create(pool_server):
    srv = pool_server
    opts = srv.sdk_opts()
    _wait(lambda: _ready(srv) >= SIZE, "a full pool of the default template")
    taken = _taken(srv)
    sbx = Sandbox.create(envs={"K": "v1"}, metadata={"who": "pool-test"}, timeout=120, secure=True, **opts)
    try:
        assert _taken(srv) == taken + 1  # it came from the pool
        srv.known_ids.add(sbx.sandbox_id)
        assert re.fullmatch(r"i[a-z0-9]{20}", sbx.sandbox_id)
        out = sbx.commands.run("echo $K $E2B_SANDBOX_ID; whoami; pwd").stdout.split()
        assert out == ["v1", sbx.sandbox_id, "user", "/home/user"]
        info = sbx.get_info()
        assert info.metadata == {"who": "pool-test"}
        left = (info.end_at - datetime.now(timezone.utc)).total_seconds()
        assert 100 < left <= 121, left
        # a secure sandbox's envd refuses calls without its access token
        r = requests.get(f"{srv.url}/files", params={"path": "/etc/hostname", "username": "user"},
                         headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}, timeout=10)
        assert r.status_code == 401, r.text
        # pooled sandboxes are nobody's: the list shows only this one
        assert [s.sandbox_id for s in Sandbox.list(**opts).next_items()] == [sbx.sandbox_id]
        # the pool refills in the background
        _wait(lambda: _ready(srv) >= SIZE, "the pool to refill", 120)
    finally:
        sbx.kill()


def test_a_burst_empties_the_pool_and_creates_go_on_the_ordinary_way(pool_server):
    srv = pool_server
    opts = srv.sdk_opts()
    _wait(lambda: _ready(srv) >= SIZE, "a full pool")
    taken = _taken(srv)
    boxes = [Sandbox.create(envs={"N": str(i)}, **opts) for i in range(SIZE + 1)]
    try:
        for sbx in boxes:
            srv.known_ids.add(sbx.sandbox_id)
        assert len({s.sandbox_id for s in boxes}) == SIZE + 1
        for i, sbx in enumerate(boxes):
            assert sbx.commands.run("echo $N").stdout == f"{i}\n"
        assert taken + 1 <= _taken(srv) <= taken + SIZE + 1
        # separate sandboxes: a file in one is not in another
        boxes[0].files.write("/home/user/only-0", "x")
        assert not boxes[1].files.exists("/home/user/only-0")
    finally:
        for sbx in boxes:
            sbx.kill()


CGROUP = Path("/sys/fs/cgroup")


def _frozen(sid: str) -> bool | None:
    """Whether the sandbox's processes are frozen in the host's cgroup freezer (None: no freezer)."""
    v1, v2 = CGROUP / "freezer" / "agentenv" / sid / "freezer.state", CGROUP / "agentenv" / sid / "cgroup.freeze"
    if v1.exists():
        return v1.read_text().strip() == "FROZEN"
    if v2.exists():
        return v2.read_text().strip() == "1" and "frozen 1" in (v2.parent / "cgroup.events").read_text()
    return None


def _cpu_ns(sid: str) -> int:
    v1, v2 = CGROUP / "cpuacct" / "agentenv" / sid / "cpuacct.usage", CGROUP / "agentenv" / sid / "cpu.stat"
    if v1.exists():
        return int(v1.read_text())
    return int(re.search(r"^usage_usec (\d+)$", v2.read_text(), re.M).group(1)) * 1000


def _pooled(srv) -> list[str]:
    running = {s.sandbox_id for s in Sandbox.list(**srv.sdk_opts()).next_items()}
    return [c for c in runsc_containers(srv.data_dir) if c not in running]


def test_pooled_sandboxes_wait_frozen_and_take_no_cpu(pool_server):
    """An idle gVisor sandbox costs tens of ms of CPU a second (runsc 20240729's systrap): a pooled
    one waits frozen in the host's cgroup freezer, and the create that takes it thaws it."""
    srv = pool_server
    _wait(lambda: _ready(srv) >= SIZE, "a full pool")
    pooled = _pooled(srv)
    assert len(pooled) >= SIZE, pooled
    if _frozen(pooled[0]) is None:
        pytest.skip("no cgroup freezer for the sandboxes on this host (neither v1 freezer nor v2 cgroup.freeze)")
    _wait(lambda: all(_frozen(sid) for sid in pooled), "the pooled sandboxes to be frozen", 10)
    before = {sid: _cpu_ns(sid) for sid in pooled}
    time.sleep(3)
    after = {sid: _cpu_ns(sid) for sid in pooled}
    assert after == before, f"pooled sandboxes used CPU while they waited: {before} -> {after}"
    taken = _taken(srv)
    sbx = Sandbox.create(envs={"K": "thawed"}, timeout=120, **srv.sdk_opts())
    try:
        srv.known_ids.add(sbx.sandbox_id)
        assert _taken(srv) == taken + 1 and sbx.sandbox_id in pooled
        assert _frozen(sbx.sandbox_id) is False
        assert sbx.commands.run("echo $K").stdout == "thawed\n"
        t0 = _cpu_ns(sbx.sandbox_id)
        time.sleep(1)
        assert _cpu_ns(sbx.sandbox_id) > t0  # a running sandbox's runtime runs (and costs) again
    finally:
        sbx.kill()


def _thaw(sid: str) -> None:
    for path, value in ((CGROUP / "freezer" / "agentenv" / sid / "freezer.state", "THAWED"),
                        (CGROUP / "agentenv" / sid / "cgroup.freeze", "0")):
        if path.exists():
            path.write_text(value)
            return


def test_a_pooled_sandbox_that_died_is_replaced_by_an_ordinary_start(pool_server):
    """Pooled sandboxes killed behind the server's back (thawed first: a frozen Sentry cannot answer
    `runsc kill`): the create that takes one still answers with a working sandbox (started the
    ordinary way, same id), and nothing of the dead one is left."""
    srv = pool_server
    opts = srv.sdk_opts()
    _wait(lambda: _ready(srv) >= SIZE, "a full pool")
    pooled = _pooled(srv)
    assert len(pooled) >= SIZE, pooled
    runsc = shutil.which("runsc")
    for sid in pooled:
        _thaw(sid)
        subprocess.run([runsc, f"--root={runsc_root(srv.data_dir)}", "kill", sid, "KILL"], check=True, timeout=60)
    _wait(lambda: all(not _alive(srv, sid) for sid in pooled), "the pooled sandboxes to die", 30)
    taken = _taken(srv)
    sbx = Sandbox.create(envs={"K": "after"}, timeout=120, **opts)
    try:
        srv.known_ids.add(sbx.sandbox_id)
        assert _taken(srv) == taken + 1 and sbx.sandbox_id in pooled  # it took a dead one...
        assert sbx.commands.run("echo $K").stdout == "after\n"  # ...and works
        sbx.files.write("/home/user/f", "x")
        assert sbx.files.read("/home/user/f") == "x"
    finally:
        sbx.kill()


def _alive(srv, sid: str) -> bool:
    r = subprocess.run([shutil.which("runsc"), f"--root={runsc_root(srv.data_dir)}", "state", sid],
                       capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and '"running"' in r.stdout


def test_a_create_with_egress_rules_bypasses_the_pool(pool_server):
    srv = pool_server
    opts = srv.sdk_opts()
    _wait(lambda: _ready(srv) >= SIZE, "a full pool")
    taken = _taken(srv)
    sbx = Sandbox.create(allow_internet_access=False, **opts)
    try:
        srv.known_ids.add(sbx.sandbox_id)
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        assert _taken(srv) == taken
    finally:
        sbx.kill()


def test_custom_templates_get_a_pool_after_their_first_create(pool_server):
    srv = pool_server
    opts = srv.sdk_opts()
    tid = Template.build(Template().from_base_image().run_cmd("echo built > /home/user/marker"), "pooled-tmpl",
                         **opts).template_id
    first = Sandbox.create("pooled-tmpl", **opts)
    try:
        srv.known_ids.add(first.sandbox_id)
        assert first.commands.run("cat /home/user/marker").stdout == "built\n"
    finally:
        first.kill()
    _wait(lambda: _ready(srv, tid) >= 1, "a pool of the custom template", 120)
    taken = _taken(srv, tid)
    sbx = Sandbox.create("pooled-tmpl", envs={"K": "t"}, **opts)
    try:
        srv.known_ids.add(sbx.sandbox_id)
        assert _taken(srv, tid) == taken + 1
        assert sbx.commands.run("cat /home/user/marker; echo $K").stdout == "built\nt\n"
    finally:
        sbx.kill()
    # deleting the template takes its pool with it
    assert requests.delete(f"{srv.url}/templates/{tid}", headers=srv.headers(), timeout=60).status_code == 204
    _wait(lambda: _ready(srv, tid) == 0, "the deleted template's pool to go", 60)


def test_stop_tears_the_pool_down(pool_server):
    srv = pool_server
    _wait(lambda: _ready(srv) >= SIZE, "a full pool")
    assert len(runsc_containers(srv.data_dir)) >= SIZE  # the pooled sandboxes run
    srv.stop(gc=False)  # the leftovers check runs before any `agentenv gc` could hide a leak
    assert runsc_containers(srv.data_dir) == []


def test_under_memory_pressure_the_pool_stays_empty_and_creates_still_work():
    """A MemAvailable threshold no host meets: the pool never holds a sandbox, creates boot or restore
    the ordinary way."""
    d = new_data_dir("poolpressure")
    srv = start_extra_server(d, env={"AGENTENV_POOL_SIZE": str(SIZE), "AGENTENV_POOL_MIN_AVAILABLE_MB": str(1 << 40)})
    try:
        _wait(lambda: _metric(srv, "agentenv_warm_pool_images", "base") >= 1, "the warm image")
        time.sleep(3)  # a pool would have started filling by now
        assert _ready(srv) == 0
        sbx = Sandbox.create(envs={"K": "p"}, **srv.sdk_opts())
        try:
            srv.known_ids.add(sbx.sandbox_id)
            assert sbx.commands.run("echo $K").stdout == "p\n"
            assert _taken(srv) == 0
        finally:
            sbx.kill()
        assert "memory pressure" in srv.log_path.read_text()
        srv.stop(gc=False)
        assert runsc_containers(srv.data_dir) == []
    finally:
        if not srv.stopped:
            srv.stop(check_leftovers=False)
        run_gc(d, srv.env)
        remove_data_dir(d)


def test_pooled_sandboxes_of_a_crashed_server_are_removed_at_the_next_start():
    d = new_data_dir("poolcrash")
    env = {"AGENTENV_POOL_SIZE": "1", "AGENTENV_POOL_MIN_AVAILABLE_MB": "0"}
    srv = start_extra_server(d, env=env)
    srv2 = None
    try:
        _wait(lambda: _ready(srv) >= 1, "a pooled sandbox")
        before = set(runsc_containers(d))
        assert before
        srv.kill9()  # the pooled sandbox keeps running, with no record anywhere
        srv2 = start_extra_server(d, api_key=srv.api_key, env=env)
        _wait(lambda: not (before & set(runsc_containers(d))), "the crashed server's pooled sandbox to go", 60)
        _wait(lambda: _ready(srv2) >= 1, "a new pooled sandbox")
        srv2.stop(gc=False)
        assert runsc_containers(d) == []
    finally:
        for s in (srv, srv2):
            if s is not None and not s.stopped:
                s.stop(check_leftovers=False)
        run_gc(d, env)
        remove_data_dir(d)
