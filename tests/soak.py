"""Many clients at once, each driving random lifecycle operations through the E2B SDK and the API
(`Soak`): create, file write and read, command, pause, resume (several clients resuming one
sandbox at once), fork, snapshot and create from it, kill, timeout expiry, and races on one
sandbox (pause, fork and snapshot at once; a pause and a kill during a fork).

What must hold whatever the interleaving: every answer is a success or a clear 409, every
sandbox (fork children and snapshot sandboxes included) has the file contents it had when last
written or captured, and a killed or expired sandbox is gone. Used against one server
(tests/lifecycle) and a cluster's gateway (tests/cluster).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from e2b import Sandbox

SANDBOX_TIMEOUT_S = 900
MARK = "/home/user/mark"


MIN_OPS = 50  # what a soak must have done to count, whatever the machine's speed
MUST_DO = frozenset({"fork", "race_capture", "race_kill"})
OVERTIME = 3  # a slow machine gets up to this many times `run_s` to do MIN_OPS and MUST_DO


class Soak:
    """The driver: `run()` it, then `assert_clean()`; `done` counts the operations that completed."""

    def __init__(self, api_url: str, api_key: str, track: Callable[[str], None], seed: int, *,
                 sdk: dict | None = None, run_s: float = 60, clients: int = 4, max_sandboxes: int = 10) -> None:
        self.api, self.headers = api_url, {"X-API-KEY": api_key}
        self.sdk = dict(sdk or {})  # E2B SDK options (api_key, api_url, sandbox_url) when not from the env
        self.track = track  # every sandbox id it creates, for the caller's cleanup
        self.run_s, self.clients, self.max_sandboxes = run_s, clients, max_sandboxes
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.boxes: dict[str, list] = {}  # id -> [expected mark, lock]
        self.done: dict[str, int] = {}
        self.failures: list[str] = []

    # ---- helpers

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 300) -> requests.Response:
        return requests.request(method, f"{self.api}{path}", json=body, headers=self.headers, timeout=timeout)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def add(self, sid: str, mark: str) -> None:
        with self.lock:
            self.boxes[sid] = [mark, threading.Lock()]
            self.track(sid)

    def grab(self) -> tuple[str | None, list | None]:
        """A sandbox no other client is using (each sandbox's own operations are serialized here;
        the races below are what run on one sandbox at once)."""
        with self.lock:
            items = list(self.boxes.items())
        self.rng.shuffle(items)
        for sid, box in items:
            if box[1].acquire(blocking=False):
                if self.boxes.get(sid) is box:
                    return sid, box
                box[1].release()
        return None, None

    def verify(self, sid: str, mark: str, where: str) -> None:
        s = Sandbox.connect(sid, timeout=SANDBOX_TIMEOUT_S, **self.sdk)
        got = s.files.read(MARK)
        if got != mark:
            self.fail(f"{where} {sid}: {MARK} is {got!r}, expected {mark!r}")
        out = s.commands.run("echo $((6*7))").stdout.strip()
        if out != "42":
            self.fail(f"{where} {sid}: command answered {out!r}")

    def forked(self, source: str, mark: str, r: requests.Response, where: str) -> None:
        if r.status_code != 201:
            return
        for item in r.json():
            if item.get("sandbox"):
                self.add(item["sandbox"]["sandboxID"], mark)
            else:
                self.fail(f"{where}: a child of {source} failed: {item}")

    def expect(self, r: requests.Response, ok: tuple[int, ...], what: str) -> None:
        if r.status_code not in ok:
            self.fail(f"{what}: {r.status_code} {r.text[:300]}")

    # ---- operations (each on a sandbox it holds, except create)

    def create(self) -> None:
        s = Sandbox.create(timeout=SANDBOX_TIMEOUT_S, metadata={"suite": "soak"}, **self.sdk)
        self.track(s.sandbox_id)
        mark = f"c-{self.rng.random()}"
        s.files.write(MARK, mark)
        self.add(s.sandbox_id, mark)

    def check(self, sid: str, box: list) -> None:
        self.verify(sid, box[0], "check")

    def write(self, sid: str, box: list) -> None:
        mark = f"w-{self.rng.random()}"
        Sandbox.connect(sid, timeout=SANDBOX_TIMEOUT_S, **self.sdk).files.write(MARK, mark)
        box[0] = mark

    def pause(self, sid: str, box: list) -> None:
        r = self.call("POST", f"/sandboxes/{sid}/pause")
        if not (r.status_code == 204 or (r.status_code == 409 and "already paused" in r.text)):
            self.fail(f"pause {sid}: {r.status_code} {r.text[:300]}")

    def fork(self, sid: str, box: list) -> None:
        if len(self.boxes) >= self.max_sandboxes:
            return
        r = self.call("POST", f"/sandboxes/{sid}/fork", {"count": self.rng.randint(1, 3), "timeout": SANDBOX_TIMEOUT_S})
        self.expect(r, (201, 409), f"fork {sid}")  # 409: paused
        self.forked(sid, box[0], r, "fork")

    def kill(self, sid: str, box: list) -> None:
        with self.lock:
            self.boxes.pop(sid, None)
        self.expect(self.call("DELETE", f"/sandboxes/{sid}"), (204,), f"kill {sid}")

    def resume_many(self, sid: str, box: list) -> None:
        self.call("POST", f"/sandboxes/{sid}/pause")
        with ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda _: Sandbox.connect(sid, timeout=SANDBOX_TIMEOUT_S, **self.sdk).files.read(MARK), range(3)))
        if any(g != box[0] for g in got):
            self.fail(f"three resumes of {sid} at once read {got}, expected {box[0]!r}")

    def snapshot(self, sid: str, box: list) -> None:
        Sandbox.connect(sid, timeout=SANDBOX_TIMEOUT_S, **self.sdk)  # a paused sandbox's snapshot is a 409
        r = self.call("POST", f"/sandboxes/{sid}/snapshots", {})
        if r.status_code != 201:
            self.fail(f"snapshot {sid}: {r.status_code} {r.text[:300]}")
            return
        snap = r.json()["snapshotID"]
        try:
            c = Sandbox.create(snap, timeout=SANDBOX_TIMEOUT_S, metadata={"suite": "soak"}, **self.sdk)
            self.track(c.sandbox_id)
            if c.files.read(MARK) != box[0]:
                self.fail(f"a sandbox from the snapshot of {sid} lacks its file")
            c.kill()
        finally:
            self.expect(self.call("DELETE", f"/snapshots/{snap}"), (200, 204), f"delete snapshot {snap}")

    def expire(self, sid: str, box: list) -> None:
        Sandbox.connect(sid, timeout=SANDBOX_TIMEOUT_S, **self.sdk)  # a paused sandbox does not expire
        with self.lock:
            self.boxes.pop(sid, None)
        self.expect(self.call("POST", f"/sandboxes/{sid}/timeout", {"timeout": 1}), (204,), f"timeout {sid}")
        deadline = time.monotonic() + 20
        while self.call("GET", f"/sandboxes/{sid}").status_code != 404:
            if time.monotonic() > deadline:
                self.fail(f"{sid} outlived its 1 s timeout by 20 s")
                return
            time.sleep(0.5)

    def race_capture(self, sid: str, box: list) -> None:
        """Pause, fork and snapshot at once: each works or says 409; the sandbox keeps its file."""
        with ThreadPoolExecutor(3) as ex:
            p = ex.submit(self.call, "POST", f"/sandboxes/{sid}/pause")
            f = ex.submit(self.call, "POST", f"/sandboxes/{sid}/fork", {"count": 1, "timeout": SANDBOX_TIMEOUT_S})
            s = ex.submit(self.call, "POST", f"/sandboxes/{sid}/snapshots", {})
            p, f, s = p.result(), f.result(), s.result()
        self.expect(p, (204, 409), f"racing pause {sid}")
        self.expect(f, (201, 409), f"racing fork {sid}")
        self.expect(s, (201, 409), f"racing snapshot {sid}")
        self.forked(sid, box[0], f, "racing fork")
        if s.status_code == 201:
            self.call("DELETE", f"/snapshots/{s.json()['snapshotID']}")
        self.verify(sid, box[0], "after the race")

    def race_kill(self, sid: str, box: list) -> None:
        """A fork, and a pause and a kill just after it (usually while its capture or its children's
        restores run): the sandbox is gone; a fork that started has every child."""
        with self.lock:
            self.boxes.pop(sid, None)
        with ThreadPoolExecutor(3) as ex:
            f = ex.submit(self.call, "POST", f"/sandboxes/{sid}/fork", {"count": 2, "timeout": SANDBOX_TIMEOUT_S})
            time.sleep(self.rng.uniform(0.02, 0.2))
            p = ex.submit(self.call, "POST", f"/sandboxes/{sid}/pause")
            k = ex.submit(self.call, "DELETE", f"/sandboxes/{sid}")
            p, k, f = p.result(), k.result(), f.result()
        self.expect(k, (204,), f"racing kill {sid}")
        self.expect(p, (204, 404, 409), f"pause racing a kill {sid}")
        self.expect(f, (201, 404, 409), f"fork racing a kill {sid}")
        self.forked(sid, box[0], f, "fork racing a kill")
        self.expect(self.call("GET", f"/sandboxes/{sid}"), (404,), f"{sid} after its kill")

    # ---- driver

    def run(self) -> None:
        """`clients` threads for `run_s` (longer, up to OVERTIME times, until MIN_OPS and MUST_DO are
        done: a loaded machine does fewer operations a second), then every sandbox left is checked
        (its data, a command)."""
        threads = [threading.Thread(target=self.client) for _ in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sid, box in list(self.boxes.items()):
            try:
                self.verify(sid, box[0], "at the end")
            except Exception as e:  # noqa: BLE001
                self.fail(f"at the end {sid}: {e!r}"[:400])

    def assert_clean(self, log_tail: str = "", logs: dict[str, Path] | None = None) -> None:
        """No failure; else fail with them, `log_tail`, and every line of `logs` (name -> log file)
        that names a sandbox or an artifact digest a failure names."""
        for f in self.failures:
            print("soak failure:", f)
        if self.failures and logs:
            log_tail += "\n" + about(self.failures, logs)
        assert not self.failures, f"{len(self.failures)} failures: {self.failures[:10]}\n{log_tail}"
        assert self.enough(), f"too little done in {OVERTIME} × {self.run_s:.0f} s: {self.done}"

    def enough(self) -> bool:
        """MIN_OPS operations done, MUST_DO among them."""
        with self.lock:
            return sum(self.done.values()) >= MIN_OPS and MUST_DO <= set(self.done)

    def client(self) -> None:
        """One client: random operations until `run_s` is over and enough is done (`run`)."""
        held = [(self.check, 5), (self.write, 3), (self.pause, 3), (self.fork, 2), (self.kill, 2),
                (self.resume_many, 1), (self.snapshot, 1), (self.expire, 1), (self.race_capture, 1),
                (self.race_kill, 1)]
        start = time.monotonic()
        end, cap = start + self.run_s, start + OVERTIME * self.run_s
        while (now := time.monotonic()) < end or (now < cap and not self.enough()):
            n = len(self.boxes)
            if n < 2 or (n < self.max_sandboxes and self.rng.random() < 0.15):
                op, name = self.create, "create"
            else:
                fn = self.rng.choices([f for f, _ in held], [w for _, w in held])[0]
                name = fn.__name__
                sid, box = self.grab()
                if sid is None:  # every sandbox is in another client's hands
                    time.sleep(0.05)
                    continue

                def op(fn=fn, sid=sid, box=box) -> None:
                    try:
                        fn(sid, box)
                    finally:
                        box[1].release()
            try:
                op()
                with self.lock:
                    self.done[name] = self.done.get(name, 0) + 1
            except Exception as e:  # noqa: BLE001 - every error is a failure here
                self.fail(f"{name}: {e!r}"[:400])


def about(failures: list[str], logs: dict[str, Path], limit: int = 150) -> str:
    """The log lines that name what `failures` name: sandbox ids, and artifact digests (12+ hex)."""
    keys = set()
    for f in failures:
        keys |= set(re.findall(r"\bi[0-9a-z]{20}\b", f)) | {d[:12] for d in re.findall(r"\b[0-9a-f]{12,64}\b", f)}
    out = []
    for name, path in logs.items():
        try:
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if any(k in ln for k in keys)]
        except OSError as e:
            lines = [f"<unreadable: {e}>"]
        out.append(f"--- {name}: {len(lines)} line(s) about {sorted(keys)[:6]}")
        out += lines[-limit:]
    return "\n".join(out)

