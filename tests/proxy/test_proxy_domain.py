"""Which `domain` the API hands to SDKs, so that `get_host(port)` names a host the proxy serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.config import Settings


@pytest.mark.parametrize(
    ("kwargs", "domain"),
    [
        ({"host": "127.0.0.1", "port": 3000}, "localhost:3000"),
        ({"host": "0.0.0.0", "port": 8080}, "localhost:8080"),  # printed URL is loopback
        ({"public_url": "http://localhost:4000/"}, "localhost:4000"),
        ({"public_url": "http://[::1]:4001"}, "localhost:4001"),
        ({"public_url": "https://sandbox.example.com"}, None),  # needs AGENTENV_DOMAIN + wildcard DNS
        ({"public_url": "http://10.1.2.3:3000"}, None),
        ({"domain": "sandbox.example.com", "public_url": "http://127.0.0.1:3000"}, "sandbox.example.com"),
    ],
)
def test_sandbox_domain(kwargs: dict, domain: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AGENTENV_DOMAIN", "AGENTENV_PUBLIC_URL", "AGENTENV_HOST", "AGENTENV_PORT", "AGENTENV_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    assert Settings(data_dir=tmp_path, **kwargs).sandbox_domain() == domain
