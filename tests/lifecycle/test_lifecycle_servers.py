"""Lifecycle across server processes: survive `kill -9` of the server; snapshots shared through S3.

Both tests run EXTRA servers (tests/serverproc.py) on their own data dirs (images hard-linked from
the shared one) and check after shutdown + `agentenv gc` that nothing of those data dirs is left.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxState

from leftovers import runsc_containers
from lifecycle_util import WORK, ask_worker, assert_same_worker, read_state, setup_worker
from s3server import start_s3
from serverproc import new_api_key, new_data_dir, remove_data_dir, start_extra_server, stop_unchecked

TIMEOUT_S = 900
STORE_GC_GRACE_S = 8  # longer than a publish here takes (seal + upload of a memory snapshot: ~1-3 s)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[str]:
    out = []
    for e in Path("/proc").iterdir():
        if not e.name.isdigit():
            continue
        try:
            if os.getpgid(int(e.name)) == pgid:
                cmd = (e / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{e.name}: {cmd[:160]}")
        except (ProcessLookupError, OSError):
            continue
    return out


@pytest.mark.timeout(420)
def test_server_kill9_then_restart_keeps_paused_sandbox_and_snapshots(server):
    d = new_data_dir("crash")
    key = new_api_key()
    first = second = None
    crashed_pgid = None
    try:
        first = start_extra_server(d, api_key=key, log_name="server-1.log")
        o1 = first.sdk_opts()
        a = Sandbox.create(timeout=TIMEOUT_S, **o1)
        first.known_ids.add(a.sandbox_id)
        a.files.write(f"{WORK}/a.txt", "paused across a crash\n")
        setup_worker(a, 16)
        b = Sandbox.create(timeout=TIMEOUT_S, **o1)
        first.known_ids.add(b.sandbox_id)
        b.files.write(f"{WORK}/b.txt", "in the snapshot\n")
        snap = b.create_snapshot()
        at_pause = read_state(a)
        assert a.pause() is True
        # b keeps running: its runsc sandbox outlives the server as an orphan.

        crashed_pgid = first.pid
        first.kill9()
        survivors = _group_members(crashed_pgid)
        print(f"after kill -9: {len(survivors)} processes left in the crashed server's group; "
              f"runsc containers: {runsc_containers(d)}")
        # as a crash in the middle of a resume leaves it: RESUMING in the store (the resume's claim)
        with sqlite3.connect(d / "state.db") as db:
            assert db.execute("UPDATE sandboxes SET state = 'resuming' WHERE sandbox_id = ?",
                              (a.sandbox_id,)).rowcount == 1

        second = start_extra_server(d, api_key=key, log_name="server-2.log")
        second.known_ids |= first.known_ids
        o2 = second.sdk_opts()

        # The paused sandbox (or the one whose resume the crash cut) resumes with its process, memory
        # and files.
        a2 = Sandbox.connect(a.sandbox_id, timeout=TIMEOUT_S, **o2)
        got = ask_worker(a2)
        assert_same_worker(got, at_pause, "paused sandbox resumed after the server crash")
        assert a2.files.read(f"{WORK}/a.txt") == "paused across a crash\n"

        # The snapshot taken before the crash still creates sandboxes.
        c = Sandbox.create(snap.snapshot_id, timeout=TIMEOUT_S, **o2)
        second.known_ids.add(c.sandbox_id)
        assert c.files.read(f"{WORK}/b.txt") == "in the snapshot\n"
        assert c.commands.run("echo ok").stdout.strip() == "ok"

        # The sandbox that was running at the crash: re-adopted (and working) or cleanly gone.
        running = {i.sandbox_id: i for i in Sandbox.list(**o2).next_items()}
        if b.sandbox_id in running:
            assert running[b.sandbox_id].state == SandboxState.RUNNING
            b2 = Sandbox.connect(b.sandbox_id, **o2)
            assert b2.files.read(f"{WORK}/b.txt") == "in the snapshot\n"
            print("running sandbox was re-adopted after the crash")
        else:
            assert b.sandbox_id not in runsc_containers(d), "dropped sandbox still has a runsc container"
            print("running sandbox was dropped after the crash")

        for sid in (a.sandbox_id, b.sandbox_id, c.sandbox_id):
            try:
                Sandbox.kill(sid, **o2)
            except Exception:  # noqa: BLE001
                pass
        assert Sandbox.delete_snapshot(snap.snapshot_id, **o2) is True
        problems = second.stop()
        second = None
        assert not problems, problems
        # Whatever of the crashed server's process group is still alive now is a leftover.
        left = _group_members(crashed_pgid)
        assert not left, f"processes of the crashed server still alive after restart + shutdown + gc: {left}"
    finally:
        stop_unchecked(second, first)
        if crashed_pgid is not None:
            _kill_group(crashed_pgid)
        remove_data_dir(d)


def _s3_client(s3):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def _keys(client, bucket: str, prefix: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


@dataclass
class S3Pair:
    s3: object
    bucket: str
    prefix: str
    a: object   # ExtraServer A (takes snapshots)
    b: object   # ExtraServer B (fresh data dir, same store + API key)


@pytest.fixture(scope="module")
def s3_pair(server) -> Iterator[S3Pair]:
    """rclone S3 + two servers on fresh data dirs sharing the store and the API key."""
    tmp = Path(tempfile.mkdtemp(prefix="agentenv-lc-s3-", dir="/var/tmp"))
    s3 = start_s3(tmp / "root")
    bucket, prefix = f"lc-{secrets.token_hex(3)}", "agentenv/"
    env = dict(AGENTENV_SNAPSHOT_STORE="s3", AGENTENV_S3_BUCKET=bucket, AGENTENV_S3_PREFIX=prefix,
               AGENTENV_S3_ENDPOINT=s3.endpoint, AGENTENV_S3_ACCESS_KEY=s3.access_key,
               AGENTENV_S3_SECRET_KEY=s3.secret_key,
               AGENTENV_STORE_GC_GRACE_S=str(STORE_GC_GRACE_S))  # their publishes touch what the test's GC needs
    dirs: list[Path] = []
    servers = []
    try:
        key = new_api_key()
        for tag in ("s3a", "s3b"):
            d = new_data_dir(tag)
            dirs.append(d)
            servers.append(start_extra_server(d, api_key=key, env=env))
        yield S3Pair(s3, bucket, prefix, servers[0], servers[1])
        # Teardown proper: every server stops cleanly, gc passes, nothing is left (errors here fail).
        problems = []
        for srv in servers:
            problems += srv.stop()
        assert not problems, problems
    finally:
        for srv in servers:
            if not srv.stopped:
                try:
                    srv.stop(check_leftovers=False)
                except Exception:  # noqa: BLE001
                    pass
        s3.stop()
        for d in dirs:
            remove_data_dir(d)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(300)
def test_s3_snapshot_taken_on_one_server_restores_on_another(s3_pair):
    a_srv, b_srv, prefix, bucket = s3_pair.a, s3_pair.b, s3_pair.prefix, s3_pair.bucket
    oa, ob = a_srv.sdk_opts(), b_srv.sdk_opts()
    src = Sandbox.create(timeout=TIMEOUT_S, **oa)
    a_srv.known_ids.add(src.sandbox_id)
    try:
        src.files.write(f"{WORK}/s3.txt", "travelled through S3\n")
        setup_worker(src, 16)
        at_snap = read_state(src)
        name = f"lc-s3-{secrets.token_hex(3)}"
        snap = src.create_snapshot(name=name)
    finally:
        Sandbox.kill(src.sandbox_id, **oa)

    s3c = _s3_client(s3_pair.s3)
    keys = _keys(s3c, bucket, prefix)
    assert f"{prefix}manifests/{snap.snapshot_id}.json" in keys, keys
    assert any(k.startswith(f"{prefix}memory/") for k in keys), keys
    assert any(k.startswith(f"{prefix}layers/") for k in keys), keys

    # Server B never saw this snapshot: it finds it in the store and downloads on demand.
    listed = {s.snapshot_id for s in Sandbox.list_snapshots(**ob).next_items()}
    assert snap.snapshot_id in listed, listed
    c = Sandbox.create(snap.snapshot_id, timeout=TIMEOUT_S, **ob)
    b_srv.known_ids.add(c.sandbox_id)
    try:
        assert_same_worker(ask_worker(c), at_snap, "sandbox restored on server B from S3")
        assert c.files.read(f"{WORK}/s3.txt") == "travelled through S3\n"
    finally:
        Sandbox.kill(c.sandbox_id, **ob)
    by_name = Sandbox.create(name, timeout=TIMEOUT_S, **ob)
    b_srv.known_ids.add(by_name.sandbox_id)
    try:
        assert by_name.files.read(f"{WORK}/s3.txt") == "travelled through S3\n"
    finally:
        Sandbox.kill(by_name.sandbox_id, **ob)
    assert Sandbox.delete_snapshot(snap.snapshot_id, **ob) is True
    assert f"{prefix}manifests/{snap.snapshot_id}.json" not in _keys(s3c, bucket, prefix)


@pytest.mark.timeout(300)
def test_s3_snapshot_deleted_on_one_server_is_gone_on_the_other(s3_pair):
    """Delete through B: A, which took (and caches) the snapshot, must not list or restore it any more."""
    a_srv, b_srv = s3_pair.a, s3_pair.b
    oa, ob = a_srv.sdk_opts(), b_srv.sdk_opts()
    src = Sandbox.create(timeout=TIMEOUT_S, **oa)
    a_srv.known_ids.add(src.sandbox_id)
    try:
        src.files.write(f"{WORK}/gone.txt", "x")
        snap = src.create_snapshot(mode="filesystem")
    finally:
        Sandbox.kill(src.sandbox_id, **oa)
    assert snap.snapshot_id in {s.snapshot_id for s in Sandbox.list_snapshots(**ob).next_items()}
    assert Sandbox.delete_snapshot(snap.snapshot_id, **ob) is True
    keys = _keys(_s3_client(s3_pair.s3), s3_pair.bucket, s3_pair.prefix)
    assert f"{s3_pair.prefix}manifests/{snap.snapshot_id}.json" not in keys

    stale = []
    if snap.snapshot_id in {s.snapshot_id for s in Sandbox.list_snapshots(**oa).next_items()}:
        stale.append("server A still lists the snapshot deleted through server B")
    try:
        ghost = Sandbox.create(snap.snapshot_id, timeout=TIMEOUT_S, **oa)
    except Exception as e:  # noqa: BLE001 - expected: not found
        print(f"create on A from the deleted snapshot: {type(e).__name__}: {str(e)[:200]}")
    else:
        a_srv.known_ids.add(ghost.sandbox_id)
        stale.append("server A still creates sandboxes from the snapshot deleted through server B "
                     "(from its local catalog + artifact cache)")
        Sandbox.kill(ghost.sandbox_id, **oa)
    assert not stale, stale



def _manifest(client, bucket: str, prefix: str, snapshot_id: str) -> dict:
    import json

    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}manifests/{snapshot_id}.json")["Body"].read())


def _pagemap(client, bucket: str, prefix: str, memory: str) -> list[str]:
    """The page packs a memory image in the store needs (its `pagemaps` record)."""
    import json

    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}pagemaps/{memory}")["Body"].read())["packs"]


def _gc_store(srv, grace_s: float, *extra: str) -> tuple[str, float]:
    """`agentenv gc --store` against server A's state store and the shared S3 store, as an operator runs it."""
    import subprocess
    import time

    from serverproc import agentenv_executable

    env = dict(os.environ)
    env.update(srv.env)
    t0 = time.monotonic()
    out = subprocess.run([agentenv_executable(), "gc", "--store", "--grace", str(grace_s), *extra], env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, time.monotonic() - t0


@pytest.mark.timeout(400)
def test_store_gc_removes_exactly_the_unreferenced_blobs_while_a_snapshot_publishes(s3_pair):
    """GC of the S3 store: blobs of deleted snapshots go; a layer a deleted snapshot shares with a
    later one (its descendant in the sandbox's chain) stays; a snapshot published while GC runs in a
    loop keeps every blob and restores on the other server."""
    import threading
    import time

    a_srv, b_srv, bucket, prefix = s3_pair.a, s3_pair.b, s3_pair.bucket, s3_pair.prefix
    oa, ob = a_srv.sdk_opts(), b_srv.sdk_opts()
    s3c = _s3_client(s3_pair.s3)
    _gc_store(a_srv, 0)  # what earlier tests of this module deleted (nothing publishes now)
    ids: list[str] = []
    try:
        src = Sandbox.create(timeout=TIMEOUT_S, **oa)
        ids.append(src.sandbox_id)
        a_srv.known_ids.add(src.sandbox_id)
        src.files.write(f"{WORK}/one.txt", "1")
        snap1 = src.create_snapshot()                       # layers [L1], memory M1
        src.files.write(f"{WORK}/two.txt", "2")
        snap2 = src.create_snapshot()                       # layers [L2, L1], memory M2: shares L1
        other = Sandbox.create(timeout=TIMEOUT_S, **oa)
        ids.append(other.sandbox_id)
        a_srv.known_ids.add(other.sandbox_id)
        other.files.write(f"{WORK}/three.txt", "3")
        snap3 = other.create_snapshot(mode="filesystem")    # layers [L3]
        m1, m2, m3 = (_manifest(s3c, bucket, prefix, s.snapshot_id) for s in (snap1, snap2, snap3))
        assert m2["layers"][1:] == m1["layers"], (m1, m2)
        for sid in ids:
            Sandbox.kill(sid, **oa)
        ids.clear()
        assert Sandbox.delete_snapshot(snap1.snapshot_id, **oa) and Sandbox.delete_snapshot(snap3.snapshot_id, **oa)
        garbage = {f"{prefix}memory/{m1['memory']}", f"{prefix}requires/{m1['memory']}",
                   f"{prefix}pagemaps/{m1['memory']}"}
        garbage |= {f"{prefix}layers/{d}" for d in set(m3["layers"]) - set(m2["layers"])}  # not the template's
        assert len(garbage) == 4, (m2, m3)
        # the memory pages only snap1's image needs (the packs its pagemap lists and snap2's does not)
        packs1, packs2 = (set(_pagemap(s3c, bucket, prefix, m["memory"])) for m in (m1, m2))
        garbage |= {f"{prefix}pages/{p}" for p in packs1 - packs2}
        kept = {f"{prefix}layers/{d}" for d in m2["layers"]} | {f"{prefix}memory/{m2['memory']}"}
        keys = set(_keys(s3c, bucket, prefix))
        assert garbage <= keys and kept <= keys, (garbage - keys, kept - keys)  # delete left the blobs to GC
        time.sleep(STORE_GC_GRACE_S + 1)  # the garbage is older than the grace period now
        dry, _ = _gc_store(a_srv, STORE_GC_GRACE_S, "--dry-run")
        assert {f"{prefix}{line.split()[2]}" for line in dry.splitlines() if line.startswith("would remove ")} \
            == garbage, dry
        assert garbage <= set(_keys(s3c, bucket, prefix)), "a dry run removed blobs"

        # A publish in flight: a sandbox from snap2 (reusing L2, L1) snapshotted while GC runs in a loop.
        pub = Sandbox.create(snap2.snapshot_id, timeout=TIMEOUT_S, **oa)
        ids.append(pub.sandbox_id)
        a_srv.known_ids.add(pub.sandbox_id)
        pub.files.write(f"{WORK}/four.txt", "4")
        # 192 MiB of new data: sealing and uploading it keeps the publish in flight for a few seconds,
        # longer than one `gc --store` run (~1-2 s)
        assert pub.commands.run(f"head -c 192M /dev/urandom > {WORK}/big.bin").exit_code == 0
        result: dict = {}

        def publish() -> None:
            try:
                result["snap"] = pub.create_snapshot()
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = e
            result["done"] = time.monotonic()

        runs: list[tuple[str, float]] = []
        started: list[float] = []
        t = threading.Thread(target=publish)
        t.start()
        while t.is_alive() or not runs:
            started.append(time.monotonic())
            runs.append(_gc_store(a_srv, STORE_GC_GRACE_S))
        t.join()
        assert "error" not in result, result
        # at least one whole GC run (list, mark, sweep) happened while the publish was in flight
        assert sum(1 for s in started if s < result["done"]) >= 2, (started, result["done"])
        for out, secs in runs:
            print(f"gc --store ({secs:.2f}s): {out.strip().splitlines()[-1]}")
        removed = {line.split()[1] for out, _ in runs for line in out.splitlines() if line.startswith("removed ")}
        assert {f"{prefix}{k}" for k in removed} == garbage, ([o for o, _ in runs], garbage)
        keys = set(_keys(s3c, bucket, prefix))
        assert not garbage & keys, garbage & keys
        m4 = _manifest(s3c, bucket, prefix, result["snap"].snapshot_id)
        assert m4["layers"][1:] == m2["layers"], (m2, m4)
        needed = kept | {f"{prefix}layers/{d}" for d in m4["layers"]} | {f"{prefix}memory/{m4['memory']}"}
        needed |= {f"{prefix}pagemaps/{m['memory']}" for m in (m2, m4)}
        needed |= {f"{prefix}pages/{p}" for m in (m2, m4) for p in _pagemap(s3c, bucket, prefix, m["memory"])}
        assert needed <= keys, needed - keys
        Sandbox.kill(pub.sandbox_id, **oa)
        ids.clear()

        # Both restore on server B, which has none of them cached: everything comes from S3.
        for snap, files in ((result["snap"], {"one": "1", "two": "2", "four": "4"}), (snap2, {"one": "1", "two": "2"})):
            c = Sandbox.create(snap.snapshot_id, timeout=TIMEOUT_S, **ob)
            b_srv.known_ids.add(c.sandbox_id)
            try:
                assert {f: c.files.read(f"{WORK}/{f}.txt") for f in files} == files
            finally:
                Sandbox.kill(c.sandbox_id, **ob)
        again, secs = _gc_store(a_srv, 0)  # nothing referenced goes, even with no grace at all
        print(f"gc --store --grace 0 ({secs:.2f}s): {again.strip().splitlines()[-1]}")
        assert needed <= set(_keys(s3c, bucket, prefix))
    finally:
        for sid in ids:
            try:
                Sandbox.kill(sid, **oa)
            except Exception:  # noqa: BLE001
                pass
