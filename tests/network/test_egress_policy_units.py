"""Egress policy parsing and the egress proxy's server-name extraction (no sandbox needed).

ClientHellos come from Python's real TLS stack (ssl.MemoryBIO), not from hand-made bytes.
"""

from __future__ import annotations

import ssl

import pytest

from agentenv.errors import BadRequest
from agentenv.network.egress import head_complete, http_host, server_name, tls_sni
from agentenv.network.policy import ALL_TRAFFIC, parse_policy, platform_sets


def client_hello(server_hostname: str | None) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_from_a_real_client_hello():
    hello = client_hello("api.example.com")
    assert head_complete(hello)
    assert tls_sni(hello) == "api.example.com"
    assert server_name(hello) == "api.example.com"
    # cut anywhere: not complete yet, and never a wrong name
    for cut in (1, 5, 40, len(hello) // 2, len(hello) - 1):
        assert not head_complete(hello[:cut])
        assert tls_sni(hello[:cut]) in (None, "api.example.com")


def test_no_sni_means_no_name():
    hello = client_hello(None)
    assert head_complete(hello)
    assert server_name(hello) is None


def test_http_host():
    req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nhOsT: Example.COM:8080\r\n\r\n"
    assert head_complete(req) and http_host(req) == "Example.COM:8080".rsplit(":", 1)[0]
    assert not head_complete(b"GET / HTTP/1.1\r\nHost: a\r\n")
    assert not head_complete(b"GE")
    assert head_complete(b"SSH-2.0-OpenSSH\r\n") and server_name(b"SSH-2.0-OpenSSH\r\n") is None
    assert http_host(b"GET / HTTP/1.0\r\n\r\n") is None
    assert http_host(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None


def test_policy_precedence_and_names():
    p = parse_policy(True, {"allowOut": ["Example.com.", "*.wild.test", "1.2.3.4", "10.0.0.0/8"],
                            "denyOut": ["0.0.0.0/0"]})
    assert p.allow_cidrs == ("1.2.3.4/32", "10.0.0.0/8", "8.8.8.8/32")  # + the default DNS server
    assert p.deny_cidrs == (ALL_TRAFFIC,)
    assert p.inspects and p.may_egress
    assert p.allows_name("example.com") and p.allows_name("EXAMPLE.COM.")
    assert not p.allows_name("sub.example.com")
    assert p.allows_name("a.wild.test") and p.allows_name("a.b.wild.test")
    assert not p.allows_name("wild.test") and not p.allows_name("xwild.test") and not p.allows_name("")
    # nothing to inspect without a deny rule; everything denied and nothing allowed: no egress at all
    assert not parse_policy(True, {"allowOut": ["example.com"]}).inspects
    closed = parse_policy(False, None)
    assert closed.deny_cidrs == (ALL_TRAFFIC,) and not closed.may_egress
    assert parse_policy(False, {"allowOut": ["1.1.1.1"]}).may_egress
    assert parse_policy(True, {"allowOut": ["x.test"], "denyOut": ["0.0.0.0/0"], "dnsServers": []}).allow_cidrs == ()


@pytest.mark.parametrize("network, word", [
    ({"denyOut": ["example.com"]}, "denyOut"),
    ({"allowOut": ["a b"]}, "allowOut"),
    ({"allowOut": ["*"]}, "allowOut"),
    ({"allowOut": ["::1"]}, "IPv4"),
    ({"allowOut": ["x.test"], "dnsServers": ["dns.google"]}, "dnsServers"),
    ({"egressProxy": {"address": "p:1080"}}, "egressProxy"),
])
def test_invalid_policies(network, word):
    with pytest.raises(BadRequest, match=word):
        parse_policy(True, network)


def test_platform_sets():
    hard, platform, opened = platform_sets("10.213.0.0/16", ["10.215.0.0/16", "fd00::/8"])
    assert "127.0.0.0/8" in hard and "10.213.0.0/16" in hard
    assert {"10.0.0.0/8", "100.64.0.0/10", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"} <= set(platform)
    assert opened == ["10.215.0.0/16"]


def test_operator_setting_is_validated():
    from pydantic import ValidationError

    from agentenv.config import Settings

    assert Settings(egress_allow_cidrs=["10.1.2.3", "172.20.0.0/16"]).egress_allow_cidrs == ["10.1.2.3", "172.20.0.0/16"]
    for bad in (["nope"], ["fd00::/8"]):
        with pytest.raises(ValidationError, match="egress_allow_cidrs"):
            Settings(egress_allow_cidrs=bad)
