"""Checkpoints are cheap: memory images are stored as deduplicated pages, so N checkpoints of a
sandbox holding 64 MiB that rewrites 1 MiB of it per step grow the data dir by far less than N
images; every checkpoint restores exactly; deleting checkpoints reclaims the pages only they used
while the others still restore.

The workload holds 64 MiB of random bytes in memory (nothing on disk knows them), rewrites the same
1 MiB with fresh random bytes per step, and answers with its step counter and the blake2b of the
whole buffer; a file per step too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.client.timetravel import TimeTravel
from lifecycle_util import start_detached
from serverproc import new_data_dir, remove_data_dir, start_extra_server, stop_unchecked

D = "/home/user/pg"
STEPS = 8
MIB = 1 << 20

HOLDER_PY = r'''
import hashlib, json, os, sys, time
d = sys.argv[1]
buf = bytearray(os.urandom(64 << 20))
counter = 0
while True:
    for name in os.listdir(d):
        if not name.startswith("req-"):
            continue
        path = os.path.join(d, name)
        action = open(path).read().strip()
        os.remove(path)
        if action == "step":
            counter += 1
            buf[8 << 20:9 << 20] = os.urandom(1 << 20)
        out = os.path.join(d, "out-" + name[4:])
        with open(out + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "counter": counter,
                       "hash": hashlib.blake2b(buf, digest_size=16).hexdigest()}, f)
        os.replace(out + ".tmp", out)
    time.sleep(0.01)
'''

ASK = (f"cd {D} && n=$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \\n') && echo {{action}} > q.$n && "
       f"mv q.$n req-$n && for i in $(seq 600); do [ -f out-$n ] && cat out-$n && rm out-$n && exit 0; "
       "sleep 0.05; done; exit 3")


def ask(sbx: Sandbox, action: str = "get") -> dict:
    return json.loads(sbx.commands.run(ASK.format(action=action), timeout=60).stdout.strip().splitlines()[-1])


def stored_bytes(data_dir: Path) -> int:
    """Disk blocks of the node's stored artifacts (each inode once: the store hard-links the cache)."""
    seen: set[int] = set()
    total = 0
    for sub in ("pages", "cache", "memory", "layers", "snapshots"):
        for dirpath, _dirs, files in os.walk(data_dir / sub):
            for f in files:
                try:
                    st = os.lstat(os.path.join(dirpath, f))
                except OSError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def assert_at(sbx: Sandbox, n: int, state: dict, where: str) -> None:
    got = ask(sbx)
    assert (got["counter"], got["hash"], got["pid"]) == (n, state["hash"], state["pid"]), \
        f"{where}: in-memory state {got}, expected step {n}: {state}"
    assert sbx.files.read(f"{D}/step.txt") == str(n), f"{where}: step.txt"


@pytest.fixture
def pages_server(server):
    """A server of its own whose snapshot store is collected every 2 s with a 5 s grace period, so a
    deleted checkpoint's pages come back within seconds (the defaults are an hour each)."""
    d = new_data_dir("pages")
    srv = start_extra_server(d, env={"AGENTENV_STORE_GC_INTERVAL_S": "2", "AGENTENV_STORE_GC_GRACE_S": "5",
                                     "AGENTENV_WARM_START": "false"})
    try:
        yield srv
        problems = srv.stop()
        assert not problems, problems
    finally:
        stop_unchecked(srv)
        remove_data_dir(d)


@pytest.mark.timeout(600)
def test_checkpoints_store_pages_once_and_gc_reclaims(pages_server):
    srv = pages_server
    opts = srv.sdk_opts()
    tt = TimeTravel(api_url=srv.url, api_key=srv.api_key)
    sbx = Sandbox.create(timeout=600, **opts)
    srv.known_ids.add(sbx.sandbox_id)
    sbx.files.write(f"{D}/holder.py", HOLDER_PY)
    start_detached(sbx, f"python3 {D}/holder.py {D} > {D}/holder.log 2>&1")
    deadline = time.monotonic() + 60
    while True:
        try:
            state = {0: ask(sbx)}
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)

    ck: dict[int, str] = {}
    sizes: list[int] = []
    for i in range(1, STEPS + 1):
        state[i] = ask(sbx, "step")
        sbx.files.write(f"{D}/step.txt", str(i))
        if i == 2:
            before = stored_bytes(srv.data_dir)  # the base (step 1's image) is in
        c = tt.checkpoint(sbx, metadata={"step": str(i)})
        ck[i] = c.checkpoint_id
        sizes.append(c.size_bytes)
    grown = stored_bytes(srv.data_dir) - before
    image = min(sizes)
    assert image > 64 * MIB, f"a checkpoint of a sandbox holding 64 MiB reports {image} bytes"
    # 7 checkpoints taken after the base: whole images would be 7 x image; pages changed are ~1 MiB each.
    assert grown < (STEPS - 1) * image / 4, \
        f"{STEPS - 1} checkpoints grew the data dir by {grown >> 20} MiB; one image is {image >> 20} MiB"

    # Every checkpoint restores exactly: rollback in place to an early one, a new sandbox from the last.
    tt.rollback(sbx, ck[2])
    assert_at(sbx, 2, state[2], "rollback to step 2")
    last = Sandbox.create(ck[STEPS], timeout=120, **opts)
    srv.known_ids.add(last.sandbox_id)
    assert_at(last, STEPS, state[STEPS], f"created from step {STEPS}")
    last.kill()

    # Delete steps 3..STEPS-1: the pages only they held go (each step's 1 MiB of fresh bytes at least).
    # A deletion removes the manifest at once; the store's GC frees the recipes past their grace
    # period, then the node's own collection the pages only they held.
    held = stored_bytes(srv.data_dir)
    for i in range(3, STEPS):
        assert Sandbox.delete_snapshot(ck[i], **opts) is True
    deadline = time.monotonic() + 90
    while (freed := held - stored_bytes(srv.data_dir)) < (STEPS - 3) * MIB:
        assert time.monotonic() < deadline, f"deleting {STEPS - 3} checkpoints freed {freed} bytes"
        time.sleep(1)
    tt.rollback(sbx, ck[STEPS])
    assert_at(sbx, STEPS, state[STEPS], f"rollback to step {STEPS} after the deletes")
    tt.rollback(sbx, ck[1])
    assert_at(sbx, 1, state[1], "rollback to step 1 after the deletes")
    for i in (1, 2, STEPS):
        tt.delete(ck[i])
    sbx.kill()
