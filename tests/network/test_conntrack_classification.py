"""Which guest TCP flows block a gVisor checkpoint, as read from the slot's conntrack table."""

from __future__ import annotations

from agentenv.constants import ENVD_PORT, GUEST_IP
from agentenv.network.manager import guest_blocking, parse_conntrack

HOST, SLOT = "10.213.0.9", "10.213.0.10"


def inbound(port: int, state: str, mark: int, sport: int = 40000, timeout: int = 60) -> str:
    return (f"ipv4 2 tcp 6 {timeout} {state} src={HOST} dst={SLOT} sport={sport} dport={port} "
            f"src={GUEST_IP} dst={HOST} sport={port} dport={sport} [ASSURED] mark={mark} zone=0 use=2")


def outbound(state: str, mark: int) -> str:
    return (f"ipv4 2 tcp 6 60 {state} src={GUEST_IP} dst=192.0.2.7 sport=51000 dport=443 "
            f"src=192.0.2.7 dst={SLOT} sport=443 dport=51000 [ASSURED] mark={mark} zone=0 use=2")


def blocking(*lines: str) -> list[str]:
    return [f["flow"] for f in guest_blocking(parse_conntrack("\n".join(lines)))]


def test_live_and_closing_states_always_block():
    for state in ("ESTABLISHED", "SYN_RECV", "FIN_WAIT", "CLOSE_WAIT", "LAST_ACK"):
        assert blocking(inbound(8080, state, 0)), state
    assert blocking(outbound("ESTABLISHED", 0))


def test_time_wait_where_the_guest_closed_first_blocks():
    assert blocking(inbound(8080, "TIME_WAIT", 0x1))
    assert blocking(outbound("TIME_WAIT", 0x1))  # e.g. pip/git closing their connections


def test_simultaneous_or_passive_close_on_a_user_port_is_presumed_blocking():
    # remote FIN seen first, guest FIN after: passive close or a simultaneous one (both sides in TIME_WAIT)
    assert blocking(inbound(8080, "TIME_WAIT", 0x3))


def test_envd_never_closes_first_so_its_passive_closes_do_not_block():
    assert blocking(inbound(ENVD_PORT, "TIME_WAIT", 0x3)) == []
    # ...but if envd's side did close first, it blocks like any other
    assert blocking(inbound(ENVD_PORT, "TIME_WAIT", 0x1))


def test_reset_connections_and_other_protocols_do_not_block():
    assert blocking(inbound(8080, "CLOSE", 0x0)) == []
    udp = f"ipv4 2 udp 17 29 src={GUEST_IP} dst=192.0.2.53 sport=5353 dport=53 src=192.0.2.53 dst={SLOT} mark=0 use=1"
    assert blocking(udp) == []


def test_seconds_left_comes_from_conntrack():
    (flow,) = guest_blocking(parse_conntrack(inbound(8080, "TIME_WAIT", 0x1, timeout=37)))
    assert flow["seconds_left"] == 37
