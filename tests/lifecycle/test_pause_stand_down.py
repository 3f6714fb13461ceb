"""A pause answers once the memory image is written; the frozen container is stopped, its slot
released and its rootfs unmounted after that (`SandboxHost.stand_down_later`). Whatever comes next
for the sandbox waits for that: a resume, a kill, a server shutdown; a crash in between is
reconciled at the next start.

The server's runsc here takes 3 s for every `delete`, so each of those steps really does find the
stand-down still in flight; after a crash of the server the pending `delete` gives up.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from e2b import Sandbox

from leftovers import NETNS_PREFIX, agentenv_netns, runsc_containers
from lifecycle_util import slow_delete_runsc
from serverproc import new_api_key, new_data_dir, remove_data_dir, start_extra_server, stop_unchecked


@pytest.mark.timeout(420)
def test_what_follows_a_pause_waits_for_its_stand_down(server):
    d = new_data_dir("standdown")
    env = {"AGENTENV_RUNSC_PATH": str(slow_delete_runsc(d)), "AGENTENV_WARM_START": "false"}
    key = new_api_key()
    first = second = None
    try:
        first = start_extra_server(d, api_key=key, env=env, log_name="server-1.log")
        o1 = first.sdk_opts()

        # resume right after the pause: the restore waits for the old container to go
        a = Sandbox.create(timeout=600, **o1)
        first.known_ids.add(a.sandbox_id)
        a.files.write("/home/user/a.txt", "kept")
        a.commands.run("sleep 3600", background=True)
        assert a.pause() is True
        a2 = Sandbox.connect(a.sandbox_id, timeout=600, **o1)
        assert a2.files.read("/home/user/a.txt") == "kept"
        assert "sleep 3600" in a2.commands.run("ps -eo args").stdout

        # kill right after the pause: nothing of it is left when the kill answers
        b = Sandbox.create(timeout=600, **o1)
        first.known_ids.add(b.sandbox_id)
        assert b.pause() is True
        assert Sandbox.kill(b.sandbox_id, **o1) is True
        assert not any(b.sandbox_id in c for c in runsc_containers(d))
        assert f"{NETNS_PREFIX}{b.sandbox_id}" not in agentenv_netns()
        assert not (d / "sandboxes" / b.sandbox_id).exists()

        # the server crashes right after a pause: the next start stops the frozen container and
        # frees its slot, and the sandbox resumes from its image
        c = Sandbox.create(timeout=600, **o1)
        first.known_ids.add(c.sandbox_id)
        c.files.write("/home/user/c.txt", "across a crash")
        assert c.pause() is True
        first.kill9()
        time.sleep(3.5)  # the pending `delete` has given up
        assert any(c.sandbox_id in x for x in runsc_containers(d)), "the crash came after the stand-down"
        assert f"{NETNS_PREFIX}{c.sandbox_id}" in agentenv_netns()
        # ... and cut its slot's release half-way: the root-ns link gone, the netns still there (a
        # crash inside the stand-down's release); the next start frees that netns too
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        (link,) = [ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()
                   if f"alias {c.sandbox_id}" in ln]
        subprocess.run(["ip", "link", "del", link], check=True)
        assert f"{NETNS_PREFIX}{c.sandbox_id}" in agentenv_netns()

        second = start_extra_server(d, api_key=key, env=env, log_name="server-2.log")
        second.known_ids |= first.known_ids
        o2 = second.sdk_opts()
        c2 = Sandbox.connect(c.sandbox_id, timeout=600, **o2)
        assert c2.files.read("/home/user/c.txt") == "across a crash"
        assert c2.commands.run("echo ok").stdout == "ok\n"

        # a shutdown right after a pause waits for the stand-down: the paused sandbox holds nothing
        assert c2.pause() is True
        problems = second.stop(gc=False)  # raises when anything of this server is left
        assert not problems, problems
    finally:
        stop_unchecked(second, first)
        remove_data_dir(d)
