"""API keys and teams: keys are issued as `e2b_<40 hex>`, stored only as sha256 hashes, checked on
every API call, and each belongs to one team (the tenant that owns sandboxes and snapshots).

The key shape matches what some E2B SDK versions validate client-side (`^e2b_[0-9a-f]+$`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets

from agentenv.errors import BadRequest, NotFound, Unauthorized
from agentenv.models import ApiKeyRecord, TeamRecord
from agentenv.state.base import StateStore

log = logging.getLogger(__name__)

KEY_PREFIX = "e2b_"
KEY_RE = re.compile(r"^e2b_[0-9a-f]+$")
INVALID_KEY_MESSAGE = "Invalid API key"
TEAM_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def generate_api_key() -> str:
    """A fresh key: `e2b_` + 40 lowercase hex chars (160 random bits)."""
    return KEY_PREFIX + secrets.token_hex(20)


def hash_key(key: str) -> str:
    """sha256 hex of the full key; enough for high-entropy keys (no salt/KDF needed)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeyAuth:
    """Creates, checks and revokes API keys kept in a `StateStore`."""

    def __init__(self, store: StateStore):
        self.store = store

    # teams -------------------------------------------------------------------------------------

    async def ensure_team(self, team_id: str, name: str | None = None) -> TeamRecord:
        """The team `team_id`, created (unlimited quota override) if it does not exist yet."""
        if not TEAM_ID_RE.match(team_id):
            raise BadRequest(f"Invalid team id {team_id!r}: use letters, digits, '_', '.', '-' (max 64)")
        team = await self.store.get_team(team_id)
        if team is None:
            team = TeamRecord(team_id=team_id, name=name or team_id)
            await self.store.put_team(team)
        return team

    async def get_team(self, team_id: str) -> TeamRecord:
        team = await self.store.get_team(team_id)
        if team is None:
            raise NotFound(f"Team {team_id!r} not found")
        return team

    async def list_teams(self) -> list[TeamRecord]:
        return await self.store.list_teams()

    async def set_team_quota(self, team_id: str, max_sandboxes: int | None) -> TeamRecord:
        """Per-team override of the concurrent-sandbox limit (None = back to the server default)."""
        if max_sandboxes is not None and max_sandboxes < 0:
            raise BadRequest("max_sandboxes must not be negative")
        team = await self.get_team(team_id)
        team.max_sandboxes = max_sandboxes
        await self.store.put_team(team)
        return team

    # keys --------------------------------------------------------------------------------------

    async def create_key(self, name: str, team_id: str = "default") -> tuple[str, ApiKeyRecord]:
        """Returns the plaintext key (shown once, never stored) and its record; creates the team if new."""
        await self.ensure_team(team_id)
        key = generate_api_key()
        rec = ApiKeyRecord(key_id=secrets.token_hex(8), key_hash=hash_key(key), team_id=team_id, name=name)
        await self.store.put_api_key(rec)
        return key, rec

    async def ensure_key(self, key: str, name: str, team_id: str = "default") -> ApiKeyRecord:
        """Registers a key given in config (bootstrap) unless already known; idempotent across restarts.

        A key that was revoked stays revoked: revocation is an explicit act that config must not undo.
        """
        if not KEY_RE.match(key):
            raise BadRequest(f"API key must look like {KEY_PREFIX}<lowercase hex>, as E2B SDKs expect")
        await self.ensure_team(team_id)
        existing = await self.store.find_api_key(hash_key(key))
        if existing is not None:
            if existing.revoked:
                log.warning("configured API key %r (id %s) is revoked; not re-enabling it", name, existing.key_id)
            return existing
        rec = ApiKeyRecord(key_id=secrets.token_hex(8), key_hash=hash_key(key), team_id=team_id, name=name)
        await self.store.put_api_key(rec)
        return rec

    async def authenticate(self, key: str | None) -> ApiKeyRecord:
        """The active record for `key`; raises Unauthorized for a missing, unknown or revoked key."""
        if not key:
            raise Unauthorized(f"{INVALID_KEY_MESSAGE}: missing X-API-KEY header")
        digest = hash_key(key)
        rec = await self.store.find_api_key(digest)
        # The lookup is by hash (not the secret), and the final check is constant-time anyway.
        if rec is None or rec.revoked or not hmac.compare_digest(rec.key_hash, digest):
            raise Unauthorized(INVALID_KEY_MESSAGE)
        return rec

    async def list_keys(self, team_id: str | None = None) -> list[ApiKeyRecord]:
        return await self.store.list_api_keys(team_id=team_id)

    async def revoke(self, key_id: str, *, team_id: str | None = None) -> None:
        """Revoke a key; with `team_id` only a key of that team (another team's key is 'not found')."""
        if team_id is not None:
            if not any(k.key_id == key_id for k in await self.store.list_api_keys(team_id=team_id)):
                raise NotFound(f"API key {key_id!r} not found")
        if not await self.store.revoke_api_key(key_id):
            raise NotFound(f"API key {key_id!r} not found")
