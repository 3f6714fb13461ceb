"""Bad input and hostile requests: the server answers with errors the SDKs understand."""

from __future__ import annotations

import os

import pytest
import requests
from e2b import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
)

from e2e_util import SandboxFactory, new_tag

MiB = 1024 * 1024
OVERSIZED = 201 * MiB  # the test server runs with AGENTENV_MAX_UPLOAD_BYTES = 200 MiB
WRONG_KEY = "e2b_" + "0" * 40


def api(server, method: str, path: str, *, key: str | None = "default", **kwargs) -> requests.Response:
    headers = kwargs.pop("headers", {})
    if key == "default":
        key = server.api_key
    if key is not None:
        headers["X-API-KEY"] = key
    return requests.request(method, f"{server.api_url}{path}", headers=headers, timeout=60, **kwargs)


def assert_error_body(r: requests.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == status
    assert isinstance(body["message"], str) and body["message"]


def none_listed(metadata: dict[str, str]) -> bool:
    paginator = Sandbox.list(query=SandboxQuery(metadata=metadata))
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return not items


def assert_access_denied(exc: BaseException) -> None:
    """The SDK error family envd uses for a forbidden path (401 / 403 / 404 / 400)."""
    if isinstance(exc, (AuthenticationException, NotFoundException, InvalidArgumentException)):
        return
    text = str(exc).lower()
    assert isinstance(exc, SandboxException) and (text.startswith("403") or "permission" in text), repr(exc)


# ------------------------------------------------------------------ control plane


def test_unknown_template(server):
    tag = new_tag()
    with pytest.raises(SandboxException) as info:
        Sandbox.create(template=f"no-such-template-{tag}", metadata={"bad-input": tag})
    assert getattr(info.value, "status_code", None) in (400, 404)
    assert none_listed({"bad-input": tag})


@pytest.mark.parametrize("timeout", [-5, 10**9])
def test_invalid_timeout_on_create(server, timeout: int):
    tag = new_tag()
    with pytest.raises(SandboxException) as info:
        Sandbox.create(timeout=timeout, metadata={"bad-input": tag})
    assert getattr(info.value, "status_code", None) == 400
    r = api(server, "POST", "/v2/sandboxes", json={"templateID": "base", "timeout": timeout, "metadata": {"bad-input": tag}})
    assert_error_body(r, 400)
    assert none_listed({"bad-input": tag})


@pytest.mark.parametrize("timeout", [-1, 10**9])
def test_invalid_set_timeout(sbx: Sandbox, timeout: int):
    before = sbx.get_info().end_at
    with pytest.raises(SandboxException):
        sbx.set_timeout(timeout)
    assert sbx.get_info().end_at == before
    assert sbx.is_running()


def test_malformed_json(server, sbx: Sandbox):
    headers = {"Content-Type": "application/json"}
    r = api(server, "POST", "/v2/sandboxes", data=b'{"templateID": "base",', headers=dict(headers))
    assert_error_body(r, 400)
    r = api(server, "POST", "/v2/sandboxes", data=b"[1, 2", headers=dict(headers))
    assert_error_body(r, 400)
    r = api(server, "POST", "/v2/sandboxes", json={"templateID": 123})
    assert_error_body(r, 400)
    r = api(server, "POST", "/v2/sandboxes", json=["not", "an", "object"])
    assert_error_body(r, 400)
    r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/timeout", data=b"{timeout: 5}", headers=dict(headers))
    assert_error_body(r, 400)
    assert sbx.is_running()


def test_wrong_api_key(server):
    tag = new_tag()
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key=WRONG_KEY, metadata={"bad-input": tag})
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=WRONG_KEY).next_items()
    assert_error_body(api(server, "GET", "/v2/sandboxes", key=WRONG_KEY), 401)
    assert_error_body(api(server, "GET", "/v2/sandboxes", key=None), 401)
    assert_error_body(api(server, "POST", "/v2/sandboxes", key=None, json={"templateID": "base"}), 401)
    assert none_listed({"bad-input": tag})
    # /health needs no key
    assert requests.get(f"{server.api_url}/health", timeout=10).status_code == 200


def test_wrong_api_key_cannot_touch_existing_sandbox(server, sbx: Sandbox):
    with pytest.raises(AuthenticationException):
        Sandbox.kill(sbx.sandbox_id, api_key=WRONG_KEY)
    with pytest.raises(AuthenticationException):
        Sandbox.connect(sbx.sandbox_id, api_key=WRONG_KEY)
    assert sbx.is_running()


def test_unknown_sandbox_is_404(server):
    assert_error_body(api(server, "GET", "/sandboxes/nosuchsandbox000"), 404)
    assert_error_body(api(server, "DELETE", "/sandboxes/nosuchsandbox000"), 404)
    with pytest.raises(NotFoundException):
        Sandbox.get_info("nosuchsandbox000")
    assert Sandbox.kill("nosuchsandbox000") is False


# ------------------------------------------------------------------ envd


def test_envd_requires_the_access_token(server, sbx: Sandbox):
    url = f"{server.sandbox_url}/filesystem.Filesystem/ListDir"
    base = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json"}
    for extra in ({}, {"X-Access-Token": "not-the-token"}):
        r = requests.post(url, headers={**base, **extra}, json={"path": "/home/user", "depth": 1}, timeout=30)
        assert r.status_code == 401, (r.status_code, r.text)
        assert "entries" not in r.text
    # files without token or signature
    r = requests.get(f"{server.sandbox_url}/files", params={"path": "/etc/hostname"}, headers=base, timeout=30)
    assert r.status_code == 401, (r.status_code, r.text)


def test_read_root_only_file_as_user(sbx: Sandbox):
    tag = new_tag()
    path = f"/root/secret-{tag}.txt"
    sbx.commands.run(f"echo top-secret-{tag} > {path} && chmod 600 {path}", user="root")
    assert sbx.files.read(path, user="root") == f"top-secret-{tag}\n"  # it exists and is readable by root
    with pytest.raises(Exception) as info:
        sbx.files.read(path)
    assert_access_denied(info.value)
    assert f"top-secret-{tag}" not in str(info.value)


def test_relative_path_traversal(sbx: Sandbox):
    assert sbx.files.read("/etc/shadow", user="root")  # exists, root only
    with pytest.raises(Exception) as info:
        sbx.files.read("../../etc/shadow")
    assert_access_denied(info.value)
    tag = new_tag()
    with pytest.raises(Exception) as info:
        sbx.files.write(f"../../etc/evil-{tag}", "pwned")
    assert_access_denied(info.value)
    assert sbx.commands.run(f"test -e /etc/evil-{tag} && echo exists || echo absent", user="root").stdout == "absent\n"


def _chunks(total: int, size: int = MiB):
    block = os.urandom(size)
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield block[:n]
        sent += n


def test_oversized_upload_is_rejected(server, sbx: Sandbox):
    path = f"/home/user/too-big-{new_tag()}.bin"
    # streamed (chunked, no Content-Length) through the SDK
    with pytest.raises(Exception) as info:
        sbx.files.write(path, _chunks(OVERSIZED))
    assert not isinstance(info.value, AssertionError)
    assert sbx.files.exists(path) is False
    # multipart with a Content-Length through a signed upload URL
    try:
        r = requests.post(sbx.upload_url(path), files={"file": ("big.bin", b"\0" * OVERSIZED)}, timeout=300)
    except requests.ConnectionError:
        pass  # rejected early: the server answered and closed the connection while we were sending
    else:
        assert 400 <= r.status_code < 500, r.status_code
    assert sbx.files.exists(path) is False
    # the sandbox is fine and smaller uploads still work
    sbx.files.write(path, _chunks(5 * MiB))
    assert sbx.files.get_info(path).size == 5 * MiB
    sbx.files.remove(path)


def test_calls_to_a_killed_sandbox_raise(sandbox_factory: SandboxFactory):
    victim = sandbox_factory.create()
    victim.files.write("/home/user/x.txt", "x")
    assert victim.kill() is True
    assert victim.is_running() is False
    with pytest.raises(SandboxException):
        victim.commands.run("echo hi")
    with pytest.raises(SandboxException):
        victim.files.read("/home/user/x.txt")
    with pytest.raises(SandboxException):
        victim.files.write("/home/user/y.txt", "y")
    with pytest.raises(SandboxException):
        victim.commands.list()
    with pytest.raises(NotFoundException):
        victim.set_timeout(60)
    with pytest.raises(NotFoundException):
        victim.get_info()
