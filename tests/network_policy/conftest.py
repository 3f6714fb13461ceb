"""Fixtures of the egress-policy suite (defined in netpolicy_util, next to the helpers they use)."""

from netpolicy_util import host_listener, test_hosts, tracker  # noqa: F401 - pytest fixtures
