"""Per-sandbox network slots (netns + two veth pairs + nftables NAT).

CONTRACT:

class NetworkManager:
    def __init__(self, settings: Settings) -> None
    async def setup_host(self) -> None         # ip_forward, root-ns NAT chain (idempotent)
    async def allocate(self, sandbox_id: str, allow_internet: bool = True) -> NetSlot
        # creates netns + veths + DNAT; only the guest interface is UP (gVisor takes over UP interfaces)
    async def activate(self, slot: NetSlot) -> None   # bring gateway/host-facing links up after runtime start
    async def release(self, slot: NetSlot) -> None    # delete netns, veths, rules; idempotent
    async def release_id(self, sandbox_id: str) -> bool  # the same by id; also a netns whose link is gone
    async def cleanup_orphans(self, keep: set[str]) -> list[str]   # by sandbox id; returns removed
    def slot_for(self, sandbox_id: str) -> NetSlot | None
    async def close(self) -> None              # spare slots (network/spares.py) removed, egress listeners closed
Extra: teardown_host(), discover(), set_internet(), deactivate().

Why nftables (not iptables): one `nft -f -` call installs a netns' whole ruleset atomically (one
process per slot keeps allocation fast), and root-ns state lives in a single table `ip agentenv`
that can be recreated idempotently and deleted in one command without touching anybody else's rules.
Per-slot internet access is membership of the slot's root-ns link name in the set `internet`.

Slot state needs no database: the slot index is the root-ns link name (aeh<index>) and the owning
sandbox id is that link's ifalias, so a restarted server rediscovers every slot from the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import errno
import logging
import os
import socket
import time
from pathlib import Path
from typing import AsyncIterator, NamedTuple

from pyroute2 import AsyncIPRoute, IPRoute, netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.ndmsg import NUD_PERMANENT

from agentenv import constants
from agentenv.config import Settings
from agentenv.errors import RuntimeFailure, Unavailable
from agentenv.network.egress import EGRESS_PROXY_PORT, EgressProxy
from agentenv.network.policy import EgressPolicy, platform_sets
from agentenv.network import nft
from agentenv.network.nsock import flush_conntrack, netlink_fd, rebind
from agentenv.network.slots import (
    GATEWAY_LINK,
    GUEST_LINK,
    NETNS_RUN_DIR,
    NS_HOST_LINK,
    NetSlot,
    SlotNames,
    slot_addresses,
    slot_capacity,
)
from agentenv.network.shaping import cap_bandwidth
from agentenv.network.spares import SpareSlots
from agentenv.proc import pid_alive

log = logging.getLogger(__name__)

CMD_TIMEOUT = 10.0
NETLINK_TIMEOUT = 10.0


def _elements(cidrs: list[str] | tuple[str, ...]) -> str:
    return f" elements = {{ {', '.join(cidrs)} }};" if cidrs else ""


def _set(name: str, cidrs: list[str] | tuple[str, ...]) -> str:
    return f"set {name} {{ type ipv4_addr; flags interval; auto-merge;{_elements(cidrs)} }}"


def _host_ruleset(names: SlotNames, hard: list[str], platform: list[str], opened: list[str]) -> str:
    """Root-ns rules of one instance (its own table, matching only its own links).

    `add` is idempotent and keeps the `internet` set's elements across server restarts. The
    platform-denied destinations are refused here too (defence in depth behind the slot's own
    table), and nothing new from a slot link is accepted by the host itself, whatever address
    of the host it is sent to.
    """
    t = f"ip {names.host_table}"
    w = f'"{names.link_prefix}*"'
    fill = "".join(f"add element {t} {n} {{ {', '.join(c)} }}\n" for n, c in
                   (("hard", hard), ("platform", platform), ("opened", opened)) if c)
    return f"""
add table {t}
add set {t} internet {{ type ifname; }}
add set {t} hard {{ type ipv4_addr; flags interval; auto-merge; }}
add set {t} platform {{ type ipv4_addr; flags interval; auto-merge; }}
add set {t} opened {{ type ipv4_addr; flags interval; auto-merge; }}
flush set {t} hard
flush set {t} platform
flush set {t} opened
{fill}
add chain {t} forward {{ type filter hook forward priority -1; policy accept; }}
add chain {t} input {{ type filter hook input priority -1; policy accept; }}
add chain {t} postrouting {{ type nat hook postrouting priority 100; policy accept; }}
flush chain {t} forward
flush chain {t} input
flush chain {t} postrouting
add rule {t} forward iifname {w} oifname {w} drop
add rule {t} forward iifname {w} ip daddr @hard drop
add rule {t} forward iifname {w} ip daddr @platform ip daddr != @opened drop
add rule {t} forward iifname {w} iifname @internet accept
add rule {t} forward iifname {w} drop
add rule {t} forward oifname {w} ct state established,related accept
add rule {t} forward oifname {w} drop
add rule {t} input iifname {w} ct state established,related accept
add rule {t} input iifname {w} drop
add rule {t} postrouting iifname {w} oifname != {w} masquerade
"""


def _netns_ruleset(host_ip: str, policy: EgressPolicy, platform: tuple[list[str], list[str], list[str]]) -> str:
    """The whole nft table of one slot's netns, replaced atomically (also by a live policy change).

    Inbound: host_ip is DNAT'ed to the guest. Outbound from the guest (forward gw0 -> host0), every
    packet in the original direction passes `egress`: hard/platform-denied destinations are
    refused (TCP reset, ICMP otherwise) unless the operator opened them, then the sandbox's
    allowOut CIDRs win over its denyOut CIDRs, then the rest is allowed. With domain rules, TCP to a
    denied destination is redirected to the egress proxy listening in this netns (`egress_nat`);
    the proxy's own upstream connections leave from this netns and pass the platform checks in
    `output`.
    """
    g = constants.GUEST_IP
    hard, plat, opened = platform
    port = EGRESS_PROXY_PORT
    nat_jump = f'iifname "{GATEWAY_LINK}" jump egress_nat' if policy.inspects else ""
    return f"""
add table ip agentenv
delete table ip agentenv
table ip agentenv {{
  {_set("hard", hard)}
  {_set("platform", plat)}
  {_set("opened", opened)}
  {_set("allow", policy.allow_cidrs)}
  {_set("deny", policy.deny_cidrs)}
  chain raw_pre {{ type filter hook prerouting priority raw; policy accept;
    iifname "{GUEST_LINK}" drop
  }}
  chain to_guest {{ type nat hook prerouting priority dstnat; policy accept;
    iifname "{NS_HOST_LINK}" ip daddr {host_ip} dnat to {g}
    {nat_jump}
  }}
  chain egress_nat {{
    ip daddr @hard return
    ip daddr @platform ip daddr != @opened return
    ip daddr @allow return
    meta l4proto tcp ip daddr @deny redirect to :{port}
  }}
  chain from_guest {{ type nat hook postrouting priority srcnat; policy accept;
    oifname "{NS_HOST_LINK}" ip saddr {g} masquerade
  }}
  chain forward_guest {{ type filter hook forward priority filter; policy drop;
    iifname "{NS_HOST_LINK}" oifname "{GATEWAY_LINK}" ip daddr {g} accept
    iifname "{GATEWAY_LINK}" oifname "{NS_HOST_LINK}" ip saddr {g} jump egress
  }}
  chain egress {{
    ct state related accept
    ct direction reply accept
    ip daddr @hard goto refuse
    ip daddr @platform ip daddr != @opened goto refuse
    ip daddr @allow accept
    ip daddr @deny goto refuse
    accept
  }}
  chain refuse {{
    meta l4proto tcp reject with tcp reset
    reject with icmp type admin-prohibited
  }}
  chain input {{ type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
    iifname "{GATEWAY_LINK}" ct status dnat tcp dport {port} accept
  }}
  chain output {{ type filter hook output priority filter; policy accept;
    oifname "{NS_HOST_LINK}" ip daddr @hard goto refuse
    oifname "{NS_HOST_LINK}" ip daddr @platform ip daddr != @opened goto refuse
  }}
}}
"""


# Written inside the slot's netns before its rules: forwarding on, IPv6 off (nothing of ours speaks
# it). The gateway link resolves the guest's address by ARP; a request a just-restored guest misses
# is retried after retrans_time_ms (1 s by default, which a create then waits out): 50 ms here.
_NETNS_SYSCTLS = {
    "/proc/sys/net/ipv4/ip_forward": "1",
    f"/proc/sys/net/ipv4/neigh/{GATEWAY_LINK}/retrans_time_ms": "50",
    "/proc/sys/net/ipv6/conf/default/disable_ipv6": "1",
    "/proc/sys/net/ipv6/conf/all/disable_ipv6": "1",
}


@contextlib.asynccontextmanager
async def _netlink(netns: str | None = None, create: bool = False,
                   exclusive: bool = False) -> AsyncIterator[AsyncIPRoute]:
    """An rtnetlink socket (optionally inside a named netns) with a deadline on everything done with it:
    netlink calls have no timeout of their own and a lost reply would hang the caller forever."""
    try:
        async with asyncio.timeout(NETLINK_TIMEOUT):
            # In a netns: a socket made there by a thread of ours (`nsock`), not by pyroute2's fork.
            kw = {} if netns is None else {
                "fileno": await netlink_fd(f"{NETNS_RUN_DIR}/{netns}", create=create, exclusive=exclusive)}
            async with AsyncIPRoute(**kw) as ipr:
                yield ipr
    except TimeoutError:
        raise RuntimeFailure(f"netlink operation{' in netns ' + netns if netns else ''} timed out "
                             f"after {NETLINK_TIMEOUT:.0f}s") from None


class _LinkTaken(Exception):
    pass


def _ignore(e: NetlinkError, *codes: int) -> bool:
    return e.code in codes


class NetworkManager:
    def __init__(self, settings: Settings, *, spare_slots: int = 0) -> None:
        """`spare_slots`: how many slots to keep built ahead of demand (the server passes
        `settings.network_spare_slots`; a harness that times slot building keeps 0)."""
        self.settings = settings
        self.subnet = settings.slot_subnet
        self.capacity = slot_capacity(self.subnet)
        self._slots: dict[str, NetSlot] = {}   # sandbox_id -> slot
        self._used: set[int] = set()           # indexes reserved (incl. allocations in progress)
        self._pending: set[str] = set()        # sandbox ids being allocated
        self._lock = asyncio.Lock()
        self._discovered = False
        self._next = 0
        self.names = SlotNames(settings.instance)
        self.platform = platform_sets(settings.slot_subnet, settings.egress_allow_cidrs)
        self.egress = EgressProxy()
        self._policies: dict[str, EgressPolicy] = {}  # sandbox_id -> policy in force
        self.spares = SpareSlots(spare_slots, self._new_spare, self._drop_spare)
        self._owner = os.getpid()  # spares of this process (`SlotNames.spare_netns_name`)

    # ---------------------------------------------------------------- host setup

    async def setup_host(self) -> None:
        """Enable forwarding and install the root-ns table; safe to call on every server start."""
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        await nft.run(_host_ruleset(self.names, *self.platform))
        await self.discover()
        await self.drop_stale_spares()

    async def close(self) -> None:
        """Remove the spare slots and close the egress proxy's listeners. Sandboxes' slots stay: they
        outlive a server restart (their listeners come back on the next start)."""
        await self.spares.close()
        await self.egress.close_all()

    async def teardown_host(self) -> None:
        """Remove the root-ns table (ip_forward is left as is: other software may rely on it)."""
        with contextlib.suppress(nft.NftError):
            await nft.run(f"delete table ip {self.names.host_table}")

    async def set_internet(self, slot: NetSlot, allow: bool) -> NetSlot:
        """Switch forwarding of the slot's traffic out of the host on or off."""
        try:
            await nft.run(f"{'add' if allow else 'delete'} element ip {self.names.host_table} internet "
                          f'{{ "{slot.veth_host}" }}')
        except nft.NftError as e:
            if allow:
                raise RuntimeFailure(f"nft: cannot allow internet for {slot.veth_host}: {e} "
                                     "(was setup_host() called?)") from None
        new = NetSlot(**{**slot.__dict__, "allow_internet": allow})
        if self._slots.get(slot.sandbox_id) == slot:
            self._slots[slot.sandbox_id] = new
        return new

    # ---------------------------------------------------------------- discovery

    def _scan_links(self, links, internet: str) -> dict[str, NetSlot]:
        """Slots described by root-ns aeh* links; `internet` is `nft list set ... internet` output."""
        found: dict[str, NetSlot] = {}
        for link in links:
            ifname = link.get_attr("IFLA_IFNAME") or ""
            index = self.names.parse_host_link(ifname)
            if index is None:
                continue
            self._used.add(index)
            sandbox_id = link.get_attr("IFLA_IFALIAS")
            if not sandbox_id or self.names.alias_owner(sandbox_id) is not None:
                continue  # being made, or a spare
            peer_ip, host_ip = slot_addresses(self.subnet, index)
            name = self.names.netns_name(sandbox_id)
            found[sandbox_id] = NetSlot(index=index, netns=name, netns_path=f"{NETNS_RUN_DIR}/{name}",
                                        host_ip=host_ip, veth_host=ifname, sandbox_id=sandbox_id,
                                        peer_ip=peer_ip, allow_internet=f'"{ifname}"' in internet)
        return found

    async def discover(self) -> dict[str, NetSlot]:
        """Rebuild the slot table from the kernel (after a server restart)."""
        async with _netlink() as ipr:
            links = [x async for x in await ipr.link("dump")]
        try:
            internet = await nft.run(f"list set ip {self.names.host_table} internet")
        except nft.NftError:
            internet = ""
        for sid, slot in self._scan_links(links, internet).items():
            self._slots.setdefault(sid, slot)
        self._discovered = True
        return dict(self._slots)

    def slot_for(self, sandbox_id: str) -> NetSlot | None:
        """The sandbox's slot; before discover() ran, looked up in the kernel directly."""
        slot = self._slots.get(sandbox_id)
        if slot is None and not self._discovered:
            # pyroute2's sync IPRoute needs its own event loop, which fails inside a running one:
            # scan from a short-lived thread. Only happens before discover() ran.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                links, internet = pool.submit(_scan_kernel_sync, self.names.host_table).result(timeout=CMD_TIMEOUT * 2)
            slot = self._scan_links(links, internet).get(sandbox_id)
            if slot is not None:
                self._slots[sandbox_id] = slot
        return slot

    # ---------------------------------------------------------------- allocation

    async def allocate(self, sandbox_id: str, allow_internet: bool = True,
                       policy: EgressPolicy | None = None, *, rules: bool = True) -> NetSlot:
        """A new slot whose egress rules are in force before anything can run in it.

        `allow_internet` is the root-ns switch (forwarding out of the host at all); `policy` the
        sandbox's own rules inside the slot (default: everything but the platform-denied ranges).
        `rules=False`: links and addresses only; the caller runs `install_rules` before `activate`
        (nothing leaves the slot before: the guest link's peer is down), e.g. alongside a restore.
        """
        t0 = time.monotonic()
        async with self._lock:
            if not self._discovered:
                await self.discover()
            if sandbox_id in self._slots or sandbox_id in self._pending:
                raise RuntimeFailure(f"sandbox {sandbox_id} already has a network slot")
            if os.path.exists(os.path.join(NETNS_RUN_DIR, self.names.netns_name(sandbox_id))):
                raise RuntimeFailure(f"netns {self.names.netns_name(sandbox_id)} already exists (stale? run cleanup_orphans)")
            self._pending.add(sandbox_id)
            self.spares.coming_up(sandbox_id)
        try:
            spare = self.spares.take()
            if spare is not None:
                slot = await self._adopt(spare, sandbox_id, allow_internet)
                if slot is not None:
                    return await self._register(slot, policy or EgressPolicy(), t0, rules)
            return await self._allocate(sandbox_id, allow_internet, policy or EgressPolicy(), t0, rules)
        except BaseException:
            self.spares.up(sandbox_id)
            raise
        finally:
            self._pending.discard(sandbox_id)

    async def _register(self, slot: NetSlot, policy: EgressPolicy, t0: float, rules: bool) -> NetSlot:
        try:
            if rules:
                await self.install_rules(slot, policy)
        except BaseException:
            await asyncio.shield(self.release(slot))
            raise
        self._slots[slot.sandbox_id] = slot
        log.debug("adopted spare slot %d for %s in %.1f ms", slot.index, slot.sandbox_id, (time.monotonic() - t0) * 1e3)
        return slot

    async def _allocate(self, sandbox_id: str, allow_internet: bool, policy: EgressPolicy, t0: float,
                        rules: bool) -> NetSlot:
        for _attempt in range(8):
            async with self._lock:
                index = self._pick_index()
                self._used.add(index)
            peer_ip, host_ip = slot_addresses(self.subnet, index)
            name = self.names.netns_name(sandbox_id)
            slot = NetSlot(index=index, netns=name, netns_path=f"{NETNS_RUN_DIR}/{name}", host_ip=host_ip,
                           veth_host=self.names.host_link_name(index), sandbox_id=sandbox_id, peer_ip=peer_ip,
                           allow_internet=allow_internet)
            try:
                await self._create(slot)
                if rules:
                    await self.install_rules(slot, policy)
                break
            except _LinkTaken:
                # aeh<index> belongs to another manager on this host (other server or test run):
                # keep the index marked used and try the next one.
                _remove_netns(slot.netns)
                continue
            except BaseException:
                await asyncio.shield(self._teardown(slot))
                async with self._lock:
                    self._used.discard(index)
                raise
        else:
            raise Unavailable("could not find a free network slot index (link names taken)")
        self._slots[sandbox_id] = slot
        log.debug("allocated slot %d for %s in %.1f ms", index, sandbox_id, (time.monotonic() - t0) * 1e3)
        return slot

    # ---------------------------------------------------------------- spare slots (network/spares.py)

    def _spare(self, index: int) -> NetSlot:
        peer_ip, host_ip = slot_addresses(self.subnet, index)
        name = self.names.spare_netns_name(self._owner, index)
        return NetSlot(index=index, netns=name, netns_path=f"{NETNS_RUN_DIR}/{name}", host_ip=host_ip,
                       veth_host=self.names.host_link_name(index), peer_ip=peer_ip)

    async def _new_spare(self) -> NetSlot:
        """A slot with no sandbox yet, named for this process (`SlotNames.spare_netns_name`)."""
        for _attempt in range(8):
            async with self._lock:
                index = self._pick_index()
                self._used.add(index)
            slot = self._spare(index)
            try:
                await self._create(slot, exclusive=True)
                return slot
            except FileExistsError:  # another manager's spare (same process): keep the index marked used
                continue
            except _LinkTaken:  # aeh<index> is another manager's: the netns made here goes
                _remove_netns(slot.netns)
                continue
            except BaseException:
                await asyncio.shield(self._drop_spare(slot))
                raise
        raise Unavailable("could not find a free network slot index (link names taken)")

    async def _drop_spare(self, slot: NetSlot) -> None:
        await _delete_link(slot.veth_host)
        _remove_netns(slot.netns)
        async with self._lock:
            self._used.discard(slot.index)

    async def _adopt(self, spare: NetSlot, sandbox_id: str, allow_internet: bool) -> NetSlot | None:
        """The spare renamed for `sandbox_id` (its netns and its link's alias), or None (then dropped)."""
        name = self.names.netns_name(sandbox_id)
        slot = NetSlot(**{**spare.__dict__, "netns": name, "netns_path": f"{NETNS_RUN_DIR}/{name}",
                          "sandbox_id": sandbox_id, "allow_internet": allow_internet})
        try:
            rebind(spare.netns_path, slot.netns_path)
        except OSError as e:
            log.warning("could not adopt spare slot %d for %s: %s", spare.index, sandbox_id, e)
            await asyncio.shield(self._drop_spare(spare))
            return None
        try:
            await _set_alias(slot.veth_host, sandbox_id)
        except BaseException:
            await asyncio.shield(self._drop_spare(slot))
            raise
        return slot

    async def _recycle(self, slot: NetSlot) -> bool:
        """Reset a released slot and keep it as a spare; False when that failed before it was renamed
        (the caller removes it as usual)."""
        async def inside() -> None:
            await flush_conntrack(slot.netns_path)  # no flow of the old guest reaches the next one
            await self.deactivate(slot)  # gw0 and host0 down: nothing passes until the next `activate`

        try:
            await self.egress.close(slot.sandbox_id)
            self._policies.pop(slot.sandbox_id, None)
            # The old rules stay until the next sandbox's replace them (one transaction, before its
            # `activate`): flushing them would cost a kernel commit (~10-20 ms) for nothing.
            await asyncio.gather(self._forget_internet(slot.veth_host), inside())
            await _set_alias(slot.veth_host, self.names.spare_alias(self._owner))
        except Exception as e:  # noqa: BLE001
            log.warning("could not reset the slot of %s for reuse, removing it: %s", slot.sandbox_id, e)
            return False
        spare = self._spare(slot.index)
        async with self._lock:
            if self._slots.get(slot.sandbox_id, slot).index == slot.index:
                self._slots.pop(slot.sandbox_id, None)
        try:
            rebind(slot.netns_path, spare.netns_path)
        except OSError as e:
            log.warning("could not rename the slot of %s for reuse, removing it: %s", slot.sandbox_id, e)
            await self._teardown(slot)
            async with self._lock:
                self._used.discard(slot.index)
            return True
        if not self.spares.put(spare):  # closed meanwhile (the server is stopping)
            await self._drop_spare(spare)
        return True

    async def drop_stale_spares(self) -> list[str]:
        """Remove the spares of servers of this instance that are gone (killed before `close`): root-ns
        links whose alias names a dead process, netns `spare_netns_name` of one. Another live
        server's spares (tests run several on one host) and this process's stay."""
        removed: list[str] = []
        async with _netlink() as ipr:
            links = [x async for x in await ipr.link("dump")]
        for link in links:
            ifname = link.get_attr("IFLA_IFNAME") or ""
            index = self.names.parse_host_link(ifname)
            owner = self.names.alias_owner(link.get_attr("IFLA_IFALIAS"))
            if index is not None and owner is not None and not pid_alive(owner):
                await _delete_link(ifname)
                async with self._lock:
                    self._used.discard(index)
                removed.append(ifname)
        if os.path.isdir(NETNS_RUN_DIR):
            for name in os.listdir(NETNS_RUN_DIR):
                owner = self.names.spare_owner(name)
                if owner is not None and not pid_alive(owner):
                    _remove_netns(name)
                    removed.append(name)
        return removed

    def _pick_index(self) -> int:
        for i in range(self.capacity):
            cand = (self._next + i) % self.capacity
            if cand not in self._used:
                self._next = (cand + 1) % self.capacity
                return cand
        raise Unavailable(f"no free network slot in {self.subnet}")

    async def _create(self, slot: NetSlot, *, exclusive: bool = False) -> None:
        # create=True: the namespace is made (`exclusive`: FileExistsError if it is there already).
        async with _netlink(netns=slot.netns, create=True, exclusive=exclusive) as ns, _netlink() as root:
            await ns.link("add", ifname=GUEST_LINK, kind="veth", address=constants.GUEST_MAC,
                          peer={"ifname": GATEWAY_LINK, "address": constants.GUEST_GATEWAY_MAC})
            # The netns now exists: plug the host-facing veth into it.
            try:
                await root.link("add", ifname=slot.veth_host, kind="veth",
                                peer={"ifname": NS_HOST_LINK, "net_ns_fd": slot.netns})
            except NetlinkError as e:
                if e.code == errno.EEXIST:
                    raise _LinkTaken(slot.veth_host) from e
                raise
            idx = _host_index(slot.veth_host)
            await root.link("set", index=idx, ifalias=slot.sandbox_id or self.names.spare_alias(self._owner))
            _disable_ipv6(slot.veth_host)
            await root.addr("add", index=idx, address=slot.peer_ip, prefixlen=30)
            await root.link("set", index=idx, state="up")

            links = await _ns_links(ns)
            eth0, gw0, host0 = (links[name].index for name in (GUEST_LINK, GATEWAY_LINK, NS_HOST_LINK))
            p = constants.GUEST_PREFIXLEN
            await ns.addr("add", index=eth0, address=constants.GUEST_IP, prefixlen=p)
            await ns.addr("add", index=gw0, address=constants.GUEST_GATEWAY_IP, prefixlen=p)
            await ns.addr("add", index=host0, address=slot.host_ip, prefixlen=30)
            await _host_neighbours(slot, root, idx, ns, links[NS_HOST_LINK])
            # Only eth0 and lo are up: runsc takes over every UP interface and copies its routes to the
            # guest. A down lo would leave the guest without 127.0.0.1 (runsc skips down links).
            await ns.link("set", index=eth0, state="up")
            await ns.link("set", index=links["lo"].index, state="up")
            await ns.route("add", dst="0.0.0.0/0", gateway=constants.GUEST_GATEWAY_IP, oif=eth0)
            await _gateway_neighbour(ns, eth0)

    async def install_rules(self, slot: NetSlot, policy: EgressPolicy) -> None:
        """The slot's egress rules (nft in the netns, the domain proxy, the internet switch, bandwidth):
        part of `allocate`, or run by its caller before `activate` (`allocate(rules=False)`)."""
        await self.egress.configure(slot.sandbox_id, slot.netns_path, policy)
        await nft.run(_netns_ruleset(slot.host_ip, policy, self.platform), netns_path=slot.netns_path,
                      sysctls=_NETNS_SYSCTLS)
        self._policies[slot.sandbox_id] = policy
        if slot.allow_internet:
            await self.set_internet(slot, True)
        await cap_bandwidth(slot, self.settings.sandbox_bandwidth_mbit)

    async def apply_policy(self, slot: NetSlot, policy: EgressPolicy) -> NetSlot:
        """Replace the slot's egress rules live (one atomic nft transaction); returns the slot as updated.

        Flows the new rules deny are cut at their next packet. Connections already handed to the
        egress proxy were checked when they opened and keep going while the sandbox still has
        domain rules; removing all of them closes the proxy (and resets those connections).
        """
        if policy.inspects:
            await self.egress.configure(slot.sandbox_id, slot.netns_path, policy)  # listen before redirecting
        await nft.run(_netns_ruleset(slot.host_ip, policy, self.platform), netns_path=slot.netns_path)
        self._policies[slot.sandbox_id] = policy
        if not policy.inspects:
            await self.egress.configure(slot.sandbox_id, slot.netns_path, policy)
        if slot.allow_internet != policy.may_egress:
            slot = await self.set_internet(slot, policy.may_egress)
        return slot

    def policy_for(self, sandbox_id: str) -> EgressPolicy | None:
        return self._policies.get(sandbox_id)

    async def activate(self, slot: NetSlot, guest_mac: str | None = None) -> None:
        """Bring up the netns-kernel side once the runtime owns eth0 (after run/restore returned).

        `guest_mac`: the guest's MAC when the runtime takes eth0's (gVisor), as a permanent neighbour
        of gw0: the slot's kernel then never ARPs for the guest. A just-restored guest missed those
        requests now and then, and every connection to it waited ~1 s for the next round."""
        self.spares.up(slot.sandbox_id)
        async with _netlink(netns=slot.netns) as ns:
            links = await _ns_links(ns)
            for ifname in (GATEWAY_LINK, NS_HOST_LINK):
                await ns.link("set", index=links[ifname].index, state="up")
            if guest_mac is not None:
                await ns.neigh("replace", dst=constants.GUEST_IP, lladdr=guest_mac, ifindex=links[GATEWAY_LINK].index,
                               state=NUD_PERMANENT)

            host0 = links[NS_HOST_LINK].index
            # runsc stripped eth0's address (and with it the guest default route); the netns kernel
            # now routes everything that is not the guest /30 back to the host.
            await ns.route("replace", dst="0.0.0.0/0", gateway=slot.peer_ip, oif=host0)

    async def deactivate(self, slot: NetSlot) -> None:
        """Undo activate() so the slot can take another runsc run/restore (e.g. a checkpointed
        sandbox restored into its own slot): gw0/host0 down, eth0 re-addressed with the guest route."""
        async with _netlink(netns=slot.netns) as ns, _netlink() as root:
            links = await _ns_links(ns)
            for ifname in (GATEWAY_LINK, NS_HOST_LINK):
                await ns.link("set", index=links[ifname].index, state="down")
            # a link taken down lost its neighbours, permanent ones too; written on the down link
            # they stay when `activate` brings it up, as `_create`'s do
            await _host_neighbours(slot, root, _host_index(slot.veth_host), ns, links[NS_HOST_LINK])
            eth0 = links[GUEST_LINK].index
            try:
                await ns.addr("add", index=eth0, address=constants.GUEST_IP, prefixlen=constants.GUEST_PREFIXLEN)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise
            await ns.link("set", index=eth0, state="up")
            await ns.route("replace", dst="0.0.0.0/0", gateway=constants.GUEST_GATEWAY_IP, oif=eth0)
            await _gateway_neighbour(ns, eth0)

    # ---------------------------------------------------------------- release

    async def release(self, slot: NetSlot, *, reuse: bool = False) -> None:
        """The slot goes. `reuse`: the caller knows nothing of its sandbox runs any more (its runtime
        stopped it, and the runtime is not a VM: a VM's tap devices would stay in the netns), so
        the slot may become a spare again (`spares.py`)."""
        self.spares.up(slot.sandbox_id)
        if reuse and slot.sandbox_id and self.spares.wants() and await self._recycle(slot):
            return
        await self._teardown(slot)
        async with self._lock:
            if self._slots.get(slot.sandbox_id, slot).index == slot.index:
                self._slots.pop(slot.sandbox_id, None)
            self._used.discard(slot.index)

    async def release_id(self, sandbox_id: str) -> bool:
        """Release the sandbox's slot, or just its netns when no root-ns link names it any more (a
        teardown cut short between the two); whether there was anything to remove."""
        slot = self.slot_for(sandbox_id)
        if slot is not None:
            await self.release(slot)
            return True
        name = self.names.netns_name(sandbox_id)
        if not os.path.exists(os.path.join(NETNS_RUN_DIR, name)):
            return False
        await self.egress.close(sandbox_id)
        _remove_netns(name)
        return True

    async def _teardown(self, slot: NetSlot) -> None:
        # The proxy's listener holds a reference to the netns: close it first or the namespace lives on.
        await self.egress.close(slot.sandbox_id)
        self._policies.pop(slot.sandbox_id, None)
        await asyncio.gather(_delete_link(slot.veth_host), self._forget_internet(slot.veth_host))
        _remove_netns(slot.netns)

    async def _forget_internet(self, ifname: str) -> None:
        with contextlib.suppress(nft.NftError):  # not there: the slot had no internet
            await nft.run(f'delete element ip {self.names.host_table} internet {{ "{ifname}" }}')

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove every agentenv netns / aeh* link whose sandbox id is not in `keep`."""
        removed: set[str] = set()
        async with _netlink() as ipr:
            links = [x async for x in await ipr.link("dump")]
        for link in links:
            ifname = link.get_attr("IFLA_IFNAME") or ""
            index = self.names.parse_host_link(ifname)
            if index is None or self.names.alias_owner(link.get_attr("IFLA_IFALIAS")) is not None:
                continue  # spares: `drop_stale_spares`
            sid = link.get_attr("IFLA_IFALIAS") or ""
            if sid in keep:
                continue
            if sid:
                await self.egress.close(sid)
            await asyncio.gather(_delete_link(ifname), self._forget_internet(ifname))
            async with self._lock:
                self._used.discard(index)
                if sid:
                    self._slots.pop(sid, None)
            removed.add(sid or ifname)
        if os.path.isdir(NETNS_RUN_DIR):
            for name in os.listdir(NETNS_RUN_DIR):
                sid = self.names.sandbox_of_netns(name)
                if sid is None or sid in keep:
                    continue
                await self.egress.close(sid)
                _remove_netns(name)
                self._slots.pop(sid, None)
                removed.add(sid)
        return sorted(removed)


def _scan_kernel_sync(host_table: str) -> tuple[list, str]:
    with IPRoute() as ipr:
        links = list(ipr.link("dump"))
    try:
        return links, nft.run_here(f"list set ip {host_table} internet")
    except nft.NftError:
        return links, ""


async def _host_neighbours(slot: NetSlot, root: AsyncIPRoute, veth_host: int, ns: AsyncIPRoute, host0: _Link) -> None:
    """Both ends of the host-facing veth know each other's MAC for good: no ARP on it. With ARP, now
    and then every connection to a just-created or just-restored sandbox went unanswered for ~1 s
    (the default ARP retry) although the guest's side had permanent neighbours already (measured on
    the dev server: 1 of 40 creates, envd's health check answered after 1.03 s; none in 230 creates
    and 40 resumes with these entries)."""
    await root.neigh("replace", dst=slot.host_ip, lladdr=host0.mac, ifindex=veth_host, state=NUD_PERMANENT)
    await ns.neigh("replace", dst=slot.peer_ip, lladdr=await _mac(root, veth_host), ifindex=host0.index,
                   state=NUD_PERMANENT)


async def _mac(ipr: AsyncIPRoute, index: int) -> str:
    (link,) = await ipr.link("get", index=index)
    return link.get_attr("IFLA_ADDRESS")


class _Link(NamedTuple):
    index: int
    mac: str


async def _ns_links(ns: AsyncIPRoute) -> dict[str, _Link]:
    """The links of a slot's netns (lo, eth0, gw0, host0) by name: one dump, where a `link_lookup`
    per name cost ~0.4 ms of the server's CPU each. KeyError for a name that is not there."""
    return {link.get_attr("IFLA_IFNAME"): _Link(link["index"], link.get_attr("IFLA_ADDRESS"))
            async for link in await ns.link("dump")}


async def _gateway_neighbour(ns: AsyncIPRoute, eth0: int) -> None:
    """The gateway's MAC as a permanent neighbour of eth0: runsc copies eth0's permanent neighbours
    into the sandbox's network stack when it takes the link (runsc/sandbox/network.go), so the guest
    never ARPs for its gateway, which it could do while gw0 is still down (gw0 comes up after the
    run or restore, `activate`)."""
    await ns.neigh("replace", dst=constants.GUEST_GATEWAY_IP, lladdr=constants.GUEST_GATEWAY_MAC, ifindex=eth0,
                   state=NUD_PERMANENT)


def _disable_ipv6(ifname: str) -> None:
    try:
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1\n")
    except OSError:
        pass  # IPv6 compiled out or disabled globally


def _host_index(ifname: str) -> int:
    """The index of a link of the server's own network namespace: one ioctl (`if_nametoindex`),
    where pyroute2's `link_lookup` dumps every link and costs ~0.4 ms of the server's CPU.
    OSError (ENODEV) when there is no such link."""
    try:
        return socket.if_nametoindex(ifname)
    except OSError:  # Python's carries no errno
        raise OSError(errno.ENODEV, f"no link named {ifname}") from None


async def _delete_link(ifname: str) -> None:
    try:
        idx = _host_index(ifname)
    except OSError as e:
        if e.errno == errno.ENODEV:
            return
        raise
    async with _netlink() as ipr:
        try:
            await ipr.link("del", index=idx)
        except NetlinkError as e:
            if not _ignore(e, errno.ENODEV):
                raise


async def _set_alias(ifname: str, alias: str) -> None:
    idx = _host_index(ifname)
    async with _netlink() as root:
        await root.link("set", index=idx, ifalias=alias)


def _remove_netns(name: str) -> None:
    """Unmount + unlink /run/netns/<name>; the namespace dies with its last user."""
    path = os.path.join(NETNS_RUN_DIR, name)
    if not os.path.exists(path):
        return
    try:
        pr_netns.remove(name)
    except FileNotFoundError:
        pass
