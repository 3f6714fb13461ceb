"""Our envd and our host-side envd clients against the envd contract in agentenv/envd/contract/.

The .proto files are compiled at test time (grpcio-tools' protoc) into a private descriptor pool;
every message envd emits or accepts here is parsed strictly against them (unknown fields fail, wrong
types fail, and a key must be the field's proto3-JSON name), then round-tripped through the binary
codec. The HTTP routes are validated with openapi-core against envd-http.yaml. A field, rpc, status
code or JSON shape that drifts from the contract fails here.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import requests

import agentenv.envd

protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools (test extra) compiles the contract")
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory  # noqa: E402
from openapi_core import OpenAPI  # noqa: E402
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse  # noqa: E402

CONTRACT = Path(agentenv.envd.__file__).parent / "contract"
SERVICES = ("process.proto", "filesystem.proto")
CONNECT_CODES = {
    "canceled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
    "permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
    "unimplemented", "internal", "unavailable", "data_loss", "unauthenticated",
}
END_STREAM = 0x02
# /init carries the host's time and envd, as root, steps CLOCK_REALTIME when it is off by 0.5 s: on the
# host that would be the machine's clock (a loaded machine delays a request that long). The envd that
# gets /init here runs without CAP_SYS_TIME.
NO_CLOCK = ["setpriv", "--bounding-set", "-sys_time", "--"]
TIMESTAMP = "google.protobuf.Timestamp"


# ---- the contract ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    path: str  # "/process.Process/Start"
    input: Any
    output: Any
    client_streaming: bool
    server_streaming: bool

    @property
    def kind(self) -> str:
        if self.client_streaming and self.server_streaming:
            return "bidi"
        return "client_stream" if self.client_streaming else "server_stream" if self.server_streaming else "unary"


class Contract:
    def __init__(self, descriptor_set: bytes) -> None:
        files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set)
        self.pool = descriptor_pool.DescriptorPool()
        for f in files.file:
            self.pool.Add(f)
        self.rpcs: dict[str, Rpc] = {}
        for f in files.file:
            for service in f.service:
                sd = self.pool.FindServiceByName(f"{f.package}.{service.name}")
                for m in sd.methods:
                    self.rpcs[f"/{sd.full_name}/{m.name}"] = Rpc(
                        f"/{sd.full_name}/{m.name}", message_factory.GetMessageClass(m.input_type),
                        message_factory.GetMessageClass(m.output_type),
                        m.client_streaming, m.server_streaming,
                    )


def compile_contract(out: Path) -> bytes:
    include = str(importlib.resources.files("grpc_tools") / "_proto")  # google/protobuf/timestamp.proto
    target = out / "contract.pb"
    rc = protoc.main(["protoc", f"-I{CONTRACT}", f"-I{include}", "--include_imports",
                      f"--descriptor_set_out={target}", *SERVICES])
    assert rc == 0, f"protoc failed on {CONTRACT}"
    return target.read_bytes()


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> Contract:
    return Contract(compile_contract(tmp_path_factory.mktemp("contract")))


@pytest.fixture(scope="module")
def http_spec() -> OpenAPI:
    return OpenAPI.from_file_path(str(CONTRACT / "envd-http.yaml"))


def _is_repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def check_json_names(desc, data: Any, where: str) -> None:
    """Every key is a field's proto3-JSON (lowerCamelCase) name: snake_case or unknown keys fail."""
    assert isinstance(data, dict), f"{where}: {desc.full_name} must be a JSON object, got {data!r}"
    by_json = {f.json_name: f for f in desc.fields}
    for key, value in data.items():
        field = by_json.get(key)
        assert field is not None, f"{where}: {key!r} is not a field of {desc.full_name} ({sorted(by_json)})"
        sub = field.message_type
        if sub is None or sub.GetOptions().map_entry or sub.full_name == TIMESTAMP:
            continue
        for item in value if _is_repeated(field) else [value]:
            check_json_names(sub, item, f"{where}.{key}")


def check_message(cls: Any, data: Any, where: str) -> Any:
    """Parse `data` strictly as `cls`; it must survive the binary codec unchanged."""
    check_json_names(cls.DESCRIPTOR, data, where)
    try:
        msg = json_format.ParseDict(data, cls(), ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        pytest.fail(f"{where}: not a valid {cls.DESCRIPTOR.full_name}: {exc}\n{json.dumps(data)[:2000]}")
    assert cls.FromString(msg.SerializeToString()) == msg, where
    return msg


def check_connect_error(err: Any, where: str) -> None:
    assert isinstance(err, dict) and set(err) <= {"code", "message", "details"}, f"{where}: {err!r}"
    assert err.get("code") in CONNECT_CODES, f"{where}: {err!r}"
    assert isinstance(err.get("message", ""), str), where


# ---- Connect over HTTP against a real envd ------------------------------------------------------------


def envelope(msg: dict, flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


def read_envelopes(raw: bytes) -> list[tuple[int, Any]]:
    out, i = [], 0
    while i < len(raw):
        flags, length = struct.unpack_from(">BI", raw, i)
        out.append((flags, json.loads(raw[i + 5:i + 5 + length] or b"{}")))
        i += 5 + length
    return out


@dataclass
class Reply:
    status: int
    messages: list[Any]  # decoded output messages (validated)
    error: dict | None


class Wire:
    """Calls rpcs of a real envd; every request and answer is checked against the contract."""

    def __init__(self, envd, contract: Contract) -> None:
        self.envd, self.contract = envd, contract
        self.seen: dict[str, set[str]] = {}  # rpc path -> top-level fields of answers seen

    def _rpc(self, method: str) -> Rpc:
        rpc = self.contract.rpcs.get("/" + method)
        assert rpc is not None, f"{method} is not in the contract"
        return rpc

    def call(self, method: str, *requests_: dict, headers: dict | None = None, timeout: float = 30) -> Reply:
        rpc = self._rpc(method)
        for i, req in enumerate(requests_):
            check_message(rpc.input, req, f"{method} request {i}")
        h = self.envd.headers(**(headers or {}))
        url = f"{self.envd.url}/{method}"
        if rpc.kind == "unary":
            r = requests.post(url, data=json.dumps(requests_[0]), timeout=timeout,
                              headers={**h, "Content-Type": "application/json"})
            assert r.headers["Content-Type"].startswith("application/json"), (method, r.headers)
            if r.status_code != 200:
                check_connect_error(r.json(), method)
                return Reply(r.status_code, [], r.json())
            return Reply(200, [self._answer(rpc, r.json(), method)], None)
        body = b"".join(envelope(m) for m in requests_)
        if rpc.client_streaming:
            body += envelope({}, END_STREAM)
        r = requests.post(url, data=body, timeout=timeout, headers={**h, "Content-Type": "application/connect+json"})
        assert r.status_code == 200 and r.headers["Content-Type"] == "application/connect+json", (method, r.text)
        return self._stream_reply(rpc, method, read_envelopes(r.content))

    def _answer(self, rpc: Rpc, data: dict, where: str) -> dict:
        check_message(rpc.output, data, f"{where} answer")
        self.seen.setdefault(rpc.path, set()).update(_shape(data))
        return data

    def _stream_reply(self, rpc: Rpc, method: str, frames: list[tuple[int, Any]]) -> Reply:
        assert frames and frames[-1][0] & END_STREAM, f"{method}: stream without an end-of-stream envelope"
        assert not any(f & END_STREAM for f, _ in frames[:-1]), f"{method}: data after end-of-stream"
        end = frames[-1][1]
        assert isinstance(end, dict) and set(end) <= {"error", "metadata"}, f"{method}: {end!r}"
        if "error" in end:
            check_connect_error(end["error"], method)
        msgs = [self._answer(rpc, m, f"{method}[{i}]") for i, (_f, m) in enumerate(frames[:-1])]
        if not rpc.server_streaming:
            assert len(msgs) <= 1, f"{method}: a client stream answers one message"
        return Reply(200, msgs, end.get("error"))

    def stream_in_thread(self, method: str, request: dict, headers: dict | None = None) -> tuple[threading.Thread, list]:
        box: list = []

        def run() -> None:
            try:
                box.append(self.call(method, request, headers=headers, timeout=60))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test via the box
                box.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, box


def _shape(data: Any, prefix: str = "") -> set[str]:
    """Dotted key paths of a JSON answer (oneof branches included), e.g. "event.data.stdout"."""
    out: set[str] = set()
    if isinstance(data, dict):
        for k, v in data.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in ("envs", "metadata"):
                out |= _shape(v, prefix + k + ".")
    return out


def joined(reply_or_box) -> Reply:
    t, box = reply_or_box
    t.join(60)
    assert box, "stream did not finish"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def wait_for(pred, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def output(reply: Reply, stream: str) -> bytes:
    return b"".join(base64.b64decode(m["event"]["data"][stream]) for m in reply.messages
                    if stream in m.get("event", {}).get("data", {}))


def end_of(reply: Reply) -> dict:
    ends = [m["event"]["end"] for m in reply.messages if "end" in m["event"]]
    assert len(ends) == 1, reply
    return ends[0]


@pytest.fixture
def wire(envd, contract) -> Wire:
    return Wire(envd, contract)


# ---- (1) every rpc served, with the contract's stream kind --------------------------------------------


def served_routes() -> set[tuple[str, str]]:
    """(method, path) of every GET/POST route of envd's app (built, not started)."""
    from agentenv.envd import server
    from agentenv.envd.state import STATE_KEY

    app = server.create_app()
    try:
        return {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
                if r.resource is not None and r.method in ("GET", "POST")}
    finally:
        app[STATE_KEY].executor.shutdown()


def is_connect(path: str) -> bool:
    return "." in path.split("/")[1]  # /process.Process/Start


def test_envd_serves_exactly_the_contract_rpcs(contract):
    assert len(contract.rpcs) == 17
    served = {path for method, path in served_routes() if is_connect(path)}
    assert {m for m, p in served_routes() if is_connect(p)} == {"post"}
    assert served == set(contract.rpcs)


def test_each_rpc_answers_with_its_stream_kind(envd, contract):
    """A request framed for the contract's kind gets an answer framed for that kind (an empty request
    may be refused, but then as a Connect error of that framing)."""
    for path, rpc in sorted(contract.rpcs.items()):
        h = envd.headers()
        if rpc.kind == "unary":
            r = requests.post(envd.url + path, data=b"{}", headers={**h, "Content-Type": "application/json"}, timeout=20)
            assert r.headers["Content-Type"].startswith("application/json"), path
            if r.status_code == 200:
                check_message(rpc.output, r.json(), path)
            else:
                check_connect_error(r.json(), path)
            continue
        assert rpc.kind in ("server_stream", "client_stream"), f"{path}: {rpc.kind} has no handler kind in envd"
        body = envelope({}) + (envelope({}, END_STREAM) if rpc.client_streaming else b"")
        r = requests.post(envd.url + path, data=body, timeout=20,
                          headers={**h, "Content-Type": "application/connect+json"})
        assert r.status_code == 200 and r.headers["Content-Type"] == "application/connect+json", (path, r.text)
        frames = read_envelopes(r.content)
        assert frames and frames[-1][0] & END_STREAM, path
        for _f, m in frames[:-1]:
            check_message(rpc.output, m, path)
        if rpc.client_streaming:
            assert len(frames) == 2 and "error" not in frames[-1][1], (path, frames)


# ---- (2) messages envd emits and accepts -------------------------------------------------------------


def test_process_messages_match_contract(wire, workdir):
    tag = "ct-" + secrets.token_hex(3)
    script = ('echo "$CT_VAR"; pwd; echo to-err >&2; read a; read b; echo "got:$a:$b"; sleep 1.5; exit 3')
    start = wire.stream_in_thread("process.Process/Start", {
        "process": {"cmd": "/bin/bash", "args": ["-c", script], "envs": {"CT_VAR": "ct-value"}, "cwd": workdir},
        "tag": tag, "stdin": True,
    }, headers={"Keepalive-Ping-Interval": "1"})
    listed = wait_for(lambda: [p for p in wire.call("process.Process/List", {}).messages[0].get("processes", [])
                               if p.get("tag") == tag], "the tagged process in List")
    info = listed[0]
    assert info["config"]["cwd"] == workdir and info["config"]["envs"] == {"CT_VAR": "ct-value"}
    pid = info["pid"]
    follow = wire.stream_in_thread("process.Process/Connect", {"process": {"tag": tag}})
    assert wire.call("process.Process/SendInput",
                     {"process": {"pid": pid}, "input": {"stdin": b64(b"one\n")}}).status == 200
    streamed = wire.call("process.Process/StreamInput", {"start": {"process": {"pid": pid}}},
                         {"data": {"input": {"stdin": b64(b"two\n")}}})
    assert streamed.error is None and streamed.messages == [{}]
    started, followed = joined(start), joined(follow)
    assert started.error is None and started.messages[0]["event"]["start"]["pid"] == pid
    assert output(started, "stdout") == f"ct-value\n{workdir}\ngot:one:two\n".encode()
    assert output(started, "stderr") == b"to-err\n"
    assert any("keepalive" in m["event"] for m in started.messages), "no keepalive within 1.5 s idle"
    assert end_of(started) == {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}
    assert followed.messages[0]["event"]["start"]["pid"] == pid and end_of(followed)["exitCode"] == 3

    # signals, and stdin closed
    sleeper = wire.stream_in_thread("process.Process/Start", {"process": {"cmd": "/bin/sleep", "args": ["30"]},
                                                              "tag": tag + "-s"})
    spid = wait_for(lambda: [p["pid"] for p in wire.call("process.Process/List", {}).messages[0].get("processes", [])
                             if p.get("tag") == tag + "-s"], "the sleeper")[0]
    assert wire.call("process.Process/SendSignal", {"process": {"pid": spid}, "signal": "SIGNAL_SIGTERM"}).status == 200
    assert end_of(joined(sleeper)) == {"exitCode": -1, "exited": False, "status": "signal: terminated", "error": "signal: terminated"}
    cat = wire.stream_in_thread("process.Process/Start", {"process": {"cmd": "/bin/cat"}, "tag": tag + "-c", "stdin": True})
    cpid = wait_for(lambda: [p["pid"] for p in wire.call("process.Process/List", {}).messages[0].get("processes", [])
                             if p.get("tag") == tag + "-c"], "cat")[0]
    wire.call("process.Process/SendInput", {"process": {"tag": tag + "-c"}, "input": {"stdin": b64(b"meow")}})
    assert wire.call("process.Process/CloseStdin", {"process": {"pid": cpid}}).status == 200
    catted = joined(cat)
    assert output(catted, "stdout") == b"meow" and end_of(catted) == {"exited": True, "status": "exit status 0"}
    missing = wire.call("process.Process/SendSignal", {"process": {"pid": 4_000_000}, "signal": "SIGNAL_SIGKILL"})
    assert missing.status == 404 and missing.error["code"] == "not_found"


def test_pty_messages_match_contract(wire, workdir):
    tag = "ctp-" + secrets.token_hex(3)
    pty = wire.stream_in_thread("process.Process/Start", {
        "process": {"cmd": "/bin/bash", "args": ["-c", "stty size; read x; stty size; echo x=$x"]},
        "pty": {"size": {"cols": 100, "rows": 30}}, "tag": tag,
    })
    pid = wait_for(lambda: [p["pid"] for p in wire.call("process.Process/List", {}).messages[0].get("processes", [])
                            if p.get("tag") == tag], "the pty process")[0]
    time.sleep(0.3)
    assert wire.call("process.Process/Update",
                     {"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}}).status == 200
    assert wire.call("process.Process/SendInput", {"process": {"pid": pid}, "input": {"pty": b64(b"go\n")}}).status == 200
    reply = joined(pty)
    text = output(reply, "pty").decode().replace("\r", "")
    assert "30 100\n" in text and "40 120\n" in text and "x=go\n" in text, text
    assert end_of(reply)["exited"] is True


def test_filesystem_messages_match_contract(wire, envd, workdir, temp_user):
    base = os.path.join(workdir, "fs")
    made = wire.call("filesystem.Filesystem/MakeDir", {"path": base})
    assert made.messages[0]["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    watch = wire.stream_in_thread("filesystem.Filesystem/WatchDir",
                                  {"path": base, "recursive": True, "includeEntry": True},
                                  headers={"Connect-Timeout-Ms": "2500", "Keepalive-Ping-Interval": "1"})
    watcher = wire.call("filesystem.Filesystem/CreateWatcher", {"path": base, "includeEntry": True})
    wid = watcher.messages[0]["watcherId"]
    time.sleep(0.3)
    r = requests.post(envd.url + "/files", params={"path": f"{base}/sub/a.txt"}, data=b"hello",
                      headers=envd.headers(**{"Content-Type": "application/octet-stream", "X-Metadata-Kind": "demo"}),
                      timeout=10)
    assert r.status_code == 200, r.text
    os.symlink(f"{base}/sub/a.txt", f"{base}/link")
    stat = wire.call("filesystem.Filesystem/Stat", {"path": f"{base}/sub/a.txt"}).messages[0]["entry"]
    assert stat["size"] == "5" and stat["type"] == "FILE_TYPE_FILE" and stat["metadata"] == {"kind": "demo"}
    assert stat["owner"] == temp_user.name
    link = wire.call("filesystem.Filesystem/Stat", {"path": f"{base}/link"}).messages[0]["entry"]
    assert link["symlinkTarget"] == f"{base}/sub/a.txt" and link["permissions"].startswith("L")
    deep = wire.call("filesystem.Filesystem/ListDir", {"path": base, "depth": 2}).messages[0]["entries"]
    assert sorted(e["name"] for e in deep) == ["a.txt", "link", "sub"]
    shallow = wire.call("filesystem.Filesystem/ListDir", {"path": base}).messages[0]["entries"]
    assert sorted(e["name"] for e in shallow) == ["link", "sub"]
    moved = wire.call("filesystem.Filesystem/Move", {"source": f"{base}/sub/a.txt", "destination": f"{base}/b.txt"})
    assert moved.messages[0]["entry"]["path"] == f"{base}/b.txt"
    events = wait_for(lambda: wire.call("filesystem.Filesystem/GetWatcherEvents",
                                        {"watcherId": wid}).messages[0].get("events"), "polled watcher events")
    assert any(e["type"] == "EVENT_TYPE_CREATE" for e in events)
    assert wire.call("filesystem.Filesystem/RemoveWatcher", {"watcherId": wid}).messages == [{}]
    assert wire.call("filesystem.Filesystem/Remove", {"path": f"{base}/b.txt"}).messages == [{}]
    gone = wire.call("filesystem.Filesystem/Stat", {"path": f"{base}/b.txt"})
    assert gone.status == 404 and gone.error["code"] == "not_found"
    watched = joined(watch)
    assert watched.messages[0] == {"start": {}} and watched.error["code"] == "deadline_exceeded"
    kinds = {m["filesystem"]["type"] for m in watched.messages if "filesystem" in m}
    assert {"EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_RENAME", "EVENT_TYPE_REMOVE"} <= kinds, kinds
    assert any("entry" in m["filesystem"] for m in watched.messages if "filesystem" in m)
    assert any("keepalive" in m for m in watched.messages)


# ---- (3) the HTTP routes -------------------------------------------------------------------------------


def test_envd_serves_exactly_the_contract_routes(http_spec):
    import yaml

    spec = yaml.safe_load((CONTRACT / "envd-http.yaml").read_text())
    described = {(method, path) for path, item in spec["paths"].items() for method in item}
    assert {(m, p) for m, p in served_routes() if not is_connect(p)} == described


class SpecHttp:
    def __init__(self, spec: OpenAPI, base: str) -> None:
        self.spec, self.base, self.statuses = spec, base, set()

    def __call__(self, method: str, path: str, *, bad_request: bool = False, **kw) -> requests.Response:
        """The request must match the contract unless it is meant not to (`bad_request`); the answer must."""
        r = requests.request(method, self.base + path, timeout=20, **kw)
        sent = r.request
        if not bad_request:
            self.spec.validate_request(RequestsOpenAPIRequest(sent))
        self.spec.validate_response(RequestsOpenAPIRequest(sent), RequestsOpenAPIResponse(r))
        self.statuses.add((method.lower(), path, r.status_code))
        return r


def test_http_routes_match_contract(envd_factory, http_spec, temp_user, workdir):
    server = envd_factory(prefix=NO_CLOCK)
    http = SpecHttp(http_spec, server.url)
    assert http("GET", "/health").status_code == 204
    token = secrets.token_hex(8)
    # the time is now: envd steps the clock when it is off (here that would be the host's clock)
    now = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    init = {"accessToken": token, "envVars": {"A": "1"}, "defaultUser": temp_user.name,
            "defaultWorkdir": workdir, "timestamp": now}
    assert http("POST", "/init", json=init).status_code == 204
    assert http("POST", "/init", json={"accessToken": "other"}).status_code == 401
    auth = {"X-Access-Token": token}
    assert http("POST", "/init", bad_request=True, data=b"{not json", headers={**auth, "Content-Type": "application/json"}).status_code == 400
    assert http("GET", "/envs").status_code == 401
    assert http("GET", "/envs", headers=auth).json() == {"A": "1"}
    assert http("GET", "/metrics").status_code == 401
    assert http("GET", "/metrics", headers=auth).json()["cpu_count"] == os.cpu_count()
    path = f"{workdir}/h.bin"
    up = http("POST", "/files", params={"path": path}, data=b"0123456789",
              headers={**auth, "Content-Type": "application/octet-stream", "X-Metadata-Note": "x"})
    assert up.json() == [{"name": "h.bin", "path": path, "type": "file", "metadata": {"note": "x"}}]
    multi = http("POST", "/files", params={"path": f"{workdir}/m.txt"}, files={"file": ("m.txt", b"multi")},
                 headers=auth)
    assert multi.status_code == 200 and multi.json()[0]["path"] == f"{workdir}/m.txt"
    assert http("POST", "/files", data=b"x", headers={**auth, "Content-Type": "application/octet-stream"}).status_code == 400
    assert http("GET", "/files", params={"path": path}, headers=auth).content == b"0123456789"
    part = http("GET", "/files", params={"path": path}, headers={**auth, "Range": "bytes=2-4"})
    assert part.status_code == 206 and part.content == b"234"
    assert http("GET", "/files", params={"path": path}, headers={**auth, "Range": "bytes=50-60"}).status_code == 416
    assert http("GET", "/files", params={"path": workdir + "/nope"}, headers=auth).status_code == 404
    assert http("GET", "/files", params={"path": workdir}, headers=auth).status_code == 400
    assert http("GET", "/files", params={"path": path, "username": "no-such-user-ct"}, headers=auth).status_code == 401
    assert http("GET", "/files", params={"path": path}).status_code == 401
    conns = http("GET", "/agentenv/connections", headers={"X-Agentenv-Host-Token": server.host_token})
    assert conns.status_code == 200 and isinstance(conns.json()["connections"], list)
    assert http("GET", "/agentenv/connections").status_code == 401
    assert "clock stepped" not in server.log_tail(200)


# ---- (4) our host-side clients use only the contract ---------------------------------------------------


class Recorder:
    """A pass-through HTTP hop in front of a real envd that keeps every request the clients send."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.requests: list[tuple[Any, bytes]] = []

    async def runner(self):
        """This hop as an HTTP server (set up, not yet listening) and a random loopback address for it."""
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        return runner, f"127.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"

    async def handle(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        self.requests.append((request, body))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length",
                                                                                 "transfer-encoding")}
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        try:
            upstream = await session.request(request.method, self.target + request.path_qs, data=body,
                                             headers=headers)
            resp = web.StreamResponse(status=upstream.status)
            for k in ("Content-Type", "Content-Range", "Content-Encoding"):
                if k in upstream.headers:
                    resp.headers[k] = upstream.headers[k]
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            await session.close()


def _check_recorded(contract: Contract, spec: OpenAPI, recorded: list[tuple[Any, bytes]]) -> set[str]:
    from openapi_core.contrib.aiohttp import AIOHTTPOpenAPIWebRequest

    used: set[str] = set()
    for request, body in recorded:
        where = f"{request.method} {request.path}"
        rpc = contract.rpcs.get(request.path)
        if rpc is None:
            spec.validate_request(AIOHTTPOpenAPIWebRequest(request, body=body))
            used.add(f"{request.method} {request.path}")
            continue
        used.add(request.path)
        assert request.method == "POST", where
        if rpc.kind == "unary":
            assert request.content_type == "application/json", where
            check_message(rpc.input, json.loads(body or b"{}"), where)
            continue
        assert request.content_type == "application/connect+json", where
        frames = read_envelopes(body)
        assert frames, where
        for flags, msg in frames:
            if flags & END_STREAM:
                assert rpc.client_streaming, f"{where}: end-of-stream envelope in a request to {rpc.kind}"
                continue
            check_message(rpc.input, msg, where)
    return used


async def test_host_clients_use_only_the_contract(envd_factory, contract, http_spec, temp_user, workdir, tmp_path):
    from aiohttp import ClientSession, web

    from agentenv.client.api import Endpoint
    from agentenv.client.envd import EnvdClient
    from agentenv.constants import ENVD_PORT
    from agentenv.orchestrator import envd_client

    server = envd_factory(prefix=NO_CLOCK)
    recorder = Recorder(server.url)
    runner, ip = await recorder.runner()
    site = web.TCPSite(runner, ip, ENVD_PORT)
    await site.start()
    try:
        # the orchestrator's calls, as at sandbox start
        await envd_client.wait_healthy(ip, timeout=10)
        token = secrets.token_hex(8)
        await envd_client.init(ip, access_token=token, env_vars={"CT": "1"}, host_token=server.host_token,
                               default_user=temp_user.name, default_workdir=workdir)
        out: list[tuple[str, str]] = []
        code = await envd_client.run_process(ip, access_token=token, cmd="echo $CT; echo e >&2; exit 4",
                                             user=temp_user.name, cwd=workdir, envs={"X": "y"},
                                             on_output=lambda s, t: out.append((s, t)), timeout=20)
        assert code == 4 and ("stdout", "1\n") in out and ("stderr", "e\n") in out
        assert await envd_client.run_process(ip, access_token=token, cmd="sleep 1", user=temp_user.name,
                                             background=True) is None
        src = tmp_path / "src.bin"
        src.write_bytes(b"payload")
        await envd_client.upload_file(ip, access_token=token, path=f"{workdir}/up.bin", src=src, user=temp_user.name)
        assert isinstance(await envd_client.blocking_connections(ip, host_token=server.host_token), list)

        # the CLI's calls (sandbox exec / shell / files)
        async with ClientSession() as http:
            client = EnvdClient(http, Endpoint(api_url="", api_key="", sandbox_url=f"http://{ip}:{ENVD_PORT}"),
                                "ctsbx", token, user=temp_user.name)
            async with client.start("/bin/cat", [], stdin=True) as proc:
                await client.send_input(proc.pid, b"abc")
                await client.close_stdin(proc.pid)
                got = b"".join([data async for _stream, data in proc])
            assert got == b"abc" and proc.end is not None and proc.end.exit_code == 0
            async with client.start("/bin/bash", ["-c", "read x; stty size; echo x=$x"], pty=(80, 24)) as proc:
                await client.resize(proc.pid, 90, 33)
                await client.send_input(proc.pid, b"hi\n", pty=True)
                text = b"".join([data async for _stream, data in proc]).decode()
            assert "33 90" in text and "x=hi" in text, text
            async with client.shell("sleep 30", timeout_s=60) as proc:
                await client.kill(proc.pid)
                assert [chunk async for chunk in proc] == [] and proc.end.exited is False
            assert await client.upload(f"{workdir}/cli.txt", b"cli") == [
                {"name": "cli.txt", "path": f"{workdir}/cli.txt", "type": "file"}]
            assert await client.read(f"{workdir}/cli.txt") == b"cli"
    finally:
        await runner.cleanup()

    assert "clock stepped" not in server.log_tail(200)
    used = _check_recorded(contract, http_spec, recorder.requests)
    assert {"/process.Process/Start", "/process.Process/SendInput", "/process.Process/CloseStdin",
            "/process.Process/Update", "/process.Process/SendSignal", "GET /health", "POST /init",
            "POST /files", "GET /files", "GET /agentenv/connections"} <= used, used
