"""Team isolation through the real E2B SDK: team B cannot list, get, connect, pause, resume, fork,
snapshot, kill, read files of, or proxy into team A's sandboxes. Every refusal must be exactly the
answer for an ID that does not exist (404 with the same text), so nothing about A leaks."""

from __future__ import annotations

import secrets

import pytest
import requests
from e2b import RateLimitException, Sandbox
from e2b.exceptions import NotFoundException, SandboxException

from sec_util import api, new_team_key

ENVD_PORT = 49983


@pytest.fixture(scope="module")
def team_b_key(server) -> str:
    return new_team_key(server, "sec-team-b")


@pytest.fixture(scope="module")
def victim(sandboxes) -> Sandbox:
    sbx = sandboxes.create(network={"allow_public_traffic": False})
    sbx.files.write("/home/user/secret.txt", "team-a-secret")
    return sbx


def _same_as_missing(server, key: str, method: str, path_tmpl: str, real_id: str, **kw) -> requests.Response:
    """Calls `path_tmpl` for the real (foreign) id and for a made-up one; both answers must match."""
    fake = "i" + secrets.token_hex(9)
    real = api(server, method, path_tmpl.format(id=real_id), key, **kw)
    missing = api(server, method, path_tmpl.format(id=fake), key, **kw)
    assert real.status_code == missing.status_code == 404, (real.status_code, real.text, missing.text)
    assert real.json()["message"].replace(real_id, "ID") == missing.json()["message"].replace(fake, "ID")
    assert set(real.json()) == set(missing.json())
    return real


CONTROL_CALLS = [
    ("GET", "/sandboxes/{id}", None),
    ("DELETE", "/sandboxes/{id}", None),
    ("POST", "/sandboxes/{id}/timeout", {"timeout": 30}),
    ("POST", "/sandboxes/{id}/refreshes", {"duration": 30}),
    ("POST", "/sandboxes/{id}/connect", {"timeout": 30}),
    ("POST", "/v2/sandboxes/{id}/connect", {}),
    ("POST", "/sandboxes/{id}/resume", {}),
    ("POST", "/sandboxes/{id}/pause", {}),
    ("POST", "/sandboxes/{id}/fork", {"count": 1}),
    ("POST", "/sandboxes/{id}/snapshots", {}),
    ("POST", "/sandboxes/{id}/checkpoints", {}),
    ("GET", "/sandboxes/{id}/checkpoints", None),
    ("POST", "/sandboxes/{id}/rollback", {"checkpointID": "s0000000000000000000"}),
]


@pytest.mark.parametrize("method,path,body", CONTROL_CALLS, ids=[f"{m} {p}" for m, p, _ in CONTROL_CALLS])
def test_foreign_sandbox_is_indistinguishable_from_missing(server, team_b_key, victim, method, path, body):
    _same_as_missing(server, team_b_key, method, path, victim.sandbox_id, json=body)
    assert victim.is_running()  # nothing B did touched it


def test_team_b_cannot_see_or_drive_team_a_through_the_sdk(server, team_b_key, victim):
    listed = Sandbox.list(api_key=team_b_key, query=None).next_items()
    assert victim.sandbox_id not in {s.sandbox_id for s in listed}
    with pytest.raises(NotFoundException):
        Sandbox.connect(victim.sandbox_id, api_key=team_b_key)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(victim.sandbox_id, api_key=team_b_key)
    assert Sandbox.kill(victim.sandbox_id, api_key=team_b_key) is False
    with pytest.raises(SandboxException):
        Sandbox.pause(victim.sandbox_id, api_key=team_b_key)
    # A still sees and uses it
    assert victim.sandbox_id in {s.sandbox_id for s in Sandbox.list(api_key=server.api_key).next_items()}
    assert victim.files.read("/home/user/secret.txt") == "team-a-secret"


def test_team_b_cannot_use_team_a_snapshots(server, team_b_key, victim):
    snap = victim.create_snapshot()
    try:
        assert snap.snapshot_id not in {s.snapshot_id for s in
                                        Sandbox.list_snapshots(api_key=team_b_key).next_items()}
        _same_as_missing(server, team_b_key, "GET", "/snapshots/{id}", snap.snapshot_id)
        _same_as_missing(server, team_b_key, "DELETE", "/snapshots/{id}", snap.snapshot_id)
        _same_as_missing(server, team_b_key, "GET", "/checkpoints/{id}/tree", snap.snapshot_id)
        for body in ({"templateID": snap.snapshot_id}, ):
            r = api(server, "POST", "/v2/sandboxes", team_b_key, json=body)
            assert r.status_code == 404 and "team" not in r.text.lower(), r.text
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=team_b_key) is False
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id, api_key=server.api_key)


def test_envd_and_user_ports_refuse_requests_without_the_sandboxes_tokens(server, victim):
    """What team B could try on the data plane knowing only the sandbox id (ids are not secrets)."""
    base = {"E2b-Sandbox-Id": victim.sandbox_id}
    url = f"{server.sandbox_url}/files"
    params = {"path": "/home/user/secret.txt", "username": "user"}
    for headers in ({}, {"X-Access-Token": "not-the-token"},
                    {"X-Access-Token": secrets.token_urlsafe(24)}):
        r = requests.get(url, params=params, headers={**base, "E2b-Sandbox-Port": str(ENVD_PORT), **headers},
                         timeout=30)
        assert r.status_code == 401, r.text
        assert "team-a-secret" not in r.text
        # the Connect RPC surface of envd too
        r = requests.post(f"{server.sandbox_url}/process.Process/List", json={},
                          headers={**base, "E2b-Sandbox-Port": str(ENVD_PORT), "Content-Type": "application/json",
                                   **headers}, timeout=30)
        assert r.status_code == 401, r.text
    # a forged v1 file signature
    for forged in ("v1_" + "0" * 64, "v1_é"):  # non-ASCII once made the proxy's comparison raise (500)
        r = requests.get(url, params={**params, "signature": forged}, timeout=30)
        assert r.status_code == 401, r.text
    # a user port of a sandbox created with allowPublicTraffic=false needs the traffic token
    victim.commands.run("python3 -m http.server 8080 --bind 0.0.0.0 >/dev/null 2>&1", background=True)
    r = requests.get(server.sandbox_url + "/", headers={**base, "E2b-Sandbox-Port": "8080"}, timeout=30)
    assert r.status_code == 403 and "secret" not in r.text
    r = requests.get(server.sandbox_url + "/", headers={**base, "E2b-Sandbox-Port": "8080",
                                                        "E2B-Traffic-Access-Token": "guess"}, timeout=30)
    assert r.status_code == 403
    # the owner, with the token from create, gets through (the check above can fail)
    token = victim.traffic_access_token
    assert token
    for _ in range(50):
        r = requests.get(server.sandbox_url + "/", headers={**base, "E2b-Sandbox-Port": "8080",
                                                            "E2B-Traffic-Access-Token": token}, timeout=30)
        if r.status_code == 200:
            break
        import time
        time.sleep(0.2)
    assert r.status_code == 200


def test_concurrent_sandbox_quota_is_a_typed_error(server, sandboxes):
    key = new_team_key(server, "sec-quota", max_sandboxes=1)
    first = sandboxes.create(api_key=key)
    with pytest.raises(RateLimitException) as e:
        sandboxes.create(api_key=key)
    assert "limit" in str(e.value).lower()
    r = api(server, "POST", "/v2/sandboxes", key, json={"templateID": "base"})
    assert r.status_code == 429 and r.json()["error_code"] == "team_sandbox_limit"
    assert r.headers.get("Should-Retry") == "false"
    r = api(server, "POST", f"/sandboxes/{first.sandbox_id}/fork", key, json={"count": 1})
    assert r.status_code == 429
    assert first.is_running()
    # other teams are not affected by this team's quota
    r = api(server, "GET", "/teams", key)
    assert r.json()[0]["maxSandboxes"] == 1
    # a paused sandbox does not count; resuming it while another runs does
    first.pause()
    second = sandboxes.create(api_key=key)
    with pytest.raises(RateLimitException):
        Sandbox.connect(first.sandbox_id, api_key=key)
    second.kill()
    resumed = Sandbox.connect(first.sandbox_id, api_key=key)
    assert resumed.commands.run("echo back").stdout == "back\n"


def test_host_token_does_not_pass_the_proxy(server, sandboxes, victim):
    """envd's host token is readable by code in any sandbox (envd's environment), so it must not work
    through the public proxy: otherwise one tenant could re-init another's envd with a token of its
    choosing and take it over."""
    thief = sandboxes.create(api_key=new_team_key(server, "sec-team-thief"))
    host_token = thief.commands.run("tr '\\0' '\\n' < /proc/1/environ | sed -n 's/^AGENTENV_ENVD_HOST_TOKEN=//p'",
                                    user="root").stdout.strip()
    assert host_token, "the test expects the token to be readable inside a sandbox"
    base = {"E2b-Sandbox-Id": victim.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT),
            "X-Agentenv-Host-Token": host_token}
    r = requests.post(f"{server.sandbox_url}/init", json={"accessToken": "stolen-" + secrets.token_hex(8)},
                      headers=base, timeout=30)
    assert r.status_code == 401, r.text
    r = requests.get(f"{server.sandbox_url}/agentenv/connections", headers=base, timeout=30)
    assert r.status_code == 401, r.text
    # the owner's token still works, so nothing was re-initialised
    assert victim.files.read("/home/user/secret.txt") == "team-a-secret"
