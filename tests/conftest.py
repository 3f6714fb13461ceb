"""Shared fixtures: the session-wide agentenv test server.

``server`` starts ``<venv>/bin/agentenv serve`` once per session on a free port with a fresh
API key and a data dir that keeps built images across runs (``AGENTENV_TEST_DATA_DIR``, default
``/var/tmp/agentenv-test``).  It exports ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``
so the unmodified E2B SDKs talk to it, and on teardown stops the server, runs ``agentenv gc``
and asserts that no container, netns, mount or process of the data dir is left.

Environment knobs:
  AGENTENV_TEST_DATA_DIR          data dir (default /var/tmp/agentenv-test)
  AGENTENV_TEST_STARTUP_TIMEOUT   seconds to wait for GET /health (default 240)
  AGENTENV_TEST_STOP_TIMEOUT      seconds between SIGTERM and SIGKILL (default 60)
  AGENTENV_TEST_BIN               agentenv executable (default: the one next to this Python)

Parallel sessions on one host (e.g. two checkouts): give each its own AGENTENV_INSTANCE (a tag of
up to 4 [a-z0-9] in every netns/link/nft name), AGENTENV_SLOT_SUBNET, AGENTENV_TEST_RUNTIME_SUBNET,
AGENTENV_TEST_DATA_DIR and AGENTENV_TEST_RUNTIME_DIR; leftover checks then see only their own.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from leftovers import agentenv_netns, assert_no_leftovers, find_leftovers, mounts_under
from serverproc import agentenv_executable, free_port, log_tail, run_gc, stop_server

DEFAULT_DATA_DIR = "/var/tmp/agentenv-test"

# No pool of ready sandboxes in the servers tests start (session, extra, cluster: they inherit this
# environment) unless a test asks for one (tests/lifecycle/test_pool.py): pooled sandboxes would be
# restored in the background while other tests measure or count containers.
os.environ.setdefault("AGENTENV_POOL_SIZE", "0")
# The Python SDK opens at most E2B_MAX_CONNECTIONS (default 200) HTTP/1 connections per address, and
# a request past them waits for one. The cluster load test runs 500 cycles at once through one
# gateway, and the creates the scheduler parks (admission long-poll, up to admission_wait_s) held
# all 200: the created sandboxes' commands and kills queued behind them, sandboxes lived ~5x longer,
# every node sat at capacity and idle Sentries took the CPU (500 cycles: 467 s at 1.07/s, node peaks
# 16/16/16; with 1000 connections 216 s at 2.31/s, peaks 4/4/4). Read when e2b is first imported.
os.environ.setdefault("E2B_MAX_CONNECTIONS", "1000")
MAX_UPLOAD_BYTES = 200 * 1024 * 1024
LOG_NAME = "test-server.log"


@dataclass
class Server:
    api_url: str
    sandbox_url: str
    api_key: str
    data_dir: Path
    pid: int
    log_path: Path
    proc: subprocess.Popen = field(repr=False)
    max_upload_bytes: int = MAX_UPLOAD_BYTES

    def sdk_env(self) -> dict[str, str]:
        """Environment for a child process using an E2B SDK against this server."""
        env = dict(os.environ)
        env.pop("E2B_DEBUG", None)
        env.update(E2B_API_URL=self.api_url, E2B_SANDBOX_URL=self.sandbox_url, E2B_API_KEY=self.api_key)
        return env

    def log_tail(self, lines: int = 80) -> str:
        return log_tail(self.log_path, lines)










def prepare_data_dir(agentenv: str, data_dir: Path) -> None:
    """Clean state of earlier runs (also crashed ones) but keep the cached images."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if (data_dir / "state.db").exists() or (data_dir / "sandboxes").exists() or (data_dir / "run").exists():
        gc = run_gc(data_dir)
        if gc.returncode != 0:
            pytest.fail(
                f"`agentenv gc` before the session failed ({gc.returncode}):\n{gc.stdout}\n{gc.stderr}"
            )
    for p in data_dir.glob("state.db*"):
        p.unlink()
    sandboxes = data_dir / "sandboxes"
    if sandboxes.exists():
        # Never recurse through a mount (it could be a shared image) — gc should have removed them.
        still_mounted = mounts_under(sandboxes)
        if still_mounted:
            pytest.fail(f"mounts left under {sandboxes} after `agentenv gc`: {still_mounted}")
        shutil.rmtree(sandboxes)


def other_agentenv_servers(exclude_pid: int | None = None) -> list[int]:
    """PIDs of other `agentenv serve` processes on this host (a shared developer machine)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (exclude_pid, os.getpid()):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"agentenv") for a in argv) and b"serve" in argv:
            found.append(int(entry.name))
    return found


def ignorable_netns(data_dir: Path, log_path: Path, preexisting: frozenset[str], shared_host: bool) -> frozenset[str]:
    """`agentenv-*` namespaces that are not this session's server's.

    Always the ones that existed before it started. When other agentenv servers ran on this host
    during the session, also every namespace whose sandbox ID our server never mentioned in its log
    and never had a directory for (netns names are host-global; CI hosts run one server only).
    """
    if not shared_host:
        return preexisting
    try:
        log_text = log_path.read_text(errors="replace")
    except OSError:
        log_text = ""
    ignore = set(preexisting)
    for name in agentenv_netns():
        sid = name[len("agentenv-"):]
        if sid and sid not in log_text and not (data_dir / "sandboxes" / sid).exists():
            ignore.add(name)
    return frozenset(ignore)






@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    agentenv = agentenv_executable()
    data_dir = Path(os.environ.get("AGENTENV_TEST_DATA_DIR") or DEFAULT_DATA_DIR).resolve()
    startup_timeout = float(os.environ.get("AGENTENV_TEST_STARTUP_TIMEOUT", "240"))
    stop_timeout = float(os.environ.get("AGENTENV_TEST_STOP_TIMEOUT", "60"))
    prepare_data_dir(agentenv, data_dir)

    # agentenv-* namespaces that exist already cannot be leftovers of this session's server
    # (only possible on a shared developer machine; CI starts clean).
    foreign_netns = frozenset(agentenv_netns())
    shared_host = bool(other_agentenv_servers())

    port = free_port()
    api_key = "e2b_" + secrets.token_hex(20)
    url = f"http://127.0.0.1:{port}"
    log_path = data_dir / LOG_NAME
    env = dict(os.environ)
    env.update(
        AGENTENV_DATA_DIR=str(data_dir),
        AGENTENV_HOST="127.0.0.1",
        AGENTENV_PORT=str(port),
        AGENTENV_BOOTSTRAP_API_KEY=api_key,
        AGENTENV_MAX_UPLOAD_BYTES=str(MAX_UPLOAD_BYTES),
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [agentenv, "serve"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    saved_env = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DEBUG")}
    startup_error = None
    try:
        deadline = time.monotonic() + startup_timeout
        last_error = "no response yet"
        while True:
            code = proc.poll()
            if code is not None:
                startup_error = f"agentenv serve exited with code {code} during startup"
                break
            try:
                r = requests.get(f"{url}/health", timeout=5)
                if r.status_code == 200:
                    break
                last_error = f"GET /health -> {r.status_code}"
            except requests.RequestException as e:
                last_error = f"GET /health: {type(e).__name__}"
            if time.monotonic() > deadline:
                startup_error = f"server not healthy after {startup_timeout:.0f}s ({last_error})"
                break
            time.sleep(0.25)
    except BaseException:
        stop_server(proc, stop_timeout)
        run_gc(data_dir)
        raise
    if startup_error is not None:
        stop_server(proc, stop_timeout)
        gc = run_gc(data_dir)
        pytest.fail(
            f"{startup_error}\n--- server log tail ({log_path}) ---\n{log_tail(log_path)}"
            f"\n--- agentenv gc ({gc.returncode}) ---\n{gc.stdout}{gc.stderr}",
            pytrace=False,
        )

    os.environ.pop("E2B_DEBUG", None)
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=api_key)
    srv = Server(
        api_url=url, sandbox_url=url, api_key=api_key, data_dir=data_dir, pid=proc.pid, log_path=log_path, proc=proc
    )
    try:
        yield srv
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        crashed = proc.poll()
        shared_host = shared_host or bool(other_agentenv_servers(exclude_pid=proc.pid))
        problems = stop_server(proc, stop_timeout)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")

        def note(msg: str) -> None:
            if reporter is not None:
                reporter.write_line(f"[agentenv server] {msg}", yellow=True)

        for p in problems:
            note(p)
        if shared_host:
            note("other agentenv servers ran on this host: netns not mentioned by ours are ignored")
        # Resources the server did not release on a clean shutdown (gc removes them next).
        ignore = ignorable_netns(data_dir, log_path, foreign_netns, shared_host)
        before_gc = find_leftovers(data_dir, ignore_netns=ignore)
        if before_gc:
            note(f"left after shutdown, before gc:\n  {before_gc.describe()}")
        failures: list[str] = []
        if crashed is not None:
            failures.append(
                f"the server exited with code {crashed} during the session\n"
                f"--- server log tail ({log_path}) ---\n{log_tail(log_path)}"
            )
        gc = run_gc(data_dir)
        if gc.returncode != 0:
            failures.append(f"`agentenv gc` failed ({gc.returncode}):\n{gc.stdout}\n{gc.stderr}")
        try:
            assert_no_leftovers(data_dir, ignore_netns=ignorable_netns(data_dir, log_path, foreign_netns, shared_host))
        except AssertionError as e:
            failures.append(str(e))
        assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server for the session's state-store tests (started on first use; each
    test takes a fresh database from it with `create_database()`)."""
    from pgserver import pg_bindir, start_postgres

    if pg_bindir() is None:
        pytest.skip("PostgreSQL server not installed (apt-get install postgresql; scripts/setup.sh --test does it)")
    srv = start_postgres()
    try:
        yield srv
    finally:
        srv.stop()
