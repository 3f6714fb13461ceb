"""TCP endpoints inside the sandbox, for the host's pre-checkpoint check.

gVisor resets TCP connections when it checkpoints (`--net-disconnect-ok`), but an event-loop server
whose connection is reset during the save can come back unable to accept after a restore. The host
therefore asks envd, before pausing, forking or snapshotting, whether anything other than listeners
(and TIME_WAIT remnants) is open, and if so has the runtime reset the connections first, while the
sandbox runs (see runtimes/gvisor.py).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import asdict, dataclass

# Linux /proc/net/tcp state codes.
_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
    "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
    "0B": "CLOSING",
}


@dataclass(frozen=True)
class Endpoint:
    local: str
    remote: str
    state: str


def _addr(hexaddr: str) -> tuple[str, int]:
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        ip = str(ipaddress.IPv6Address(words))
        if ip.startswith("::ffff:"):
            ip = ip[7:]
    return ip, int(port_hex, 16)


def tcp_endpoints(paths: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> list[Endpoint]:
    out: list[Endpoint] = []
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 4:
                continue
            (lip, lport), (rip, rport) = _addr(cols[1]), _addr(cols[2])
            out.append(Endpoint(f"{lip}:{lport}", f"{rip}:{rport}", _STATES.get(cols[3].upper(), cols[3])))
    return out


def blocking_endpoints(exclude_remote: tuple[str, int] | None = None) -> list[dict]:
    """Endpoints that would block a checkpoint, minus the connection asking (`exclude_remote`)."""
    skip = f"{exclude_remote[0]}:{exclude_remote[1]}" if exclude_remote else None
    return [asdict(e) for e in tcp_endpoints() if e.state != "LISTEN" and e.remote != skip]
