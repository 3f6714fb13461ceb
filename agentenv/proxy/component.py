"""`agentenv data-plane`: HAProxy as a component of its own (a sidecar container beside a role).

A server or cluster role with `haproxy_external = true` writes its HAProxy configuration and maps as
always and drives HAProxy through the runtime API, but does not run it (`haproxy.DataPlane`, external).
This command runs it instead, from the role's files:

- it waits for the role's configuration, then runs `haproxy -W -db -f <config>` (master-worker, in
  the foreground, so a container runtime sees it);
- when the role writes a new configuration (a restart with other settings), it checks it and has
  HAProxy reload it (SIGUSR2 to the master: new workers, open connections finish on the old ones);
  the role notices the new worker and sends it every route again;
- when HAProxy exits, it is started again (growing delay); SIGTERM/SIGINT stop it and end the command.

The component and the role must share the data dir and the socket dir (`haproxy.sock_dir_for`, under
TMPDIR) and, on a node, the network namespace (the sandboxes' addresses). docs/proxy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from pathlib import Path

from agentenv.proc import run_cmd
from agentenv.proxy.haproxy import RESTART_DELAY_S, make_sock_dir, release_sock_dir
from agentenv.proxy.haproxy_conf import HaproxyLayout

log = logging.getLogger(__name__)

CHECK_S = 1.0


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class Component:
    """One HAProxy master process run from a role's configuration, reloaded when it changes."""

    def __init__(self, binary: str, layout: HaproxyLayout) -> None:
        self.binary = binary
        self.layout = layout
        self.proc: asyncio.subprocess.Process | None = None
        self.digest: str | None = None
        self.reloads = 0
        self.starts = 0

    async def _spawn(self) -> None:
        make_sock_dir(self.layout)
        self.digest = _digest(self.layout.config)
        self.proc = await asyncio.create_subprocess_exec(
            self.binary, "-W", "-db", "-f", str(self.layout.config), stdin=asyncio.subprocess.DEVNULL)
        self.starts += 1
        log.info("haproxy started (master pid %d) from %s", self.proc.pid, self.layout.config)

    async def _reload_if_changed(self) -> None:
        digest = _digest(self.layout.config)
        if digest is None or digest == self.digest or self.proc is None:
            return
        res = await run_cmd([self.binary, "-c", "-f", self.layout.config], timeout=30, check=False)
        if res.returncode != 0:  # keep serving with the old one; the role reports its own check
            log.error("the new haproxy configuration does not check, not reloading: %s",
                      " ".join(line for line in (res.stdout + res.stderr).splitlines() if "ALERT" in line)[-1500:])
            self.digest = digest
            return
        self.digest = digest
        self.proc.send_signal(signal.SIGUSR2)
        self.reloads += 1
        log.info("configuration changed: haproxy reloads it")

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set: wait for the configuration, run HAProxy, reload it, restart it."""
        if not self.layout.config.exists():
            log.info("waiting for the role's haproxy configuration at %s", self.layout.config)
        while not self.layout.config.exists():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
            if stop.is_set():
                return
        attempt = 0
        try:
            while not stop.is_set():
                if self.proc is None or self.proc.returncode is not None:
                    if self.proc is not None:
                        log.warning("haproxy exited (%s); starting it again", self.proc.returncode)
                        await asyncio.sleep(RESTART_DELAY_S[min(attempt, len(RESTART_DELAY_S) - 1)])
                        attempt += 1
                    await self._spawn()
                await self._reload_if_changed()
                exited = asyncio.ensure_future(self.proc.wait())
                stopping = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait({exited, stopping}, timeout=CHECK_S, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (exited, stopping):
                        t.cancel()
        finally:
            await self._stop()

    async def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()  # the master stops its workers
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
        log.info("haproxy stopped")
        release_sock_dir(self.layout, ours=self.layout.admin_socket, theirs=self.layout.app_socket)
