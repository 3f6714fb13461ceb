"""The E2B SDK's `Template` builder against agentenv: steps, COPY uploads, start/ready command,
restore-based creates, the build-step cache, tags and deletion.

One template is built per module (builds boot sandboxes; the machine is small) and every test
reads what it needs from it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, Template, wait_for_port

pytestmark = pytest.mark.timeout(900)


def _logs(collect: list):
    return lambda entry: collect.append(str(entry.message))


@pytest.fixture(scope="module")
def context_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ctx")
    app = d / "app"
    (app / "sub").mkdir(parents=True)
    (app / "hello.txt").write_text("hello from the build context\n")
    (app / "sub" / "run.sh").write_text("#!/bin/sh\necho sub-script-ran\n")
    (app / "sub" / "run.sh").chmod(0o755)
    (d / "single.cfg").write_text("key=value\n")
    (app / "session.txt").write_text(secrets.token_hex(8))  # a new files hash: the upload really happens
    return d


def make_template(ctx: Path, marker: str, last_step: str = "echo last") -> Template:
    return (
        Template(file_context_path=str(ctx))
        .from_base_image()
        .set_envs({"BUILD_MARKER": marker})
        .run_cmd(f"echo \"$BUILD_MARKER\" > /home/user/marker.txt && date +%s%N > /home/user/built-at.txt")
        .copy("app", "/home/user/app")
        .copy("single.cfg", "/etc/agentenv-test/")
        .set_workdir("/home/user/srv")
        .run_cmd("echo served-content > index.html")
        .run_cmd("id -un > /home/user/root-step.txt", user="root")
        .run_cmd(last_step)
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )


@pytest.fixture(scope="module")
def built(server, context_dir):
    name = f"tpl-{secrets.token_hex(4)}"
    marker = secrets.token_hex(6)
    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(make_template(context_dir, marker), name, on_build_logs=_logs(logs))
    took = time.monotonic() - t0
    yield {"name": name, "marker": marker, "info": info, "logs": logs, "seconds": took}
    requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                    timeout=60)


def test_build_runs_steps_and_copies_the_context(built):
    sbx = Sandbox.create(built["name"], timeout=120)
    try:
        r = sbx.commands.run("cat /home/user/marker.txt /home/user/app/hello.txt /etc/agentenv-test/single.cfg")
        assert r.stdout.split("\n")[:3] == [built["marker"], "hello from the build context", "key=value"]
        assert sbx.commands.run("/home/user/app/sub/run.sh").stdout.strip() == "sub-script-ran"
        owner = sbx.commands.run("stat -c %U /home/user/app/hello.txt").stdout.strip()
        assert owner == "user"
        assert sbx.commands.run("cat /home/user/root-step.txt").stdout.strip() == "root"
        # ENV steps are build-time only (the SDK documents them so)
        assert sbx.commands.run("echo -n ${BUILD_MARKER:-unset}").stdout == "unset"
    finally:
        sbx.kill()


def test_sandbox_from_template_has_start_command_running(built):
    t0 = time.monotonic()
    sbx = Sandbox.create(built["name"], timeout=120)
    created = time.monotonic() - t0
    try:
        # Already running: no wait, no retry loop. It serves the WORKDIR set before it.
        procs = sbx.commands.run("ps -eo args").stdout
        assert "python3 -m http.server 8000" in procs, procs
        page = sbx.commands.run("curl -s http://127.0.0.1:8000/index.html").stdout
        assert page.strip() == "served-content"
        # The same process that was started at build time (restored, not started again): it was
        # started before the sandbox existed.
        pid = sbx.commands.run("pgrep -f 'http.server 8000'").stdout.split()[0]
        started = int(sbx.commands.run(f"stat -c %Y /proc/{pid}").stdout.strip() or 0)
        assert started > 0
        print(f"create from template took {created:.2f}s")
    finally:
        sbx.kill()


def test_build_logs_and_status(server, built):
    info = built["info"]
    logs = built["logs"]
    assert any(m.startswith("[2/8] RUN echo") for m in logs), logs
    assert "Uploaded 'app'" in logs, logs
    assert any("Template is ready" in m for m in logs), logs
    st = Template.get_build_status(info)
    assert st.status.value == "ready"
    h = {"X-API-KEY": server.api_key}
    r = requests.get(f"{server.api_url}/templates/{info.template_id}", headers=h, timeout=30)
    assert r.status_code == 200 and r.json()["builds"][-1]["status"] == "ready"
    names = [t["names"] for t in requests.get(f"{server.api_url}/templates", headers=h, timeout=30).json()]
    assert [built["name"]] in names
    assert Template.exists(built["name"]) is True
    assert Template.exists(f"nope-{secrets.token_hex(3)}") is False


def test_second_build_reuses_cached_prefix(server, built, context_dir):
    logs: list[str] = []
    # Same steps up to the last RUN, which changes: everything before it comes from the cache.
    t = make_template(context_dir, built["marker"], last_step="echo changed > /home/user/last.txt")
    Template.build(t, built["name"] + ":v2", on_build_logs=_logs(logs))
    cached = [m for m in logs if m.startswith("CACHED")]
    assert len(cached) == 7, logs  # ENV, RUN, COPY, COPY, WORKDIR, RUN, RUN(root)
    assert any(m.startswith("[8/8] RUN") for m in logs), logs
    sbx = Sandbox.create(built["name"] + ":v2", timeout=120)
    try:
        # The cached RUN did not run again: its timestamp is the first build's.
        first = Sandbox.create(built["name"], timeout=120)
        try:
            a = first.commands.run("cat /home/user/built-at.txt").stdout
        finally:
            first.kill()
        assert sbx.commands.run("cat /home/user/built-at.txt").stdout == a
        assert sbx.commands.run("cat /home/user/last.txt").stdout.strip() == "changed"
    finally:
        sbx.kill()
    tags = {t.tag for t in Template.get_tags(built["name"])}
    assert {"default", "v2"} <= tags


def test_unchanged_template_rebuild_is_fully_cached(server, built, context_dir):
    logs: list[str] = []
    t0 = time.monotonic()
    Template.build(make_template(context_dir, built["marker"]), built["name"] + ":again", on_build_logs=_logs(logs))
    took = time.monotonic() - t0
    assert len([m for m in logs if m.startswith("CACHED [")]) == 8, logs
    assert any(m.startswith("CACHED commit") for m in logs), logs
    sbx = Sandbox.create(built["name"] + ":again", timeout=120)
    try:
        assert sbx.commands.run("curl -s http://127.0.0.1:8000/index.html").stdout.strip() == "served-content"
    finally:
        sbx.kill()
    print(f"fully cached rebuild took {took:.2f}s (first build {built['seconds']:.2f}s)")


def test_from_template_builds_on_another_template(server, built):
    name = f"child-{secrets.token_hex(4)}"
    t = (Template().from_template(built["name"])
         .run_cmd("cat /home/user/marker.txt > /home/user/from-parent.txt"))
    info = Template.build(t, name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("cat /home/user/from-parent.txt").stdout.strip() == built["marker"]
        finally:
            sbx.kill()
    finally:
        r = requests.delete(f"{server.api_url}/templates/{info.template_id}",
                            headers={"X-API-KEY": server.api_key}, timeout=60)
        assert r.status_code == 204


def test_failing_step_reports_error_with_step(server):
    from e2b.exceptions import BuildException

    t = Template().from_base_image().run_cmd("echo before").run_cmd("echo boom >&2; exit 7")
    name = f"bad-{secrets.token_hex(4)}"
    logs: list[str] = []
    with pytest.raises(BuildException) as ei:
        Template.build(t, name, on_build_logs=_logs(logs))
    assert "exit code 7" in str(ei.value)
    assert any("boom" in m for m in logs), logs
    r = requests.delete(f"{server.api_url}/templates/{name}", headers={"X-API-KEY": server.api_key}, timeout=60)
    assert r.status_code == 204


def test_delete_template_collects_its_layers(server, context_dir):
    name = f"gone-{secrets.token_hex(4)}"
    t = Template().from_base_image().run_cmd(f"head -c 1000000 /dev/urandom > /home/user/blob-{name}")
    info = Template.build(t, name)
    layers_dir = server.data_dir / "layers"
    before = {p.name for p in layers_dir.iterdir()}
    h = {"X-API-KEY": server.api_key}
    b = requests.get(f"{server.api_url}/templates/{info.template_id}", headers=h, timeout=30).json()
    assert b["builds"][0]["status"] == "ready"
    assert requests.delete(f"{server.api_url}/templates/{name}", headers=h, timeout=60).status_code == 204
    after = {p.name for p in layers_dir.iterdir()}
    assert before - after, "deleting the template removed none of its layers"
    assert requests.get(f"{server.api_url}/templates/{info.template_id}", headers=h, timeout=30).status_code == 404
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=30)
