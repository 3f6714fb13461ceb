"""Isolation between sandboxes, envd independence from the user's rootfs, user-port traffic."""

from __future__ import annotations

import pytest
import requests
from e2b import Sandbox, SandboxException

from e2e_util import SandboxFactory, new_tag, wait_until


@pytest.fixture(scope="module")
def pair(sandbox_factory: SandboxFactory) -> tuple[Sandbox, Sandbox]:
    return sandbox_factory.create(), sandbox_factory.create()


def test_sandboxes_do_not_share_files(pair):
    a, b = pair
    tag = new_tag()
    for path in (f"/home/user/iso-{tag}.txt", f"/tmp/iso-{tag}.txt", f"/var/tmp/iso-{tag}.txt"):
        a.commands.run(f"echo {tag} > {path}", user="root")
        assert a.files.exists(path)
        assert b.files.exists(path) is False
        assert b.commands.run(f"test -e {path} && echo visible || echo absent").stdout == "absent\n"
    # root-owned system locations are per sandbox too
    a.commands.run(f"echo {tag} > /etc/iso-{tag}", user="root")
    assert b.commands.run(f"cat /etc/iso-{tag} 2>/dev/null || echo absent").stdout == "absent\n"


def test_sandboxes_do_not_share_processes(pair):
    a, b = pair
    marker = 4_000_000 + int(new_tag()[:5], 16)  # unique sleep argument as process marker
    # "slee[p]" matches the sleep process but not the shell running the search itself
    pattern = f"slee[p] {marker}"
    handle = a.commands.run(f"sleep {marker}", background=True)
    try:
        assert a.commands.run(f"pgrep -f '{pattern}' >/dev/null && echo seen || echo none").stdout == "seen\n"
        assert b.commands.run(f"pgrep -f '{pattern}' >/dev/null && echo seen || echo none").stdout == "none\n"
        assert not any(any(str(marker) in arg for arg in p.args) for p in b.commands.list())
        # B cannot see A's processes through /proc either (A can: the check works)
        find = (
            "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"
            f" | grep -c '{pattern}' || true"
        )
        assert int(a.commands.run(find).stdout) >= 1
        assert int(b.commands.run(find).stdout) == 0
    finally:
        a.commands.kill(handle.pid)


def test_envd_survives_removing_python_from_the_rootfs(sandbox_factory: SandboxFactory):
    sbx = sandbox_factory.create()
    assert sbx.commands.run("ls /usr/bin/python3*").exit_code == 0  # there is something to delete
    sbx.commands.run("rm -rf /usr/bin/python3* /usr/lib/python3*", user="root")
    assert sbx.commands.run("ls /usr/bin/python3* 2>/dev/null | wc -l").stdout.strip() == "0"
    # everything still works: commands, files, listing, process control
    assert sbx.commands.run("echo still-alive").stdout == "still-alive\n"
    sbx.files.write("/home/user/after.txt", "after python is gone")
    assert sbx.files.read("/home/user/after.txt") == "after python is gone"
    assert "after.txt" in {e.name for e in sbx.files.list("/home/user")}
    handle = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(handle.pid) is True
    assert sbx.is_running()


def _proxy_get(server, sandbox_id: str, port: int, path: str = "/") -> requests.Response:
    return requests.get(
        f"{server.sandbox_url}{path}",
        headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)},
        timeout=30,
    )


def test_http_server_in_sandbox_reachable_through_traffic_listener(server, pair):
    a, b = pair
    tag = new_tag()
    a.files.write(f"/home/user/www/hello-{tag}.txt", f"served {tag}\n")
    handle = a.commands.run("python3 -m http.server 8080 --bind 0.0.0.0", cwd="/home/user/www", background=True)
    try:

        def fetch():
            r = _proxy_get(server, a.sandbox_id, 8080, f"/hello-{tag}.txt")
            return r if r.status_code == 200 else None

        r = wait_until(fetch, "the in-sandbox HTTP server", limit=60, interval=0.5)
        assert r.text == f"served {tag}\n"
        # the same port of the other sandbox is a different, closed port
        other = _proxy_get(server, b.sandbox_id, 8080, f"/hello-{tag}.txt")
        assert other.status_code == 502
        assert f"served {tag}" not in other.text
    finally:
        a.commands.kill(handle.pid)


def test_traffic_to_unknown_sandbox_is_502(server):
    r = _proxy_get(server, "nosuchsandbox0000000", 8080)
    assert r.status_code == 502
    assert "was not found" in r.text


def test_a_users_command_has_none_of_envds_root(pair):
    """Commands as `user` start with the user's real, effective and saved ids and groups and no
    capabilities (envd switches only its spawning thread's credentials), and envd is root again
    for the next command and file operation."""
    a, _ = pair
    for _ in range(3):   # a switch back that failed would show in the next round
        status = a.commands.run("grep -E '^(Uid|Gid|Groups|CapPrm|CapEff):' /proc/self/status").stdout
        fields = {line.split(":")[0]: line.split(":", 1)[1].split() for line in status.splitlines()}
        assert fields["Uid"] == ["1000"] * 4 and fields["Gid"] == ["1000"] * 4, status
        assert fields["Groups"] == ["1000"], status
        assert fields["CapPrm"] == fields["CapEff"] == ["0000000000000000"], status
        back = a.commands.run("python3 -c 'import os; os.setresuid(0, 0, 0)' 2>&1 || echo refused").stdout
        assert back.endswith("refused\n"), back
        root = a.commands.run("id -u; grep ^CapEff /proc/self/status", user="root").stdout.split()
        assert root[0] == "0" and root[2] != "0" * 16, root
        a.files.write("/etc/agentenv-root-check", "x", user="root")   # envd's file side is root again too
        with pytest.raises(SandboxException):
            a.files.write("/etc/agentenv-user-check", "x")         # and as user it is not
