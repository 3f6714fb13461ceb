"""Typed errors that map one-to-one onto HTTP statuses and E2B's JSON error body {code, message}."""

from __future__ import annotations


class AgentEnvError(Exception):
    """Base error; `status` is the HTTP status the API answers with."""

    status: int = 500

    def __init__(self, message: str, *, error_code: str | None = None, status: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.error_code = error_code
        # Extra response headers, e.g. Retry-After / Should-Retry (the E2B SDKs' retry protocol).
        self.headers = dict(headers or {})
        if status is not None:
            self.status = status

    def to_json(self) -> dict:
        body: dict = {"code": self.status, "message": self.message}
        if self.error_code:
            body["error_code"] = self.error_code
        return body


class BadRequest(AgentEnvError):
    status = 400


class Unauthorized(AgentEnvError):
    status = 401


class Forbidden(AgentEnvError):
    status = 403


class NotFound(AgentEnvError):
    status = 404


class Conflict(AgentEnvError):
    """Illegal lifecycle transition or state clash."""

    status = 409


class PayloadTooLarge(AgentEnvError):
    status = 413


class TooManyRequests(AgentEnvError):
    """A quota is exhausted (E2B SDKs raise RateLimitException for 429)."""

    status = 429


class Unavailable(AgentEnvError):
    """Capacity exhausted or a dependency is down; clients may retry."""

    status = 503


class RuntimeFailure(AgentEnvError):
    """The runtime (runsc, a VMM) failed to do what was asked."""

    status = 500


class CaptureRefused(RuntimeFailure):
    """The runtime could not checkpoint a sandbox, and the sandbox runs on unchanged: retry later."""

    status = 503


def sandbox_not_found(sandbox_id: str) -> NotFound:
    """The exact 404 the E2B API gives for unknown, killed or foreign sandboxes."""
    return NotFound(f"Sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it")


class Gone(AgentEnvError):
    """The resource existed but is gone for good (a cluster sandbox lost with its node)."""

    status = 410
