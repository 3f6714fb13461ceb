"""E2B-shaped ids: a letter + 20 chars of [a-z0-9] (the proxy's host routing needs ^[a-z0-9]+$)."""

from __future__ import annotations

import secrets
import string

_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def new_sandbox_id() -> str:
    return new_id("i")


def new_snapshot_id() -> str:
    return new_id("s")
