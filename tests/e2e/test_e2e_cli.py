"""The `agentenv` CLI's sandbox and snapshot commands against the real server (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2b import Sandbox

AGENTENV = str(Path(sys.executable).parent / "agentenv")


def cli(server, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([AGENTENV, *args], env=server.sdk_env(), capture_output=True, text=True,
                       timeout=180)
    if check:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def test_cli_create_fork_pause_resume_snapshot_kill(server):
    sid = cli(server, "sandbox", "create", "--timeout", "120").stdout.strip()
    created = [sid]
    try:
        sbx = Sandbox.connect(sid)
        sbx.files.write("/home/user/state.txt", "from the parent")
        children = cli(server, "sandbox", "fork", sid, "--count", "2").stdout.split()
        created += children
        assert len(children) == 2 and sid not in children
        for c in children:
            assert Sandbox.connect(c).files.read("/home/user/state.txt") == "from the parent"
        listed = {r["sandboxID"]: r["state"] for r in json.loads(cli(server, "sandbox", "list", "--json").stdout)}
        assert all(listed.get(x) == "running" for x in created), listed
        assert "sandboxID" in cli(server, "sandbox", "list").stdout  # the human table renders too

        cli(server, "sandbox", "pause", sid)
        assert Sandbox.get_info(sid).state.value == "paused"
        again = cli(server, "sandbox", "pause", sid, check=False)
        assert again.returncode != 0 and "409" in again.stderr  # a clear error, not a crash
        cli(server, "sandbox", "resume", sid)
        assert Sandbox.connect(sid).files.read("/home/user/state.txt") == "from the parent"

        snap = cli(server, "snapshot", "create", sid, "--name", "cli-snap").stdout.strip()
        assert snap in {r["snapshotID"] for r in json.loads(cli(server, "snapshot", "list", "--json").stdout)}
        cli(server, "snapshot", "delete", snap)
        gone = cli(server, "snapshot", "delete", snap, check=False)
        assert gone.returncode != 0 and "404" in gone.stderr
    finally:
        for x in created:
            cli(server, "sandbox", "kill", x, check=False)
    assert "404" in cli(server, "sandbox", "kill", sid, check=False).stderr
