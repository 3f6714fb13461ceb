"""Fixtures for real-runsc tests: per-test overlay rootfs over the scratch Debian tree, network slots.

Everything a test creates is registered with `SandboxKit` and torn down in its finalizer, even when
the test fails half-way.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.network.manager import NetworkManager
from agentenv.network.slots import NetSlot
from agentenv.runtimes.base import SandboxSpec
from agentenv.runtimes.gvisor import GVisorRuntime

DATA_DIR = Path(os.environ.get("AGENTENV_TEST_RUNTIME_DIR", "/var/tmp/agentenv-test-runtime"))
# The read-only lower: the test data dir's base image (built by `agentenv image build`, which
# scripts/test.sh runs before pytest), or AGENTENV_TEST_LOWER.
LOWER = Path(os.environ.get("AGENTENV_TEST_LOWER") or
             Path(os.environ.get("AGENTENV_TEST_DATA_DIR") or "/var/tmp/agentenv-test") / "images/base/rootfs")
# A subnet of its own so test slots never collide with a dev server's addresses on this host.
TEST_SUBNET = os.environ.get("AGENTENV_TEST_RUNTIME_SUBNET", "10.214.0.0/16")
PORT = 49983
GUEST_SERVER = Path(__file__).with_name("guest_server.py")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("runsc") is None:
        return "runsc not installed"
    if not (LOWER / "usr/bin/python3").exists():
        return f"no base image rootfs with python3 at {LOWER} (scripts/test.sh builds it: agentenv image build)"
    return None


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=60)


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


# ------------------------------------------------------------------ HTTP helpers (host side)


def http_get(host: str, path: str, timeout: float = 5.0) -> dict:
    """One request on a fresh HTTP/1.1 keep-alive connection that the *client* closes.

    The guest server never closes first, so no TIME_WAIT endpoint is left inside the sandbox.
    """
    conn = http.client.HTTPConnection(host, PORT, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return json.loads(resp.read())
    finally:
        conn.close()


def wait_http(host: str, timeout: float = 20.0) -> float:
    """Seconds until GET / answers."""
    t0 = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - t0 < timeout:
        try:
            http_get(host, "/", timeout=1.0)
            return time.monotonic() - t0
        except (OSError, http.client.HTTPException) as e:
            last = e
            time.sleep(0.02)
    raise AssertionError(f"{host}:{PORT} not answering after {timeout}s: {last!r}")


def tcp_reachable(host: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, PORT), timeout=timeout):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ sandbox kit


@dataclass
class Box:
    sandbox_id: str
    dir: Path
    slot: NetSlot
    spec: SandboxSpec

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        return self.dir / "upper"


@dataclass
class SandboxKit:
    settings: Settings
    net: NetworkManager
    rt: GVisorRuntime
    tools: Path
    boxes: list[Box] = field(default_factory=list)

    def new_id(self, prefix: str = "rt") -> str:
        return f"{prefix}{uuid.uuid4().hex[:10]}"  # no "-": netns names are <prefix><id>

    def mount_rootfs(self, box_dir: Path, upper_from: Path | None = None) -> Path:
        """overlay(LOWER, <box_dir>/upper) at <box_dir>/rootfs; upper optionally a copy of another."""
        box_dir.mkdir(parents=True, exist_ok=True)
        upper, work, merged = box_dir / "upper", box_dir / "work", box_dir / "rootfs"
        if upper_from is not None:
            run("cp", "-a", str(upper_from), str(upper))  # cp keeps overlay whiteouts (char 0:0)
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        merged.mkdir(exist_ok=True)
        run("mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={LOWER},upperdir={upper},workdir={work}", str(merged))
        return merged

    async def prepare(self, sandbox_id: str | None = None, *, memory_mb: int = 512, cpu_count: int = 1,
                      upper_from: Path | None = None, allow_internet: bool = False) -> Box:
        """Slot + rootfs + spec, not started. Registered for cleanup before anything can fail."""
        sandbox_id = sandbox_id or self.new_id()
        box_dir = self.settings.paths.sandbox_dir(sandbox_id)
        slot = await self.net.allocate(sandbox_id, allow_internet=allow_internet)
        spec = SandboxSpec(sandbox_id=sandbox_id, rootfs=box_dir / "rootfs", tools_dir=self.tools, slot=slot,
                           bundle_dir=box_dir / "bundle", cpu_count=cpu_count, memory_mb=memory_mb,
                           args=["/usr/bin/python3", "/srv/guest_server.py", str(PORT)])
        box = Box(sandbox_id, box_dir, slot, spec)
        self.boxes.append(box)
        self.mount_rootfs(box_dir, upper_from)
        if upper_from is None:
            (box.rootfs / "srv").mkdir(exist_ok=True)
            shutil.copy(GUEST_SERVER, box.rootfs / "srv" / "guest_server.py")
        return box

    async def start(self, **kw) -> tuple[Box, float]:
        """Start a sandbox; returns it and the start-to-first-HTTP-answer latency."""
        box = await self.prepare(**kw)
        t0 = time.monotonic()
        await self.rt.start(box.spec)
        await self.net.activate(box.slot)
        wait_http(box.slot.host_ip)
        return box, time.monotonic() - t0

    async def destroy(self, box: Box) -> None:
        await self.rt.stop(box.sandbox_id)
        await self.net.release(box.slot)
        if is_mounted(box.rootfs):
            run("umount", str(box.rootfs))
        shutil.rmtree(box.dir, ignore_errors=True)
        if box in self.boxes:
            self.boxes.remove(box)

    async def close(self) -> None:
        errors = []
        for box in list(self.boxes):
            try:
                await self.destroy(box)
            except Exception as e:  # keep cleaning the others
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture(scope="session")
def settings() -> Settings:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    # the `outside` test host lives in 10.215/16, a private range only an operator opens to sandboxes
    return Settings(data_dir=DATA_DIR, slot_subnet=TEST_SUBNET, egress_allow_cidrs=["10.215.0.0/16"])


@pytest.fixture
async def kit(settings: Settings):
    if _missing():
        pytest.skip(_missing())
    net = NetworkManager(settings)
    await net.setup_host()
    tools = DATA_DIR / "tools"
    tools.mkdir(parents=True, exist_ok=True)
    k = SandboxKit(settings, net, GVisorRuntime(settings), tools)
    try:
        yield k
    finally:
        await k.close()


@dataclass
class Outside:
    """A stand-in for "the internet": a netns of our own, routed from the root ns, with an HTTP server."""

    ip: str
    port: int


@pytest.fixture
def outside():
    """netns `aetest-<rand>` + veth aetx<rand> (10.215.<n>.1/30 root side, .2 inside) + python http.server.

    Torn down (server killed by PID, veth + netns deleted) even if the test fails.
    """
    if _missing():
        pytest.skip(_missing())
    tag = uuid.uuid4().hex[:4]
    ns, veth = f"aetest-{tag}", f"aetx{tag}"
    octet = int(tag[:2], 16)
    root_ip, ext_ip = f"10.215.{octet}.1", f"10.215.{octet}.2"
    proc = None
    try:
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "ext0", "netns", ns)
        run("ip", "addr", "add", f"{root_ip}/30", "dev", veth)
        run("ip", "link", "set", veth, "up")
        run("ip", "-n", ns, "addr", "add", f"{ext_ip}/30", "dev", "ext0")
        run("ip", "-n", ns, "link", "set", "ext0", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-m", "http.server", "8080",
                                 "--bind", ext_ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((ext_ip, 8080), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield Outside(ext_ip, 8080)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
        run("ip", "link", "del", veth, check=False)
        run("ip", "netns", "del", ns, check=False)
