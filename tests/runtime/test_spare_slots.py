"""Network slots built ahead of demand and reused (agentenv/network/spares.py), against the real
kernel and runsc."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from agentenv.config import Settings
from agentenv.network.manager import NetworkManager
from agentenv.runtimes.gvisor import GVisorRuntime

from .conftest import DATA_DIR, SandboxKit, _missing, http_get, run


def spare_netns(net: NetworkManager, owner: int | None = None) -> set[str]:
    owner = os.getpid() if owner is None else owner
    return {n for n in os.listdir("/run/netns") if net.names.spare_owner(n) == owner}


def spare_links(net: NetworkManager, owner: int | None = None) -> set[str]:
    alias = net.names.spare_alias(os.getpid() if owner is None else owner)
    links = json.loads(run("ip", "-j", "-d", "link", "show").stdout)
    return {x["ifname"] for x in links
            if net.names.parse_host_link(x["ifname"]) is not None and x.get("ifalias") == alias}


def conntrack_entries(netns: str) -> int:
    return len(run("ip", "netns", "exec", netns, "cat", "/proc/net/nf_conntrack").stdout.splitlines())


async def wait_for(what, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
async def spare_kit(settings: Settings):
    if _missing():
        pytest.skip(_missing())
    net = NetworkManager(settings, spare_slots=2)
    await net.setup_host()
    k = SandboxKit(settings, net, GVisorRuntime(settings), DATA_DIR / "tools")
    try:
        yield k
    finally:
        try:
            await k.close()
        finally:
            await net.close()


async def test_a_sandbox_adopts_a_spare_slot_and_close_removes_the_rest(spare_kit: SandboxKit):
    net = spare_kit.net
    assert not spare_netns(net) and not spare_links(net)  # none before the first allocation
    first, _ = await spare_kit.start()  # built on the spot; arms the filling
    await wait_for(lambda: len(net.spares) == 2 and len(spare_netns(net)) == 2)
    ready = spare_netns(net)
    assert len(spare_links(net)) == 2

    box, _ = await spare_kit.start(allow_internet=True)
    assert net.names.spare_netns_name(os.getpid(), box.slot.index) in ready  # it took a spare
    assert not os.path.exists(f"/run/netns/{net.names.spare_netns_name(os.getpid(), box.slot.index)}")
    assert box.slot.netns == net.names.netns_name(box.sandbox_id)
    link = json.loads(run("ip", "-j", "-d", "link", "show", box.slot.veth_host).stdout)[0]
    assert link.get("ifalias") == box.sandbox_id  # a restarted server finds its owner by it
    assert net.slot_for(box.sandbox_id) == box.slot
    # its rules are the sandbox's: the guest answers the host, the internet switch is on
    assert http_get(box.slot.host_ip, "/whoami")
    assert f'"{box.slot.veth_host}"' in run("nft", "list", "set", "ip", net.names.host_table, "internet").stdout
    assert "table ip agentenv" in run("ip", "netns", "exec", box.slot.netns, "nft", "list", "ruleset").stdout

    # a quiet node builds the taken spare again
    await wait_for(lambda: len(net.spares) == 2 and len(spare_netns(net)) == 2)
    await spare_kit.destroy(box)
    await spare_kit.destroy(first)
    await net.close()
    assert not spare_netns(net) and not spare_links(net)


async def test_a_released_slot_is_reset_and_serves_the_next_sandbox(spare_kit: SandboxKit):
    net = spare_kit.net
    net.spares.coming_up("held")  # as if a sandbox were coming up: no spare is built meanwhile
    old, _ = await spare_kit.start(allow_internet=True)
    assert http_get(old.slot.host_ip, "/whoami")  # a tracked connection in its netns
    assert conntrack_entries(old.slot.netns) > 0
    await spare_kit.rt.stop(old.sandbox_id)
    n = len(net.spares)
    await net.release(old.slot, reuse=True)  # its runtime stopped it
    spare_kit.boxes.remove(old)
    run("umount", str(old.rootfs))
    reused = net.names.spare_netns_name(os.getpid(), old.slot.index)
    assert n < 2 and len(net.spares) == n + 1 and os.path.exists(f"/run/netns/{reused}")
    assert not os.path.exists(old.slot.netns_path) and net.slot_for(old.sandbox_id) is None
    assert conntrack_entries(reused) == 0, "a flow of the old guest could reach the next one"
    assert f'"{old.slot.veth_host}"' not in run("nft", "list", "set", "ip", net.names.host_table, "internet").stdout
    assert old.slot.veth_host in spare_links(net)

    # the next sandbox takes it (last in, first out) and works in it
    new, _ = await spare_kit.start()
    assert new.slot.index == old.slot.index and new.slot.host_ip == old.slot.host_ip
    assert http_get(new.slot.host_ip, "/whoami")
    assert f'"{new.slot.veth_host}"' not in run("nft", "list", "set", "ip", net.names.host_table, "internet").stdout

    # a release without `reuse` (the runtime may not have stopped it) removes the slot
    await spare_kit.destroy(new)
    assert not os.path.exists(f"/run/netns/{reused}") and not os.path.exists(new.slot.netns_path)
    net.spares.up("held")


# A server process that builds two spares and dies without closing its manager (as `kill -9` does).
_KILLED = """
import asyncio, os, sys, time
from agentenv.config import Settings
from agentenv.network.manager import NetworkManager

async def main():
    net = NetworkManager(Settings(data_dir=sys.argv[1], slot_subnet=sys.argv[2]), spare_slots=2)
    await net.setup_host()
    slot = await net.allocate("spareprobe" + str(os.getpid()))
    await net.activate(slot)
    await net.release(slot)
    deadline = time.monotonic() + 20
    while len(net.spares) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print(os.getpid(), len(net.spares), flush=True)
    os._exit(0)

asyncio.run(main())
"""


async def test_a_killed_servers_spares_are_removed_on_the_next_start_and_a_live_ones_are_not(
        spare_kit: SandboxKit, settings: Settings):
    live = spare_kit.net
    box, _ = await spare_kit.start()
    await wait_for(lambda: len(live.spares) == 2)  # this process's: a live server's
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(settings.data_dir), settings.slot_subnet],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pid, count = map(int, proc.stdout.split())
    assert count == 2
    # its pid is gone now; the spares it left carry it
    assert len(spare_netns(live, pid)) == 2 and len(spare_links(live, pid)) == 2
    net2 = NetworkManager(settings)
    await net2.setup_host()  # as the next `agentenv serve` (or `agentenv gc`) starts
    assert not spare_netns(live, pid) and not spare_links(live, pid)
    assert len(spare_netns(live)) == 2 and len(spare_links(live)) == 2  # the live server's stay
    assert net2.slot_for(box.sandbox_id) == box.slot  # a sandbox's slot is not a spare
    assert http_get(box.slot.host_ip, "/whoami")
    await net2.close()
