"""Per-sandbox bandwidth caps with tc in the slot's netns.

Every byte to or from a sandbox crosses its netns kernel: towards the guest it leaves through
`gw0` (the guest veth's peer), from the guest it leaves through `host0` (towards the host and the
internet). A token-bucket qdisc on the egress of each caps both directions without touching the
root namespace. One `tc -batch` process installs both.
"""

from __future__ import annotations

from agentenv.errors import RuntimeFailure
from agentenv.network.slots import GATEWAY_LINK, NS_HOST_LINK, NetSlot
from agentenv.proc import run_cmd

TC_TIMEOUT = 10.0


def tbf_batch(mbit: int) -> str:
    # burst: at least rate/HZ-ish and a few MTUs; latency bounds the queue (drops beyond it).
    burst_kb = max(32, mbit * 1000 // 8 // 100)  # ~10 ms of traffic
    return "".join(f"qdisc replace dev {dev} root tbf rate {mbit}mbit burst {burst_kb}kb latency 50ms\n"
                   for dev in (GATEWAY_LINK, NS_HOST_LINK))


async def cap_bandwidth(slot: NetSlot, mbit: int) -> None:
    """Limit the sandbox of `slot` to `mbit` Mbit/s in each direction (no-op for 0)."""
    if mbit <= 0:
        return
    res = await run_cmd(["tc", "-n", slot.netns, "-batch", "-"], input=tbf_batch(mbit).encode(),
                        timeout=TC_TIMEOUT, check=False, what="tc bandwidth cap")
    if res.returncode != 0:
        raise RuntimeFailure(f"tc: cannot cap bandwidth of {slot.netns}: {res.stderr.strip()[-300:]}")
