"""Time travel through the unmodified E2B SDK and agentenv's client: a 20-step trajectory with a
checkpoint per step, rollback in place, branching from a checkpoint while the source keeps going,
deleting checkpoints in the middle of the chain, and the bad-input cases.

The workload is a process holding a counter in memory (nothing on disk knows it) that advances
one step per request, plus one file per step and a file overwritten at every step.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import Sandbox

from agentenv.client.api import ApiError
from agentenv.client.timetravel import AsyncTimeTravel, TimeTravel
from lifecycle_util import kill_quietly, start_detached
from serverproc import agentenv_executable

D = "/home/user/tt"
STEPS = 20

COUNTER_PY = r'''
import json, os, sys, time
d = sys.argv[1]
counter = 0
trail = []  # in memory only
while True:
    for name in os.listdir(d):
        if not name.startswith("req-"):
            continue
        path = os.path.join(d, name)
        with open(path) as f:
            action = f.read().strip()
        os.remove(path)
        if action == "step":
            counter += 1
            trail.append(counter * counter)
        out = os.path.join(d, "out-" + name[4:])
        with open(out + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "counter": counter, "trail": sum(trail)}, f)
        os.replace(out + ".tmp", out)
    time.sleep(0.01)
'''

ASK_PY = r'''
import json, os, sys, time
d, action = sys.argv[1], sys.argv[2]
nonce = os.urandom(6).hex()
with open(os.path.join(d, "q.tmp" + nonce), "w") as f:
    f.write(action)
os.replace(os.path.join(d, "q.tmp" + nonce), os.path.join(d, "req-" + nonce))
out = os.path.join(d, "out-" + nonce)
deadline = time.time() + 60
while time.time() < deadline:
    if os.path.exists(out):
        with open(out) as f:
            print(f.read())
        os.remove(out)
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
'''


def ask(sbx: Sandbox, action: str = "get") -> dict:
    r = sbx.commands.run(f"python3 {D}/ask.py {D} {action}", timeout=90)
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_counter(sbx: Sandbox) -> int:
    sbx.files.write(f"{D}/counter.py", COUNTER_PY)
    sbx.files.write(f"{D}/ask.py", ASK_PY)
    sbx.commands.run(f"mkdir -p {D}/files")
    start_detached(sbx, f"python3 {D}/counter.py {D} > {D}/counter.log 2>&1")
    deadline = time.monotonic() + 60
    while True:
        try:
            return ask(sbx)["pid"]
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


# Per step, besides a new file and an overwritten one: a file of the previous step deleted, a
# directory deleted and made again, and (as root) a directory of the image replaced by one holding
# only this step's file (an overlay opaque directory).
CHURN = ("rm -f {d}/files/*.tmp; echo {i} > {d}/files/step-{i:02d}.tmp; rm -rf {d}/scratch; mkdir {d}/scratch; "
         "echo {i} > {d}/scratch/n; [ {i} -gt 1 ] || {{ rm -rf /etc/apt/apt.conf.d; mkdir /etc/apt/apt.conf.d; }}; "
         "echo {i} > /etc/apt/apt.conf.d/zz-step")


def step(sbx: Sandbox, i: int) -> dict:
    got = ask(sbx, "step")
    sbx.files.write(f"{D}/files/step-{i:02d}.txt", f"step {i} of {sbx.sandbox_id}\n")
    sbx.files.write(f"{D}/latest.txt", str(i))
    sbx.commands.run(CHURN.format(d=D, i=i), user="root")
    return got


def trail(n: int) -> int:
    return sum(k * k for k in range(1, n + 1))


def assert_at_step(sbx: Sandbox, n: int, pid: int, where: str) -> None:
    got = ask(sbx)
    assert got["counter"] == n and got["trail"] == trail(n), f"{where}: in-memory counter {got}, expected step {n}"
    assert got["pid"] == pid, f"{where}: the counter process changed ({got['pid']} != {pid})"
    files = sorted(e.name for e in sbx.files.list(f"{D}/files"))
    assert files == sorted([f"step-{k:02d}.txt" for k in range(1, n + 1)] + [f"step-{n:02d}.tmp"]), \
        f"{where}: files {files}"
    assert sbx.files.read(f"{D}/latest.txt") == str(n), f"{where}: latest.txt"
    r = sbx.commands.run("cat scratch/n; ls scratch; ls /etc/apt/apt.conf.d; cat /etc/apt/apt.conf.d/zz-step", cwd=D)
    assert r.stdout.split() == [str(n), "n", "zz-step", str(n)], f"{where}: scratch dirs {r.stdout!r}"


@pytest.fixture
def tracker(tracker):
    """The lifecycle suite's tracker; at teardown also every checkpoint taken of its sandboxes."""
    yield tracker
    tt = TimeTravel()
    for sid in tracker.ids:
        try:
            for c in tt.checkpoints(sid):
                tt.delete(c.checkpoint_id)
        except ApiError:
            pass


def error_of(fn) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn()
    return exc.value


@pytest.mark.timeout(600)
def test_trajectory_rollback_branch_delete(server, tracker):
    tt = TimeTravel()
    src = tracker.create(metadata={"suite": "lifecycle", "run": "time-travel"})
    pid = start_counter(src)
    info0 = src.get_info()

    ck: dict[int, str] = {}
    frozen_ok = 0
    for i in range(1, STEPS + 1):
        assert step(src, i)["counter"] == i
        c = tt.checkpoint(src, name=f"tt-{src.sandbox_id}-{i}", metadata={"step": str(i)})
        assert c.sandbox_id == src.sandbox_id and c.size_bytes > 0
        assert c.parent_id == ck.get(i - 1), f"step {i}: parent {c.parent_id}, expected {ck.get(i - 1)}"
        ck[i] = c.checkpoint_id
        frozen_ok += 1
    # The source was never restarted: the same process, every step in its memory.
    assert_at_step(src, STEPS, pid, "source after 20 checkpoints")

    # Checkpoints are snapshots to the unmodified SDK, and a chain in the tree.
    listed = {s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()}
    assert set(ck.values()) <= listed
    assert [c.checkpoint_id for c in tt.checkpoints(src)] == [ck[i] for i in range(1, STEPS + 1)]
    tree = tt.tree(ck[7])
    assert tree.root_id == ck[1] and [c.checkpoint_id for c in tree.path_to(ck[STEPS])] == list(ck.values())
    assert tree.checkpoints[6].metadata == {"step": "7"}

    # Rollback in place to step 5: the same sandbox (id, token, timeout), memory and files of step 5.
    tt.rollback(src, ck[5])
    assert_at_step(src, 5, pid, "after rollback to step 5")
    info = src.get_info()
    assert info.sandbox_id == src.sandbox_id and info.end_at == info0.end_at and info.metadata == info0.metadata
    assert src.is_running()
    # Going on from step 5 branches the tree there.
    assert step(src, 6)["counter"] == 6
    b6 = tt.checkpoint(src, name=f"tt-{src.sandbox_id}-b6")
    assert b6.parent_id == ck[5]

    # Branch 4 children from step 12 (restores of a checkpoint) while the source keeps stepping.
    stop = threading.Event()
    went_on: list[int] = []

    def keep_going() -> None:
        n = 6
        while not stop.is_set() and n < 12:
            n += 1
            went_on.append(step(src, n)["counter"])

    walker = threading.Thread(target=keep_going)
    walker.start()
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            children = list(pool.map(lambda _: tracker.add(Sandbox.create(ck[12], timeout=300)), range(4)))
    finally:
        stop.set()
        walker.join()
    assert went_on and went_on == list(range(7, 7 + len(went_on))), f"source steps during the branch: {went_on}"

    def check_child(c: Sandbox) -> int:
        assert_at_step(c, 12, pid, f"child {c.sandbox_id} of step 12")
        return step(c, 13)["counter"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(check_child, children)) == [13] * 4
    # a branch's checkpoints hang under the checkpoint it was created from
    assert tt.checkpoint(children[0]).parent_id == ck[12]
    assert len({c.sandbox_id for c in children} | {src.sandbox_id}) == 5
    for c in children:
        kill_quietly(c)

    # Delete steps 6-11 (through the SDK): steps 12 and later still restore, the tree skips them.
    for i in range(6, 12):
        Sandbox.delete_snapshot(ck[i])
    tree = tt.tree(ck[12])
    ids = [c.checkpoint_id for c in tree.checkpoints]
    assert not set(ids) & {ck[i] for i in range(6, 12)}
    assert {c.checkpoint_id: c.parent_id for c in tree.checkpoints}[ck[12]] == ck[5]
    tt.rollback(src, ck[14])
    assert_at_step(src, 14, pid, "after rollback to step 14 (6-11 deleted)")
    last = tracker.add(Sandbox.create(ck[STEPS], timeout=300))
    assert_at_step(last, STEPS, pid, "sandbox created from step 20 (6-11 deleted)")
    kill_quietly(last)


@pytest.mark.timeout(300)
def test_bad_input_is_refused_and_nothing_is_lost(server, tracker):
    tt = TimeTravel()
    src = tracker.create()
    pid = start_counter(src)
    step(src, 1)
    c1 = tt.checkpoint(src)
    step(src, 2)

    e = error_of(lambda: tt.rollback(src, "s" + secrets.token_hex(10)))
    assert e.status == 404 and "not found" in e.message
    e = error_of(lambda: tt.tree("nope-" + secrets.token_hex(4)))
    assert e.status == 404
    e = error_of(lambda: tt._call("POST", f"/sandboxes/{src.sandbox_id}/rollback", {}))
    assert e.status == 400 and "checkpointID" in e.message
    e = error_of(lambda: tt._call("POST", f"/sandboxes/{src.sandbox_id}/checkpoints", {"metadata": {"a": 1}}))
    assert e.status == 400
    e = error_of(lambda: tt.checkpoint("i" + secrets.token_hex(9)))
    assert e.status == 404
    snap = tt._call("POST", f"/sandboxes/{src.sandbox_id}/snapshots", {"memory": False})
    e = error_of(lambda: tt.rollback(src, snap["snapshotID"]))
    assert e.status == 400 and "memory" in e.message
    Sandbox.delete_snapshot(snap["snapshotID"])

    # Another team: neither its sandbox nor its checkpoint is reachable.
    out = subprocess.run([agentenv_executable(), "keys", "create", "--team", f"tt-{secrets.token_hex(3)}",
                          "--data-dir", str(server.data_dir), "--json"], capture_output=True, text=True, check=True)
    other = TimeTravel(api_url=server.api_url, api_key=json.loads(out.stdout)["key"])
    e = error_of(lambda: other.rollback(src.sandbox_id, c1.checkpoint_id))
    assert e.status == 404
    e = error_of(lambda: other.tree(c1.checkpoint_id))
    assert e.status == 404
    foreign = Sandbox.create(api_key=json.loads(out.stdout)["key"], timeout=120)
    try:
        fc = other.checkpoint(foreign.sandbox_id)
        e = error_of(lambda: tt.rollback(src, fc.checkpoint_id))
        assert e.status == 404 and fc.checkpoint_id in e.message
        other.delete(fc.checkpoint_id)
    finally:
        kill_quietly(foreign)

    # A rollback while a capture of the same sandbox runs: 409, and the capture completes. (96 MiB in
    # its upper make the capture last long enough: the copy and its seal.)
    src.commands.run("head -c 100663296 /dev/urandom > /home/user/big.bin")
    codes: list[int] = []
    taken: list = []
    t = threading.Thread(target=lambda: taken.append(tt.checkpoint(src)))
    t.start()
    time.sleep(0.3)
    while t.is_alive():
        try:
            tt.rollback(src, c1.checkpoint_id)
            codes.append(200)
        except ApiError as err:
            codes.append(err.status)
            assert err.status == 409, err
            assert "captured" in err.message or "capture" in err.message, err.message
        time.sleep(0.02)
    t.join()
    assert 409 in codes and len(taken) == 1, f"no rollback was refused during the capture: {codes}"
    assert ask(src)["pid"] == pid and src.is_running()

    # A paused sandbox: checkpoint and rollback are 409, and it resumes intact.
    src.pause()
    e = error_of(lambda: tt.checkpoint(src.sandbox_id))
    assert e.status == 409 and "paused" in e.message
    e = error_of(lambda: tt.rollback(src.sandbox_id, c1.checkpoint_id))
    assert e.status == 409
    resumed = Sandbox.connect(src.sandbox_id)
    assert ask(resumed)["pid"] == pid


async def test_async_client(server, tracker):
    sbx = tracker.create()
    att = AsyncTimeTravel(sbx.connection_config)
    c = await att.checkpoint(sbx, name=f"async-{sbx.sandbox_id}", metadata={"k": "v"})
    sbx.files.write("/home/user/after.txt", "x")
    await att.rollback(sbx, c.checkpoint_id)
    assert not sbx.files.exists("/home/user/after.txt")
    assert [x.checkpoint_id for x in await att.checkpoints(sbx)] == [c.checkpoint_id]
    tree = await att.tree(c.name)
    assert tree.root_id == c.checkpoint_id and tree.checkpoints[0].metadata == {"k": "v"}
    await att.delete(c.checkpoint_id)
