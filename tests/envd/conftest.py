"""Fixtures for envd tests: a real envd subprocess on a free loopback port, a temporary OS user, and
E2B SDK clients pointed straight at envd (the SDK's envd-level clients, no control plane)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from packaging.version import Version

from agentenv.constants import ENVD_VERSION

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests need root (users, setuid)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Envd:
    url: str
    proc: subprocess.Popen = field(repr=False)
    log_path: Path
    host_token: str
    token: str | None = None

    def headers(self, **extra: str) -> dict[str, str]:
        h = {"X-Access-Token": self.token} if self.token else {}
        h.update(extra)
        return h

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError as exc:
            return f"<no log: {exc}>"


def start_envd(workdir: Path, extra_env: dict[str, str] | None = None, prefix: list[str] | None = None,
               host: str = "127.0.0.1", port: int | None = None) -> Envd:
    """envd on a free loopback port (or `host`:`port`); `prefix` runs it through a wrapper (e.g. setpriv
    dropping a capability)."""
    port = port or free_port()
    host_token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env["AGENTENV_ENVD_HOST_TOKEN"] = host_token
    env.update(extra_env or {})
    log_path = workdir / f"envd-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "agentenv.envd", "--host", host, "--port", str(port), "--subreaper"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    envd = Envd(f"http://{host}:{port}", proc, log_path, host_token)
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited with {proc.returncode}:\n{envd.log_tail()}")
        try:
            if requests.get(envd.url + "/health", timeout=2).status_code == 204:
                return envd
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            stop_envd(envd)
            raise RuntimeError(f"envd not healthy after 15 s:\n{envd.log_tail()}")
        time.sleep(0.1)


def stop_envd(envd: Envd) -> None:
    """Stop envd by PID, then kill whatever is left of its process group (its children's sessions differ,
    but envd kills those on shutdown)."""
    proc = envd.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class TempUser:
    name: str
    uid: int
    home: str


@pytest.fixture(scope="session")
def temp_user() -> Iterator[TempUser]:
    name = "aetest" + secrets.token_hex(3)
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, timeout=30, capture_output=True)
    try:
        import pwd

        pw = pwd.getpwnam(name)
        yield TempUser(name, pw.pw_uid, pw.pw_dir)
    finally:
        # Processes of the user may linger after a failed test; end them by PID before removing it.
        out = subprocess.run(["pgrep", "-u", name], capture_output=True, text=True, timeout=10)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["userdel", "-r", name], timeout=30, capture_output=True)


@pytest.fixture(scope="session")
def envd(tmp_path_factory: pytest.TempPathFactory, temp_user: TempUser) -> Iterator[Envd]:
    """One envd for the session, initialised with a token, global env and the temp user as default."""
    server = start_envd(tmp_path_factory.mktemp("envd"))
    try:
        token = secrets.token_hex(16)
        r = requests.post(
            server.url + "/init",
            json={"accessToken": token, "envVars": {"GLOBAL_VAR": "from-init"}, "defaultUser": temp_user.name},
            timeout=10,
        )
        assert r.status_code == 204, r.text
        server.token = token
        yield server
    finally:
        stop_envd(server)


def make_config(envd: Envd):
    from e2b.connection_config import ConnectionConfig

    headers = {"E2b-Sandbox-Id": "envdtest", "E2b-Sandbox-Port": "49983"}
    if envd.token:
        headers["X-Access-Token"] = envd.token
    return ConnectionConfig(
        api_key="e2b_" + "0" * 40, sandbox_url=envd.url, extra_sandbox_headers=headers, request_timeout=30
    )


def sdk_kwargs(envd: Envd) -> dict:
    return dict(
        sandbox_id="envdtest",
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=envd.token,
        traffic_access_token=None,
        connection_config=make_config(envd),
    )


@pytest.fixture(scope="session")
def sbx(envd: Envd):
    """The sync SDK Sandbox object talking directly to our envd."""
    from e2b import Sandbox

    return Sandbox(**sdk_kwargs(envd))


@pytest.fixture
def sandbox_for():
    """The sync SDK Sandbox object for a given envd (one from `envd_factory`)."""
    from e2b import Sandbox

    return lambda envd: Sandbox(**sdk_kwargs(envd))


@pytest.fixture
async def asbx(envd: Envd):
    from e2b import AsyncSandbox

    return AsyncSandbox(**sdk_kwargs(envd))


@pytest.fixture
def workdir(temp_user: TempUser) -> Iterator[str]:
    """A fresh directory inside the temp user's home, owned by them, removed afterwards."""
    import shutil

    path = os.path.join(temp_user.home, "t-" + secrets.token_hex(4))
    os.mkdir(path)
    os.chown(path, temp_user.uid, -1)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def envd_factory(tmp_path: Path) -> Iterator:
    """Start extra envd instances (e.g. with other env settings); all are stopped after the test."""
    started: list[Envd] = []

    def factory(extra_env: dict[str, str] | None = None, prefix: list[str] | None = None, **where) -> Envd:
        server = start_envd(tmp_path, extra_env, prefix, **where)
        started.append(server)
        return server

    try:
        yield factory
    finally:
        for server in started:
            stop_envd(server)
