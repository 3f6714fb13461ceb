"""Helpers and fixtures for the egress-policy suite: real sandboxes (E2B SDK) trying to reach what they must not.

Test hosts are network namespaces of our own, routed from the root netns (nothing ever leaves the
machine): a "public" host in TEST-NET-2 (198.51.100.0/24, not a platform-denied range) answering
HTTP on 80 and HTTPS (self-signed) on 443 at two addresses, and a "private" host in 10.235/16
(RFC 1918, denied unless the operator opens it). Names resolve through the sandbox's /etc/hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.network.slots import SlotNames

SANDBOX_TIMEOUT_S = 900
INSTANCE = os.environ.get("AGENTENV_INSTANCE", "")
HOST_SERVER = Path(__file__).with_name("host_server.py")

# Runs inside the sandbox: connect to each target and report what happened, as JSON.
# Every socket is closed with a reset (SO_LINGER 0) so no TIME_WAIT endpoint is left in the guest
# (old gVisor could not checkpoint it: forks and snapshots follow in the same sandboxes).
PROBE = r'''
import json, socket, ssl, struct, sys
def probe(t):
    s = None
    try:
        s = socket.create_connection((t["host"], t["port"]), timeout=t.get("timeout", 4))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if t["kind"] == "tcp":
            return "ok"
        if t["kind"] == "raw":  # a protocol that names no server: send a line, expect an answer
            s.sendall(b"SSH-2.0-probe\r\n")
            return "ok:" + s.recv(100).decode(errors="replace") if s.recv(1, socket.MSG_PEEK) else "err:eof"
        if t["kind"] == "https":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=t["host"])
        s.sendall(("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % t["host"]).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
        return "ok:" + body.decode().strip() if data.startswith(b"HTTP/1") else "err:garbage"
    except Exception as e:
        return "err:" + type(e).__name__
    finally:
        if s is not None:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            s.close()
print(json.dumps([probe(t) for t in json.loads(sys.argv[1])]))
'''


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=60)


def probe(sbx: Sandbox, targets: list[dict]) -> list[str]:
    """Run PROBE in the sandbox; one result per target: "ok", "ok:<body>" or "err:<exception>"."""
    if not sbx.files.exists("/tmp/probe.py"):
        sbx.files.write("/tmp/probe.py", PROBE)
    res = sbx.commands.run(f"python3 /tmp/probe.py '{json.dumps(targets)}'", timeout=120)
    return json.loads(res.stdout)


def ok(result: str) -> bool:
    return result.startswith("ok")


def body(result: str) -> dict:
    assert result.startswith("ok:"), result
    return json.loads(result[3:])


def add_hosts(sbx: Sandbox, entries: dict[str, str]) -> None:
    lines = "".join(f"{ip} {name}\n" for name, ip in entries.items())
    sbx.commands.run(f"printf '{lines}' >> /etc/hosts", user="root")


def slot_addresses(sandbox_id: str) -> tuple[str, str]:
    """(root-ns peer address, host_ip) of a running sandbox's slot, read from the kernel."""
    ns = SlotNames(INSTANCE).netns_name(sandbox_id)
    out = run("ip", "-n", ns, "-4", "-o", "addr", "show", "dev", "host0").stdout
    host_ip = out.split(" inet ", 1)[1].split("/", 1)[0]
    peer = socket.inet_ntoa((int.from_bytes(socket.inet_aton(host_ip), "big") - 1).to_bytes(4, "big"))
    return peer, host_ip


def host_reachable(ip: str, port: int, timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((ip, port), timeout=timeout).close()
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ test hosts


@dataclass
class Hosts:
    public: str          # 198.51.100.x: HTTP + HTTPS
    public2: str         # a second address of the same host
    private: str         # 10.235.x.2: HTTP + HTTPS, RFC 1918


def _make_ns(ns: str, veth: str, root_cidr: str, inner_cidrs: list[str]) -> None:
    run("ip", "netns", "add", ns)
    run("ip", "link", "add", veth, "type", "veth", "peer", "name", "ext0", "netns", ns)
    run("ip", "addr", "add", root_cidr, "dev", veth)
    run("ip", "link", "set", veth, "up")
    for cidr in inner_cidrs:
        run("ip", "-n", ns, "addr", "add", cidr, "dev", "ext0")
    run("ip", "-n", ns, "link", "set", "ext0", "up")
    run("ip", "-n", ns, "link", "set", "lo", "up")
    run("ip", "-n", ns, "route", "add", "default", "via", root_cidr.split("/")[0])


@pytest.fixture(scope="session")
def test_hosts(tmp_path_factory) -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with running_test_hosts(tmp_path_factory.mktemp("hosts")) as hosts:
        yield hosts


@contextlib.contextmanager
def running_test_hosts(d: Path) -> Iterator[Hosts]:
    """The test hosts, torn down (servers killed by PID, veths and netns deleted) even on failure."""
    tag = INSTANCE + secrets.token_hex(2)
    cert, key = d / "cert.pem", d / "key.pem"
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-host",
        "-keyout", str(key), "-out", str(cert))
    block = 8 * secrets.randbelow(31)
    pub_root, pub, pub2 = (f"198.51.100.{block + i}" for i in (1, 2, 3))
    octet = secrets.randbelow(250)
    priv_root, priv = f"10.235.{octet}.1", f"10.235.{octet}.2"
    nets = [(f"aepub{tag}", f"aepx{tag}", f"{pub_root}/29", [f"{pub}/29", f"{pub2}/29"], [pub, pub2]),
            (f"aepriv{tag}", f"aevx{tag}", f"{priv_root}/30", [f"{priv}/30"], [priv])]
    procs: list[subprocess.Popen] = []
    try:
        for ns, veth, root_cidr, inner, addrs in nets:
            _make_ns(ns, veth, root_cidr, inner)
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HOST_SERVER), str(cert), str(key),
                                  *addrs], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready"
        for ip in (pub, pub2, priv):
            assert host_reachable(ip, 80) and host_reachable(ip, 443), f"test host {ip} not reachable from the host"
        yield Hosts(public=pub, public2=pub2, private=priv)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        for ns, veth, *_ in nets:
            run("ip", "link", "del", veth, check=False)
            run("ip", "netns", "del", ns, check=False)


@dataclass
class HostListener:
    """A TCP listener of the host itself (root netns, all addresses) that sandboxes must not reach."""

    port: int
    accepted: int = 0


@pytest.fixture(scope="session")
def host_listener() -> Iterator[HostListener]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    lst = HostListener(srv.getsockname()[1])
    stop = threading.Event()

    def loop() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            lst.accepted += 1
            c.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield lst
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()


def host_addresses() -> list[str]:
    """Global IPv4 addresses of the host (not ours: no slot or test-host links)."""
    out = run("ip", "-4", "-o", "addr", "show", "scope", "global").stdout
    addrs = []
    for line in out.splitlines():
        parts = line.split()
        ifname, addr = parts[1], parts[3].split("/")[0]
        if ifname.startswith(("ae", "veth")) or addr.startswith(("198.51.100.", "10.235.")):
            continue
        addrs.append(addr)
    return addrs


# ------------------------------------------------------------------ sandboxes


class Tracker:
    def __init__(self) -> None:
        self.sandboxes: list[Sandbox] = []

    def create(self, template: str | None = None, **kw) -> Sandbox:
        kw.setdefault("timeout", SANDBOX_TIMEOUT_S)
        kw.setdefault("metadata", {"suite": "network_policy"})
        sbx = Sandbox.create(template, **kw) if template else Sandbox.create(**kw)
        self.sandboxes.append(sbx)
        return sbx

    def add(self, sbx: Sandbox) -> Sandbox:
        self.sandboxes.append(sbx)
        return sbx

    def cleanup(self) -> None:
        for sbx in self.sandboxes:
            try:
                sbx.kill()
            except Exception:  # noqa: BLE001 - best effort, the session gc catches the rest
                pass


@pytest.fixture(scope="module")
def tracker(server) -> Iterator[Tracker]:
    t = Tracker()
    try:
        yield t
    finally:
        t.cleanup()


def wait_for(predicate, what: str, limit: float = 30.0):
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
