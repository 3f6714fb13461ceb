"""Data-plane proxy: routes SDK traffic into sandboxes (see traffic.py)."""

from agentenv.proxy.traffic import (
    LISTENER_OPTIONS,
    ProxyStats,
    SandboxResolver,
    SandboxRoute,
    TrafficProxy,
    file_signature,
)

__all__ = ["LISTENER_OPTIONS", "ProxyStats", "SandboxResolver", "SandboxRoute", "TrafficProxy", "file_signature"]
