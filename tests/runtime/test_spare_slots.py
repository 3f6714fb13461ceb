"""Network slots built ahead of demand (agentenv/network/spares.py), against the real kernel and runsc."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from agentenv.config import Settings
from agentenv.network.manager import NetworkManager
from agentenv.runtimes.gvisor import GVisorRuntime

from .conftest import DATA_DIR, SandboxKit, _missing, http_get, run


def spare_netns(net: NetworkManager) -> set[str]:
    return {n for n in os.listdir("/run/netns") if net.names.is_spare_netns(n)}


def links_without_alias(net: NetworkManager) -> set[str]:
    links = json.loads(run("ip", "-j", "-d", "link", "show").stdout)
    return {x["ifname"] for x in links
            if net.names.parse_host_link(x["ifname"]) is not None and not x.get("ifalias")}


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
    assert not spare_netns(net) and not links_without_alias(net)  # none before the first allocation
    first, _ = await spare_kit.start()  # built on the spot; arms the filling
    await wait_for(lambda: len(net.spares) == 2 and len(spare_netns(net)) == 2)
    ready = spare_netns(net)
    assert len(links_without_alias(net)) == 2

    box, _ = await spare_kit.start(allow_internet=True)
    assert net.names.spare_netns_name(box.slot.index) in ready  # it took a spare
    assert not os.path.exists(f"/run/netns/{net.names.spare_netns_name(box.slot.index)}")
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
    assert not spare_netns(net) and not links_without_alias(net)


async def test_a_killed_servers_spares_are_removed_on_the_next_start(spare_kit: SandboxKit, settings: Settings):
    net = spare_kit.net
    box, _ = await spare_kit.start()
    await wait_for(lambda: len(net.spares) == 2)
    left = spare_netns(net)
    # "killed": the manager is never closed; the next one (as `agentenv serve` or `agentenv gc` starts)
    net2 = NetworkManager(settings, spare_slots=2)
    await net2.setup_host()
    assert not spare_netns(net2) and not links_without_alias(net2), left
    assert net2.slot_for(box.sandbox_id) == box.slot  # a sandbox's slot is not a spare
    assert http_get(box.slot.host_ip, "/whoami")
    await net2.close()
