"""Egress policy of one sandbox: what its guest may connect to.

Two layers, evaluated in this order for every new outbound flow (see docs/network.md):

1. Platform (operator) rules, the same for every sandbox of a node: destinations that a sandbox
   never reaches — host loopback, the slot subnet (the node's other sandboxes and the host's
   slot-side addresses), link-local / cloud metadata, RFC 1918, CGNAT, multicast and reserved
   ranges — unless the operator opens some of them (`Settings.egress_allow_cidrs`). Loopback and
   the slot subnet can never be opened. The host's own addresses are refused independently of
   their value by the root-ns `input` chain (nothing new from a slot link is accepted there).
2. The sandbox's E2B options: `allowOut` (CIDRs, IPs, domain names, `*.domain` wildcards) always
   wins over `denyOut` (CIDRs, IPs); `allow_internet_access=false` means `denyOut: [0.0.0.0/0]`;
   everything not denied is allowed. A domain in `allowOut` can only be decided from the flow's
   content, so TCP to a denied destination is redirected to the egress proxy (TLS SNI / HTTP
   Host) whenever `allowOut` names a domain; the DNS servers (`dnsServers`, default 8.8.8.8)
   are then allowed too.

The policy is pure data: `agentenv.network.manager` renders it into the slot's nft table and
`agentenv.network.egress` applies its domain part.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from agentenv.errors import BadRequest

# Always denied unless the operator opens them (Settings.egress_allow_cidrs).
PLATFORM_DENIED: tuple[str, ...] = (
    "0.0.0.0/8",        # "this network"
    "10.0.0.0/8",       # RFC 1918
    "100.64.0.0/10",    # CGNAT (RFC 6598)
    "169.254.0.0/16",   # link-local, incl. cloud metadata 169.254.169.254
    "172.16.0.0/12",    # RFC 1918
    "192.0.0.0/24",     # IETF protocol assignments
    "192.168.0.0/16",   # RFC 1918
    "198.18.0.0/15",    # benchmarking
    "224.0.0.0/4",      # multicast
    "240.0.0.0/4",      # reserved + limited broadcast
)
# Never reachable, whatever the operator says (the slot subnet is added per node).
HARD_DENIED: tuple[str, ...] = ("127.0.0.0/8",)

DEFAULT_DNS_SERVERS: tuple[str, ...] = ("8.8.8.8",)
ALL_TRAFFIC = "0.0.0.0/0"
MAX_ENTRIES = 1000
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN_RE = re.compile(rf"^(\*\.)?(?:{_LABEL}\.)*{_LABEL}$")
# Fields of the `network` object that PUT /sandboxes/{id}/network replaces (the others stay).
EGRESS_FIELDS = ("allowOut", "denyOut", "dnsServers", "egressProxy", "rules")


def _cidr(entry: str, field_name: str) -> str | None:
    """`entry` as a normalized IPv4 network, None if it is not an address/CIDR at all."""
    try:
        net = ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None
    if net.version != 4:
        raise BadRequest(f"{field_name}: {entry!r}: only IPv4 destinations are supported (sandboxes have no IPv6)")
    return str(net)


def normalize_domain(name: str) -> str:
    return name.strip().rstrip(".").lower()


@dataclass(frozen=True)
class EgressPolicy:
    allow_cidrs: tuple[str, ...] = ()
    deny_cidrs: tuple[str, ...] = ()
    allow_domains: tuple[str, ...] = ()  # normalized; "*.x" matches subdomains of x at any depth
    dns_servers: tuple[str, ...] = field(default=())

    @property
    def inspects(self) -> bool:
        """Whether TCP to denied destinations goes through the egress proxy (domain rules apply)."""
        return bool(self.allow_domains) and bool(self.deny_cidrs)

    @property
    def may_egress(self) -> bool:
        """False only when nothing at all can leave (everything denied, nothing allowed)."""
        return not (ALL_TRAFFIC in self.deny_cidrs and not self.allow_cidrs and not self.allow_domains)

    def allows_name(self, name: str) -> bool:
        """Whether a server name (SNI / Host) is allowed by a domain entry of allowOut."""
        name = normalize_domain(name)
        if not name:
            return False
        for d in self.allow_domains:
            if d.startswith("*."):
                if name.endswith(d[1:]) and len(name) > len(d) - 1:
                    return True
            elif name == d:
                return True
        return False


def parse_policy(allow_internet_access: bool, network: dict | None) -> EgressPolicy:
    """The policy of a sandbox record; BadRequest (400) for entries that are not valid."""
    network = network or {}
    allow_out = network.get("allowOut") or []
    deny_out = network.get("denyOut") or []
    if len(allow_out) > MAX_ENTRIES or len(deny_out) > MAX_ENTRIES:
        raise BadRequest(f"allowOut/denyOut: at most {MAX_ENTRIES} entries each")
    allow_cidrs: list[str] = []
    domains: list[str] = []
    for entry in allow_out:
        if not isinstance(entry, str) or not entry.strip():
            raise BadRequest(f"allowOut: {entry!r} is not a CIDR, an IP address or a domain name")
        net = _cidr(entry, "allowOut")
        if net is not None:
            allow_cidrs.append(net)
            continue
        name = normalize_domain(entry)
        if name == "*" or not _DOMAIN_RE.match(name):
            raise BadRequest(f"allowOut: {entry!r} is not a CIDR, an IP address or a domain name")
        domains.append(name)
    deny_cidrs: list[str] = []
    for entry in deny_out:
        net = _cidr(entry, "denyOut") if isinstance(entry, str) else None
        if net is None:
            raise BadRequest(f"denyOut: {entry!r} is not a CIDR or an IP address (domain names are only "
                             "supported in allowOut)")
        deny_cidrs.append(net)
    if not allow_internet_access:
        deny_cidrs.append(ALL_TRAFFIC)
    dns: list[str] = []
    raw_dns = network.get("dnsServers")
    for entry in (DEFAULT_DNS_SERVERS if raw_dns is None else raw_dns):
        try:
            ip = ipaddress.ip_address(entry)
        except (TypeError, ValueError):
            raise BadRequest(f"dnsServers: {entry!r} is not an IPv4 address") from None
        if ip.version != 4:
            raise BadRequest(f"dnsServers: {entry!r} is not an IPv4 address")
        dns.append(str(ip))
    if len(dns) > 10:
        raise BadRequest("dnsServers: at most 10 entries")
    if network.get("egressProxy"):
        raise BadRequest("egressProxy is not supported by this server")
    if domains:
        allow_cidrs += [f"{d}/32" for d in dns]
    return EgressPolicy(allow_cidrs=tuple(dict.fromkeys(allow_cidrs)), deny_cidrs=tuple(dict.fromkeys(deny_cidrs)),
                        allow_domains=tuple(dict.fromkeys(domains)), dns_servers=tuple(dns))


def platform_sets(slot_subnet: str, operator_allow: list[str] | tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """(hard-denied, platform-denied, operator-opened) CIDR lists for the nft sets."""
    opened = []
    for entry in operator_allow:
        net = ipaddress.ip_network(entry, strict=False)
        if net.version == 4:
            opened.append(str(net))
    return [*HARD_DENIED, str(ipaddress.ip_network(slot_subnet, strict=False))], list(PLATFORM_DENIED), opened
