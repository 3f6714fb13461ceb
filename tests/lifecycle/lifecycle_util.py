"""Helpers for the lifecycle suite: an in-sandbox 'stateful worker' and ways to query it.

The worker is a Python process that holds a counter and N MiB of in-memory data (seeded random
bytes, so checkpoint images are realistic, not a compressible pattern) and keeps its sha256 taken
at start. It writes `state.json` (pid, start time, counter, start hash) every 0.1 s and answers a
file-based request: `ask.py NONCE` drops `check.req`, the worker re-hashes its memory and writes
`check.out`. No TCP anywhere: gVisor cannot checkpoint a sandbox holding TCP connections.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2b import Sandbox

SANDBOX_TIMEOUT_S = 900
WORK = "/home/user/lc"

WORKER_PY = r'''
import hashlib, json, os, random, sys, time
d = sys.argv[1]
mib = int(sys.argv[2])
data = bytearray(random.Random(20260101).randbytes(mib << 20))
h0 = hashlib.sha256(data).hexdigest()
started = time.time()
counter = 0

def put(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)

while True:
    counter += 1
    base = {"pid": os.getpid(), "started": started, "counter": counter, "h0": h0, "mib": mib}
    put(os.path.join(d, "state.json"), base)
    req = os.path.join(d, "check.req")
    if os.path.exists(req):
        with open(req) as f:
            nonce = f.read().strip()
        os.remove(req)
        put(os.path.join(d, "check.out"), dict(base, nonce=nonce, hash=hashlib.sha256(data).hexdigest()))
    time.sleep(0.1)
'''

ASK_PY = r'''
import json, os, sys, time
d, nonce = sys.argv[1], sys.argv[2]
out = os.path.join(d, "check.out")
with open(os.path.join(d, "check.req.tmp"), "w") as f:
    f.write(nonce)
os.replace(os.path.join(d, "check.req.tmp"), os.path.join(d, "check.req"))
deadline = time.time() + float(sys.argv[3] if len(sys.argv) > 3 else 60)
while time.time() < deadline:
    try:
        with open(out) as f:
            r = json.load(f)
        if r.get("nonce") == nonce:
            print(json.dumps(r))
            sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.05)
print("timeout", file=sys.stderr)
sys.exit(3)
'''

# Lists every process whose command line mentions the worker (for 'process NOT running' checks).
FIND_WORKER_PY = r'''
import os
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "worker.py" in cmd and "find_worker" not in cmd:
            print(p, cmd)
'''


@dataclass
class WorkerState:
    pid: int
    started: float
    counter: int
    h0: str
    mib: int
    hash: str | None = None


def start_detached(sbx: Sandbox, cmd: str) -> int:
    """Start `cmd` in the background for as long as the test needs it; its pid.

    timeout=0: a command's timeout (60 s by default) bounds the process itself, as in E2B's envd,
    and these processes must outlive the test however slow the machine. The stream is dropped:
    nothing may hold a connection into the sandbox at capture time (the server closes its own anyway).
    """
    handle = sbx.commands.run(cmd, background=True, timeout=0)
    handle.disconnect()
    return handle.pid


def setup_worker(sbx: Sandbox, mib: int, *, wait_counter: int = 5) -> WorkerState:
    """Write the scripts + a marker file, start the worker in the background, wait until it ticks."""
    sbx.files.write(f"{WORK}/worker.py", WORKER_PY)
    sbx.files.write(f"{WORK}/ask.py", ASK_PY)
    sbx.files.write(f"{WORK}/find_worker.py", FIND_WORKER_PY)
    start_detached(sbx, f"python3 {WORK}/worker.py {WORK} {mib} > {WORK}/worker.log 2>&1")
    deadline = time.monotonic() + 120
    while True:
        st = read_state(sbx)
        if st is not None and st.counter >= wait_counter:
            return st
        if time.monotonic() > deadline:
            log = sbx.commands.run(f"cat {WORK}/worker.log || true").stdout
            pytest.fail(f"worker in {sbx.sandbox_id} did not start: {log}")
        time.sleep(0.3)


def read_state(sbx: Sandbox) -> WorkerState | None:
    try:
        raw = sbx.files.read(f"{WORK}/state.json")
    except Exception:  # noqa: BLE001 - not written yet
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return WorkerState(d["pid"], d["started"], d["counter"], d["h0"], d["mib"])


def ask_worker(sbx: Sandbox, timeout: float = 90) -> WorkerState:
    """Make the worker re-hash its memory now; returns its answer (fails if it does not answer)."""
    nonce = secrets.token_hex(8)
    r = sbx.commands.run(f"python3 {WORK}/ask.py {WORK} {nonce} {timeout}", timeout=timeout + 30,
                         request_timeout=timeout + 60)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return WorkerState(d["pid"], d["started"], d["counter"], d["h0"], d["mib"], d["hash"])


def worker_processes(sbx: Sandbox) -> str:
    return sbx.commands.run(f"python3 {WORK}/find_worker.py").stdout.strip()


def assert_same_worker(got: WorkerState, before: WorkerState, where: str) -> None:
    """`got` is the very process of `before` (same pid + start time), counter continued, memory intact."""
    assert got.pid == before.pid, f"{where}: worker pid {got.pid} != {before.pid}"
    assert got.started == before.started, f"{where}: worker restarted (start time changed)"
    assert got.counter >= before.counter, f"{where}: counter {got.counter} < value at capture {before.counter}"
    assert got.h0 == before.h0, f"{where}: start hash changed"
    assert got.hash == before.h0, f"{where}: in-memory data corrupted (sha256 {got.hash} != {before.h0})"


def kill_quietly(sbx) -> None:
    try:
        sbx.kill()
    except Exception:  # noqa: BLE001
        pass


# runsc whose `delete` takes 3 s and is dropped when the server that asked for it died meanwhile: a
# teardown or a pause's stand-down is then still running when the test's next step comes. It waits
# in its own process (no `sleep` child), so a server that kills it leaves no orphan behind.
SLOW_DELETE_RUNSC = """#!{python} -IS
import os, sys, time
if "delete" in sys.argv[1:]:
    parent = os.getppid()
    time.sleep(3)
    if os.getppid() != parent:
        sys.exit(1)
os.execv({real!r}, [{real!r}] + sys.argv[1:])
"""


def slow_delete_runsc(where: Path) -> Path:
    """Write the slow-`delete` runsc wrapper into the directory `where`; its path (AGENTENV_RUNSC_PATH)."""
    real = shutil.which("runsc")
    assert real, "runsc not installed"
    wrapper = where / "runsc-slow-delete"
    wrapper.write_text(SLOW_DELETE_RUNSC.format(python=sys.executable, real=real))
    wrapper.chmod(0o755)
    return wrapper
