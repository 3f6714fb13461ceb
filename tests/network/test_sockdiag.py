"""`sockdiag.reset_connections`: one process's TCP connections to one address are reset, no others."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from agentenv.network import sockdiag

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="SOCK_DESTROY needs CAP_NET_ADMIN (run as root)")

# A child that connects to the address twice, reports ready, then reads both until each ends.
_CLIENT = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
socks = [socket.create_connection((host, port)) for _ in range(2)]
print("ready", flush=True)
for s in socks:
    try:
        s.recv(1)
        print("eof", flush=True)
    except ConnectionError as e:   # the local end of a destroyed socket: ECONNABORTED
        print(type(e).__name__, flush=True)
"""


class _Server:
    """A listener on a loopback address that accepts and holds every connection."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def _wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_only_the_given_process_connections_to_the_address_are_reset() -> None:
    target, other = "127.0.0.61", "127.0.0.62"
    srv, srv_other = _Server(target), _Server(other)
    mine = socket.create_connection((target, srv.port))   # ours, to the same address: must survive
    child = subprocess.Popen([sys.executable, "-c", _CLIENT, target, str(srv.port)], stdout=subprocess.PIPE,
                             text=True)
    child_other = subprocess.Popen([sys.executable, "-c", _CLIENT, other, str(srv_other.port)],
                                   stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child_other.stdout.readline().strip() == "ready"
        _wait_for(lambda: len(srv.held) == 3 and len(srv_other.held) == 2)

        mine.settimeout(5)
        peer = next(c for c in srv.held if c.getpeername() == mine.getsockname())
        child_peers = [c for c in srv.held if c is not peer]
        child_socks = sockdiag.socket_inodes(child.pid)
        assert len(child_socks & {c.inode for c in sockdiag.connections_to(target)}) == 2
        assert sockdiag.reset_connections(child.pid, target) == 2
        # The far end (the sandbox's side) got a RST on both; the child saw its own ends aborted...
        for c in child_peers:
            c.settimeout(5)
            with pytest.raises(ConnectionResetError):
                c.recv(1)
        assert [child.stdout.readline().strip() for _ in range(2)] == ["ConnectionAbortedError"] * 2
        assert child.wait(timeout=10) == 0
        # ...our connection to the same address still works, and so do the other child's to another one.
        peer.sendall(b"y")
        assert mine.recv(1) == b"y"
        assert sockdiag.reset_connections(os.getpid(), other) == 0
        assert child_other.poll() is None
        # Ours goes the same way when it is our turn.
        assert sockdiag.reset_connections(os.getpid(), target) == 1
        with pytest.raises(ConnectionError):
            mine.recv(1)
    finally:
        for p in (child, child_other):
            p.kill()
            p.wait()
        mine.close()
        srv.close()
        srv_other.close()
