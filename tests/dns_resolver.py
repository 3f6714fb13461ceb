"""A resolver for `*.<domain>` in tests, so clients reach wildcard sandbox hosts by name through real
DNS, as in production: dnsmasq bound to one loopback address answers every name under the domain
with that address, and `Resolver.run` runs a program in a private mount namespace whose
/etc/resolv.conf names that dnsmasq (what `ip netns exec` does for a netns, without leaving the host's
network). Used by tests/proxy/test_proxy_https.py (`serve`) and tests/cluster/test_cluster_https.py
(a cluster gateway)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest


class Resolver:
    """dnsmasq on <addr>:53 for *.<domain>, and a way to run programs that resolve through it."""

    def __init__(self, addr: str, domain: str, workdir: Path) -> None:
        self.addr, self.domain = addr, domain
        self.resolv_conf = workdir / "resolv.conf"
        self.resolv_conf.write_text(f"nameserver {addr}\noptions timeout:2 attempts:2\n")
        self.proc = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--listen-address={addr}", "--bind-interfaces", "--port=53", f"--address=/{domain}/{addr}",
             "--user=root", "--log-facility=-"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 180,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """`argv` in a private mount namespace with our resolv.conf bound over /etc/resolv.conf."""
        wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(self.resolv_conf)]
        return subprocess.run(wrapper + argv, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=cwd)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            r = self.run(["getent", "hosts", f"api.{self.domain}"], timeout=10)
            if r.returncode == 0 and self.addr in r.stdout:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None and self.proc.stderr else ""
                pytest.fail(f"dnsmasq on {self.addr} does not answer for {self.domain}: {r.stderr} {err}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
