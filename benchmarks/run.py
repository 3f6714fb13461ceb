#!/usr/bin/env python3
"""agentenv benchmarks: our server (through the official e2b SDK) next to raw runsc baselines.

Usage (as root, from the repo):
    .venv/bin/python benchmarks/run.py [--quick] [--only create,exec,files,pause,fork,snapshot,proxy]

Starts its own `agentenv serve` (data dir /var/tmp/agentenv-bench, images hard-linked from
/var/tmp/agentenv-test/images when present), measures, stops the server by PID, runs `agentenv gc`
and writes benchmarks/results/<timestamp>.json + .md (and latest.json / latest.md).
Raw baselines use agentenv's own NetworkManager / RootfsManager / GVisorRuntime directly (same OCI
spec, same netns wrapper, same overlay rootfs) with a separate runsc --root, so the server never
sees them. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import ipaddress
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from agentenv.constants import GUEST_MAC  # noqa: E402

BENCH_DIR = Path(os.environ.get("AGENTENV_BENCH_DATA_DIR", "/var/tmp/agentenv-bench"))
TEST_IMAGES = Path(os.environ.get("AGENTENV_BENCH_IMAGES_FROM", "/var/tmp/agentenv-test/images"))
RESULTS = REPO / "benchmarks" / "results"
# The raw harness's instance tag and network slots (`Raw`): apart from the server's (10.213.0.0/16, untagged).
RAW_INSTANCE = "raw"
RAW_SUBNET = "10.222.0.0/16"
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import machine_cpu_s  # noqa: E402
# Steps that need neither the agentenv server nor the raw runsc baseline.
SERVERLESS_STEPS = {"firecracker", "qemu"}
# Steps that need the server but no raw runsc baseline.
RAWLESS_STEPS = {"metrics", "templates", "pool"}
AGENTENV = str(Path(sys.prefix) / "bin" / "agentenv")
RAW_PORT = 49983
MiB = 1024 * 1024

# The raw baseline's only process: optionally holds N MiB of random bytes, answers "ok\n" on TCP.
# The client always closes first, so the sandbox never holds a TIME_WAIT endpoint (which would
# make runsc checkpoint fail).
RAW_SERVER = r"""
import os, socket, sys
hold = os.urandom(int(sys.argv[1]) << 20) if int(sys.argv[1]) else b""
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", %d)); s.listen(64)
while True:
    c, _ = s.accept()
    try:
        c.sendall(b"ok\n"); c.settimeout(10); c.recv(1)
    except Exception:
        pass
    c.close()
""" % RAW_PORT


# The proxy benchmark's upstream: a minimal keep-alive HTTP/1.1 server (asyncio, so it is not the
# bottleneck of what is measured: the proxy in front of it). Answers every GET with 23 bytes.
PROXY_APP_PORT = 8000
PROXY_APP = r"""
import asyncio
BODY = b"hello from the sandbox\n"
RESP = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
class App(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        n = self.buf.count(b"\r\n\r\n")
        if n:
            self.buf = self.buf[self.buf.rfind(b"\r\n\r\n") + 4:]
            self.t.write(RESP * n)
async def main():
    server = await asyncio.get_running_loop().create_server(App, "0.0.0.0", PORT, backlog=1024)
    await server.serve_forever()
asyncio.run(main())
""".replace("PORT", str(PROXY_APP_PORT))

# The templates benchmark's service: loads (hashes) a 64 MiB dataset, then serves it on :8000.
TEMPLATE_APP = r"""
import hashlib, http.server
digest = hashlib.sha256(open("/home/user/data.bin", "rb").read()).hexdigest().encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", str(len(digest))); self.end_headers()
        self.wfile.write(digest)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""

NGINX_CONF = """{preamble}
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream sandbox {{ {upstream} }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      {access}
      proxy_pass http://sandbox;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $remote_addr;
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
  {servers}
}}
"""


def nginx_conf(root: Path, port: int, upstream: str, *, preamble: str = "", access: str = "",
               servers: str = "") -> str:
    """The benchmark's nginx reverse proxy (one worker, upstream keep-alive, no buffering) on
    127.0.0.1:`port`; `upstream`: the body of its `upstream sandbox` block."""
    return NGINX_CONF.format(dir=root, port=port, upstream=upstream, preamble=preamble, access=access,
                             servers=servers)


# nginx routing at run time, as a data plane built on nginx would (Debian's libnginx-mod-http-lua):
# the sandbox id header looks up the slot address in a shared dictionary of 10,000 routes, a Lua
# balancer sends the request there, upstream connections are kept alive per address. No token
# check, Host or /proxy/ routing: a lower bound of what an nginx data plane would cost.
NGINX_LUA_MODULE = Path("/usr/lib/nginx/modules/ngx_http_lua_module.so")
NGINX_LUA_UPSTREAM = """server 0.0.0.1;
    balancer_by_lua_block {
      local ok, err = require("ngx.balancer").set_current_peer(ngx.ctx.ip, ngx.ctx.port)
      if not ok then ngx.log(ngx.ERR, err); return ngx.exit(502) end
    }
    keepalive 64;"""
NGINX_LUA_ACCESS = """access_by_lua_block {
        local sid = ngx.var.http_e2b_sandbox_id
        local ip = sid and ngx.shared.routes:get(sid)
        if not ip then return ngx.exit(502) end
        ngx.ctx.ip = ip
        ngx.ctx.port = tonumber(ngx.var.http_e2b_sandbox_port) or ENVD_PORT
      }"""
# the route table, loaded by POST /routes ("<sandbox id> <address>" lines) on the admin port
NGINX_LUA_ADMIN = """lua_shared_dict routes 16m;
  server {
    listen 127.0.0.1:ADMIN_PORT;
    client_body_buffer_size 4m;
    client_max_body_size 4m;
    location = /routes {
      content_by_lua_block {
        ngx.req.read_body()
        local n = 0
        for k, v in string.gmatch(ngx.req.get_body_data() or "", "(%S+) (%S+)\\n") do
          ngx.shared.routes:set(k, v)
          n = n + 1
        end
        ngx.say(n)
      }
    }
  }"""

# The same HAProxy binary as a bare reverse proxy to one fixed server (no routing, no header rules):
# what HAProxy itself costs, apart from agentenv's configuration of it.
BARE_HAPROXY_CONF = """
global
    nbthread 1
defaults
    mode http
    timeout connect 5s
    timeout client 1m
    timeout server 1m
frontend bare
    bind 127.0.0.1:{port}
    default_backend sandbox
backend sandbox
    http-reuse always
    server app {upstream}
"""


def wait_proxy(proc: subprocess.Popen, port: int, what: str) -> None:
    """Until the reverse proxy `proc` answers 200 on 127.0.0.1:`port` (20 s at most)."""
    import requests

    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
        time.sleep(0.1)


def spawn_nginx(root: Path) -> subprocess.Popen:
    """nginx on `root`/nginx.conf, in the foreground of its own session (stderr kept for errors)."""
    return subprocess.Popen(["nginx", "-c", str(root / "nginx.conf"), "-p", str(root), "-e", str(root / "error.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def start_nginx_lua(root: Path, routes: dict[str, str], others: int) -> tuple[subprocess.Popen, int]:
    """nginx routing by Lua (NGINX_LUA_*) on a free port, its dictionary loaded with `routes`
    (sandbox id -> slot address) and `others` more routes to addresses nothing listens on."""
    import requests

    root.mkdir(parents=True)
    port, admin = free_port(), free_port()
    (root / "nginx.conf").write_text(nginx_conf(
        root, port, NGINX_LUA_UPSTREAM, access=NGINX_LUA_ACCESS.replace("ENVD_PORT", str(RAW_PORT)),
        servers=NGINX_LUA_ADMIN.replace("ADMIN_PORT", str(admin)),
        preamble=f"load_module {NGINX_LUA_MODULE.parent / 'ndk_http_module.so'};\nload_module {NGINX_LUA_MODULE};"))
    proc = spawn_nginx(root)
    table = {**{f"i{i:019d}": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}" for i in range(others)}, **routes}
    deadline = time.monotonic() + 20
    while True:
        try:
            r = requests.post(f"http://127.0.0.1:{admin}/routes", timeout=5,
                              data="".join(f"{k} {v}\n" for k, v in table.items()))
            if r.status_code == 200 and int(r.text) == len(table):
                return proc, port
            raise RuntimeError(f"nginx-lua took {r.text.strip()!r} of {len(table)} routes ({r.status_code})")
        except requests.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"nginx with Lua did not start: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
            time.sleep(0.1)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU the processes have used so far (all their threads)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wrk(url: str, *, connections: int, seconds: int, headers: dict[str, str] | None = None) -> dict:
    """One `wrk --latency` run: requests/s, p50/p99 latency (s), errors."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    out = sh(argv + [url], timeout=seconds + 60).stdout

    def dur(tok: str) -> float:
        m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", tok)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[m.group(2)]

    lat = {int(m.group(1)): dur(m.group(2)) for m in re.finditer(r"^\s+(\d+)%\s+(\S+)", out, re.M)}
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    reqs = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"rps": float(rps.group(1)) if rps else None, "p50": lat.get(50), "p99": lat.get(99),
            "requests": int(reqs.group(1)) if reqs else 0, "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": sum(int(x) for x in sock.groups()) if sock else 0, "connections": connections,
            "seconds": seconds, "raw": out}


def capture_times(logtxt: str) -> tuple[float, float, float] | None:
    """(checkpoint, seal, source unavailable) of the first capture in a server log excerpt: a capture
    that stops the source ("captured X: checkpoint C s, seal S s, source back after B s") or one
    that leaves it running ("captured X without stopping it: frozen F s, running again after R s,
    sealed after T s": unavailable for the freeze only)."""
    m = re.search(r"captured \S+: checkpoint ([0-9.]+)s, seal ([0-9.]+)s, source back after ([0-9.]+)s", logtxt)
    if m:
        return float(m.group(1)), float(m.group(2)), float(m.group(3))
    m = re.search(r"captured \S+ without stopping it: frozen ([0-9.]+)s, running again after ([0-9.]+)s, "
                  r"sealed after ([0-9.]+)s", logtxt)
    if m:
        return float(m.group(1)), float(m.group(3)) - float(m.group(2)), float(m.group(1))
    return None


def haproxy_user_answers(data_dir: Path) -> int | None:
    """Answers HAProxy of the server on `data_dir` gave from sandboxes' user ports (its runtime API)."""
    from agentenv.proxy.haproxy import RuntimeApi, backend_stats, sock_dir_for

    try:
        stats = asyncio.run(backend_stats(RuntimeApi(sock_dir_for(data_dir) / "admin.sock")))
    except OSError:
        return None
    user = stats.get("sandbox_user")
    return sum(user[f"hrsp_{k}xx"] for k in range(1, 6)) if user else None


def gateway_hop_answers(gateway_data_dir: Path, port: str) -> int | None:
    """Answers a cluster gateway's HAProxy relayed from nodes on its fast path (its node_hop backend)."""
    from agentenv.proxy.haproxy import RuntimeApi, backend_stats, sock_dir_for

    try:
        stats = asyncio.run(backend_stats(RuntimeApi(sock_dir_for(gateway_data_dir / "gateway-haproxy" / port)
                                                     / "admin.sock"), ("node_hop",)))
    except OSError:
        return None
    hop = stats.get("node_hop")
    return sum(hop[f"hrsp_{k}xx"] for k in range(1, 6)) if hop else None


def gateway_route_of(gateway_data_dir: Path, port: str, sandbox_id: str) -> str | None:
    """The node a cluster gateway's HAProxy routes `sandbox_id` to now (its routes map), if any."""
    from agentenv.proxy.haproxy import RuntimeApi, sock_dir_for

    base = gateway_data_dir / "gateway-haproxy" / port
    try:
        out = asyncio.run(RuntimeApi(sock_dir_for(base) / "admin.sock").run([f"get map {base / 'routes.map'} {sandbox_id}"]))
    except OSError:
        return None
    m = re.search(r'value="([^"]*)"', "\n".join(out))
    return m.group(1) if m else None


def wait_route(gateway_data_dir: Path, port: str, sandbox_id: str, present: bool, limit_s: float = 15.0) -> float | None:
    """Seconds until the gateway's routes map has (or no longer has) `sandbox_id`; None past `limit_s`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if (gateway_route_of(gateway_data_dir, port, sandbox_id) is not None) == present:
            return time.perf_counter() - t0
        time.sleep(0.005)
    return None


def lag_of(lag: dict[str, list], kind: str, sandbox_id: str, seconds: float | None) -> None:
    """Record one route lag (`wait_route`), or the sandbox as missed."""
    if seconds is None:
        lag["missed"].append(sandbox_id)
    else:
        lag[kind].append(seconds)


def proxy_versions(haproxy_pid: int | None) -> dict[str, str]:
    """What the proxy benchmark ran: the data plane's HAProxy (the running binary) and nginx."""
    out = {}
    if haproxy_pid is not None:
        exe = os.readlink(f"/proc/{haproxy_pid}/exe")
        out["haproxy"] = sh([exe, "-v"]).stdout.splitlines()[0].strip()
    ngx = sh(["nginx", "-v"])
    out["nginx"] = (ngx.stderr or ngx.stdout).strip()
    return out


def haproxy_pids(data_dir: Path) -> list[int]:
    """The HAProxy process serving the server on `data_dir` (none: the Python proxy serves)."""
    from agentenv.proxy.haproxy import processes_running

    return processes_running(data_dir / "haproxy" / "haproxy.cfg")


async def route_update_bench(n: int) -> dict:
    """Route updates of the HAProxy data plane (agentenv.proxy.haproxy) at `n` routes, on a HAProxy
    of its own: the initial load of `n` routes, then single updates (one sandbox created or killed:
    an event, then `sync` of that id) one after the other at n routes, then a burst of 1,000 creates
    and 1,000 kills applied together (what a busy node's event stream batches)."""
    from types import SimpleNamespace

    from agentenv.proxy.haproxy import DataPlane, HaproxyLayout

    class Source:
        def __init__(self) -> None:
            self.routes: dict[str, str] = {}

        def running_routes(self):
            return (SimpleNamespace(sandbox_id=k, host_ip=v, traffic_access_token=None) for k, v in self.routes.items())

        def route_for(self, sandbox_id: str):
            ip_ = self.routes.get(sandbox_id)
            return None if ip_ is None else SimpleNamespace(host_ip=ip_, traffic_access_token=None)

    def ip(i: int) -> str:
        return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"

    root = BENCH_DIR / "routes"
    shutil.rmtree(root, ignore_errors=True)
    src = Source()
    dp = DataPlane(shutil.which("haproxy") or "haproxy", HaproxyLayout(root, root / "s"), src,
                   http_bind=f"127.0.0.1:{free_port()}")
    await dp.start()
    try:
        src.routes = {f"i{i:019d}": ip(i) for i in range(n)}
        t0 = time.perf_counter()
        await dp.routes.sync()
        load_s = time.perf_counter() - t0
        lat = []
        for i in range(n, n + 500):  # one create, then one kill, each applied alone
            sid = f"i{i:019d}"
            src.routes[sid] = ip(i)
            t = time.perf_counter()
            await dp.routes.sync({sid})
            lat.append(time.perf_counter() - t)
            del src.routes[sid]
            t = time.perf_counter()
            await dp.routes.sync({sid})
            lat.append(time.perf_counter() - t)
        burst_ids = {f"i{i:019d}" for i in range(1000)} | {f"b{i:019d}" for i in range(1000)}
        for i in range(1000):
            del src.routes[f"i{i:019d}"]
            src.routes[f"b{i:019d}"] = ip(n + i)
        t0 = time.perf_counter()
        await dp.routes.sync(burst_ids)
        burst_s = time.perf_counter() - t0
        shown = await dp.api.run([f"show map {dp.layout.routes_map}"])
        entries = sum(len(o.strip().splitlines()) for o in shown)
        return {"routes": n, "initial_load_s": load_s, "initial_load_per_s": n / load_s,
                "single_update": {k: v for k, v in stats(lat).items() if k != "raw"},
                "burst_2000_s": burst_s, "burst_per_s": 2000 / burst_s, "entries_after": entries}
    finally:
        await dp.stop()
        shutil.rmtree(root, ignore_errors=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50), "p95": pct(xs, 95), "max": max(xs) if xs else None,
            "min": min(xs) if xs else None, "mean": statistics.fmean(xs) if xs else None, "raw": xs}


def host_file_counts(url: str) -> tuple[int, int] | None:
    """The server's counts of downloads sent from the host and uploads staged there
    (`agentenv_proxy_host_file_sends_total`, `..._stages_total`), if it has them."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    found = [re.search(rf"^agentenv_proxy_host_file_{kind}_total (\S+)$", text, re.M) for kind in ("sends", "stages")]
    return (int(float(found[0].group(1))), int(float(found[1].group(1)))) if all(found) else None


def slot_host_ip(sandbox_id: str) -> str:
    """The address the host reaches a sandbox's envd at: the root-ns link of its slot carries the
    sandbox id as its alias and the slot's peer address; the host address is the next one."""
    for link in Path("/sys/class/net").iterdir():
        try:
            alias = (link / "ifalias").read_text().strip()
        except OSError:
            continue
        if alias == sandbox_id:
            out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", link.name], capture_output=True,
                                 text=True, check=True).stdout.split()
            peer = out[out.index("inet") + 1].split("/")[0]
            return str(ipaddress.IPv4Address(peer) + 1)
    raise RuntimeError(f"no slot link with alias {sandbox_id}")


def http_transfer(host: str, port: int, method: str, target: str, headers: dict, body: bytes | None = None,
                  into: bytearray | None = None) -> float:
    """Seconds for one plain HTTP/1.1 request carrying `body` (octet-stream) or reading the answer into
    `into` (identity encoding): http.client with one send and readinto, so the client costs little."""
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        hdrs = {**headers, "Accept-Encoding": "identity"}
        if body is not None:
            hdrs["Content-Type"] = "application/octet-stream"
        t0 = time.monotonic()
        conn.request(method, target, body=body, headers=hdrs)
        resp = conn.getresponse()
        if into is not None:
            view, got = memoryview(into), 0
            while got < len(into):
                n = resp.readinto(view[got:])
                if not n:
                    break
                got += n
            resp.read()
        else:
            resp.read()
        elapsed = time.monotonic() - t0
        if resp.status != 200 or (into is not None and got != len(into)):
            raise RuntimeError(f"{method} {target}: HTTP {resp.status}, {got if into is not None else 0} bytes")
        return elapsed
    finally:
        conn.close()


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def hardware() -> dict:
    mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_total": f"{mem_kb / 1024 / 1024:.1f} GiB",
            "kernel": platform.release(), "runsc": sh(["runsc", "--version"]).stdout.strip().splitlines()[:2],
            "python": platform.python_version(), "disk_fs": sh(["stat", "-f", "-c", "%T", "/var/tmp"]).stdout.strip()}


# ---------------------------------------------------------------- process memory

def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def procs_of(sandbox_id: str) -> list[int]:
    """runsc-sandbox + gofer (and their platform stub children) of one container: cmdline mentions the id."""
    children: dict[int, list[int]] = {}
    roots = []
    for e in Path("/proc").iterdir():
        if not e.name.isdigit():
            continue
        try:
            cmd = (e / "cmdline").read_bytes()
            ppid = int((e / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(e.name))
        if sandbox_id.encode() in cmd and (b"runsc-sandbox" in cmd or b"gofer" in cmd or b"boot" in cmd):
            roots.append(int(e.name))
    out, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return sorted(out)


def sandbox_pss_mb(sandbox_id: str) -> tuple[float, int]:
    pids = procs_of(sandbox_id)
    return sum(pss_kb(p) for p in pids) / 1024, len(pids)


# ---------------------------------------------------------------- the server

class BenchServer:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / "bench-server.log"
        self.url = ""
        self.key = ""
        self._log_offset = 0
        self.env: dict[str, str] = {}

    def prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if (self.data_dir / "state.db").exists() or (self.data_dir / "sandboxes").exists():
            self.gc()
        for p in self.data_dir.glob("state.db*"):
            p.unlink()
        images = self.data_dir / "images"
        if not images.exists() and TEST_IMAGES.is_dir():
            log(f"hard-linking images from {TEST_IMAGES}")
            subprocess.run(["cp", "-al", str(TEST_IMAGES), str(images)], check=True)

    def gc(self) -> str:
        env = dict(os.environ, AGENTENV_DATA_DIR=str(self.data_dir))
        r = subprocess.run([AGENTENV, "gc"], env=env, capture_output=True, text=True, timeout=180,
                           stdin=subprocess.DEVNULL)
        return (r.stdout + r.stderr).strip()

    def start(self, timeout: float = 600, env: dict[str, str] | None = None) -> None:
        """Start the server; `env`: AGENTENV_* overrides (kept for restarts). No pool of ready
        sandboxes unless asked (AGENTENV_POOL_SIZE): the pool has its own step (`pool`)."""
        port = free_port()
        self.key = "e2b_" + secrets.token_hex(20)
        self.url = f"http://127.0.0.1:{port}"
        if env is not None:
            self.env = dict(env)
        env = dict(os.environ, AGENTENV_DATA_DIR=str(self.data_dir), AGENTENV_HOST="127.0.0.1",
                   AGENTENV_PORT=str(port), AGENTENV_BOOTSTRAP_API_KEY=self.key,
                   **{"AGENTENV_POOL_SIZE": "0", **self.env})
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen([AGENTENV, "serve"], env=env, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        import requests
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server not healthy in time")
            time.sleep(0.25)
        os.environ.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=self.key)
        os.environ.pop("E2B_DEBUG", None)
        log(f"server pid {self.proc.pid} on {self.url}")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # our own server's process group only
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self.proc = None

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        import requests
        try:
            return requests.get(f"{self.url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def log_mark(self) -> int:
        return self.log_path.stat().st_size


# ---------------------------------------------------------------- raw runsc baselines

class Raw:
    """Bare runsc containers built from the same pieces agentenv uses (own --root, own dir)."""

    def __init__(self, data_dir: Path) -> None:
        from agentenv.config import load_settings
        from agentenv.network.manager import NetworkManager
        from agentenv.runtimes.gvisor import GVisorRuntime
        from agentenv.storage.rootfs import RootfsManager

        self.root = data_dir / "raw"
        # Raw: runsc's own threads as it starts them (agentenv's timer slack is agentenv's work). Its
        # own instance tag and slot subnet: its links and netns never collide with the server's (a
        # collision cost a timed start 8 failed attempts, a rescan and a retry).
        self.settings = load_settings(data_dir=self.root, sandbox_timer_slack_us=0,
                                      instance=RAW_INSTANCE, slot_subnet=RAW_SUBNET)
        self.server_settings = load_settings()  # the server's (the same environment): its instance, its slack
        self.net = NetworkManager(self.settings)
        self.rt = GVisorRuntime(self.settings)
        self.rootfs = RootfsManager(self.settings.paths)
        self.base = (data_dir / "images" / "base" / "rootfs").resolve()
        # The server rebuilds (and drops the old) tools layer whenever the envd sources change, which
        # happens mid-run on a shared checkout: keep a private hard-linked copy of the current one.
        tools = sorted((t for t in (data_dir / "images" / "tools").glob("*") if t.is_dir()),
                       key=lambda t: t.stat().st_mtime)
        self.tools = self.root / "tools"
        if self.tools.exists():
            shutil.rmtree(self.tools)
        self.root.mkdir(parents=True, exist_ok=True)
        if tools:
            subprocess.run(["cp", "-al", str(tools[-1]), str(self.tools)], check=True)
        else:
            self.tools.mkdir()
        self.live: dict[str, object] = {}  # id -> slot
        self._n = 0
        self._reaper: asyncio.Future | None = None
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def new_id(self) -> str:
        self._n += 1
        return f"rawbench{os.getpid()}x{self._n}"

    def spec(self, sid: str, rootfs: Path, slot, mem_mb: int = 0, envd: bool = False):
        from agentenv.runtimes.base import SandboxSpec
        from agentenv.storage import tools
        if envd:  # agentenv's own in-sandbox daemon, started exactly as the server starts it
            args = tools.envd_argv()
            env = {**tools.envd_env(), "AGENTENV_ENVD_HOST_TOKEN": secrets.token_hex(16)}
        else:
            args, env = ["python3", "-c", RAW_SERVER, str(mem_mb)], {}
        return SandboxSpec(sandbox_id=sid, rootfs=rootfs, tools_dir=self.tools, slot=slot,
                           bundle_dir=self.settings.paths.sandbox_dir(sid) / "bundle", cpu_count=2,
                           memory_mb=1024, args=args, env=env)

    async def setup(self) -> None:
        # As the server does (`runtimes/_reaper`): runsc's sandbox processes are orphans, and `runsc
        # delete` waits until the killed one is reaped, which this host's PID 1 does every 2 s.
        from agentenv.runtimes._reaper import become_subreaper, reap_forever
        if become_subreaper():
            self._reaper = asyncio.ensure_future(reap_forever())
        await self.net.setup_host()
        await self._clear_leftovers()

    async def _clear_leftovers(self) -> None:
        """Whatever is under this harness's own runsc root, sandbox dir and instance tag (containers,
        overlays, netns and links) that no live container holds: a run killed before its cleanup
        (SIGKILL, a lost machine) left it, or a step cut short did."""
        ids = set(await self.rt.list_ids())
        sandboxes = self.settings.paths.sandboxes
        ids |= {d.name for d in sandboxes.iterdir()} if sandboxes.is_dir() else set()
        for sid in sorted(ids - set(self.live)):
            log(f"raw: removing {sid}, left behind")
            await self.rt.stop(sid)
            await self.rootfs.release(sid)
        await self.net.discover()
        gone = await self.net.cleanup_orphans(keep=set(self.live))
        if gone:
            log(f"raw: removed {len(gone)} network slots left behind")

    async def _prepare(self, sid: str, layer: Path | None = None):
        """Overlay (`layer`, e.g. a checkpointed container's upper, over the base) + network slot."""
        lowers = [self.base] if layer is None else [layer, self.base]
        for attempt in range(3):
            try:
                rootfs, slot = await asyncio.gather(self.rootfs.prepare(sid, lowers), self.net.allocate(sid))
                break
            except Exception as e:  # noqa: BLE001 - slot index raced with the server: rescan, retry
                log(f"raw slot/rootfs for {sid} failed ({e!r}); retrying")
                await self.destroy(sid)
                await self.net.discover()
                if attempt == 2:
                    raise
        self.live[sid] = slot
        return rootfs, slot

    async def wait_answer(self, host_ip: str, timeout: float = 60) -> None:
        """As agentenv's health check waits (`envd_client.wait_healthy`): a connect whose SYN was
        dropped while the slot came up is given up after 0.1 s (growing on each timeout) for a fresh
        one, instead of waiting out the kernel's 1 s SYN retransmission."""
        deadline = time.monotonic() + timeout
        connect = 0.1
        while True:
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(host_ip, RAW_PORT), connect)
                data = await asyncio.wait_for(r.readexactly(3), 5)
                w.close()  # client closes first: no TIME_WAIT inside the sandbox
                if data == b"ok\n":
                    return
            except asyncio.TimeoutError:
                connect = min(connect * 2, 2.0)
            except (OSError, asyncio.IncompleteReadError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw container at {host_ip} never answered")
            await asyncio.sleep(0.01)

    async def start(self, mem_mb: int = 0, envd: bool = False) -> tuple[str, dict]:
        """overlay + slot + runsc run + first answer (TCP, or envd GET /health); returns (id, phases)."""
        from agentenv.orchestrator import envd_client
        sid = self.new_id()
        t0 = time.monotonic()
        rootfs, slot = await self._prepare(sid)
        t1 = time.monotonic()
        await self.rt.start(self.spec(sid, rootfs, slot, mem_mb, envd=envd))
        t2 = time.monotonic()
        await self.net.activate(slot, guest_mac=GUEST_MAC)  # as the server does (host.launch)
        if envd:
            await envd_client.wait_healthy(slot.host_ip)
        else:
            await self.wait_answer(slot.host_ip)
        t3 = time.monotonic()
        return sid, {"total": t3 - t0, "prepare": t1 - t0, "runsc_run": t2 - t1, "to_answer": t3 - t2}

    async def checkpoint(self, sid: str, image: Path, frozen: bool = False) -> float:
        """Bare `runsc checkpoint` (same netns wrapper, same compression as the server's:
        `runsc_compression`, none by default); `frozen`: the capture a pause makes, `runsc pause` and
        then `runsc checkpoint --leave-running` of the frozen container (a refused one leaves it
        running, where a refused plain checkpoint loses it on runsc 20240729). The container is
        deleted afterwards (not timed) so the id can be restored."""
        await asyncio.sleep(0.3)  # let the probe connection finish closing on the sandbox side
        shutil.rmtree(image, ignore_errors=True)
        image.mkdir(parents=True)
        slot = self.live[sid]
        t0 = time.monotonic()
        try:
            if frozen:
                await self.rt._runsc("pause", sid)
            await self.rt._runsc("checkpoint", *(["--leave-running"] if frozen else []),
                                 f"--compression={self.settings.runsc_compression}", f"--image-path={image}", sid,
                                 timeout=300, netns_path=slot.netns_path,
                                 output_file=self.settings.paths.sandbox_dir(sid) / "ckpt.log")
            return time.monotonic() - t0
        finally:
            await self.rt.stop(sid)

    async def warm_envd(self, sid: str) -> None:
        """One login shell in a container running envd, as the server does before it takes its warm
        image (`envd_client.warm_login_shell`)."""
        from agentenv.orchestrator import envd_client
        await envd_client.warm_login_shell(self.live[sid].host_ip, access_token=None, user="user")

    async def first_command(self, sid: str) -> None:
        """One `bash -l -c true` through envd's process API: what `commands.run("true")` sends."""
        from agentenv.orchestrator import envd_client
        code = await envd_client.run_process(self.live[sid].host_ip, access_token=None, cmd="true", user="user",
                                             shell="/bin/bash", login=True, timeout=60)
        if code != 0:
            raise RuntimeError(f"`true` exited {code}")

    async def image(self, image: Path, layer: Path, envd: bool = True) -> float:
        """Checkpoint a new container into `image` (envd: after `warm_envd`) and keep its upper in
        `layer`, which restores over the base need (a restore reopens the files its processes held);
        returns the checkpoint's time."""
        sid, _ph = await self.start(envd=envd)
        try:
            if envd:
                await self.warm_envd(sid)
            t = await self.checkpoint(sid, image)
            shutil.rmtree(layer, ignore_errors=True)
            shutil.copytree(self.rootfs.upper_path(sid), layer, symlinks=True)
            return t
        finally:
            await self.destroy(sid)

    async def restore_into(self, sid: str, image: Path, envd: bool = False, layer: Path | None = None) -> dict:
        """Restore `image` as container `sid` (existing slot after deactivate, or a new one over `layer`,
        the checkpointed container's upper: a restore reopens the files its processes held); first
        answer: TCP, or envd's GET /health for a container started with envd."""
        from agentenv.orchestrator import envd_client
        t0 = time.monotonic()
        slot = self.live.get(sid)
        if slot is None:
            rootfs, slot = await self._prepare(sid, layer)
        else:
            await self.net.deactivate(slot)
            rootfs = self.rootfs.rootfs_path(sid)
        t1 = time.monotonic()
        await self.rt.restore(self.spec(sid, rootfs, slot, envd=envd), image)
        t2 = time.monotonic()
        await self.net.activate(slot, guest_mac=GUEST_MAC)  # as the server does (host.launch)
        if envd:
            await envd_client.wait_healthy(slot.host_ip)
        else:
            await self.wait_answer(slot.host_ip)
        t3 = time.monotonic()
        return {"total": t3 - t0, "prepare": t1 - t0, "runsc_restore": t2 - t1, "to_answer": t3 - t2}

    async def restore_to_first_command(self, image: Path, layer: Path) -> float:
        """The raw steps a create from the warm image stands for: a new overlay (`layer` over the base)
        and slot, `runsc restore` of `image` (a container running envd), envd's first `/health`, one
        `bash -l -c true` through envd's process API. Returns the seconds until that command answered;
        the teardown after it is not timed (a kill is not part of agentenv's sample either)."""
        sid = self.new_id()
        t0 = time.monotonic()
        try:
            await self.restore_into(sid, image, envd=True, layer=layer)
            await self.first_command(sid)
            return time.monotonic() - t0
        finally:
            await self.destroy(sid)

    async def lifecycle(self, image: Path, layer: Path, clients: int, seconds: float) -> dict:
        """The raw steps of a lifecycle cycle (create → one command → kill), `clients` loops at once for
        `seconds`: overlay (`layer` over the base) + slot, `runsc restore` of a container running envd
        (`image`), envd's first
        `/health` answer, one `bash -l -c true` through envd's process API (what `commands.run` sends),
        then `runsc delete`, slot and overlay released. What agentenv adds on top: the API, the SDK,
        envd's `/init`, the database, the routes and the proxy."""
        stop_at = time.monotonic() + seconds
        lat: list[float] = []
        errors: list[str] = []

        async def client() -> None:
            while time.monotonic() < stop_at:
                sid = self.new_id()
                t0 = time.monotonic()
                try:
                    await self.restore_into(sid, image, envd=True, layer=layer)
                    await self.first_command(sid)
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    errors.append(repr(e)[:200])
                    await self.destroy(sid)
                    continue
                await self.destroy(sid)
                lat.append(time.monotonic() - t0)

        cpu0, t0 = machine_cpu_s(), time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed, cpu = time.monotonic() - t0, machine_cpu_s() - cpu0
        return {"clients": clients, "cycles": len(lat), "seconds": elapsed, "per_s": len(lat) / elapsed,
                "per_s_per_core": len(lat) / elapsed / (os.cpu_count() or 1), "latency": lat, "errors": errors,
                "machine_cpu_s": cpu, "cpu_ms_per_cycle": 1000 * cpu / len(lat) if lat else None}

    async def destroy(self, sid: str) -> None:
        try:
            await self.rt.stop(sid)
        except Exception as e:  # noqa: BLE001
            log(f"raw stop {sid}: {e}")
        slot = self.live.pop(sid, None)
        if slot is not None:
            await self.net.release(slot)
        try:
            await self.rootfs.release(sid)
        except Exception as e:  # noqa: BLE001
            log(f"raw rootfs release {sid}: {e}")

    async def server_slots(self) -> dict:
        """The server's sandboxes' network slots (its instance, not this harness's), by sandbox id."""
        from agentenv.network.manager import NetworkManager
        return await NetworkManager(self.server_settings).discover()

    async def close(self) -> None:
        """Every raw container gone, the instance's host setup (nft table) removed, the reaper stopped."""
        # A step cut short (SIGTERM, Ctrl-C) leaves its task pending in this loop: end it first, so it
        # does not go on starting a container while the cleanup runs.
        cut = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t is not self._reaper]
        for t in cut:
            t.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        for sid in list(self.live):
            await self.destroy(sid)
        await self._clear_leftovers()  # what no live container held (a step cut short mid-start)
        await self.net.close()
        await self.net.teardown_host()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    async def pss(self, sid: str) -> float:
        return sandbox_pss_mb(sid)[0]


def runsc_exec_argv(root: Path, sid: str, *command: str, exec_flags: tuple[str, ...] = ()) -> list[str]:
    """`runsc exec` with the global flags the server runs its containers with (platform, network);
    `/bin/true` unless a command is given."""
    return ["runsc", f"--root={root}", f"--platform={gvisor_platform()}", "--net-disconnect-ok", "exec",
            *exec_flags, sid, *(command or ("/bin/true",))]


def gvisor_platform() -> str:
    """The platform the server chose on this host (the same probe and cache it uses)."""
    from agentenv.runtimes.gvisor_platform import choose_platform, default_cache_dir
    return asyncio.run(choose_platform("runsc", os.environ.get("AGENTENV_GVISOR_PLATFORM", "auto"),
                                       default_cache_dir(BENCH_DIR))).platform


# ---------------------------------------------------------------- benchmarks

class Bench:
    def __init__(self, quick: bool, server: BenchServer, raw: Raw) -> None:
        self.quick = quick
        self.srv = server
        self.raw = raw
        self.results: dict = {}
        from e2b import Sandbox
        self.Sandbox = Sandbox
        self.pool = concurrent.futures.ThreadPoolExecutor(32)
        self._acc: dict[str, list] = {}

    def create(self, **kw):
        return self.Sandbox.create(timeout=1800, **kw)

    def create_first_command(self) -> tuple[float, float]:
        """`Sandbox.create()`, then `commands.run("true")`, then a kill (not timed): the seconds of
        the create call and of the first command."""
        t0 = time.monotonic()
        sbx = self.create()
        t1 = time.monotonic()
        sbx.commands.run("true")
        t2 = time.monotonic()
        sbx.kill()
        return t1 - t0, t2 - t1

    # 1 ------------------------------------------------------------------
    def bench_create(self) -> None:
        n = 10 if self.quick else 30
        # Samples survive a retry after the server was killed from outside (see run_all).
        ours, phases = self._acc.setdefault("create_ours", []), self._acc.setdefault("create_phases", [])
        # The raw step a create stands for, taken in turn with agentenv's samples (one each, the order
        # swapped every pair) so both see the same load: the machine is shared, and a raw row taken
        # minutes apart moved the ratio by ±10 % (thirty-third session).
        paired = self._acc.setdefault("create_raw_paired", [])
        img, layer = self.raw.root / "ckpt-create", self.raw.root / "layer-create"
        self.raw.run(self.raw.image(img, layer))
        log(f"create: {n - len(ours)} sandboxes via SDK, each beside one raw restore → envd → one command")
        try:
            while len(ours) < n:
                raw_first = len(ours) % 2 == 1
                if raw_first:
                    r = self.raw.run(self.raw.restore_to_first_command(img, layer))
                create, first_cmd = self.create_first_command()
                ours.append(create + first_cmd)
                phases.append({"create": create, "first_cmd": first_cmd})
                if not raw_first:
                    r = self.raw.run(self.raw.restore_to_first_command(img, layer))
                paired.append((create + first_cmd, r))
        finally:
            shutil.rmtree(img, ignore_errors=True)
            shutil.rmtree(layer, ignore_errors=True)
        log(f"create: {n} raw runsc run (python TCP answer)")
        raw, raw_phases = [], []
        for _ in range(n):
            sid, ph = self.raw.run(self.raw.start())
            raw.append(ph["total"])
            raw_phases.append(ph)
            self.raw.run(self.raw.destroy(sid))
        log(f"create: {n} raw runsc run of envd (GET /health answered)")
        raw_envd = []
        for _ in range(n):
            sid, ph = self.raw.run(self.raw.start(envd=True))
            raw_envd.append(ph)
            self.raw.run(self.raw.destroy(sid))
        self.results["create"] = {
            "raw_envd": stats([p["total"] for p in raw_envd]),
            "raw_envd_to_healthy": stats([p["to_answer"] for p in raw_envd]),
            "ours": stats(ours), "ours_create_call": stats([p["create"] for p in phases]),
            "ours_first_cmd": stats([p["first_cmd"] for p in phases]),
            "raw_envd_restore_to_first_cmd": stats([r for _o, r in paired]),
            # each agentenv sample over the raw one taken next to it (a pair a server restart broke
            # is not in the list)
            "paired_ratio": stats([o / r for o, r in paired]),
            "raw": stats(raw), "raw_runsc_run": stats([p["runsc_run"] for p in raw_phases]),
            "raw_prepare": stats([p["prepare"] for p in raw_phases]),
            "raw_to_answer": stats([p["to_answer"] for p in raw_phases])}

    # 2 ------------------------------------------------------------------
    def bench_exec(self) -> None:
        n, nraw = (30, 15) if self.quick else (120, 40)
        log(f"exec: {n} commands.run('true'), {nraw} raw runsc exec")
        sbx = self.create()
        try:
            sbx.commands.run("true")
            ours = []
            for _ in range(n):
                t0 = time.monotonic()
                sbx.commands.run("true")
                ours.append(time.monotonic() - t0)
            # The same command the SDK has envd start: `/bin/bash -l -c true` as the sandbox's user, in
            # their home, with the variables envd sets (the shell alone costs ~20 ms in gVisor).
            uid, gid, home, name = sbx.commands.run("id -u; id -g; echo $HOME; id -un").stdout.split()
            as_user = (f"--user={uid}:{gid}", f"--cwd={home}", f"--env=HOME={home}", f"--env=USER={name}",
                       f"--env=LOGNAME={name}")
            root = BENCH_DIR / "run" / "runsc"
            raw, raw_shell = [], []
            for _ in range(nraw):
                for argv, into in ((runsc_exec_argv(root, sbx.sandbox_id), raw),
                                   (runsc_exec_argv(root, sbx.sandbox_id, "/bin/bash", "-l", "-c", "true",
                                                    exec_flags=as_user), raw_shell)):
                    t0 = time.monotonic()
                    r = sh(argv, timeout=30)
                    into.append(time.monotonic() - t0)
                    if r.returncode != 0:
                        raise RuntimeError(f"runsc exec failed: {r.stderr[-500:]}")
        finally:
            sbx.kill()
        self.results["exec"] = {"ours": stats(ours), "raw_runsc_exec": stats(raw),
                                "raw_runsc_exec_shell": stats(raw_shell)}

    # 3 ------------------------------------------------------------------
    def bench_files(self) -> None:
        reps = 2 if self.quick else 4
        size = 64 * MiB
        data = os.urandom(size)
        log(f"files: {reps} x 64 MiB write/read via SDK, raw HTTP via proxy and straight to envd, host disk, dd")
        w, r, rs, lw, lr, dw, dr = [], [], [], [], [], [], []
        pw, pr, ew, er = [], [], [], []
        counts_before = host_file_counts(self.srv.url)
        sbx = self.create()
        local = BENCH_DIR / "files-baseline.bin"
        envd_ip = slot_host_ip(sbx.sandbox_id)
        token = {"X-Access-Token": sbx._envd_access_token} if sbx._envd_access_token else {}
        proxy = urlsplit(self.srv.url)
        proxied = {**token, "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        buf = bytearray(size)
        try:
            for i in range(reps):
                t0 = time.monotonic()
                sbx.files.write(f"/tmp/bench-{i}.bin", data)
                w.append(time.monotonic() - t0)
                t0 = time.monotonic()
                back = sbx.files.read(f"/tmp/bench-{i}.bin", format="bytes")
                r.append(time.monotonic() - t0)
                if len(back) != size or back[:4096] != data[:4096] or back[-4096:] != data[-4096:]:
                    raise RuntimeError("files.read returned different bytes")
                del back
                t0 = time.monotonic()
                got = sum(len(chunk) for chunk in sbx.files.read(f"/tmp/bench-{i}.bin", format="stream"))
                rs.append(time.monotonic() - t0)
                if got != size:
                    raise RuntimeError("files.read(format='stream') returned a different size")
                # the same bytes as one octet-stream request each way: through the proxy, then to envd
                for (host, port, headers), (tw, tr) in (((proxy.hostname, proxy.port, proxied), (pw, pr)),
                                                       ((envd_ip, 49983, token), (ew, er))):
                    target = f"/files?path=/tmp/raw-{i}.bin&username=user"
                    tw.append(http_transfer(host, port, "POST", target, headers, body=data))
                    tr.append(http_transfer(host, port, "GET", target, headers, into=buf))
                    if buf[:4096] != data[:4096] or buf[-4096:] != data[-4096:]:
                        raise RuntimeError("GET /files returned different bytes")
                t0 = time.monotonic()
                local.write_bytes(data)
                lw.append(time.monotonic() - t0)
                t0 = time.monotonic()
                _ = local.read_bytes()
                lr.append(time.monotonic() - t0)
                del _
                out = sbx.commands.run(f"dd if=/dev/zero of=/tmp/dd-{i}.bin bs=1M count=64 2>&1; "
                                       f"dd if=/tmp/dd-{i}.bin of=/dev/null bs=1M 2>&1")
                secs = [float(x) for x in re.findall(r"copied, ([0-9.]+) s", out.stdout)]
                if len(secs) == 2:
                    dw.append(secs[0])
                    dr.append(secs[1])
                sbx.commands.run(f"rm -f /tmp/bench-{i}.bin /tmp/raw-{i}.bin /tmp/dd-{i}.bin")
        finally:
            sbx.kill()
            local.unlink(missing_ok=True)

        def mbps(ts):
            return {**stats(ts), "MiBps_p50": 64 / pct(ts, 50) if ts else None}
        counts = host_file_counts(self.srv.url)
        moved = None if counts is None or counts_before is None else [a - b for a, b in zip(counts, counts_before)]
        self.results["files"] = {"size_MiB": 64, "sdk_write": mbps(w), "sdk_read": mbps(r),
                                 "sdk_read_stream": mbps(rs),
                                 "host_file_sends": moved[0] if moved else None,
                                 "host_file_stages": moved[1] if moved else None,
                                 "proxy_http_write": mbps(pw), "proxy_http_read": mbps(pr),
                                 "envd_http_write": mbps(ew), "envd_http_read": mbps(er), "host_write": mbps(lw),
                                 "host_read": mbps(lr), "sandbox_dd_write": mbps(dw), "sandbox_dd_read": mbps(dr)}

    # 4a -----------------------------------------------------------------
    def bench_pause_resume(self) -> None:
        reps = 2 if self.quick else 5
        log(f"pause/resume: {reps} reps (SDK), each beside one rep of the raw checkpoints/restores")
        pause, resume, first, right_after = [], [], [], []
        # The raw steps twice: a bare container (a tiny TCP server), and one running envd as a sandbox
        # does, whose memory image is the size of a sandbox's (what a resume restores).
        # The envd container is checkpointed as the warm image is (after one login shell), and after its
        # restore runs one `bash -l -c true` through envd, as `commands.run` does (`raw_envd_first_cmd`).
        # Each rep of them runs right after one agentenv rep, so both see the same load.
        raw: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}
        raw_first: list[float] = []
        raw_frozen: list[float] = []
        img = self.raw.root / "ckpt-pr"

        def raw_rep() -> None:
            for envd, (ck, rs) in raw.items():
                sid, _ph = self.raw.run(self.raw.start(envd=envd))
                try:
                    if envd:
                        self.raw.run(self.raw.warm_envd(sid))
                    ck.append(self.raw.run(self.raw.checkpoint(sid, img)))
                    t0 = time.monotonic()
                    rs.append(self.raw.run(self.raw.restore_into(sid, img, envd=envd))["total"])
                    if envd:
                        self.raw.run(self.raw.first_command(sid))
                        raw_first.append(time.monotonic() - t0)
                finally:
                    self.raw.run(self.raw.destroy(sid))
            # the capture a pause makes (freeze + checkpoint that leaves it running), on envd
            sid, _ph = self.raw.run(self.raw.start(envd=True))
            try:
                self.raw.run(self.raw.warm_envd(sid))
                raw_frozen.append(self.raw.run(self.raw.checkpoint(sid, img, frozen=True)))
            finally:
                self.raw.run(self.raw.destroy(sid))

        # A pause answers once the image is written and stops the frozen container after that
        # (~0.15 s): the resumes below come 1 s later, as a resume after an agent's pause does; one
        # more pair resumes at once, and waits for that stand-down (`right_after`).
        for rep in range(reps + 1):
            sbx = self.create()
            try:
                sbx.commands.run("true")
                t0 = time.monotonic()
                sbx.pause()
                if rep < reps:
                    pause.append(time.monotonic() - t0)
                    time.sleep(1.0)
                t0 = time.monotonic()
                sbx2 = self.Sandbox.connect(sbx.sandbox_id, timeout=1800)
                if rep < reps:
                    resume.append(time.monotonic() - t0)
                sbx2.commands.run("true")
                (first if rep < reps else right_after).append(time.monotonic() - t0)
            finally:
                try:
                    self.Sandbox.kill(sbx.sandbox_id)
                except Exception:  # noqa: BLE001
                    pass
            if rep < reps:
                raw_rep()
        shutil.rmtree(img, ignore_errors=True)
        self.results["pause_resume"] = {"ours_pause": stats(pause), "ours_connect": stats(resume),
                                        "ours_connect_to_first_cmd": stats(first),
                                        "ours_connect_right_after_pause_to_first_cmd": stats(right_after),
                                        "raw_checkpoint": stats(raw[False][0]),
                                        "raw_restore_to_answer": stats(raw[False][1]),
                                        "raw_envd_checkpoint": stats(raw[True][0]),
                                        "raw_envd_restore_to_answer": stats(raw[True][1]),
                                        "raw_envd_restore_to_first_cmd": stats(raw_first),
                                        "raw_envd_frozen_checkpoint": stats(raw_frozen)}

    # 4b -----------------------------------------------------------------
    def bench_fork(self) -> None:
        counts = [1, 4, 16]
        log(f"fork: children {counts}")
        out = {}
        for n in counts:
            src = self.create()
            kids = []
            try:
                src.commands.run("echo hi > /tmp/marker")
                mark = self.srv.log_mark()
                cpu0 = machine_cpu_s()
                t0 = time.monotonic()
                res = src.fork(count=n, timeout=1800)
                t_call = time.monotonic() - t0
                kids = [k for k in res if not isinstance(k, Exception)]
                errs = [repr(k) for k in res if isinstance(k, Exception)]
                list(self.pool.map(lambda k: k.commands.run("cat /tmp/marker"), kids))
                t_all = time.monotonic() - t0
                cpu = machine_cpu_s() - cpu0
                src.commands.run("true")
                logtxt = self.srv.log_since(mark)
                m = capture_times(logtxt)
                pss = []
                if n == 4 or (n == 1 and len(counts) == 1):
                    time.sleep(2)
                    pss = [sandbox_pss_mb(k.sandbox_id)[0] for k in kids]
                out[str(n)] = {"ok": len(kids), "errors": errs, "fork_call": t_call, "all_answer": t_all,
                               "machine_cpu_s": cpu,
                               "source_checkpoint": m[0] if m else None,
                               "source_seal": m[1] if m else None,
                               "source_paused": m[2] if m else None,
                               "child_pss_MiB": pss}
                log(f"fork {n}: all answered in {t_all:.2f}s, source paused {out[str(n)]['source_paused']}")
            finally:
                list(self.pool.map(lambda k: _kill(k), kids + [src]))
        # raw: checkpoint a container, N parallel restores into fresh slots/overlays; twice: the bare
        # TCP server, and a container running envd (taken as the warm image is, after one login shell)
        # whose children each also run one `bash -l -c true` through envd, as every fork child answers
        # one `commands.run` above
        raw: dict = {}
        ck: float | None = None
        for envd in (False, True):
            img, layer = self.raw.root / "ckpt-fork", self.raw.root / "layer-fork"
            t = self.raw.run(self.raw.image(img, layer, envd=envd))
            ck = t if not envd else ck
            for n in counts:
                ids = [self.raw.new_id() for _ in range(n)]

                async def child(i: str) -> None:
                    await self.raw.restore_into(i, img, envd=envd, layer=layer)
                    if envd:
                        await self.raw.first_command(i)

                async def par():
                    t0 = time.monotonic()
                    await asyncio.gather(*(child(i) for i in ids))
                    return time.monotonic() - t0
                key = f"envd_{n}" if envd else str(n)
                try:
                    cpu0 = machine_cpu_s()
                    raw[key] = {"all_answer": self.raw.run(par())}
                    raw[key]["machine_cpu_s"] = machine_cpu_s() - cpu0
                    log(f"raw parallel restore {n}{' (envd + one command)' if envd else ''}: all answered in "
                        f"{raw[key]['all_answer']:.2f}s")
                    if n == 4:
                        time.sleep(2)
                        raw[key]["child_pss_MiB"] = [sandbox_pss_mb(i)[0] for i in ids]
                finally:
                    async def destroy_all():
                        await asyncio.gather(*(self.raw.destroy(i) for i in ids))
                    self.raw.run(destroy_all())
            shutil.rmtree(img, ignore_errors=True)
            shutil.rmtree(layer, ignore_errors=True)
        # idle sandbox (fresh, not forked) for the memory comparison
        idle = self.create()
        try:
            idle.commands.run("true")
            time.sleep(2)
            idle_pss = [sandbox_pss_mb(idle.sandbox_id)[0]]
        finally:
            _kill(idle)
        self.results["fork"] = {"ours": out, "raw_checkpoint": ck, "raw_parallel_restore": raw,
                                "idle_sandbox_pss_MiB": idle_pss}

    # 4c -----------------------------------------------------------------
    def bench_snapshot(self) -> None:
        sizes = [0, 64, 256]
        log(f"snapshot: memory touched {sizes} MiB, files written {sizes} MiB")
        rows = []
        for kind in ("memory", "files"):
            for mb in sizes:
                if kind == "files" and mb == 0:
                    continue  # same as memory 0
                sbx = self.create()
                try:
                    if mb and kind == "memory":
                        sbx.commands.run(
                            f"python3 -c \"import os,time; b=os.urandom({mb}<<20); open('/tmp/ready','w').close(); "
                            f"time.sleep(1e6)\"", background=True)
                        sbx.commands.run("for i in $(seq 600); do [ -e /tmp/ready ] && break; sleep 0.1; done")
                    elif mb:
                        sbx.commands.run(f"head -c {mb}M /dev/urandom > $HOME/changed.bin && sync", timeout=300)
                    mark = self.srv.log_mark()
                    t0 = time.monotonic()
                    snap = sbx.create_snapshot()
                    t_snap = time.monotonic() - t0
                    sbx.commands.run("true")
                    t_back = time.monotonic() - t0
                    logtxt = self.srv.log_since(mark)
                    m = re.search(r"committed \((\d+) layers, [a-z ]+, (\d+) bytes\)", logtxt)
                    c = capture_times(logtxt)
                    row = {"kind": kind, "MiB": mb, "snapshot_call": t_snap, "source_answers_after": t_back,
                           "size_bytes": int(m.group(2)) if m else None,
                           "checkpoint": c[0] if c else None, "seal": c[1] if c else None,
                           "source_paused": c[2] if c else None,
                           "memory_image_bytes": _newest_memory_blob(BENCH_DIR)}
                    rows.append(row)
                    log(f"snapshot {kind} {mb} MiB: {t_snap:.2f}s, {row['size_bytes']} bytes")
                    try:
                        self.Sandbox.delete_snapshot(snap.snapshot_id)
                    except Exception as e:  # noqa: BLE001
                        log(f"delete_snapshot: {e}")
                finally:
                    _kill(sbx)
        # raw baseline: checkpoint of a bare container holding N MiB of random bytes
        raw = []
        for mb in sizes:
            sid, _ = self.raw.run(self.raw.start(mem_mb=mb))
            img = self.raw.root / f"ckpt-mem{mb}"
            try:
                t = self.raw.run(self.raw.checkpoint(sid, img))
            finally:
                self.raw.run(self.raw.destroy(sid))
            size = sum(p.stat().st_size for p in img.rglob("*") if p.is_file())
            shutil.rmtree(img, ignore_errors=True)
            raw.append({"MiB": mb, "checkpoint": t, "size_bytes": size})
        self.results["snapshot"] = {"ours": rows, "raw_checkpoint_memory": raw}

    # 5 ------------------------------------------------------------------
    def bench_proxy(self) -> None:
        """Requests/s and latency to one in-sandbox HTTP server: direct to the sandbox's slot address,
        through agentenv's proxy (header routing on the server's one listener), and through nginx
        set up as the same kind of reverse proxy (one worker, upstream keep-alive, no buffering)."""
        if not (shutil.which("wrk") and shutil.which("nginx")):
            raise RuntimeError("the proxy benchmark needs wrk and nginx: apt-get install wrk nginx-light")
        seconds = 5 if self.quick else 10
        sbx = self.create()
        nginx = bare = lua = None
        ngx_dir = BENCH_DIR / "nginx"
        try:
            sbx.files.write("/tmp/bench_app.py", PROXY_APP)
            sbx.commands.run("setsid nohup python3 /tmp/bench_app.py >/tmp/bench_app.log 2>&1 </dev/null &")
            slot = self.raw.run(self.raw.server_slots()).get(sbx.sandbox_id)
            if slot is None:
                raise RuntimeError(f"no network slot found for {sbx.sandbox_id}")
            upstream = f"{slot.host_ip}:{PROXY_APP_PORT}"
            route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(PROXY_APP_PORT)}
            import requests
            deadline = time.monotonic() + 60
            while True:
                try:
                    if requests.get(f"{self.srv.url}/", headers=route, timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the benchmark app in the sandbox did not answer")
                time.sleep(0.2)
            shutil.rmtree(ngx_dir, ignore_errors=True)
            ngx_dir.mkdir(parents=True)
            ngx_port = free_port()
            (ngx_dir / "nginx.conf").write_text(nginx_conf(ngx_dir, ngx_port, f"server {upstream}; keepalive 64;"))
            nginx = spawn_nginx(ngx_dir)
            wait_proxy(nginx, ngx_port, "nginx")
            lua = lua_port = None
            if NGINX_LUA_MODULE.exists():
                lua, lua_port = start_nginx_lua(ngx_dir / "lua", {sbx.sandbox_id: slot.host_ip}, 10_000)
            haproxy = haproxy_pids(self.srv.data_dir)
            if haproxy:
                bare_port = free_port()
                (ngx_dir / "bare-haproxy.cfg").write_text(BARE_HAPROXY_CONF.format(upstream=upstream, port=bare_port))
                bare = subprocess.Popen(["haproxy", "-db", "-f", str(ngx_dir / "bare-haproxy.cfg")],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, start_new_session=True)
                wait_proxy(bare, bare_port, "the bare HAProxy")
            # CPU the proxy itself burns per request: unlike requests/s, it does not depend on how
            # much of the shared machine the proxy got during the run.
            targets = [("direct", f"http://{upstream}/", {}, []),
                       # the data plane's own CPU: HAProxy's, or the server's when it is the proxy
                       # (the server's background work is not per request)
                       ("agentenv", f"{self.srv.url}/", route, haproxy or [self.srv.proc.pid]),
                       ("nginx", f"http://127.0.0.1:{ngx_port}/", route, [nginx.pid] + child_pids(nginx.pid))]
            if bare is not None:
                targets.append(("haproxy-bare", f"http://127.0.0.1:{bare_port}/", route, [bare.pid]))
            if lua is not None:
                targets.append(("nginx-lua", f"http://127.0.0.1:{lua_port}/", route, [lua.pid] + child_pids(lua.pid)))
            out: dict = {"upstream": "python asyncio keep-alive server in the sandbox", "runs": {},
                         "data_plane": "haproxy" if haproxy else "python", "rounds": 3,
                         "versions": proxy_versions(haproxy[0] if haproxy else None)}
            # The three targets take turns, three rounds each, and each figure is the median of its
            # rounds: on a shared machine a single run of each mostly measures who else was busy.
            for conns in (1, 32):
                for name, url, headers, _ in targets:
                    wrk(url, connections=conns, seconds=2, headers=headers)  # warm-up (pools, JIT-less caches)
                rounds: dict[str, list[dict]] = {name: [] for name, *_ in targets}
                for _ in range(out["rounds"]):
                    for name, url, headers, pids in targets:
                        cpu0 = cpu_seconds(pids)
                        r = wrk(url, connections=conns, seconds=max(2, seconds // 2), headers=headers)
                        r["proxy_cpu_ms_per_request"] = ((cpu_seconds(pids) - cpu0) * 1000 / r["requests"]
                                                         if pids and r["requests"] else None)
                        rounds[name].append(r)
                for name, rs in rounds.items():
                    cpus = [x["proxy_cpu_ms_per_request"] for x in rs if x["proxy_cpu_ms_per_request"] is not None]
                    r = {"rps": statistics.median(x["rps"] or 0 for x in rs),
                         "p50": statistics.median(x["p50"] for x in rs), "p99": statistics.median(x["p99"] for x in rs),
                         "requests": sum(x["requests"] for x in rs), "non_2xx": sum(x["non_2xx"] for x in rs),
                         "socket_errors": sum(x["socket_errors"] for x in rs), "connections": conns,
                         "proxy_cpu_ms_per_request": statistics.median(cpus) if cpus else None,
                         "rounds_rps": [x["rps"] for x in rs]}
                    log(f"proxy: {name:8s} c={conns:2d}: {r['rps']} req/s (rounds {r['rounds_rps']}), "
                        f"p50 {r['p50'] * 1000:.2f} ms, p99 {r['p99'] * 1000:.2f} ms, proxy CPU/request "
                        f"{r['proxy_cpu_ms_per_request']} ms, non-2xx {r['non_2xx']}, socket errors {r['socket_errors']}")
                    out["runs"].setdefault(str(conns), {})[name] = r
            if haproxy:
                out["routes"] = asyncio.run(route_update_bench(10_000))
                log(f"proxy: routes: {out['routes']}")
            self.results["proxy"] = out
        finally:
            for proc in (nginx, bare, lua):
                if proc is None:
                    continue
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            shutil.rmtree(ngx_dir, ignore_errors=True)
            _kill(sbx)

    def run_all(self, only: set[str]) -> None:
        steps = [("create", self.bench_create), ("idle", self.bench_idle), ("exec", self.bench_exec),
                 ("files", self.bench_files),
                 ("pause", self.bench_pause_resume), ("fork", self.bench_fork), ("snapshot", self.bench_snapshot),
                 ("firecracker", self.bench_firecracker), ("qemu", self.bench_qemu), ("proxy", self.bench_proxy), ("metrics", self.bench_metrics),
                 ("templates", self.bench_templates), ("pool", self.bench_pool), ("lifecycle", self.bench_lifecycle)]
        for name, fn in steps:
            if only and name not in only:
                continue
            t0 = time.monotonic()
            for attempt in (1, 2, 3, 4):
                if name in SERVERLESS_STEPS:
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001
                        log(f"{name} FAILED: {e}")
                        self.results.setdefault("errors", {})[name] = traceback.format_exc()
                    break
                self.ensure_server()
                try:
                    fn()
                    self.results.get("errors", {}).pop(name, None)
                    break
                except Exception as e:  # noqa: BLE001 - keep the other benchmarks going
                    log(f"{name} FAILED: {e}")
                    self.results.setdefault("errors", {})[name] = traceback.format_exc()
                    if self.srv.alive():
                        break  # a real failure, not the server disappearing under us: do not retry
                    log(f"{name}: the server is gone (killed from outside?); restarting it and retrying")
            self.results.setdefault("durations_s", {})[name] = round(time.monotonic() - t0, 1)

    # 1b -----------------------------------------------------------------
    SLEEP_1MS = ("python3 -c 'import time; t = time.perf_counter(); [time.sleep(0.001) for _ in range(100)]; "
                 "print((time.perf_counter() - t) * 10)'")

    def _slack_sweep(self, ours: list, secs: float, usage) -> dict:
        """The same idle sandboxes at each host timer slack in turn (`sandbox_timer_slack_us`, set on
        their threads as the server does): their CPU, and what a 1 ms `sleep` inside one takes."""
        from agentenv.runtimes.cgroups import set_timer_slack
        out = {}
        try:
            for slack_us in (50, 1000, 5000, 20000):
                for sbx in ours:
                    set_timer_slack(sbx.sandbox_id, slack_us * 1000)
                sleep_ms = float(ours[0].commands.run(self.SLEEP_1MS).stdout)
                time.sleep(1.0)  # past the command's tail
                u0 = {s.sandbox_id: usage(s.sandbox_id) for s in ours}
                time.sleep(secs)
                u1 = {s.sandbox_id: usage(s.sandbox_id) for s in ours}
                vals = [(u1[i][0] - u0[i][0]) / 1e6 / secs for i in u0 if u0[i] and u1.get(i)]
                out[str(slack_us)] = {"cpu_ms_per_s": stats(vals), "sleep_1ms_takes_ms": sleep_ms}
                log(f"idle: timer slack {slack_us} us: {out[str(slack_us)]['cpu_ms_per_s']['p50']:.1f} ms/s, "
                    f"a 1 ms sleep inside takes {sleep_ms:.2f} ms")
        finally:
            configured = self.raw.server_settings.sandbox_timer_slack_us
            for sbx in ours:
                set_timer_slack(sbx.sandbox_id, configured * 1000 or 50_000)
        return out

    def bench_idle(self) -> None:
        """Host CPU an idle sandbox costs, from its cgroup (Sentry, gofer and everything inside), in ms
        a second: agentenv's sandboxes (after one command) next to raw containers running envd (no
        memory limit given, so no OOM guard) and the bare TCP server, all idle side by side."""
        from agentenv.observability.sampler import cgroup_usage
        n, secs = (3, 5.0) if self.quick else (5, 10.0)
        log(f"idle: {n} sandboxes of each kind, {secs:.0f} s")
        ours = [self.create() for _ in range(n)]
        raw: dict[bool, list[str]] = {}
        try:
            for sbx in ours:
                sbx.commands.run("true")
            for envd in (True, False):
                raw[envd] = [self.raw.run(self.raw.start(envd=envd))[0] for _ in range(n)]
            kinds = {"ours": [s.sandbox_id for s in ours], "raw_envd": raw[True], "raw_bare": raw[False]}
            time.sleep(2.0)  # past the first command's and the first answer's tails
            u0 = {sid: cgroup_usage(sid) for ids in kinds.values() for sid in ids}
            time.sleep(secs)
            u1 = {sid: cgroup_usage(sid) for ids in kinds.values() for sid in ids}
            out = {}
            for kind, ids in kinds.items():
                vals = [(u1[i][0] - u0[i][0]) / 1e6 / secs for i in ids if u0.get(i) and u1.get(i)]
                out[kind] = {"cpu_ms_per_s": stats(vals)}
            self.results["idle"] = {"n": n, "seconds": secs, **out,
                                    "slack_sweep": self._slack_sweep(ours, secs, usage=cgroup_usage)}
            log("idle: " + ", ".join(f"{k} {v['cpu_ms_per_s']['p50']:.1f} ms/s" for k, v in out.items()))
        finally:
            for sbx in ours:
                _kill(sbx)
            for ids in raw.values():
                for sid in ids:
                    self.raw.run(self.raw.destroy(sid))

    # 6 ------------------------------------------------------------------
    def bench_metrics(self) -> None:
        """Cost of scraping /metrics and /sandboxes/metrics with 0 and 100 sandboxes (docs/observability.md)."""
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        n_sbx, reps = 100, 30 if self.quick else 100
        sess = requests.Session()
        hdr = {"X-API-KEY": self.srv.key}

        def scrape(path: str, key: bool) -> tuple[list[float], list[float], int, list[float]]:
            wall, render, sampler = [], [], []
            size = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                r = sess.get(self.srv.url + path, headers=hdr if key else {}, timeout=60)
                wall.append(time.perf_counter() - t0)
                r.raise_for_status()
                size = len(r.content)
                if "X-Render-Seconds" in r.headers:
                    render.append(float(r.headers["X-Render-Seconds"]))
                if path == "/metrics":
                    for fam in text_string_to_metric_families(r.text):
                        if fam.name == "agentenv_resource_sampler_duration_seconds":
                            sampler.append(fam.samples[0].value)
            return wall, render, size, sampler

        def cpu_s() -> float:
            for fam in text_string_to_metric_families(sess.get(self.srv.url + "/metrics", timeout=60).text):
                if fam.name == "process_cpu_seconds":
                    return fam.samples[0].value
            return float("nan")

        def measure(label: str, ids: list[str]) -> dict:
            time.sleep(5)  # a few sampler passes over the current set
            c0, t0 = cpu_s(), time.monotonic()
            time.sleep(20)  # idle server: what the sampler + housekeeping cost per second
            idle_cpu = (cpu_s() - c0) / (time.monotonic() - t0)
            c1, t1 = cpu_s(), time.monotonic()
            m_wall, m_render, m_size, sampler = scrape("/metrics", key=False)
            # server CPU per scrape: robust on a noisy host, unlike wall times
            m_cpu = ((cpu_s() - c1) - idle_cpu * (time.monotonic() - t1)) / reps
            c1, t1 = cpu_s(), time.monotonic()
            a_wall, _, a_size, _ = scrape("/sandboxes/metrics", key=True)
            a_cpu = ((cpu_s() - c1) - idle_cpu * (time.monotonic() - t1)) / reps
            one = scrape(f"/sandboxes/{ids[0]}/metrics", key=True) if ids else None
            out = {"sandboxes": len(ids), "metrics": {**stats(m_wall), "bytes": m_size},
                   "metrics_render": stats(m_render), "all_sandbox_metrics": {**stats(a_wall), "bytes": a_size},
                   "one_sandbox_series": ({**stats(one[0]), "bytes": one[2]} if one else None),
                   "sampler_pass": stats(sampler), "server_cpu_idle_cores": idle_cpu,
                   "metrics_cpu_per_scrape": m_cpu, "all_sandbox_metrics_cpu_per_scrape": a_cpu}
            log(f"metrics with {len(ids)} sandboxes: /metrics p50 {out['metrics']['p50'] * 1000:.1f} ms "
                f"({m_size} B), /sandboxes/metrics p50 {out['all_sandbox_metrics']['p50'] * 1000:.1f} ms "
                f"({a_size} B), sampler pass p50 {out['sampler_pass']['p50'] * 1000:.1f} ms, "
                f"server idle CPU {idle_cpu:.3f} cores")
            return out

        res = {"empty": measure("empty", [])}
        made: list = []
        log(f"metrics: creating {n_sbx} sandboxes")
        t0 = time.monotonic()
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                made = [s for s in pool.map(lambda _: self.create(), range(n_sbx))]
            log(f"metrics: {len(made)} sandboxes up in {time.monotonic() - t0:.0f}s")
            res["full"] = measure("full", [s.sandbox_id for s in made])
        finally:
            list(self.pool.map(_kill, made))
        self.results["metrics"] = res

    # 7 ------------------------------------------------------------------
    def bench_templates(self) -> None:
        """Template-based create (a restore with the service already running) vs the base image.

        The service: a Python HTTP server that hashes a 64 MiB dataset before it listens (a stand-in
        for an app with dependencies and data to load). Compared: (a) create from the template until
        the service answers; (b) create from the base image until a first command answers (no
        service); (c) create from the base image, run the same setup, start the service, wait until it
        answers (what a template saves). Also: the build itself, uncached and fully cached.
        """
        import base64

        from e2b import Template, wait_for_port
        from e2b.sandbox.commands.command_handle import CommandExitException

        n = 8 if self.quick else 20
        app = base64.b64encode(TEMPLATE_APP.encode()).decode()
        setup = (f"head -c {64 * MiB} /dev/urandom > /home/user/data.bin && "
                 f"echo {app} | base64 -d > /home/user/app.py")
        start = "python3 /home/user/app.py"
        name = f"bench-tpl-{secrets.token_hex(3)}"

        def template():
            return Template().from_base_image().run_cmd(setup).set_start_cmd(start, wait_for_port(8000))

        def answered(sbx) -> None:
            while True:
                try:
                    sbx.commands.run("curl -sf http://127.0.0.1:8000/ >/dev/null")
                    return
                except CommandExitException:
                    time.sleep(0.05)

        t0 = time.monotonic()
        Template.build(template(), name)
        build_first = time.monotonic() - t0
        logs: list[str] = []
        t0 = time.monotonic()
        Template.build(template(), name, on_build_logs=lambda e: logs.append(str(e.message)))
        build_cached = time.monotonic() - t0
        cached_steps = sum(1 for m in logs if m.startswith("CACHED"))
        log(f"templates: build {build_first:.1f}s uncached, {build_cached:.1f}s with {cached_steps} cached step(s)")
        tpl, tpl_call, base, base_call, manual = [], [], [], [], []
        try:
            for _ in range(n):
                t0 = time.monotonic()
                sbx = self.create(template=name)
                t1 = time.monotonic()
                answered(sbx)
                tpl.append(time.monotonic() - t0)
                tpl_call.append(t1 - t0)
                sbx.kill()
                t0 = time.monotonic()
                sbx = self.create()
                t1 = time.monotonic()
                sbx.commands.run("true")
                base.append(time.monotonic() - t0)
                base_call.append(t1 - t0)
                sbx.kill()
                t0 = time.monotonic()
                sbx = self.create()
                sbx.commands.run(setup)
                sbx.commands.run(start, background=True)
                answered(sbx)
                manual.append(time.monotonic() - t0)
                sbx.kill()
        finally:
            import requests

            requests.delete(f"{self.srv.url}/templates/{name}", headers={"X-API-KEY": self.srv.key}, timeout=120)
        self.results["templates"] = {
            "build_uncached_s": build_first, "build_cached_s": build_cached, "cached_steps": cached_steps,
            "template_to_service": stats(tpl), "template_create_call": stats(tpl_call),
            "base_to_first_cmd": stats(base), "base_create_call": stats(base_call),
            "base_setup_start_to_service": stats(manual)}
        log(f"templates: template→service p50 {stats(tpl)['p50']:.2f}s, base→first cmd p50 "
            f"{stats(base)['p50']:.2f}s, base+setup+start→service p50 {stats(manual)['p50']:.2f}s")

    def bench_firecracker(self) -> None:
        """Firecracker snapshot load through our runtime vs the bare VMM (benchmarks/firecracker_bench.py)."""
        import firecracker_bench

        self.results["firecracker"] = asyncio.run(firecracker_bench.run(self.quick, BENCH_DIR / "fc", log=log))

    def bench_qemu(self) -> None:
        """The QEMU runtime's real Linux guest: boot, checkpoint, restore, fork, PSS per clone (benchmarks/qemu_bench.py)."""
        import qemu_bench

        self.results["qemu"] = asyncio.run(qemu_bench.run(self.quick, BENCH_DIR / "qemu", TEST_IMAGES, log=log))

    def bench_pool(self) -> None:
        import pool_bench
        pool_bench.bench_pool(self, log, stats)

    def bench_lifecycle(self) -> None:
        import pool_bench
        pool_bench.bench_lifecycle(self, log, stats)

    def ensure_server(self) -> None:
        if self.srv is None or self.srv.alive():
            return
        tail = self.srv.log_since(max(0, self.srv.log_mark() - 600)).strip().splitlines()[-3:]
        self.results.setdefault("server_restarts", []).append(
            {"at": time.strftime("%H:%M:%S"), "exit": self.srv.proc.poll() if self.srv.proc else None,
             "log_tail": tail})
        log(f"server not alive (log tail: {tail}); restarting")
        self.srv.stop()
        self.srv.log_path = self.srv.data_dir / f"bench-server-{len(self.results['server_restarts'])}.log"
        self.srv.start()


def _kill(sbx) -> None:
    try:
        sbx.kill()
    except Exception:  # noqa: BLE001
        pass


def _newest_memory_blob(data_dir: Path) -> int | None:
    """Size of the most recently written memory artifact (local store) — the snapshot's memory part."""
    best = None
    tops = [d for d in data_dir.iterdir() if d.is_dir() and d.name not in ("images", "sandboxes", "raw", "run")]
    for p in (f for d in tops for f in d.rglob("*")):
        if "memory" in p.parts and "cache" in p.parts and p.is_file():
            try:
                st = p.stat()
            except OSError:
                continue
            if best is None or st.st_mtime > best[0]:
                best = (st.st_mtime, st.st_size, p)
    return best[1] if best else None


# ---------------------------------------------------------------- report

def ms(x) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


def s_(x) -> str:
    return "–" if x is None else f"{x:.2f} s"


def mb(x) -> str:
    return "–" if x is None else f"{x / 1e6:.1f} MB"


def report(res: dict) -> str:
    L = []
    meta = res["meta"]
    hw = meta["hardware"]
    L += [f"## Results {meta['started']} ({'quick' if meta['quick'] else 'full'} run)", "",
          f"Host: {hw['nproc']} cores ({hw['cpu']}), {hw['mem_total']} RAM, kernel {hw['kernel']}, "
          f"{' / '.join(hw['runsc'])}, /var/tmp on {hw['disk_fs']}. "
          f"Load average at start {meta['load_start']}, at end {meta['load_end']} (shared, noisy machine). "
          f"Total {meta['duration_s']:.0f} s.", ""]
    c = res.get("create")
    if c:
        L += ["### 1. Create → first command", "",
              "| | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for label, k in [("**agentenv**: `Sandbox.create()` + `commands.run('true')`", "ours"),
                         ("  of which `Sandbox.create()`", "ours_create_call"),
                         ("  of which first `commands.run`", "ours_first_cmd"),
                         ("**raw, what a create stands for**, taken in turn with the agentenv samples: overlay + "
                          "slot + `runsc restore` of a warm envd image → `/health` → one `bash -l -c true` "
                          "through envd", "raw_envd_restore_to_first_cmd"),
                         ("**raw**: overlay + netns slot + `runsc run` + first TCP answer", "raw"),
                         ("  of which `runsc run --detach`", "raw_runsc_run"),
                         ("  of which overlay mount + netns slot", "raw_prepare"),
                         ("  of which run → process answers", "raw_to_answer"),
                         ("**raw, envd as process**: same, until envd `GET /health` answers", "raw_envd"),
                         ("  of which run → envd healthy", "raw_envd_to_healthy")]:
            st = c.get(k)
            if st is None:  # results from before this row existed
                continue
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['p95'])} | {ms(st['max'])} |")
        L.append("")
        pr = c.get("raw_envd_restore_to_first_cmd")
        if pr and pr.get("n"):
            L += [f"Create → first command against the raw step taken beside it: p50 "
                  f"{c['ours']['p50'] / pr['p50']:.2f}×, p95 {c['ours']['p95'] / pr['p95']:.2f}×; the median of "
                  f"the {c['paired_ratio']['n']} pairs' own ratios {c['paired_ratio']['p50']:.2f}× (goal ≤ 1.1×).", ""]
    idle = res.get("idle")
    if idle:
        L += [f"### 1b. An idle sandbox's host CPU ({idle['n']} of each, side by side, {idle['seconds']:.0f} s)", "",
              "| | n | p50 | max |", "|---|---|---|---|"]
        for label, k in [("**agentenv** sandbox (after one command)", "ours"),
                         ("**raw** container running envd (no memory limit: no OOM guard)", "raw_envd"),
                         ("**raw** bare container (a Python TCP server)", "raw_bare")]:
            st = idle[k]["cpu_ms_per_s"]
            L.append(f"| {label} | {st['n']} | {st['p50']:.1f} ms/s | {st['max']:.1f} ms/s |")
        L.append("")
        sweep = idle.get("slack_sweep")
        if sweep:
            L += ["The same agentenv sandboxes at each host timer slack in turn (`sandbox_timer_slack_us`; the "
                  "raw containers above run at the kernel's default 50 µs):", "",
                  "| timer slack | idle CPU p50 | max | a 1 ms `sleep` inside takes |", "|---|---|---|---|"]
            for us, r in sweep.items():
                st = r["cpu_ms_per_s"]
                L.append(f"| {int(us) / 1000:g} ms | {st['p50']:.1f} ms/s | {st['max']:.1f} ms/s | "
                         f"{r['sleep_1ms_takes_ms']:.2f} ms |")
            L.append("")
    import pool_bench
    L += pool_bench.report(res, ms)
    e = res.get("exec")
    if e:
        L += ["### 2. Command round trip", "", "| | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for label, k in [("**agentenv**: `commands.run('true')` (SDK → proxy → envd)", "ours"),
                         ("**raw**: `runsc exec <id> /bin/true` (same sandbox)", "raw_runsc_exec"),
                         ("**raw**: `runsc exec --user=<user> <id> /bin/bash -l -c true` (what the SDK has envd run)",
                          "raw_runsc_exec_shell")]:
            st = e.get(k)
            if st is None:  # results from before this row existed
                continue
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['p95'])} | {ms(st['max'])} |")
        L.append("")
    f = res.get("files")
    if f:
        L += ["### 3. File throughput (64 MiB of random bytes)", "",
              "| | n | p50 time | p50 MiB/s | max time |", "|---|---|---|---|---|"]
        for label, k in [("**agentenv** `files.write`", "sdk_write"), ("**agentenv** `files.read`", "sdk_read"),
                         ("**agentenv** `files.read(format=\"stream\")`", "sdk_read_stream"),
                         ("HTTP `POST /files` (octet-stream) through the proxy", "proxy_http_write"),
                         ("HTTP `GET /files` (identity) through the proxy", "proxy_http_read"),
                         ("HTTP `POST /files` straight to envd (slot address)", "envd_http_write"),
                         ("HTTP `GET /files` straight to envd (slot address)", "envd_http_read"),
                         ("host: `write_bytes` to /var/tmp (page cache, no fsync)", "host_write"),
                         ("host: `read_bytes` (page cache)", "host_read"),
                         ("in sandbox: `dd if=/dev/zero bs=1M count=64`", "sandbox_dd_write"),
                         ("in sandbox: `dd of=/dev/null bs=1M`", "sandbox_dd_read")]:
            st = f.get(k)
            if st is None:  # results from before this row existed
                continue
            r = f"{st['MiBps_p50']:.0f}" if st.get("MiBps_p50") else "–"
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {r} | {ms(st['max'])} |")
        L.append("")
        if f.get("host_file_sends") is not None:
            L += [f"Downloads the data plane sent from the sandbox's disk on the host "
                  f"(`agentenv_proxy_host_file_sends_total`): {f['host_file_sends']}; uploads it staged there "
                  f"(`agentenv_proxy_host_file_stages_total`): {f.get('host_file_stages')}.", ""]
    p = res.get("pause_resume")
    if p:
        L += ["### 4a. Pause / resume", "", "| | n | p50 | max |", "|---|---|---|---|"]
        for label, k in [("**agentenv** `sbx.pause()` (checkpoint; the container stops after the answer)", "ours_pause"),
                         ("**agentenv** `Sandbox.connect()` of a paused sandbox (restore), 1 s after the pause", "ours_connect"),
                         ("**agentenv** connect → first `commands.run` answered", "ours_connect_to_first_cmd"),
                         ("**agentenv** the same, right after the pause (waits for its stand-down)",
                          "ours_connect_right_after_pause_to_first_cmd"),
                         ("**raw** `runsc checkpoint` (bare container)", "raw_checkpoint"),
                         ("**raw** `runsc restore` → first TCP answer", "raw_restore_to_answer"),
                         ("**raw** `runsc checkpoint` (container running envd, as a sandbox)", "raw_envd_checkpoint"),
                         ("**raw** `runsc pause` + `runsc checkpoint --leave-running` (envd; the capture a pause makes)",
                          "raw_envd_frozen_checkpoint"),
                         ("**raw** `runsc restore` → envd's first `/health` answer", "raw_envd_restore_to_answer"),
                         ("**raw** the same → one `bash -l -c true` through envd answered",
                          "raw_envd_restore_to_first_cmd")]:
            st = p.get(k)
            if st:
                L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['max'])} |")
        L.append("")
        rf, rc, rz = (p.get(k) for k in ("raw_envd_restore_to_first_cmd", "raw_envd_checkpoint",
                                         "raw_envd_frozen_checkpoint"))
        if rf and rf.get("n") and rc and rc.get("n") and rz and rz.get("n"):
            L += [f"p50 ratios: pause {p['ours_pause']['p50'] / rc['p50']:.2f}× the raw `runsc checkpoint` (envd), "
                  f"{p['ours_pause']['p50'] / rz['p50']:.2f}× the raw capture a pause makes (goal ≤ 1.3×); resume → first command {p['ours_connect_to_first_cmd']['p50'] / rf['p50']:.2f}× "
                  "the raw restore → envd → one command (goal ≤ 1.2×).", ""]
    fk = res.get("fork")
    if fk:
        L += ["### 4b. Fork", "",
              "| children | agentenv: fork call | agentenv: every child answered `commands.run` | source paused "
              "(checkpoint / seal) | raw: N parallel `runsc restore` all answering (bare; envd + one command) | "
              "machine CPU, agentenv / raw (bare; envd) |",
              "|---|---|---|---|---|---|"]
        for n, o in fk["ours"].items():
            r = fk["raw_parallel_restore"].get(n, {})
            e = fk["raw_parallel_restore"].get(f"envd_{n}", {})
            L.append(f"| {n} ({o['ok']} ok) | {s_(o['fork_call'])} | {s_(o['all_answer'])} | "
                     f"{s_(o['source_paused'])} ({s_(o['source_checkpoint'])} / {s_(o['source_seal'])}) | "
                     f"{s_(r.get('all_answer'))}; {s_(e.get('all_answer'))} | "
                     f"{s_(o.get('machine_cpu_s'))} / {s_(r.get('machine_cpu_s'))}; {s_(e.get('machine_cpu_s'))} |")
        L += ["", f"Raw `runsc checkpoint` of the bare source: {s_(fk['raw_checkpoint'])}. Machine CPU: "
              "CPU seconds of the whole host (`/proc/stat`) from the fork call until every child answered "
              "(agentenv: the source's checkpoint, the children's restores, envd, the server, the SDK), "
              "and over the raw parallel restores.", ""]
        kids = fk["ours"].get("4", {}).get("child_pss_MiB") or []
        rkids = fk["raw_parallel_restore"].get("4", {}).get("child_pss_MiB") or []
        ekids = fk["raw_parallel_restore"].get("envd_4", {}).get("child_pss_MiB") or []
        L += ["Host memory (sum of PSS of runsc-sandbox, gofer and ptrace stub processes):", "",
              "| | PSS per sandbox |", "|---|---|",
              f"| agentenv idle sandbox (fresh create) | {', '.join(f'{x:.0f}' for x in fk['idle_sandbox_pss_MiB'])} MiB |",
              f"| agentenv idle fork child (of 4) | {', '.join(f'{x:.0f}' for x in kids)} MiB |",
              f"| raw restored bare container (of 4) | {', '.join(f'{x:.0f}' for x in rkids)} MiB |",
              f"| raw restored container running envd, after one command (of 4) | "
              f"{', '.join(f'{x:.0f}' for x in ekids)} MiB |", ""]
    sn = res.get("snapshot")
    if sn:
        L += ["### 4c. Snapshot size and time vs what changed", "",
              "| changed | `create_snapshot()` | source paused | checkpoint | seal | snapshot size | of which memory image |",
              "|---|---|---|---|---|---|---|"]
        for r in sn["ours"]:
            what = "nothing" if r["MiB"] == 0 else f"{r['MiB']} MiB {'held in memory' if r['kind'] == 'memory' else 'of files written'}"
            L.append(f"| {what} | {s_(r['snapshot_call'])} | {s_(r['source_paused'])} | {s_(r['checkpoint'])} | "
                     f"{s_(r['seal'])} | {mb(r['size_bytes'])} | {mb(r['memory_image_bytes'])} |")
        L += ["", "Raw baseline: `runsc checkpoint` of a bare container holding N MiB of random bytes:", "",
              "| memory held | checkpoint | image size |", "|---|---|---|"]
        for r in sn["raw_checkpoint_memory"]:
            L.append(f"| {r['MiB']} MiB | {s_(r['checkpoint'])} | {mb(r['size_bytes'])} |")
        L.append("")
    px = res.get("proxy")
    if px:
        L += ["### 5. Data-plane proxy (wrk, GET of 23 bytes, keep-alive; medians of 3 interleaved rounds)", ""]
        if px.get("versions"):
            L += ["Versions: " + "; ".join(f"{k}: {v}" for k, v in px["versions"].items()), ""]
        L += ["| connections | path | requests/s | p50 | p99 | proxy CPU per request | non-2xx / socket errors |",
              "|---|---|---|---|---|---|---|"]
        plane = "HAProxy data plane" if px.get("data_plane") == "haproxy" else "Python proxy"
        labels = {"direct": "direct to the sandbox (slot address)", "agentenv": f"**agentenv** ({plane}, header routing)",
                  "nginx": "nginx reverse proxy (1 worker, upstream keep-alive)",
                  "haproxy-bare": "bare HAProxy (same binary, one fixed server, no rules)",
                  "nginx-lua": "nginx routing by Lua (shared dict of 10,000 routes, Lua balancer, keep-alive)"}
        for conns, runs in px["runs"].items():
            for name, r in runs.items():
                cpu = r.get("proxy_cpu_ms_per_request")
                L.append(f"| {conns} | {labels[name]} | {r['rps']:.0f} | {r['p50'] * 1000:.2f} ms | "
                         f"{r['p99'] * 1000:.2f} ms | {'–' if cpu is None else f'{cpu:.3f} ms'} | "
                         f"{r['non_2xx']} / {r['socket_errors']} |")
        L.append("")
        for conns, runs in px["runs"].items():
            d, a, n = runs.get("direct"), runs.get("agentenv"), runs.get("nginx")
            if d and a and n:
                L.append(f"- {conns} connection(s): agentenv = {a['rps'] / d['rps']:.2f}x direct, "
                         f"{a['rps'] / n['rps']:.2f}x nginx; p50 direct + {(a['p50'] - d['p50']) * 1000:.2f} ms")
            b = runs.get("haproxy-bare")
            if a and b and n and a.get("proxy_cpu_ms_per_request") and b.get("proxy_cpu_ms_per_request") \
                    and n.get("proxy_cpu_ms_per_request"):
                L.append(f"  - proxy CPU per request: agentenv {a['proxy_cpu_ms_per_request'] * 1000:.0f} µs, "
                         f"bare HAProxy {b['proxy_cpu_ms_per_request'] * 1000:.0f} µs, "
                         f"nginx {n['proxy_cpu_ms_per_request'] * 1000:.0f} µs; bare HAProxy = "
                         f"{b['rps'] / d['rps']:.2f}x direct, {b['rps'] / n['rps']:.2f}x nginx")
            lu = runs.get("nginx-lua")
            if a and lu and n and d and lu.get("proxy_cpu_ms_per_request"):
                L.append(f"  - nginx routing by Lua: {lu['rps'] / d['rps']:.2f}x direct, {lu['rps'] / n['rps']:.2f}x "
                         f"nginx, {lu['proxy_cpu_ms_per_request'] * 1000:.0f} µs CPU per request; agentenv = "
                         f"{a['rps'] / lu['rps']:.2f}x it")
        rt = px.get("routes")
        if rt:
            su = rt["single_update"]
            L += ["", f"Route updates at {rt['routes']:,} routes (HAProxy runtime API, no reload): initial load "
                  f"{rt['initial_load_s'] * 1000:.0f} ms ({rt['initial_load_per_s']:,.0f} routes/s); one update "
                  f"alone p50 {su['p50'] * 1000:.2f} ms, p95 {su['p95'] * 1000:.2f} ms (n={su['n']}); "
                  f"1,000 creates + 1,000 kills together {rt['burst_2000_s'] * 1000:.0f} ms "
                  f"({rt['burst_per_s']:,.0f} routes/s)."]
        L.append("")
    cl = res.get("cluster")
    if cl:
        L += ["### 7. Cluster: scheduling overhead per create", "",
              "| `Sandbox.create()` | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for label, k in [("through the gateway (auth in PostgreSQL, placement, node RPC)", "gateway_create"),
                         ("directly to the node's own API", "direct_create"),
                         ("`get_info()` through the gateway", "gateway_info"),
                         ("`get_info()` directly to the node", "direct_info")]:
            st = cl[k]
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['p95'])} | {ms(st['max'])} |")
        L += ["", f"Overhead of the gateway + scheduler at p50: {ms(cl['overhead_p50'])}.", ""]
        lag = cl.get("gateway_route_lag") or {}
        if lag.get("add") and lag.get("remove"):
            L += [f"A sandbox created or killed straight on the node (its lifecycle event is all the gateway "
                  f"hears): on the gateway's HAProxy routes after p50 {ms(lag['add']['p50'])} (max "
                  f"{ms(lag['add']['max'])}), off them after a kill p50 {ms(lag['remove']['p50'])} (max "
                  f"{ms(lag['remove']['max'])}), n = {lag['add']['n']}; not within 15 s: {lag['missed']}.", ""]
        tr = cl.get("traffic")
        if tr:
            L += [f"Sandbox traffic on the node (`wrk`, 23-byte answers; node data plane: {tr['node_data_plane']}, "
                  f"gateway data plane: {tr.get('gateway_data_plane', 'python')}):", "",
                  "| connections | path | requests/s | p50 | vs direct |", "|---|---|---|---|---|"]
            for conns, runs in tr["runs"].items():
                for name, label in (("direct", "directly to the sandbox (raw)"), ("node", "the node's listener"),
                                    ("gateway", "through the gateway"),
                                    ("gateway_https", "through the gateway's HTTPS listener")):
                    r = runs.get(name)
                    if r:
                        ratio = f"{r['rps'] / runs['direct']['rps']:.2f}x" if runs.get("direct") else "–"
                        L.append(f"| {conns} | {label} | {r['rps']:,.0f} | {r['p50'] * 1000:.2f} ms | {ratio} |")
            L.append("")
    if res.get("errors"):
        L += ["### Errors", ""] + [f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in res["errors"].items()] + [""]
    mt = res.get("metrics")
    if mt:
        def ms1(x) -> str:  # sub-millisecond resolution for this table (a local `ms` would shadow the module one)
            return "–" if x is None else f"{x * 1000:.1f} ms"

        L += ["### 6. Scraping cost (observability)", "",
              "| sandboxes | `GET /metrics` p50 / p95 (bytes) | server render p50 | server CPU per scrape | "
              "`GET /sandboxes/metrics` p50 / p95 (bytes) | its CPU per call | one sandbox's series p50 | "
              "sampler pass p50 / max | server CPU when idle |", "|---|---|---|---|---|---|---|---|---|"]
        for k in ("empty", "full"):
            r = mt.get(k)
            if not r:
                continue
            one = r["one_sandbox_series"]
            L.append(f"| {r['sandboxes']} | {ms1(r['metrics']['p50'])} / {ms1(r['metrics']['p95'])} "
                     f"({r['metrics']['bytes']}) | {ms1(r['metrics_render']['p50'])} | "
                     f"{ms1(r.get('metrics_cpu_per_scrape'))} | "
                     f"{ms1(r['all_sandbox_metrics']['p50'])} / {ms1(r['all_sandbox_metrics']['p95'])} "
                     f"({r['all_sandbox_metrics']['bytes']}) | {ms1(r.get('all_sandbox_metrics_cpu_per_scrape'))} | "
                     f"{ms1(one['p50']) if one else '–'} | "
                     f"{ms1(r['sampler_pass']['p50'])} / {ms1(r['sampler_pass']['max'])} | "
                     f"{r['server_cpu_idle_cores']:.3f} cores |")
        L.append("")
    tp = res.get("templates")
    if tp:
        L += ["### 7. Templates: create from a template vs from the base image", "",
              f"Build of the benchmark template (base + 1 RUN writing a 64 MiB dataset + start command): "
              f"{s_(tp['build_uncached_s'])} uncached, {s_(tp['build_cached_s'])} rebuilt with "
              f"{tp['cached_steps']} step(s) from the cache.", "",
              "| | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for label, k in [("**template**: `Sandbox.create(tpl)` → service answers (restore, already running)",
                          "template_to_service"),
                         ("  of which `Sandbox.create(tpl)`", "template_create_call"),
                         ("**base image**: `Sandbox.create()` → first command (no service)", "base_to_first_cmd"),
                         ("  of which `Sandbox.create()`", "base_create_call"),
                         ("**base image + same setup + start** → service answers", "base_setup_start_to_service")]:
            st = tp[k]
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['p95'])} | {ms(st['max'])} |")
        L.append("")
    if "firecracker" in res:
        import firecracker_bench

        L += firecracker_bench.report(res["firecracker"])
    if "qemu" in res:
        import qemu_bench

        L += qemu_bench.report(res["qemu"])
    return "\n".join(L)


# ---------------------------------------------------------------- cluster: scheduling overhead

def cluster_bench(quick: bool) -> dict:
    """Create latency through the gateway (auth + placement + node RPC) vs straight to the node's own API.

    One node (root network namespace, loopback), a scheduler, a gateway and a real PostgreSQL
    (initdb'd into a temp dir, as the cluster tests do). Creates alternate between the two paths
    in one run, so both see the same machine load.
    """
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "tests" / "cluster"))
    from pgserver import start_postgres  # noqa: E402
    import requests
    import urllib3
    from e2b import Sandbox

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the gateway's local CA, health only

    n = 8 if quick else 20
    data = BENCH_DIR.parent / (BENCH_DIR.name + "-cluster-node")
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "images").exists() and TEST_IMAGES.is_dir():
        subprocess.run(["cp", "-al", str(TEST_IMAGES), str(data / "images")], check=True)
    pg = start_postgres()
    procs: list[subprocess.Popen] = []
    key, token = "e2b_" + secrets.token_hex(20), secrets.token_hex(16)
    common = dict(os.environ, AGENTENV_DATABASE_URL=pg.url(), AGENTENV_CLUSTER_TOKEN=token,
                  AGENTENV_HOST="127.0.0.1", AGENTENV_HEARTBEAT_INTERVAL_S="1")
    ports = {r: free_port() for r in ("node", "scheduler", "gateway", "gateway_https")}
    urls = {r: f"http{'s' if r == 'gateway_https' else ''}://127.0.0.1:{p}" for r, p in ports.items()}
    out: dict = {"n": n}
    try:
        envs = {
            "scheduler": dict(common, AGENTENV_PORT=str(ports["scheduler"])),
            # its HTTPS listener too (a local CA under its data dir; wrk routes by header, no DNS)
            "gateway": dict(common, AGENTENV_PORT=str(ports["gateway"]), AGENTENV_SCHEDULER_URL=urls["scheduler"],
                            AGENTENV_BOOTSTRAP_API_KEY=key, AGENTENV_DATA_DIR=str(data / "gateway"),
                            AGENTENV_DOMAIN="bench.test", AGENTENV_HTTPS_BIND=f"127.0.0.1:{ports['gateway_https']}"),
            "node": dict(common, AGENTENV_PORT=str(ports["node"]), AGENTENV_DATA_DIR=str(data),
                         AGENTENV_NODE_ID="bench", AGENTENV_NODE_URL=urls["node"]),
        }
        for role in ("scheduler", "gateway", "node"):
            with open(data / f"{role}.log", "wb") as f:
                procs.append(subprocess.Popen([AGENTENV, role], env=envs[role], stdin=subprocess.DEVNULL, stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 600
        while True:
            try:
                nodes = requests.get(f"{urls['scheduler']}/internal/nodes", timeout=3,
                                     headers={"X-Agentenv-Cluster-Token": token}).json()
                if nodes and all(requests.get(f"{u}/health", timeout=3, verify=False).ok for u in urls.values()):
                    break
            except Exception:  # noqa: BLE001
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"cluster did not come up; see {data}/*.log")
            time.sleep(0.5)
        time.sleep(8)  # the node's warm image
        timings: dict[str, list[float]] = {"gateway": [], "direct": [], "gateway_info": [], "direct_info": []}
        # A sandbox created or killed straight on the node: how long until the gateway's HAProxy routes
        # it (or no longer does). Nothing went through the gateway, so only the node's lifecycle event
        # (the gateway's /events tail) or its reconcile with PostgreSQL can tell it.
        lag: dict[str, list[float]] = {"add": [], "remove": [], "missed": []}
        gw_dir, gw_port = data / "gateway", urls["gateway"].rsplit(":", 1)[1]
        for i in range(2 * n + 2):
            path = "gateway" if i % 2 == 0 else "direct"
            url = urls["gateway" if path == "gateway" else "node"]
            t0 = time.perf_counter()
            sbx = Sandbox.create(api_key=key, api_url=url, sandbox_url=url, timeout=120)
            dt = time.perf_counter() - t0
            if path == "direct" and i >= 2:
                lag_of(lag, "add", sbx.sandbox_id, wait_route(gw_dir, gw_port, sbx.sandbox_id, True))
            infos = []
            for _ in range(5):  # a cheap control call: the fixed cost of the extra hop
                t1 = time.perf_counter()
                sbx.get_info()
                infos.append(time.perf_counter() - t1)
            sbx.kill()
            if path == "direct" and i >= 2:
                lag_of(lag, "remove", sbx.sandbox_id, wait_route(gw_dir, gw_port, sbx.sandbox_id, False))
            if i >= 2:  # the first of each path warms connections and caches
                timings[path].append(dt)
                timings[f"{path}_info"] += infos
        out["gateway_route_lag"] = {"add": stats(lag["add"]) if lag["add"] else None,
                                    "remove": stats(lag["remove"]) if lag["remove"] else None,
                                    "missed": len(lag["missed"])}
        if lag["add"] and lag["remove"]:
            log(f"cluster: a sandbox created on the node is on the gateway's fast path after p50 "
                f"{statistics.median(lag['add']) * 1000:.0f} ms (max {max(lag['add']) * 1000:.0f}), "
                f"off it after a kill p50 {statistics.median(lag['remove']) * 1000:.0f} ms "
                f"(max {max(lag['remove']) * 1000:.0f}); missed within 15 s: {len(lag['missed'])}")
        out["gateway_create"] = stats(timings["gateway"])
        out["direct_create"] = stats(timings["direct"])
        out["overhead_p50"] = out["gateway_create"]["p50"] - out["direct_create"]["p50"]
        out["gateway_info"] = stats(timings["gateway_info"])
        out["direct_info"] = stats(timings["direct_info"])
        log(f"cluster: create p50 via gateway {out['gateway_create']['p50']*1000:.0f} ms, direct "
            f"{out['direct_create']['p50']*1000:.0f} ms")
        if shutil.which("wrk"):
            out["traffic"] = cluster_traffic(key, urls, quick)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        pg.stop()
        env = dict(os.environ, AGENTENV_DATA_DIR=str(data))
        subprocess.run([AGENTENV, "gc"], env=env, capture_output=True, timeout=180, stdin=subprocess.DEVNULL)
    return out


def cluster_traffic(key: str, urls: dict[str, str], quick: bool) -> dict:
    """wrk to one in-sandbox server (the proxy benchmark's) on a cluster node: through the node's
    own listener (its data plane: HAProxy when installed) and through the gateway (the gateway's
    data plane, HAProxy when installed, then the node's listener), taking turns, medians of the rounds."""
    import requests
    from e2b import Sandbox

    sbx = Sandbox.create(api_key=key, api_url=urls["gateway"], sandbox_url=urls["gateway"], timeout=300)
    try:
        sbx.files.write("/tmp/bench_app.py", PROXY_APP)
        sbx.commands.run("setsid nohup python3 /tmp/bench_app.py >/tmp/bench_app.log 2>&1 </dev/null &")
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(PROXY_APP_PORT)}
        deadline = time.monotonic() + 60
        while requests.get(f"{urls['node']}/", headers=route, timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark app in the sandbox did not answer")
            time.sleep(0.2)
        node_dir = BENCH_DIR.parent / (BENCH_DIR.name + "-cluster-node")
        node_log = (node_dir / "node.log").read_text(errors="replace")
        gateway_log = (node_dir / "gateway.log").read_text(errors="replace")
        out: dict = {"node_data_plane": "haproxy" if "data plane: haproxy" in node_log else "python",
                     "gateway_data_plane": "haproxy" if "data plane: haproxy" in gateway_log else "python", "runs": {}}
        served0 = haproxy_user_answers(node_dir)
        gw_port = urls["gateway"].rsplit(":", 1)[1]
        hop0 = gateway_hop_answers(node_dir / "gateway", gw_port)
        # the raw step: the same server at the sandbox's slot address (the node's netns for it, host0)
        ns = [n for n in sh(["ip", "netns", "list"]).stdout.split() if n.endswith(f"-{sbx.sandbox_id}")]
        addr = sh(["ip", "-n", ns[0], "-4", "-o", "addr", "show", "host0"]).stdout.split("inet ")[1].split("/")[0]
        urls = {**urls, "direct": f"http://{addr}:{PROXY_APP_PORT}"}
        seconds = 2 if quick else 4
        # a fresh in-sandbox server answers at a third of its speed for its first seconds (gVisor
        # warming up); the rounds below start after that
        wrk(f"{urls['node']}/", connections=32, seconds=5, headers=route)
        for conns in (1, 32):
            rounds: dict[str, list[dict]] = {"direct": [], "node": [], "gateway": [], "gateway_https": []}
            for name in rounds:  # warm-up (connection pools)
                wrk(f"{urls[name]}/", connections=conns, seconds=1, headers=route)
            for _ in range(3):
                for name in rounds:
                    rounds[name].append(wrk(f"{urls[name]}/", connections=conns, seconds=seconds, headers=route))
            for name, rs in rounds.items():
                r = {"rps": statistics.median(x["rps"] or 0 for x in rs), "p50": statistics.median(x["p50"] for x in rs),
                     "non_2xx": sum(x["non_2xx"] for x in rs), "socket_errors": sum(x["socket_errors"] for x in rs)}
                out["runs"].setdefault(str(conns), {})[name] = r
                log(f"cluster traffic: {name:13s} c={conns:2d}: {r['rps']:.0f} req/s, p50 {r['p50'] * 1000:.2f} ms, "
                    f"non-2xx {r['non_2xx']}, socket errors {r['socket_errors']}")
        # whether the node's HAProxy served the requests itself (its user-port backend's answers)
        out["haproxy_answers"] = haproxy_user_answers(node_dir) - served0 if served0 is not None else None
        log(f"cluster traffic: the node's HAProxy answered {out['haproxy_answers']} requests itself")
        hop = gateway_hop_answers(node_dir / "gateway", gw_port)
        out["gateway_hop_answers"] = hop - hop0 if hop is not None and hop0 is not None else None
        log(f"cluster traffic: the gateway's HAProxy relayed {out['gateway_hop_answers']} requests itself")
        return out
    finally:
        sbx.kill()


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (≲ 5 min)")
    ap.add_argument("--only", default="",
                    help="comma list of: create,idle,exec,files,pause,fork,snapshot,firecracker,qemu,proxy,metrics,cluster,templates,"
                         "pool,lifecycle")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (runsc, netns, mounts)", file=sys.stderr)
        return 2
    only = {x.strip() for x in args.only.split(",") if x.strip()}

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM (`timeout`, a CI runner) as Ctrl-C: the cleanup below still runs and the partial results
    # are written.
    signal.signal(signal.SIGTERM, interrupted)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t_start = time.monotonic()
    res: dict = {"meta": {"started": started, "quick": args.quick, "load_start": loadavg(),
                          "hardware": hardware(), "only": sorted(only)}}
    srv = BenchServer(BENCH_DIR)
    raw = None
    rc = 0
    try:
        steps = only - {"cluster"}
        if not only or steps:
            if steps and steps <= SERVERLESS_STEPS:
                b = Bench(args.quick, None, None)
            else:
                srv.prepare()
                srv.start()
                if not (steps and steps <= SERVERLESS_STEPS | RAWLESS_STEPS):
                    raw = Raw(BENCH_DIR)
                    raw.run(raw.setup())
                b = Bench(args.quick, srv, raw)
            b.run_all(steps)
            res.update(b.results)
        if not only or "cluster" in only:
            res["cluster"] = cluster_bench(args.quick)
    except (Exception, KeyboardInterrupt):  # noqa: BLE001
        res.setdefault("errors", {})["main"] = traceback.format_exc()
        log(traceback.format_exc())
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup is not cut short by a second one
        if raw is not None:
            try:
                raw.run(raw.close())
            except Exception as e:  # noqa: BLE001
                log(f"raw cleanup: {e}")
        if srv.proc is not None:
            srv.stop()
        res["meta"]["gc"] = srv.gc()
        left = sh(["sh", "-c", f"grep -c ' {BENCH_DIR}' /proc/self/mountinfo; "
                   f"runsc --root={BENCH_DIR}/run/runsc list -quiet 2>/dev/null | wc -l; "
                   f"runsc --root={BENCH_DIR}/raw/run/runsc list -quiet 2>/dev/null | wc -l"]).stdout.split()
        res["meta"]["leftover_mounts_containers"] = left
        log(f"cleanup: gc={res['meta']['gc']!r}; leftover mounts/containers/raw containers: {left}")
    res["meta"]["load_end"] = loadavg()
    res["meta"]["duration_s"] = time.monotonic() - t_start
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = started.replace(":", "").replace("-", "") + ("-quick" if args.quick else "")
    js = json.dumps(res, indent=1, default=str)
    md = report(res)
    for name in (f"{tag}.json", "latest.json"):
        (RESULTS / name).write_text(js)
    for name in (f"{tag}.md", "latest.md"):
        (RESULTS / name).write_text(md + "\n")
    print(md)
    log(f"wrote {RESULTS / (tag + '.json')} and .md")
    return rc or (1 if res.get("errors") else 0)


if __name__ == "__main__":
    sys.exit(main())
