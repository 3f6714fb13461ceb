"""HAProxy as the data plane, supervised and configured live by the server (docs/proxy.md).

`DataPlane` writes the configuration (`haproxy_conf`), starts `haproxy` (through agentenv.proc),
restarts it when it exits, and stops it with the server. `RouteTable` keeps HAProxy's two maps
(sandbox id -> slot address, sandbox id -> traffic token) equal to the orchestrator's running
sandboxes through the runtime API socket: lifecycle events mark sandboxes dirty, a background task
applies the difference in batches (one connection, `;`-separated commands), and a periodic full
reconcile repairs anything an event did not say. No reload ever happens for a route change.

Before a sandbox is paused, forked, snapshotted or killed (`Orchestrator.on_before_stop`) its routes
are removed first (new requests then reach the Python proxy, which waits and wakes), and after the
Python proxy closed its own connections, HAProxy's into it are reset (`network/sockdiag.py`, what `ss -K` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from agentenv.errors import RuntimeFailure
from agentenv.network import sockdiag
from agentenv.proc import CommandError, run_cmd, run_streamed
from agentenv.proxy.haproxy_conf import SANDBOX_BACKENDS, ClusterListener, HaproxyLayout, NodeHop, render

log = logging.getLogger(__name__)

# Commands per runtime-API line stay under HAProxy's 16 KiB CLI buffer.
_LINE_BYTES = 8000
_RECONCILE_S = 5.0
RESTART_DELAY_S = (0.5, 1.0, 2.0, 5.0)
_FOLLOW_S = 1.0          # an external HAProxy: how often its instance is checked
_EXTERNAL_WAIT_S = 120.0  # ... and how long a starting server waits for it
# What may go into a runtime-API command: ids, tokens (token_urlsafe) and addresses never need more.
_SAFE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def _safe(*values: str) -> bool:
    return all(_SAFE.match(v) for v in values)


class RouteSource(Protocol):
    """What the route table reads: every running sandbox with its slot address (a full reconcile),
    and one sandbox's route or None (an update after an event: O(1), however many sandboxes run).
    A route has `sandbox_id`, `host_ip` (the routes map's value: the slot address, or on a cluster
    gateway the node id) and `traffic_access_token` (None for a public sandbox, and on a gateway)."""

    def running_routes(self) -> Iterable[Any]: ...

    def route_for(self, sandbox_id: str) -> Any | None: ...


def haproxy_binary(path: str = "haproxy") -> str | None:
    return shutil.which(path)


SOCK_DIR_PREFIX = "agentenv-dp-"
SOCK_DIR_OWNER = "owner"  # in a socket dir: the data plane dir (under a data dir) it serves


def sock_dir_for(data_dir: Path) -> Path:
    """A short directory for the unix sockets (sun_path holds 107 bytes; data dirs can be long)."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"{SOCK_DIR_PREFIX}{digest}"


def make_sock_dir(layout: HaproxyLayout) -> None:
    """Create the socket dir and name its owner in it, so a dir left by a killed server can be told
    from a live one once its data dir is gone (`sweep_orphan_sock_dirs`)."""
    layout.sock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = layout.sock_dir / SOCK_DIR_OWNER
    if not owner.exists():
        owner.write_text(str(layout.dir.resolve()))


def release_sock_dir(layout: HaproxyLayout, *, ours: Path, theirs: Path) -> None:
    """One side of a shared socket dir is done (HAProxy as its own component and the role it serves):
    its socket goes, and the dir with it once the other side's socket does not answer either."""
    if answers(theirs):
        with contextlib.suppress(FileNotFoundError):
            ours.unlink()
    else:
        shutil.rmtree(layout.sock_dir, ignore_errors=True)


def answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket `path`: a process of another PID
    namespace too, which /proc does not show (HAProxy as its own component)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def sweep_orphan_sock_dirs(tmp: Path | None = None) -> list[str]:
    """Remove the socket dirs in the temp dir whose data dir no longer exists and whose HAProxy is
    not running: what a server killed with SIGKILL leaves when its data dir is deleted afterwards
    (a test's, a CI job's). A dir without an owner file (older versions) is left alone."""
    removed = []
    for d in (tmp or Path(tempfile.gettempdir())).glob(f"{SOCK_DIR_PREFIX}*"):
        try:
            owner = Path((d / SOCK_DIR_OWNER).read_text().strip())
        except (OSError, UnicodeDecodeError):
            continue
        left = HaproxyLayout(owner, d)
        if not owner.is_absolute() or owner.exists() or processes_running(left.config) \
                or answers(left.admin_socket):  # (a HAProxy in another PID namespace answers there)
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


class RuntimeApi:
    """HAProxy's runtime API (the `stats socket`): batches of commands, one connection per line."""

    def __init__(self, socket_path: Path) -> None:
        self._path = socket_path

    async def run(self, commands: list[str]) -> list[str]:
        """Run the commands in order; returns the non-empty outputs (errors, `show` results)."""
        outputs: list[str] = []
        line: list[str] = []
        size = 0
        for cmd in commands:
            if line and size + len(cmd) + 1 > _LINE_BYTES:
                outputs += await self._line(line)
                line, size = [], 0
            line.append(cmd)
            size += len(cmd) + 1
        if line:
            outputs += await self._line(line)
        return outputs

    async def _line(self, commands: list[str]) -> list[str]:
        return await self.send(";".join(commands) + "\n")

    async def send(self, text: str) -> list[str]:
        """One request as it is (e.g. a command with a `<<` payload), on a connection of its own."""
        reader, writer = await asyncio.open_unix_connection(str(self._path))
        try:
            writer.write(text.encode())
            await writer.drain()
            out = await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        return [chunk for chunk in out.decode(errors="replace").split("\n\n") if chunk.strip()]


class RouteTable:
    """HAProxy's maps kept equal to the running sandboxes (ids and tokens are [a-zA-Z0-9_-])."""

    def __init__(self, source: RouteSource, api: RuntimeApi, layout: HaproxyLayout) -> None:
        self._source = source
        self._api = api
        self._layout = layout
        self.routes: dict[str, str] = {}   # what HAProxy has: sandbox id -> ip
        self.tokens: dict[str, str] = {}   # sandbox id -> traffic token
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._held: set[str] = set()       # quiescing: kept out of the maps until an event says otherwise
        self._lock = asyncio.Lock()        # one change at a time: HAProxy applies them in our order
        self.updates = 0

    def desired(self) -> tuple[dict[str, str], dict[str, str]]:
        routes: dict[str, str] = {}
        tokens: dict[str, str] = {}
        for r in self._source.running_routes():
            if r.host_ip and r.sandbox_id not in self._held and _safe(r.sandbox_id, r.host_ip,
                                                                      r.traffic_access_token or "x"):
                routes[r.sandbox_id] = r.host_ip
                if r.traffic_access_token:
                    tokens[r.sandbox_id] = r.traffic_access_token
        return routes, tokens

    def write_files(self) -> None:
        """The maps HAProxy loads when it (re)starts: the current state."""
        self.routes, self.tokens = self.desired()
        _write_map(self._layout.routes_map, self.routes)
        _write_map(self._layout.tokens_map, self.tokens)

    def mark(self, *sandbox_ids: str | None) -> None:
        for sid in sandbox_ids:
            if sid:
                self._held.discard(sid)
                self._dirty.add(sid)
        self._wake.set()

    async def hold(self, sandbox_id: str) -> None:
        """Take a sandbox out of the fast path now (it is about to stop); events bring it back."""
        self._held.add(sandbox_id)
        async with self._lock:
            await self._hold(sandbox_id)

    async def _hold(self, sandbox_id: str) -> None:
        cmds = []
        if sandbox_id in self.tokens:  # token first: never a window with the route but no token
            cmds.append(f"del map {self._layout.routes_map} {sandbox_id}")
            cmds.append(f"del map {self._layout.tokens_map} {sandbox_id}")
        elif sandbox_id in self.routes:
            cmds.append(f"del map {self._layout.routes_map} {sandbox_id}")
        self.routes.pop(sandbox_id, None)
        self.tokens.pop(sandbox_id, None)
        if cmds:
            await self._apply(cmds)

    async def resend(self) -> int:
        """A HAProxy that loaded its maps from the files: empty them and add every route again (the
        files were written when the server started; the routes went on changing)."""
        async with self._lock:
            await self._apply([f"clear map {self._layout.tokens_map}", f"clear map {self._layout.routes_map}"])
            self.routes, self.tokens = {}, {}
            return await self._sync(None)

    async def sync(self, only: set[str] | None = None) -> int:
        """Apply the difference between HAProxy's maps and the running sandboxes (all, or `only`)."""
        async with self._lock:
            return await self._sync(only)

    def _desired_for(self, ids: set[str]) -> tuple[dict[str, str], dict[str, str]]:
        routes: dict[str, str] = {}
        tokens: dict[str, str] = {}
        for sid in ids:
            r = None if sid in self._held else self._source.route_for(sid)
            if r is not None and r.host_ip and _safe(sid, r.host_ip, r.traffic_access_token or "x"):
                routes[sid] = r.host_ip
                if r.traffic_access_token:
                    tokens[sid] = r.traffic_access_token
        return routes, tokens

    async def _sync(self, only: set[str] | None) -> int:
        if only is not None:
            routes, tokens = self._desired_for(only)
            ids = only
        else:
            routes, tokens = self.desired()
            ids = set(routes) | set(self.routes) | set(tokens) | set(self.tokens)
        rmap, tmap = self._layout.routes_map, self._layout.tokens_map
        first: list[str] = []   # tokens before routes when adding, routes before tokens when removing
        second: list[str] = []
        for sid in ids:
            ip, have_ip = routes.get(sid), self.routes.get(sid)
            tok, have_tok = tokens.get(sid), self.tokens.get(sid)
            if tok != have_tok and tok is not None:
                first.append(f"{'set' if have_tok else 'add'} map {tmap} {sid} {tok}")
                self.tokens[sid] = tok
            if ip != have_ip:
                if ip is None:
                    first.append(f"del map {rmap} {sid}")
                    self.routes.pop(sid, None)
                else:
                    second.append(f"{'set' if have_ip else 'add'} map {rmap} {sid} {ip}")
                    self.routes[sid] = ip
            if tok is None and have_tok is not None:
                second.append(f"del map {tmap} {sid}")
                self.tokens.pop(sid, None)
        cmds = first + second
        if cmds:
            await self._apply(cmds)
        return len(cmds)

    async def _apply(self, cmds: list[str]) -> None:
        errors = [o for o in await self._api.run(cmds) if o.strip()]
        self.updates += len(cmds)
        if errors:
            log.warning("haproxy runtime API: %s", "; ".join(e.strip() for e in errors[:3]))

    async def run(self) -> None:
        """Apply marked changes as they come, and reconcile everything every couple of seconds."""
        while True:
            try:
                async with asyncio.timeout(_RECONCILE_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            try:
                await self.sync(dirty if dirty else None)
            except (OSError, asyncio.TimeoutError) as e:
                log.debug("route sync deferred (haproxy not reachable: %s)", e)
                self._dirty |= dirty
                await asyncio.sleep(0.2)


async def backend_stats(api: RuntimeApi, backends=SANDBOX_BACKENDS) -> dict[str, dict[str, int]]:
    """Counters of `backends` (default: the sandbox backends; a gateway's is `node_hop`) from
    `show stat`: responses by class, bytes in and out."""
    out = await api.run(["show stat"])
    lines = "\n".join(out).splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    stats: dict[str, dict[str, int]] = {}
    for line in lines[1:]:
        row = dict(zip(cols, line.split(",")))
        if row.get("svname") == "BACKEND" and row.get("pxname") in backends:
            stats[row["pxname"]] = {k: int(row.get(k) or 0) for k in (
                "hrsp_1xx", "hrsp_2xx", "hrsp_3xx", "hrsp_4xx", "hrsp_5xx", "bin", "bout")}
    return stats


def processes_running(config: Path) -> list[int]:
    """The HAProxy processes (a master and its workers, or one process) running `config`, found by
    their command line (HAProxy in the foreground writes no pid file)."""
    want = os.fsencode(config)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"haproxy") and want in argv:
            found.append(int(entry.name))
    return found


def _is_haproxy(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"haproxy")
    except OSError:
        return False


def _write_map(path: Path, entries: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
    os.chmod(tmp, 0o600)
    tmp.replace(path)


class DataPlane:
    """The supervised HAProxy process and its live routes.

    `external`: HAProxy is its own component (`agentenv data-plane`, `proxy/component.py`, e.g. a
    sidecar container) that runs what this server writes. The server then writes the configuration
    and maps as always, waits for the runtime API, and follows the instance behind it: a restarted
    or reloaded HAProxy (a new worker pid) gets every route again. It never starts or stops it."""

    def __init__(self, binary: str, layout: HaproxyLayout, source: RouteSource, *, http_bind: str | None,
                 https_bind: str | None = None, cert: Path | None = None, threads: int | None = None,
                 cluster: ClusterListener | None = None, hop: NodeHop | None = None,
                 external: bool = False, host_reads: bool = False) -> None:
        """`host_reads`: downloads (`GET /files`) and large uploads go through the server, which moves
        large files between the client and the sandbox's disk on the host (`hostfiles`)."""
        self.binary = binary
        self.external = external
        self._instance: str | None = None  # external: the worker behind the runtime API (`_worker`)
        self.layout = layout
        self.api = RuntimeApi(layout.admin_socket)
        self.routes = RouteTable(source, self.api, layout)
        self._http_bind = http_bind
        self._https_bind = https_bind
        self._cert = cert
        self._cluster = cluster
        self._hop = hop
        self._host_reads = host_reads
        self._threads = threads or max(1, min((os.cpu_count() or 1) // 2, 4))
        self._supervisor: asyncio.Task[None] | None = None
        self._sync: asyncio.Task[None] | None = None
        self.restarts = 0
        self._pid: int | None = None

    def pid(self) -> int | None:
        """The HAProxy process running our configuration, if any (HAProxy in the foreground writes
        no pid file; the process is found by its command line). External: its worker, when this
        process can see it (a shared PID namespace)."""
        if self.external:
            pid = int(self._instance.split("@")[0]) if self._instance else None
            return pid if pid is not None and _is_haproxy(pid) else None
        if self._pid is not None and self._is_ours(self._pid):
            return self._pid
        self._pid = next(iter(processes_running(self.layout.config)), None)
        return self._pid

    def _is_ours(self, pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return len(argv) > 1 and argv[0].endswith(b"haproxy") and os.fsencode(self.layout.config) in argv

    async def start(self) -> None:
        """Write config and maps, start HAProxy (external: wait for it), return once it answers on
        its runtime API."""
        self.layout.dir.mkdir(parents=True, exist_ok=True)
        make_sock_dir(self.layout)
        if not self.external:
            await self.stop_leftover()
            if swept := await asyncio.to_thread(sweep_orphan_sock_dirs):
                log.info("removed data plane socket dirs of deleted data dirs: %s", ", ".join(swept))
        config = render(self.layout, http_bind=self._http_bind, https_bind=self._https_bind, cert=self._cert,
                        threads=self._threads, cluster=self._cluster, hop=self._hop,
                        host_reads=self._host_reads)
        self.routes.write_files()
        tmp = self.layout.config.with_suffix(".tmp")  # whole or not at all: an external HAProxy may read it now
        tmp.write_text(config)
        res = await run_cmd([self.binary, "-c", "-f", tmp], timeout=30, check=False)
        if res.returncode != 0:
            alerts = [line for line in (res.stdout + res.stderr).splitlines() if "ALERT" in line]
            raise CommandError(f"haproxy configuration check failed: {' '.join(alerts)[-1500:]}")
        tmp.replace(self.layout.config)
        started = asyncio.get_running_loop().create_future()
        work = self._follow(started) if self.external else self._supervise(started)
        self._supervisor = asyncio.create_task(work, name="haproxy-supervisor")
        await started
        self._sync = asyncio.create_task(self.routes.run(), name="haproxy-routes")

    async def _worker(self) -> str | None:
        """`<pid>@<start time>` of the HAProxy worker answering on the runtime API (None: nothing
        answers). The start time too: a container started again may give its HAProxy the same pid."""
        try:
            out = "\n".join(await self.api.run(["show info"]))
        except (OSError, asyncio.TimeoutError):
            return None
        pid = re.search(r"^Pid: (\d+)$", out, re.M)
        start = re.search(r"^Start_time_sec: (\d+)$", out, re.M)
        return f"{pid.group(1)}@{start.group(1) if start else ''}" if pid else None

    async def _follow(self, started: asyncio.Future[None]) -> None:
        """External HAProxy: wait until it answers, then give every new instance (restarted, or
        reloaded with this server's new configuration) all routes again: it loaded the map files,
        written when this server started, while the routes went on changing."""
        waited = 0.0
        while True:
            worker = await self._worker()
            if worker is None:
                if not started.done() and waited >= _EXTERNAL_WAIT_S:
                    started.set_exception(CommandError(
                        f"no haproxy answered on {self.layout.admin_socket} within {_EXTERNAL_WAIT_S:.0f}s: "
                        f"haproxy_external is set, so `agentenv data-plane` (its own component) runs it"))
                    return
                if waited % 10.0 == 0.0:
                    log.info("waiting for the data plane component (haproxy) on %s", self.layout.admin_socket)
            elif worker != self._instance:
                if self._instance is not None:
                    log.warning("haproxy behind %s is a new instance (worker %s): sending it every route",
                                self.layout.admin_socket, worker)
                    self.restarts += 1
                self._instance = worker
                try:
                    await self.routes.resend()
                except (OSError, asyncio.TimeoutError) as e:
                    log.warning("routes not resent to haproxy yet: %s", e)
                    self._instance = None
                if not started.done() and self._instance is not None:
                    started.set_result(None)
            await asyncio.sleep(_FOLLOW_S)
            waited += _FOLLOW_S

    async def stop_leftover(self) -> None:
        """A HAProxy of ours left by a server that died without stopping it holds our ports."""
        pid = self.pid()
        if pid is None:
            return
        log.warning("stopping leftover haproxy (pid %d) of a previous run", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        for _ in range(50):
            if not self._is_ours(pid):
                break
            await asyncio.sleep(0.1)

    async def _spawn_once(self, started: asyncio.Future[None] | None) -> None:
        self.routes.write_files()
        with contextlib.suppress(FileNotFoundError):
            self.layout.admin_socket.unlink()
        run = asyncio.create_task(run_streamed(
            [self.binary, "-db", "-f", self.layout.config],
            timeout=10 * 365 * 86400, on_line=lambda line: log.info("haproxy: %s", line)))
        try:
            await self._wait_ready(run)
        except BaseException as e:
            if started is not None and not started.done():
                started.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            run.cancel()
            with contextlib.suppress(BaseException):
                await run
            raise
        if started is not None and not started.done():
            started.set_result(None)
        self._pid = None
        # Routes that changed while HAProxy was down.
        self.routes.mark()
        await run

    async def _wait_ready(self, run: asyncio.Task[str]) -> None:
        for _ in range(200):
            if run.done():
                try:
                    await run
                except CommandError as e:  # keep HAProxy's own alerts, not its banner
                    alerts = [re.sub(r"^\[ALERT\]\s+\(\d+\)\s*:\s*", "", line)
                              for line in str(e).splitlines() if "ALERT" in line]
                    raise CommandError("; ".join(alerts) or str(e)) from None
                raise CommandError("haproxy exited during startup")
            try:
                await self.api.run(["show info"])
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise CommandError("haproxy did not open its runtime API within 10 s")

    async def _supervise(self, started: asyncio.Future[None]) -> None:
        attempt = 0
        while True:
            try:
                await self._spawn_once(started if not started.done() else None)
                log.warning("haproxy exited; restarting it")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a supervisor keeps trying
                if started.done() and started.exception() is not None:
                    return  # it never started: `start` reports the error
                log.warning("haproxy exited (%s); restarting it", str(e)[-300:])
            self.restarts += 1
            await asyncio.sleep(RESTART_DELAY_S[min(attempt, len(RESTART_DELAY_S) - 1)])
            attempt += 1

    async def stop(self) -> None:
        for task in (self._sync, self._supervisor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._sync = self._supervisor = None
        if self.external:  # the component's sockets and configuration stay while it goes on running
            release_sock_dir(self.layout, ours=self.layout.app_socket, theirs=self.layout.admin_socket)
            return
        shutil.rmtree(self.layout.sock_dir, ignore_errors=True)

    async def backend_stats(self) -> dict[str, dict[str, int]]:
        """Counters of the sandbox backends (`backend_stats`)."""
        return await backend_stats(self.api)

    async def install_certificate(self, pem: Path | None = None) -> None:
        """Hand HAProxy a certificate file's current content without a reload (`set ssl cert` +
        `commit ssl cert` on its runtime API): new TLS handshakes use it, open connections go on.
        `pem`: the HTTPS listener's (default) or the cluster listener's file."""
        pem = pem or self._cert
        if pem is None or (self.pid() is None and not self.external):
            return  # no HTTPS, or HAProxy is restarting and reads the file itself
        name = str(pem)
        payload = pem.read_text().strip("\n")
        out = "".join(await self.api.send(f"set ssl cert {name} <<\n{payload}\n\n"))
        if "Transaction" not in out:
            raise RuntimeFailure(f"haproxy refused the new certificate: {out.strip()[:300]}")
        out = "".join(await self.api.send(f"commit ssl cert {name}\n"))
        if "Success" not in out:
            await self.api.send(f"abort ssl cert {name}\n")
            raise RuntimeFailure(f"haproxy could not commit the new certificate: {out.strip()[:300]}")

    async def leave_fast_path(self, sandbox_id: str) -> None:
        """A sandbox is about to stop: its routes leave the maps (events bring them back)."""
        if self._supervisor is None:
            return  # stopped (a node draining after its listener closed): no fast path to leave
        try:
            await self.routes.hold(sandbox_id)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("could not take %s out of haproxy's routes: %s", sandbox_id, e)

    async def reset_connections(self, host_ip: str) -> None:
        """Reset (RST) HAProxy's TCP connections to one sandbox address, none of anyone else's. An
        external HAProxy this process cannot see (no shared PID namespace): every connection to that
        address in this network namespace, which only HAProxy and this server open (this server
        closed its own already, `attach`)."""
        pid = self.pid()
        if pid is None and not self.external:
            return
        try:
            n = await asyncio.to_thread(sockdiag.reset_connections, pid, host_ip)
            if n:
                log.debug("reset %d of haproxy's connections to %s", n, host_ip)
        except OSError as e:
            log.warning("could not reset haproxy's connections to %s: %s", host_ip, e)
