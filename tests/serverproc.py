"""Start and stop EXTRA `agentenv serve` processes (own data dir, port, API key, env, log).

The session ``server`` fixture (tests/conftest.py) is the main server; tests that need a server they
can crash, restart or configure differently (S3 snapshot store, ...) use this helper:

    d = new_data_dir("crash")                   # fresh dir, images hard-linked from the shared one
    srv = start_extra_server(d, env={...})      # waits for GET /health
    Sandbox.create(**srv.sdk_opts())            # SDK options pointing at it (no global env change)
    srv.kill9()                                 # crash: SIGKILL the main server pid only
    srv2 = start_extra_server(d, api_key=srv.api_key)   # restart on the same data dir
    srv2.stop()                                 # SIGTERM -> wait -> SIGKILL, `agentenv gc`, leftovers check
    remove_data_dir(d)

Extra data dirs live next to the shared one (same file system: `cp -al` needs it) and never build
a second base image: `<AGENTENV_TEST_DATA_DIR or /var/tmp/agentenv-test>/images` is hard-link
copied into them. The shared images dir is never modified or deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from leftovers import NETNS_PREFIX, agentenv_netns, assert_no_leftovers, mounts_under

DEFAULT_DATA_DIR = "/var/tmp/agentenv-test"


def shared_data_dir() -> Path:
    return Path(os.environ.get("AGENTENV_TEST_DATA_DIR") or DEFAULT_DATA_DIR).resolve()


def agentenv_executable() -> str:
    override = os.environ.get("AGENTENV_TEST_BIN")
    if override:
        return override
    candidate = Path(sys.prefix) / "bin" / "agentenv"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("agentenv")
    if found:
        return found
    raise RuntimeError("agentenv executable not found (run scripts/setup.sh --test)")


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def new_data_dir(tag: str) -> Path:
    """A fresh data dir beside the shared one, with the shared built images hard-linked into it."""
    shared = shared_data_dir()
    images = shared / "images"
    if not (images / "base").exists():
        raise RuntimeError(f"no built images under {images}: the session server must have built them first")
    d = shared.parent / f"{shared.name}-{tag}-{secrets.token_hex(3)}"
    d.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(images), str(d / "images")], check=True, timeout=300)
    return d


def remove_data_dir(d: Path) -> None:
    """rm -rf an extra data dir — never through a mount, never the shared one."""
    d = d.resolve()
    if d == shared_data_dir():
        raise RuntimeError("refusing to remove the shared test data dir")
    left = mounts_under(d)
    if left:
        raise RuntimeError(f"mounts still under {d}: {left}")
    shutil.rmtree(d, ignore_errors=True)


def log_tail(path: Path, lines: int = 80) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no server log at {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_members(pgid: int) -> list[str]:
    """`pid: command line` of each live process in the group (what a failed check names); a zombie
    (a process that exited as the server did, which init reaps) is no process left running."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) != pgid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{name}: {cmdline[:200]}")
        except (OSError, IndexError):
            continue
    return found


@dataclass
class ExtraServer:
    url: str
    api_key: str
    data_dir: Path
    log_path: Path
    env: dict[str, str]                 # the AGENTENV_* overrides it was started with
    proc: subprocess.Popen = field(repr=False)
    preexisting_netns: frozenset[str] = frozenset()
    known_ids: set[str] = field(default_factory=set)   # sandbox ids the test created on it
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def sdk_opts(self, **extra) -> dict:
        """Keyword options for e2b Sandbox.* calls that target this server."""
        return dict(api_key=self.api_key, api_url=self.url, sandbox_url=self.url, **extra)

    def headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.api_key}

    def log_tail(self, lines: int = 80) -> str:
        return log_tail(self.log_path, lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        """Crash: SIGKILL the main server process only (its sandboxes and helpers are left as they are)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.stopped = True

    def stop(self, *, timeout: float = 60, gc: bool = True, check_leftovers: bool = True) -> list[str]:
        """SIGTERM, wait, SIGKILL the group if needed; then `agentenv gc` and the leftovers check.

        Returns non-fatal problems; raises AssertionError when gc fails or resources are left.
        """
        problems: list[str] = []
        if not self.stopped:
            problems += stop_server(self.proc, timeout)
            self.stopped = True
        if gc:
            r = run_gc(self.data_dir, self.env)
            if r.returncode != 0:
                raise AssertionError(f"`agentenv gc --data-dir {self.data_dir}` failed ({r.returncode}):\n"
                                     f"{r.stdout}\n{r.stderr}")
        if check_leftovers:
            assert_no_leftovers(self.data_dir, ignore_netns=self.foreign_netns())
        return problems

    def foreign_netns(self) -> frozenset[str]:
        """`agentenv-*` netns that cannot be this server's (other servers share the host's netns names)."""
        try:
            log_text = self.log_path.read_text(errors="replace")
        except OSError:
            log_text = ""
        sandboxes = self.data_dir / "sandboxes"
        ignore = set(self.preexisting_netns)
        for name in agentenv_netns():
            sid = name[len(NETNS_PREFIX):]  # agentenv_netns() lists only this instance's names
            if sid in self.known_ids or (sid and sid in log_text) or (sandboxes / sid).exists():
                continue
            ignore.add(name)
        return frozenset(ignore)


def stop_unchecked(*servers: "ExtraServer | None") -> None:
    """For a test's `finally`: stop whatever of `servers` still runs and `agentenv gc` its data dir,
    without the leftovers check (the test failed already). A server the test killed itself gets the
    gc too: its sandboxes, netns and mounts outlived it."""
    for srv in servers:
        if srv is None:
            continue
        try:
            if srv.stopped:
                run_gc(srv.data_dir, srv.env)
            else:
                srv.stop(check_leftovers=False)
        except Exception:  # noqa: BLE001
            pass


def stop_server(proc: subprocess.Popen, timeout: float) -> list[str]:
    """SIGTERM a server, wait, SIGKILL its process group if needed. Returns problems seen."""
    problems: list[str] = []
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            problems.append(f"server {proc.pid} did not exit within {timeout:.0f}s of SIGTERM; killed")
    else:
        problems.append(f"server {proc.pid} had already exited with code {proc.returncode}")
    if _group_alive(pgid):
        left = _group_members(pgid) if proc.poll() is not None else []
        if left:
            problems.append(f"server {proc.pid} exited but left processes in its process group; killed: "
                            f"{'; '.join(left)}")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return problems


def run_gc(data_dir: Path, env_overrides: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_overrides or {})
    env["AGENTENV_DATA_DIR"] = str(data_dir)
    return subprocess.run([agentenv_executable(), "gc", "--data-dir", str(data_dir)], env=env,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def start_extra_server(data_dir: Path, *, api_key: str | None = None, env: dict[str, str] | None = None,
                       startup_timeout: float = 120, log_name: str | None = None,
                       wait_healthy: bool = True) -> ExtraServer:
    """Start `agentenv serve` on `data_dir` (a free port, its own API key) and wait for GET /health
    (`wait_healthy=False`: return at once, the server still starting)."""
    port = free_port()
    api_key = api_key or new_api_key()
    url = f"http://127.0.0.1:{port}"
    overrides = dict(env or {})
    overrides.update(AGENTENV_DATA_DIR=str(data_dir), AGENTENV_HOST="127.0.0.1", AGENTENV_PORT=str(port),
                     AGENTENV_BOOTSTRAP_API_KEY=api_key)
    full_env = dict(os.environ)
    for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        full_env.pop(k, None)
    full_env.update(overrides)
    log_path = data_dir / (log_name or f"server-{port}.log")
    preexisting = frozenset(agentenv_netns())
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([agentenv_executable(), "serve"], env=full_env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = ExtraServer(url=url, api_key=api_key, data_dir=data_dir, log_path=log_path, env=overrides, proc=proc,
                      preexisting_netns=preexisting)
    if not wait_healthy:
        return srv
    deadline = time.monotonic() + startup_timeout
    last = "no response yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"agentenv serve ({data_dir}) exited with code {code} during startup\n"
                               f"--- log ---\n{srv.log_tail()}")
        try:
            r = requests.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return srv
            last = f"GET /health -> {r.status_code}"
        except requests.RequestException as e:
            last = f"GET /health: {type(e).__name__}"
        if time.monotonic() > deadline:
            stop_server(proc, 30)
            raise RuntimeError(f"extra server not healthy after {startup_timeout:.0f}s ({last})\n"
                               f"--- log ---\n{srv.log_tail()}")
        time.sleep(0.2)
