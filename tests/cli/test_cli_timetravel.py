"""`agentenv sandbox checkpoint|rollback|checkpoints` and `agentenv checkpoint tree` against the session
server: a file written after a checkpoint is gone after the rollback, the tree shows the chain, and
a bad checkpoint id exits 1 with the server's message."""

from __future__ import annotations

import json

from cli_util import run_cli


def test_checkpoint_rollback_tree(server, sandboxes):
    sid = sandboxes.create()
    run_cli(server, "sandbox", "exec", sid, "--", "sh", "-c", "echo one > /home/user/state")
    c1 = run_cli(server, "sandbox", "checkpoint", sid, "--name", f"cli-{sid}-1", "-m", "step=1").stdout.decode().strip()
    run_cli(server, "sandbox", "exec", sid, "--", "sh", "-c", "echo two > /home/user/state")
    c2 = json.loads(run_cli(server, "sandbox", "checkpoint", sid, "--json").stdout)
    assert c2["parent_id"] == c1 and c2["sandbox_id"] == sid

    run_cli(server, "sandbox", "rollback", sid, c1)
    out = run_cli(server, "sandbox", "exec", sid, "--", "cat", "/home/user/state").stdout.decode()
    assert out == "one\n"

    listed = json.loads(run_cli(server, "sandbox", "checkpoints", sid, "--json").stdout)
    assert [c["checkpoint_id"] for c in listed] == [c1, c2["checkpoint_id"]]
    tree = run_cli(server, "checkpoint", "tree", c1).stdout.decode().splitlines()
    assert tree[0].startswith(c1) and "step=1" in tree[0] and tree[0].endswith("*")
    assert tree[1].startswith("  " + c2["checkpoint_id"])

    bad = run_cli(server, "sandbox", "rollback", sid, "s" + "0" * 20, check=False)
    assert bad.returncode == 1 and b"not found" in bad.stderr
    for c in (c2["checkpoint_id"], c1):
        run_cli(server, "snapshot", "delete", c)
