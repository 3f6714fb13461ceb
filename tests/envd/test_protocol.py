"""Wire-level checks: Connect-JSON unary/stream framing, errors, keepalives, timeouts, auth, /init, /metrics."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time

import requests

UNAUTH = {"code": 401, "message": "unauthorized access, please provide a valid access token or method signing if supported"}


def envelope(msg: dict, flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


def read_stream(resp: requests.Response) -> list[tuple[int, dict, float]]:
    """All envelopes of a streaming response as (flags, message, arrival time)."""
    out = []
    raw = resp.raw
    while True:
        header = raw.read(5)
        if not header:
            return out
        assert len(header) == 5
        flags, length = struct.unpack(">BI", header)
        out.append((flags, json.loads(raw.read(length)), time.monotonic()))


def unary(envd, method: str, msg: dict, **headers) -> requests.Response:
    return requests.post(f"{envd.url}/{method}", json=msg, timeout=20,
                         headers=envd.headers(**{"Content-Type": "application/json", **headers}))


def stream(envd, method: str, msg: dict, **headers) -> requests.Response:
    return requests.post(f"{envd.url}/{method}", data=envelope(msg), stream=True, timeout=20,
                         headers=envd.headers(**{"Content-Type": "application/connect+json", **headers}))


def start(envd, cmd: str, **headers) -> list[tuple[int, dict, float]]:
    r = stream(envd, "process.Process/Start", {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}}, **headers)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/connect+json"
    return read_stream(r)


def test_health_and_token_enforcement(envd):
    r = requests.get(envd.url + "/health", timeout=5)
    assert r.status_code == 204 and r.content == b""
    r = requests.post(envd.url + "/process.Process/List", json={}, timeout=5)
    assert r.status_code == 401 and r.json() == UNAUTH
    r = requests.post(envd.url + "/process.Process/List", json={}, headers={"X-Access-Token": "wrong"}, timeout=5)
    assert r.status_code == 401 and r.json() == UNAUTH
    assert requests.get(envd.url + "/envs", timeout=5).status_code == 401
    r = requests.get(envd.url + "/envs", headers=envd.headers(), timeout=5)
    assert r.status_code == 200 and r.json() == {"GLOBAL_VAR": "from-init"}
    assert unary(envd, "process.Process/List", {}).status_code == 200


def test_metrics_shape(envd):
    r = requests.get(envd.url + "/metrics", headers=envd.headers(), timeout=5)
    m = r.json()
    for key in ("ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "mem_total_mib",
                "mem_used_mib", "disk_used", "disk_total"):
        assert key in m, key
    assert m["cpu_count"] == os.cpu_count()
    assert 0 < m["mem_used"] <= m["mem_total"] and 0 < m["disk_used"] <= m["disk_total"]
    assert abs(m["ts"] - time.time()) < 5


def test_init_reinit_rules(envd_factory):
    server = envd_factory()
    url = server.url + "/init"
    assert requests.post(url, json={"accessToken": "t1", "envVars": {"A": "1"}}, timeout=5).status_code == 204
    # later calls need the current token or the host token
    r = requests.post(url, json={"accessToken": "evil"}, timeout=5)
    assert r.status_code == 401 and r.json() == UNAUTH
    r = requests.post(url, json={"accessToken": "evil"}, headers={"X-Agentenv-Host-Token": "nope"}, timeout=5)
    assert r.status_code == 401
    r = requests.post(url, json={"accessToken": "t2", "envVars": {"B": "2"}},
                      headers={"X-Agentenv-Host-Token": server.host_token}, timeout=5)
    assert r.status_code == 204
    assert requests.get(server.url + "/envs", headers={"X-Access-Token": "t1"}, timeout=5).status_code == 401
    r = requests.get(server.url + "/envs", headers={"X-Access-Token": "t2"}, timeout=5)
    assert r.json() == {"B": "2"}
    r = requests.post(url, json={"accessToken": "t3"}, headers={"X-Access-Token": "t2"}, timeout=5)
    assert r.status_code == 204


def test_unknown_routes_and_methods_answer_json_errors(envd):
    r = requests.get(envd.url + "/no-such-route", headers=envd.headers(), timeout=5)
    assert r.status_code == 404 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["code"] == 404 and "/no-such-route" in r.json()["message"]
    r = requests.delete(envd.url + "/envs", headers=envd.headers(), timeout=5)
    assert r.status_code == 405 and r.json()["code"] == 405 and "GET" in r.headers["Allow"]


def test_unary_errors_are_connect_json(envd, workdir):
    r = unary(envd, "filesystem.Filesystem/Stat", {"path": f"{workdir}/missing"})
    assert r.status_code == 404 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["code"] == "not_found" and "missing" in r.json()["message"]
    r = unary(envd, "filesystem.Filesystem/Stat", {"path": workdir}, Authorization="Basic " + base64.b64encode(b"nobody-xyz:").decode())
    assert r.status_code == 401 and r.json() == {"code": "unauthenticated", "message": "invalid username: 'nobody-xyz'"}
    r = unary(envd, "process.Process/SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = unary(envd, "filesystem.Filesystem/RemoveWatcher", {"watcherId": "nope"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_snake_case_and_int64_strings(envd, workdir):
    with open(f"{workdir}/f", "w") as f:
        f.write("12345")
    r = unary(envd, "filesystem.Filesystem/ListDir", {"path": workdir, "depth": 1})
    (entry,) = r.json()["entries"]
    assert entry["size"] == "5" and entry["type"] == "FILE_TYPE_FILE" and "modifiedTime" in entry
    r = unary(envd, "filesystem.Filesystem/CreateWatcher", {"path": workdir, "include_entry": True})
    wid = r.json()["watcherId"]
    with open(f"{workdir}/g", "w") as f:
        f.write("x")
    deadline = time.monotonic() + 5
    events = []
    while not any(e.get("entry") for e in events):
        assert time.monotonic() < deadline
        events += unary(envd, "filesystem.Filesystem/GetWatcherEvents", {"watcher_id": wid}).json()["events"]
        time.sleep(0.05)
    assert unary(envd, "filesystem.Filesystem/RemoveWatcher", {"watcherId": wid}).status_code == 200
    r = unary(envd, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
    assert r.status_code == 404


def test_stream_framing_and_end_event(envd):
    msgs = start(envd, "echo hi; exit 3")
    flags = [f for f, _, _ in msgs]
    assert flags[-1] == 2 and all(f == 0 for f in flags[:-1])
    assert msgs[-1][1] == {}
    events = [m["event"] for f, m, _ in msgs[:-1]]
    assert "pid" in events[0]["start"]
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert out == b"hi\n"
    assert events[-1] == {"end": {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}}


def test_stream_error_inside_200(envd):
    r = stream(envd, "process.Process/Start", {"process": {"cmd": "/bin/true", "cwd": "/no/such/dir"}})
    assert r.status_code == 200
    (only,) = read_stream(r)
    assert only[0] == 2
    assert only[1] == {"error": {"code": "invalid_argument", "message": "cwd '/no/such/dir' does not exist"}}


def test_keepalive_events(envd):
    msgs = start(envd, "sleep 2.5", **{"Keepalive-Ping-Interval": "1"})
    events = [m.get("event", {}) for f, m, _ in msgs if f == 0]
    assert sum(1 for e in events if "keepalive" in e) >= 2
    assert "end" in events[-1]


def test_connect_timeout_bounds_stream_and_process(envd):
    """As E2B's envd: the stream's deadline (from the request) ends it with deadline_exceeded, never
    with the end event of the process, which the same timeout (from its spawn) kills right after."""
    for _ in range(5):
        t0 = time.monotonic()
        msgs = start(envd, "sleep 30.7", **{"Connect-Timeout-Ms": "700.0"})
        assert time.monotonic() - t0 < 5
        assert not any("end" in m.get("event", {}) for _f, m, _t in msgs), msgs
        assert msgs[-1][0] == 2 and msgs[-1][1]["error"]["code"] == "deadline_exceeded", msgs
    deadline = time.monotonic() + 5
    while any("sleep 30.7" in " ".join(p["config"].get("args", []))
              for p in unary(envd, "process.Process/List", {}).json().get("processes", [])):
        assert time.monotonic() < deadline, "the timed-out processes were not killed"
        time.sleep(0.1)


def test_sigterm_and_client_stream_input(envd):
    r = stream(envd, "process.Process/Start",
               {"process": {"cmd": "/bin/bash", "args": ["-c", "read a; read b; echo $a$b; sleep 30"]}, "stdin": True})
    header = r.raw.read(5)
    _flags, length = struct.unpack(">BI", header)
    pid = json.loads(r.raw.read(length))["event"]["start"]["pid"]
    body = (envelope({"start": {"process": {"pid": pid}}})
            + envelope({"data": {"input": {"stdin": base64.b64encode(b"x\n").decode()}}})
            + envelope({"keepalive": {}})
            + envelope({"data": {"input": {"stdin": base64.b64encode(b"y\n").decode()}}}))
    rin = requests.post(envd.url + "/process.Process/StreamInput", data=iter([body]), timeout=10,
                        headers=envd.headers(**{"Content-Type": "application/connect+json"}))
    assert rin.status_code == 200
    deadline = time.monotonic() + 5
    listed = []
    while not listed:
        assert time.monotonic() < deadline
        listed = [p for p in unary(envd, "process.Process/List", {}).json()["processes"] if p["pid"] == pid]
    assert unary(envd, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}).status_code == 200
    events = [m["event"] for f, m, _ in read_stream(r) if f == 0]
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert out == b"xy\n"
    assert events[-1]["end"]["status"] == "signal: terminated"


def test_server_never_closes_idle_connection(envd):
    with socket.create_connection(("127.0.0.1", int(envd.url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 204")
        s.settimeout(1.5)
        try:
            data = s.recv(1)
        except socket.timeout:
            data = None
        assert data is None, "server closed (or wrote on) an idle keep-alive connection"
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 204")


def _tcp_states_for_local_port(port: int) -> list[str]:
    """TCP states (hex codes of /proc/net/tcp*) of sockets whose local port is `port`, listeners excluded."""
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local_port = int(fields[1].rsplit(":", 1)[1], 16)
                    if local_port == port and fields[3] != "0A":  # 0A = LISTEN
                        states.append(fields[3])
        except FileNotFoundError:
            continue
    return states


def test_envd_never_closes_first(envd_factory, temp_user):
    """After clients hang up, envd's side must leave no TIME_WAIT/FIN_WAIT (gVisor refuses to checkpoint)."""
    server = envd_factory({"AGENTENV_ENVD_MAX_UPLOAD": "1000"})
    port = int(server.url.rsplit(":", 1)[1])
    assert requests.post(server.url + "/init", json={"defaultUser": temp_user.name}, timeout=5).status_code == 204
    with requests.Session() as s:
        assert s.get(server.url + "/health", timeout=5).status_code == 204
        assert s.post(server.url + "/filesystem.Filesystem/Stat", json={"path": "/nope"}, timeout=5).status_code == 404
        r = s.post(server.url + "/files", params={"path": "big"}, data=iter([b"x" * 800, b"y" * 800]), timeout=5,
                   headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 413
        assert s.get(server.url + "/does-not-exist", timeout=5).status_code == 404
        # a stream the client abandons half-way
        r = s.post(server.url + "/process.Process/Start", stream=True, timeout=5,
                   data=envelope({"process": {"cmd": "/bin/bash", "args": ["-c", "echo x; sleep 2"]}}),
                   headers={"Content-Type": "application/connect+json"})
        r.raw.read(5)
        r.close()
        assert s.get(server.url + "/health", timeout=5).status_code == 204
    time.sleep(0.5)
    bad = [st for st in _tcp_states_for_local_port(port) if st in ("04", "05", "06", "0B")]  # FIN_WAIT1/2, TIME_WAIT, CLOSING
    assert not bad, f"envd closed connections first (states {bad})"
