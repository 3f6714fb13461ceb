"""ApiKeyAuth over a real SQLite store."""

from __future__ import annotations

import re

import pytest

from agentenv.api.auth import ApiKeyAuth, generate_api_key, hash_key
from agentenv.errors import BadRequest, NotFound, Unauthorized
from agentenv.state.sqlite import SQLiteStateStore


@pytest.fixture
async def auth(tmp_path):
    store = SQLiteStateStore(tmp_path / "state.db")
    await store.open()
    try:
        yield ApiKeyAuth(store)
    finally:
        await store.close()


def test_key_shape_and_hash():
    keys = {generate_api_key() for _ in range(50)}
    assert len(keys) == 50
    assert all(re.fullmatch(r"e2b_[0-9a-f]{40}", k) for k in keys)
    k = next(iter(keys))
    assert re.fullmatch(r"[0-9a-f]{64}", hash_key(k)) and hash_key(k) == hash_key(k) != hash_key(k + "0")


async def test_create_authenticate_revoke(auth, tmp_path):
    key, rec = await auth.create_key("ci", team_id="team-a")
    got = await auth.authenticate(key)
    assert (got.key_id, got.team_id, got.name) == (rec.key_id, "team-a", "ci")
    assert key.encode() not in (tmp_path / "state.db").read_bytes()  # only the hash is stored
    for bad in (None, "", key + "0", key.upper(), generate_api_key()):
        with pytest.raises(Unauthorized):
            await auth.authenticate(bad)
    await auth.revoke(rec.key_id)
    with pytest.raises(Unauthorized):
        await auth.authenticate(key)
    with pytest.raises(NotFound):
        await auth.revoke("no-such-key")
    assert [k.key_id for k in await auth.list_keys()] == [rec.key_id]


async def test_ensure_key_is_idempotent_and_respects_revocation(auth):
    key = generate_api_key()
    first = await auth.ensure_key(key, "bootstrap")
    again = await auth.ensure_key(key, "bootstrap")
    assert first.key_id == again.key_id and len(await auth.list_keys()) == 1
    assert (await auth.authenticate(key)).key_id == first.key_id
    await auth.revoke(first.key_id)
    assert (await auth.ensure_key(key, "bootstrap")).revoked
    with pytest.raises(Unauthorized):
        await auth.authenticate(key)


async def test_ensure_key_rejects_keys_sdks_would_refuse(auth):
    with pytest.raises(BadRequest):
        await auth.ensure_key("not-an-e2b-key", "bootstrap")


async def test_teams_quota_and_team_scoped_keys(auth):
    key_a, rec_a = await auth.create_key("a", team_id="team-a")
    _, rec_b = await auth.create_key("b", team_id="team-b")
    assert {t.team_id for t in await auth.list_teams()} == {"team-a", "team-b"}  # created with their first key
    assert (await auth.get_team("team-a")).max_sandboxes is None
    assert (await auth.set_team_quota("team-a", 3)).max_sandboxes == 3
    assert (await auth.get_team("team-a")).max_sandboxes == 3
    assert (await auth.set_team_quota("team-a", None)).max_sandboxes is None
    with pytest.raises(NotFound):
        await auth.set_team_quota("no-team", 1)
    with pytest.raises(BadRequest):
        await auth.ensure_team("bad/team")
    assert [k.key_id for k in await auth.list_keys(team_id="team-a")] == [rec_a.key_id]
    # a team cannot revoke another team's key, and is told only "not found"
    with pytest.raises(NotFound) as e:
        await auth.revoke(rec_b.key_id, team_id="team-a")
    assert "team-b" not in e.value.message
    assert (await auth.authenticate(key_a)).team_id == "team-a"
    await auth.revoke(rec_a.key_id, team_id="team-a")
    with pytest.raises(Unauthorized):
        await auth.authenticate(key_a)
