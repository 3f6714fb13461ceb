"""Mutable daemon state shared by all handlers (token, global env, defaults) and the selected-user helper."""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from dataclasses import dataclass, field

from aiohttp import web

from agentenv.constants import DEFAULT_USER
from agentenv.envd.connect import ConnectError
from agentenv.envd.users import UnknownUser, User, UserExecutor, lookup_user

STATE_KEY: web.AppKey["EnvdState"] = web.AppKey("envd_state")

UNAUTHORIZED_MESSAGE = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)
# The orchestrator's credential for envd (re-init, connection checks, staged file transfers).
HOST_TOKEN_HEADER = "X-Agentenv-Host-Token"


@dataclass
class EnvdState:
    host_token: str | None = None
    max_upload: int | None = None
    access_token: str | None = None
    initialized: bool = False
    env_vars: dict[str, str] = field(default_factory=dict)
    default_user: str = DEFAULT_USER
    default_workdir: str | None = None
    # the `timestamp` of the /init whose `agentenvAwayMs` moved the deadlines (a resent copy moves none)
    away_applied: object = None
    executor: UserExecutor = field(default_factory=UserExecutor)

    @classmethod
    def from_environ(cls) -> "EnvdState":
        limit = os.environ.get("AGENTENV_ENVD_MAX_UPLOAD", "").strip()
        if limit and not limit.isdigit():
            raise ValueError(f"AGENTENV_ENVD_MAX_UPLOAD must be a number of bytes, got {limit!r}")
        return cls(
            host_token=os.environ.get("AGENTENV_ENVD_HOST_TOKEN") or None,
            max_upload=int(limit) if limit else None,
        )

    def token_ok(self, presented: str | None) -> bool:
        if not self.access_token:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), self.access_token.encode())

    def from_host(self, request) -> bool:
        """The request carries the host token (`HOST_TOKEN_HEADER`)."""
        return self.host_token_ok(request.headers.get(HOST_TOKEN_HEADER))

    def host_token_ok(self, presented: str | None) -> bool:
        return bool(self.host_token) and presented is not None and hmac.compare_digest(
            presented.encode(), self.host_token.encode()  # type: ignore[union-attr]
        )


def get_state(request: web.Request) -> EnvdState:
    return request.app[STATE_KEY]


def basic_auth_user(request: web.Request) -> str | None:
    """The username from `Authorization: Basic base64("<user>:")` (user selection, not authentication)."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip()).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.split(":", 1)[0] or None


def rpc_user(request: web.Request) -> User:
    """The user an RPC acts as; unknown users are a Connect `unauthenticated` error."""
    state = get_state(request)
    name = basic_auth_user(request) or state.default_user
    try:
        return lookup_user(name)
    except UnknownUser:
        raise ConnectError("unauthenticated", f"invalid username: '{name}'") from None


def process_env(state: EnvdState, user: User, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
    }
    env.update(state.env_vars)
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env
