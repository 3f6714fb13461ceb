"""Template build steps that work in /tmp (issue 14 item 7), through the SDK's `Template` builder.

/tmp is a directory of the sandbox's disk, as in E2B: what a step leaves there is in the template's
layers, a later step (and the start command) can use a WORKDIR under /tmp, and a sandbox of the
template finds the files, also after a filesystem-only pause (a boot from the layers alone).
"""

from __future__ import annotations

import secrets

import pytest
import requests
from e2b import Sandbox, Template, wait_for_port

pytestmark = pytest.mark.timeout(900)


def sh(sbx: Sandbox, cmd: str, **kw) -> str:
    return sbx.commands.run(cmd, timeout=120, **kw).stdout


@pytest.fixture(scope="module")
def built(server):
    name = f"tpl-tmp-{secrets.token_hex(4)}"
    marker = secrets.token_hex(6)
    template = (
        Template()
        .from_base_image()
        .run_cmd(f"mkdir -p /tmp/x && cd /tmp/x && echo {marker} > data.txt")
        .set_workdir("/tmp/x")
        .run_cmd("echo from-workdir > wd.txt && pwd > pwd.txt")
        .run_cmd("cd /tmp/x && cat data.txt wd.txt > both.txt", user="root")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    logs: list[str] = []
    info = Template.build(template, name, on_build_logs=lambda e: logs.append(str(e.message)))
    yield {"name": name, "marker": marker, "info": info, "logs": logs}
    requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                    timeout=60)


def test_steps_in_tmp_and_a_tmp_workdir_reach_the_template(built):
    marker = built["marker"]
    sbx = Sandbox.create(built["name"], timeout=300)
    try:
        assert sh(sbx, "cat /tmp/x/data.txt /tmp/x/wd.txt /tmp/x/pwd.txt").split() == [marker, "from-workdir",
                                                                                        "/tmp/x"]
        assert sbx.files.read("/tmp/x/both.txt") == f"{marker}\nfrom-workdir\n"
        # The start command runs in the WORKDIR under /tmp and serves its files.
        assert sh(sbx, "curl -s http://127.0.0.1:8000/data.txt").strip() == marker
        assert sh(sbx, "cat data.txt", cwd="/tmp/x").strip() == marker
        assert sh(sbx, "stat -c '%a %U:%G' /tmp").strip() == "1777 root:root"
        assert sh(sbx, "awk '$5 == \"/tmp\"' /proc/self/mountinfo") == ""

        # The files are in the template's layers, not only in its memory snapshot: a filesystem-only
        # pause drops memory and the resume boots from the layers and the sandbox's own changes.
        sbx.files.write("/tmp/x/from-sandbox.txt", "mine")
        assert sbx.pause(mode="filesystem") is True
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert sh(sbx, "cat /tmp/x/data.txt /tmp/x/from-sandbox.txt").split() == [marker, "mine"]
        assert sh(sbx, "ps -eo args | grep -c '[h]ttp.server' || true").strip() == "0"
    finally:
        sbx.kill()


def test_sandboxes_of_the_template_do_not_share_tmp(built):
    a = Sandbox.create(built["name"], timeout=300)
    b = Sandbox.create(built["name"], timeout=300)
    try:
        a.files.write("/tmp/x/data.txt", "changed in a")
        assert b.files.read("/tmp/x/data.txt").strip() == built["marker"]
        assert not b.files.exists("/tmp/x/from-sandbox.txt")
    finally:
        a.kill()
        b.kill()
