"""The host's pre-capture question to envd ("which TCP connections do you hold?") must itself be
over inside the sandbox when it returns: the freeze follows within a millisecond, and a checkpoint
(`--net-disconnect-ok`) that still finds envd holding that connection resets it under envd, whose
restored copies (fork children) then now and then never answered again."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess

import pytest

from agentenv.constants import ENVD_PORT
from agentenv.orchestrator import envd_client
from leftovers import NETNS_PREFIX

FIN_WAIT = {"04", "05"}  # /proc/net/tcp: FIN_WAIT1, FIN_WAIT2 (the peer has not closed its end yet)


def slot_ip(sandbox_id: str) -> str:
    out = subprocess.run(["ip", "-n", f"{NETNS_PREFIX}{sandbox_id}", "-j", "addr"], capture_output=True,
                         text=True, check=True).stdout
    (ip,) = [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])
             if a.get("family") == "inet" and not a["local"].startswith(("127.", "169.254."))]
    return ip


def half_closed_to(ip: str, port: int) -> list[str]:
    """Host sockets to ip:port whose sandbox end is still open after the host's close."""
    want = socket.inet_aton(ip)[::-1].hex().upper() + f":{port:04X}"
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return [r[1] for r in rows if r[2] == want and r[3] in FIN_WAIT]


@pytest.mark.timeout(120)
def test_connection_check_is_closed_inside_the_sandbox_when_it_returns(server, tracker):
    sbx = tracker.create()
    ip = slot_ip(sbx.sandbox_id)
    token = (server.data_dir / "host-token").read_text().strip()

    async def check_many() -> list[str]:
        left = []
        for _ in range(30):
            conns = await envd_client.blocking_connections(ip, host_token=token)
            assert isinstance(conns, list)
            left += half_closed_to(ip, ENVD_PORT)  # read at once, as the capture's freeze comes at once
            await asyncio.sleep(0.02)
        return left

    left = asyncio.run(check_many())
    assert not left, f"envd still held the check's connection when it returned ({len(left)} of 30): {left[:3]}"
    # and the check sees nothing of its own earlier rounds
    assert asyncio.run(envd_client.blocking_connections(ip, host_token=token)) == []
