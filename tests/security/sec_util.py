"""Helpers for the security suite: extra teams (API keys) on the session server, sandboxes that
are always killed, and helpers that talk to the API and the data plane directly."""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from e2b import Sandbox

from serverproc import agentenv_executable, free_port, stop_server

SANDBOX_TIMEOUT_S = 600


def agentenv_cli(server, *args: str) -> str:
    """Runs the host CLI against the session server's data dir (its state DB is shared, WAL mode)."""
    env = dict(os.environ, AGENTENV_DATA_DIR=str(server.data_dir))
    res = subprocess.run([agentenv_executable(), *args, "--data-dir", str(server.data_dir)], env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"agentenv {' '.join(args)} failed: {res.stdout}{res.stderr}"
    return res.stdout.strip()


def new_team_key(server, team: str, *, max_sandboxes: int | None = None) -> str:
    """A fresh API key of `team` (created through the CLI, as an operator would)."""
    create = ["teams", "create", team]
    if max_sandboxes is not None:
        create += ["--max-sandboxes", str(max_sandboxes)]
    agentenv_cli(server, *create)
    return agentenv_cli(server, "keys", "create", "--name", f"sec-{team}", "--team", team).splitlines()[-1]


class Sandboxes:
    """Creates sandboxes (any key) and kills every one at teardown with the key that made it."""

    def __init__(self, server) -> None:
        self.server = server
        self.made: list[tuple[str, str]] = []

    def create(self, api_key: str | None = None, **kw) -> Sandbox:
        kw.setdefault("timeout", SANDBOX_TIMEOUT_S)
        key = api_key or self.server.api_key
        sbx = Sandbox.create(api_key=key, metadata={"suite": "security"}, **kw)
        self.made.append((sbx.sandbox_id, key))
        return sbx

    def cleanup(self) -> None:
        for sid, key in self.made:
            try:
                Sandbox.kill(sid, api_key=key)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


def api(server, method: str, path: str, key: str, **kw) -> requests.Response:
    kw.setdefault("timeout", 120)
    return requests.request(method, server.api_url + path, headers={"X-API-KEY": key}, **kw)




# --- a second server with tight per-sandbox limits ----------------------------------------------------

LIMITS_INSTANCE = "tnlq"


@dataclass
class LimitsServer:
    api_url: str
    api_key: str
    data_dir: Path
    proc: subprocess.Popen
    env: dict[str, str]
    bandwidth_mbit: int
    nofile: int
    disk_mb: int
    memory_mb: int


def start_limits_server(base: Path, images_from: Path, subnet: str) -> LimitsServer:
    """`agentenv serve` on its own data dir (the built images hard-linked in) with per-sandbox disk
    images, a bandwidth cap, a low open-files limit and small sandboxes."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = subprocess.run(["cp", "-al", str(images_from), str(base / "images")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    mnt = base
    port = free_port()
    key = "e2b_" + secrets.token_hex(20)
    limits = dict(bandwidth_mbit=40, nofile=4096, disk_mb=512, memory_mb=512)
    env = dict(os.environ)
    env.update(
        AGENTENV_DATA_DIR=str(mnt), AGENTENV_HOST="127.0.0.1", AGENTENV_PORT=str(port),
        AGENTENV_BOOTSTRAP_API_KEY=key, AGENTENV_INSTANCE=LIMITS_INSTANCE, AGENTENV_SLOT_SUBNET=subnet,
        AGENTENV_WARM_START="false", AGENTENV_DISK_QUOTA="loop",
        AGENTENV_SANDBOX_BANDWIDTH_MBIT=str(limits["bandwidth_mbit"]),
        AGENTENV_SANDBOX_NOFILE=str(limits["nofile"]), AGENTENV_DEFAULT_DISK_MB=str(limits["disk_mb"]),
        AGENTENV_DEFAULT_MEMORY_MB=str(limits["memory_mb"]), AGENTENV_DEFAULT_CPU_COUNT="1",
    )
    log = open(mnt / "limits-server.log", "wb")
    proc = subprocess.Popen([agentenv_executable(), "serve"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"limits server exited: {(mnt / 'limits-server.log').read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            stop_server(proc, 30)
            raise RuntimeError("limits server not healthy after 240 s")
        time.sleep(0.25)
    return LimitsServer(api_url=url, api_key=key, data_dir=mnt, proc=proc, env=env, **limits)


def stop_limits_server(srv: LimitsServer) -> None:
    stop_server(srv.proc, 60)
    env = dict(os.environ, AGENTENV_INSTANCE=LIMITS_INSTANCE, AGENTENV_SLOT_SUBNET=srv.env["AGENTENV_SLOT_SUBNET"])
    subprocess.run([agentenv_executable(), "gc", "--data-dir", str(srv.data_dir)], env=env, capture_output=True,
                   timeout=180, stdin=subprocess.DEVNULL)
    shutil.rmtree(srv.data_dir, ignore_errors=True)


class Latency:
    """Runs a trivial command in a bystander sandbox in a loop (its own thread) and keeps the times."""

    def __init__(self, sbx: Sandbox) -> None:
        self.sbx = sbx
        self.samples: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Latency":
        def loop() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    out = self.sbx.commands.run("echo ok", timeout=60, request_timeout=90)
                    assert out.stdout == "ok\n"
                    self.samples.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                    self.errors.append(f"{type(e).__name__}: {e}"[:300])
                self._stop.wait(0.2)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(120)

    def summary(self) -> dict[str, float]:
        s = sorted(self.samples)
        if not s:
            return {"n": 0}
        return {"n": len(s), "median_ms": round(statistics.median(s) * 1000, 1),
                "p95_ms": round(s[min(len(s) - 1, int(len(s) * 0.95))] * 1000, 1), "max_ms": round(s[-1] * 1000, 1)}
