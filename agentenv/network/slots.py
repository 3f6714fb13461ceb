"""Network slots: one network namespace per sandbox, reachable from the host.

Inside every slot the sandbox sees the same address (constants.GUEST_IP); the host reaches it
through the slot's own host-side address, DNAT'ed to the guest address inside the namespace.
That makes a checkpoint restorable into any fresh slot unchanged (fork children).

Topology of slot <i> (addresses from settings.slot_subnet, one /30 per slot):

    root netns                      netns agentenv-<sandbox_id> (agentenv-_<pid>_<i> while spare)
    aeh<i>  (base+4i+1/30) <veth>   host0 (base+4i+2/30 = host_ip, DNAT -> GUEST_IP)
                                    gw0   (GUEST_GATEWAY_IP/30) <veth> eth0 (GUEST_IP/30, owned by gVisor)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

NETNS_PREFIX = "agentenv-"
HOST_LINK_PREFIX = "aeh"  # root-ns end of the host-facing veth: aeh<index>
GUEST_LINK = "eth0"       # the interface the sandbox runtime takes over
GATEWAY_LINK = "gw0"      # netns end of the guest veth, carries GUEST_GATEWAY_IP
NS_HOST_LINK = "host0"    # netns end of the host-facing veth, carries host_ip
NETNS_RUN_DIR = "/run/netns"


@dataclass(frozen=True)
class SlotNames:
    """Host-global names of one agentenv instance's network objects.

    Several agentenv instances (node agents of a test cluster, parallel test sessions, a developer's
    second server) can share one host only if their netns, root-ns links and nft table never
    collide: a non-empty ``instance`` tag (settings.instance) goes into every name. The default
    (empty) tag keeps the plain names. Sandbox ids never contain ``-``, so ``agentenv-<id>`` and
    ``agentenv-<tag>-<id>`` cannot be mistaken for each other.
    """

    instance: str = ""

    @property
    def netns_prefix(self) -> str:
        return f"{NETNS_PREFIX}{self.instance}-" if self.instance else NETNS_PREFIX

    @property
    def link_prefix(self) -> str:
        return f"ae{self.instance}h" if self.instance else HOST_LINK_PREFIX

    @property
    def host_table(self) -> str:
        return f"agentenv-{self.instance}" if self.instance else "agentenv"

    def netns_name(self, sandbox_id: str) -> str:
        return f"{self.netns_prefix}{sandbox_id}"

    # A slot built ahead of demand (`network/spares.py`) belongs to a server process, not a sandbox:
    # its netns is `<prefix>_<pid>_<index>` and its root-ns link's alias `_<pid>` (`_` is in no
    # sandbox id), so a server never takes another live server's spares for stale ones.

    def spare_netns_name(self, owner: int, index: int) -> str:
        return f"{self.netns_prefix}_{owner}_{index}"

    def spare_owner(self, netns_name: str) -> int | None:
        """The server process a spare's netns name names, or None if it is no spare of ours."""
        rest = netns_name[len(self.netns_prefix):] if netns_name.startswith(self.netns_prefix) else ""
        owner, _, index = rest[1:].partition("_")
        return int(owner) if rest.startswith("_") and owner.isdigit() and index.isdigit() else None

    @staticmethod
    def spare_alias(owner: int) -> str:
        return f"_{owner}"

    @staticmethod
    def alias_owner(alias: str | None) -> int | None:
        """The server process a root-ns link's alias names as a spare's owner (None: a sandbox's)."""
        return int(alias[1:]) if alias and alias.startswith("_") and alias[1:].isdigit() else None

    def sandbox_of_netns(self, name: str) -> str | None:
        """The sandbox id a netns name of this instance encodes, or None if it is not ours."""
        if not name.startswith(self.netns_prefix):
            return None
        sid = name[len(self.netns_prefix):]
        return sid if sid and "-" not in sid and "_" not in sid else None

    def host_link_name(self, index: int) -> str:
        return f"{self.link_prefix}{index}"

    def parse_host_link(self, ifname: str) -> int | None:
        """Slot index encoded in a root-ns link name, or None if it is not one of ours."""
        rest = ifname[len(self.link_prefix):] if ifname.startswith(self.link_prefix) else ""
        return int(rest) if rest.isdigit() else None


def slot_addresses(subnet: str, index: int) -> tuple[str, str]:
    """(root-ns peer address, host_ip) of slot `index`: the 2 usable hosts of its /30."""
    net = ipaddress.IPv4Network(subnet)
    capacity = net.num_addresses // 4
    if not 0 <= index < capacity:
        raise ValueError(f"slot index {index} outside {subnet} (capacity {capacity})")
    base = int(net.network_address) + 4 * index
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def slot_capacity(subnet: str) -> int:
    return ipaddress.IPv4Network(subnet).num_addresses // 4


@dataclass(frozen=True)
class NetSlot:
    index: int
    netns: str       # name under /run/netns
    netns_path: str  # /run/netns/<name>
    host_ip: str     # address the host connects to; DNAT'ed to GUEST_IP inside the netns
    veth_host: str   # host-side interface name
    sandbox_id: str = ""          # owner (also stored as the root-ns link's ifalias for rediscovery)
    peer_ip: str = ""             # root-ns address of veth_host: the netns' default gateway
    allow_internet: bool = True   # forwarded + masqueraded out of the host when True


class SlotAllocator:
    """Placeholder: the real implementation lives in agentenv.network.manager (NetworkManager)."""
