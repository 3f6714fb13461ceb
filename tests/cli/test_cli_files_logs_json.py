"""`agentenv sandbox files get/put`, `sandbox logs [-f]` and the `--json` outputs of list/create commands."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

from e2b import Sandbox

from cli_util import run_cli
from serverproc import agentenv_executable


def test_files_put_get_round_trip_of_a_binary_file(server, sid, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17) + bytes(range(256))  # every byte value, not a multiple of a chunk
    src, back = tmp_path / "blob.bin", tmp_path / "back.bin"
    src.write_bytes(data)
    p = run_cli(server, "sandbox", "files", "put", sid, str(src), "/home/user/deep/dir/blob.bin", "--json")
    assert json.loads(p.stdout)[0]["path"] == "/home/user/deep/dir/blob.bin"
    # what the sandbox holds, checked inside it
    inside = run_cli(server, "sandbox", "exec", sid, "--", "sha256sum /home/user/deep/dir/blob.bin").stdout
    assert inside.split()[0].decode() == hashlib.sha256(data).hexdigest()

    run_cli(server, "sandbox", "files", "get", sid, "/home/user/deep/dir/blob.bin", str(back))
    assert back.read_bytes() == data
    # a directory as LOCAL: the remote base name inside it
    run_cli(server, "sandbox", "files", "get", sid, "deep/dir/blob.bin", str(tmp_path))
    assert (tmp_path / "blob.bin").read_bytes() == data


def test_files_through_stdin_and_stdout(server, sid):
    data = os.urandom(100_000)
    run_cli(server, "sandbox", "files", "put", sid, "-", "piped.bin", input=data)
    assert run_cli(server, "sandbox", "files", "get", sid, "piped.bin", "-").stdout == data
    # the SDK sees the same file (relative paths are under the user's home)
    assert Sandbox.connect(sid).files.read("/home/user/piped.bin", format="bytes") == data
    # a pipe as LOCAL (process substitution: /dev/fd/N)
    p = subprocess.run(["/bin/bash", "-c", f"{agentenv_executable()} sandbox files put {sid} "
                                           "<(printf from-a-fifo) fifo.txt"],
                       env=server.sdk_env(), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert run_cli(server, "sandbox", "files", "get", sid, "fifo.txt", "-").stdout == b"from-a-fifo"


def test_files_errors_exit_1_and_leave_nothing_behind(server, sid, tmp_path):
    target = tmp_path / "never"
    p = run_cli(server, "sandbox", "files", "get", sid, "/no/such/file", str(target), check=False)
    assert p.returncode == 1 and b"does not exist" in p.stderr
    assert not target.exists() and list(tmp_path.iterdir()) == []
    p = run_cli(server, "sandbox", "files", "put", sid, str(tmp_path / "missing"), "/tmp/x", check=False)
    assert p.returncode == 2  # a usage error: LOCAL is not a file


def test_logs_show_the_lifecycle_and_follow_ends_at_kill(server, sandboxes):
    sid = sandboxes.create()
    entries = [json.loads(line) for line in run_cli(server, "sandbox", "logs", sid, "--json").stdout.splitlines()]
    assert any(e["fields"].get("type") == "created" for e in entries), entries
    assert all({"timestamp", "level", "message", "fields"} <= set(e) for e in entries)
    human = run_cli(server, "sandbox", "logs", sid).stdout.decode()
    assert "Sandbox created" in human

    follow = subprocess.Popen([agentenv_executable(), "sandbox", "logs", "-f", "--json", sid], env=server.sdk_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        time.sleep(2)
        assert follow.poll() is None, "logs -f ended while the sandbox still runs"
        run_cli(server, "sandbox", "pause", sid)
        run_cli(server, "sandbox", "kill", sid)
        out, err = follow.communicate(timeout=30)  # -f stops by itself once the sandbox is killed
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    types = [json.loads(line)["fields"].get("type") for line in out.splitlines()]
    assert types.count("created") == 1  # each entry once, though the cursor is inclusive
    assert "paused" in types and types[-1] == "killed", types


def test_logs_of_an_unknown_sandbox_exit_1(server):
    p = run_cli(server, "sandbox", "logs", "nosuchsandbox0000000", check=False)
    assert p.returncode == 1 and b"404" in p.stderr


def test_json_of_create_list_fork_and_snapshot_commands(server, sandboxes):
    created = json.loads(run_cli(server, "sandbox", "create", "--timeout", "120", "--json",
                                 "-m", "who=json-test", "-e", "FROM_CLI=yes").stdout)
    sid = created["sandboxID"]
    sandboxes.adopt(sid)
    assert created["templateID"] and created["envdAccessToken"]
    assert run_cli(server, "sandbox", "exec", sid, "--", "echo $FROM_CLI").stdout == b"yes\n"

    listed = {r["sandboxID"]: r for r in json.loads(run_cli(server, "sandbox", "list", "--json").stdout)}
    assert listed[sid]["metadata"] == {"who": "json-test"} and listed[sid]["state"] == "running"

    forked = json.loads(run_cli(server, "sandbox", "fork", sid, "--count", "2", "--json").stdout)
    children = [r["sandbox"]["sandboxID"] for r in forked]
    sandboxes.adopt(*children)
    assert len(children) == 2 and sid not in children

    snap = json.loads(run_cli(server, "snapshot", "create", sid, "--name", "cli-json-snap", "--json").stdout)
    try:
        assert "cli-json-snap" in snap["names"]
        snaps = json.loads(run_cli(server, "snapshot", "list", "--json").stdout)
        assert snap["snapshotID"] in {s["snapshotID"] for s in snaps}
    finally:
        run_cli(server, "snapshot", "delete", snap["snapshotID"], check=False)


def test_json_of_local_list_and_create_commands(server):
    data_dir = ["--data-dir", str(server.data_dir)]
    images = json.loads(run_cli(server, "image", "list", "--json", *data_dir).stdout)
    assert isinstance(images, list) and images
    templates = json.loads(run_cli(server, "templates", "list", "--json", *data_dir).stdout)
    assert "base" in {a for t in templates for a in t["aliases"]}

    team = f"cli-json-{os.getpid()}"
    t = json.loads(run_cli(server, "teams", "create", team, "--max-sandboxes", "3", "--json", *data_dir).stdout)
    assert t["teamID"] == team and t["maxSandboxes"] == 3
    assert team in {x["teamID"] for x in json.loads(run_cli(server, "teams", "list", "--json", *data_dir).stdout)}

    key = json.loads(run_cli(server, "keys", "create", "--team", team, "--name", "k", "--json", *data_dir).stdout)
    try:
        assert key["key"].startswith("e2b_") and key["teamID"] == team
        keys = {k["keyID"]: k for k in json.loads(run_cli(server, "keys", "list", "--team", team, "--json",
                                                          *data_dir).stdout)}
        assert keys[key["keyID"]]["revoked"] is False
        # the new key works against the running server: its team sees none of the default team's sandboxes
        env = {**server.sdk_env(), "E2B_API_KEY": key["key"]}
        p = subprocess.run([agentenv_executable(), "sandbox", "list", "--json"], env=env, capture_output=True,
                           timeout=60)
        assert p.returncode == 0 and json.loads(p.stdout) == []
    finally:
        run_cli(server, "keys", "revoke", key["keyID"], *data_dir, check=False)
