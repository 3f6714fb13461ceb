"""envd fuzzed inside a real sandbox, through the traffic proxy as the SDK reaches it: Connect RPCs
with malformed envelopes, huge length prefixes, truncated frames and random JSON; `/files` with
traversal paths and odd parameters. envd must answer errors (never 5xx for bad input, never hang),
keep serving, and never show anything outside the sandbox (a marker file on the host stays unseen).
"""

from __future__ import annotations

import json
import secrets
import struct
from pathlib import Path

import pytest
import requests
from e2b import Sandbox
from hypothesis import HealthCheck, given, settings, strategies as st

ENVD_PORT = 49983
UNARY = ["/filesystem.Filesystem/Stat", "/filesystem.Filesystem/ListDir", "/filesystem.Filesystem/MakeDir",
         "/filesystem.Filesystem/Move", "/filesystem.Filesystem/Remove", "/process.Process/List",
         "/process.Process/SendInput", "/process.Process/SendSignal", "/process.Process/Update",
         "/process.Process/CloseStdin", "/filesystem.Filesystem/CreateWatcher"]
STREAMS = ["/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir",
           "/process.Process/StreamInput"]


@pytest.fixture(scope="module")
def target(server, sandboxes, tmp_path_factory):
    sbx = sandboxes.create()
    marker = secrets.token_hex(16)
    host_file = tmp_path_factory.mktemp("host-secret") / "marker.txt"
    host_file.write_text(marker)
    # a symlink inside the sandbox pointing at the host path: it must resolve inside the sandbox
    sbx.commands.run(f"ln -s {host_file} /home/user/host-link", user="user")
    return sbx, marker, host_file


class Envd:
    def __init__(self, server, sbx: Sandbox) -> None:
        self.url = server.sandbox_url
        self.base = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT),
                     "X-Access-Token": sbx._envd_access_token}
        self.session = requests.Session()

    def post(self, path: str, body: bytes, content_type: str, **headers: str) -> requests.Response:
        return self.session.post(self.url + path, data=body, timeout=30,
                                 headers={**self.base, "Content-Type": content_type, **headers})

    def files(self, method: str, params: dict, body: bytes | None = None) -> requests.Response:
        return self.session.request(method, self.url + "/files", params=params, data=body, timeout=30,
                                    headers=self.base)


def _frame(payload: bytes, flags: int = 0, length: int | None = None) -> bytes:
    return struct.pack(">BI", flags, len(payload) if length is None else length) + payload


def _assert_error_not_crash(resp: requests.Response, what: str) -> None:
    assert resp.status_code < 500 or resp.status_code in (501, 503), f"{what}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400 and resp.headers.get("Content-Type", "").startswith("application/json"):
        body = resp.json()
        assert isinstance(body, dict) and ("message" in body or "code" in body), body
        assert "Traceback" not in resp.text


def _healthy(sbx: Sandbox) -> None:
    assert sbx.commands.run("echo fine").stdout == "fine\n"


MALFORMED_FRAMES = [
    b"",                                        # no envelope at all
    b"\x00",                                    # truncated header
    b"\x00\x00\x00",
    _frame(b"{}", length=0xFFFFFFFF),           # 4 GiB announced, 2 bytes sent
    _frame(b"{}", length=0x7FFFFFFF),
    _frame(b"{", length=10),                    # truncated payload
    _frame(b"not json"),
    _frame(b"[]"),
    _frame(b'{"process": {"cmd": 5}}'),
    _frame(b"{}", flags=0x01),                  # "compressed" without a negotiated codec
    _frame(b"{}", flags=0x02) + _frame(b"{}"),  # end-stream flag from the client, then more
    _frame(b"\xff\xfe\x00garbage"),
    _frame(b'{"process": {"cmd": "/bin/true"}}') * 3,  # several requests to a server-stream RPC
]


@pytest.mark.parametrize("path", STREAMS)
def test_streaming_rpcs_reject_malformed_envelopes(server, target, path):
    sbx, _, _ = target
    envd = Envd(server, sbx)
    for i, body in enumerate(MALFORMED_FRAMES):
        resp = envd.post(path, body, "application/connect+json")
        _assert_error_not_crash(resp, f"{path} frame #{i}")
    _healthy(sbx)


@pytest.mark.parametrize("path", UNARY)
def test_unary_rpcs_reject_bad_bodies(server, target, path):
    sbx, _, _ = target
    envd = Envd(server, sbx)
    bodies = [b"", b"{", b"null", b"[]", b'"x"', b"1e999999", b'{"path": 5}', b'{"path": null}',
              b'{"path": "' + b"a" * 100_000 + b'"}', json.dumps({"path": "\x00bad"}).encode(),
              b'{"pid": -1}', b'{"pid": 99999999999999999999}', b'{"process": {"pid": "x"}}',
              b"\xff\xfe\xfd", b'{"a":' * 5000 + b"1" + b"}" * 5000]
    for i, body in enumerate(bodies):
        _assert_error_not_crash(envd.post(path, body, "application/json"), f"{path} body #{i}")
        _assert_error_not_crash(envd.post(path, body, "application/proto"), f"{path} proto #{i}")
    _healthy(sbx)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(UNARY + STREAMS), body=st.binary(max_size=2048),
       ctype=st.sampled_from(["application/json", "application/connect+json", "text/plain", ""]))
def test_random_bytes_to_any_rpc(server, target, path, body, ctype):
    sbx, _, _ = target
    _assert_error_not_crash(Envd(server, sbx).post(path, body, ctype), f"{path} {ctype}")


TRAVERSALS = [
    "../../../../../../{host}", "/../../../../{host}", "/home/user/../../../{host}", "{host}",
    "/proc/1/root{host}", "/proc/self/root/../../{host}", "/.agentenv/../../..{host}",
    "/home/user/host-link", "//{host}", "/home/user/./././../../..{host}", "%2e%2e/%2e%2e{host}",
]


def test_files_traversal_never_reaches_the_host(server, target):
    sbx, marker, host_file = target
    envd = Envd(server, sbx)
    for tmpl in TRAVERSALS:
        path = tmpl.format(host=host_file)
        for user in ("user", "root"):
            resp = envd.files("GET", {"path": path, "username": user})
            _assert_error_not_crash(resp, f"GET {path}")
            assert marker not in resp.text, f"host file leaked through {path!r}"
            rpc = envd.post("/filesystem.Filesystem/ListDir", json.dumps({"path": str(Path(path).parent)}).encode(),
                            "application/json")
            assert host_file.name not in rpc.text or rpc.status_code >= 400 or marker not in rpc.text
    # writes through traversal paths land inside the sandbox, never on the host
    probe = host_file.with_name("written-" + secrets.token_hex(4))
    for tmpl in ("../../../../..{p}", "{p}", "/proc/1/root{p}"):
        resp = envd.files("POST", {"path": tmpl.format(p=probe), "username": "root"}, body=b"x")
        _assert_error_not_crash(resp, "POST traversal")
    assert not probe.exists()
    _healthy(sbx)


def test_files_odd_parameters(server, target):
    sbx, _, _ = target
    envd = Envd(server, sbx)
    cases = [
        ("GET", {"path": ""}), ("GET", {}), ("GET", {"path": "/nonexistent/x"}), ("GET", {"path": "/home/user"}),
        ("GET", {"path": "/etc/hostname", "username": "no-such-user"}), ("GET", {"path": "\x00"}),
        ("GET", {"path": "/" + "a" * 5000}),
        ("POST", {"path": "/home/user/x", "username": "nobody-here"}), ("POST", {"path": "/proc/sysrq-trigger"}),
        ("DELETE", {"path": "/etc/hostname"}), ("PUT", {"path": "/tmp/x"}),
    ]
    for method, params in cases:
        try:
            resp = envd.files(method, params, body=b"data" if method in ("POST", "PUT") else None)
        except requests.ReadTimeout:
            pytest.fail(f"{method} /files {params} hung")
        _assert_error_not_crash(resp, f"{method} {params}")
    # a multipart upload announcing far more than it sends, and a malformed multipart body
    r = envd.session.post(envd.url + "/files", params={"path": "/tmp/big"}, timeout=30, data=b"--x\r\n\r\n",
                          headers={**envd.base, "Content-Type": "multipart/form-data; boundary=x"})
    _assert_error_not_crash(r, "malformed multipart")
    _healthy(sbx)
