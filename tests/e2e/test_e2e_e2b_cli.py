"""The official E2B CLI (npm `@e2b/cli`, pinned in tests/js/package.json) against the test server.

The CLI runs unmodified as a subprocess with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY pointing at
the server (its config dir, ~/.e2b, is a fresh temporary HOME). Interactive commands (`sandbox
connect`, `sandbox create`, `sandbox spawn`) run in a real pseudo-terminal: the test types into it
and asserts on what the terminal shows. What each command does is checked through the Python SDK.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, SandboxQuery, SandboxState

from e2e_util import kill_quietly, new_tag, wait_until

JS_DIR = Path(__file__).resolve().parent.parent / "js"
E2B_BIN = JS_DIR / "node_modules" / ".bin" / "e2b"
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\r")
PROMPT = "$ "


def plain(text: str) -> str:
    """Terminal output without colour, title and hyperlink escapes or carriage returns."""
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
def cli_env(server, tmp_path_factory) -> dict[str, str]:
    if shutil.which("node") is None or not E2B_BIN.exists():
        pytest.fail(f"{E2B_BIN} is missing (run scripts/setup.sh --test)")
    env = server.sdk_env()
    home = tmp_path_factory.mktemp("e2b-cli-home")
    # A clean ~/.e2b (no stored login), no npm update check (no network in CI), no colours off a TTY.
    env.update(HOME=str(home), NO_UPDATE_NOTIFIER="1", FORCE_COLOR="0", TERM="xterm")
    return env


def e2b(env: dict[str, str], *args: str, cwd: Path | None = None, check: bool = True,
        timeout: float = 180) -> subprocess.CompletedProcess:
    p = subprocess.run([str(E2B_BIN), *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
    return p


@dataclass
class Terminal:
    """A command in a real pseudo-terminal (80x24 unless told): type into it, wait for what it shows."""

    proc: subprocess.Popen
    fd: int
    raw: bytearray = field(default_factory=bytearray)

    @classmethod
    def spawn(cls, argv: list[str], env: dict[str, str], rows: int = 24, cols: int = 100) -> Terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                start_new_session=True, close_fds=True)
        os.close(slave)
        return cls(proc, master)

    @property
    def screen(self) -> str:
        return plain(self.raw.decode(errors="replace"))

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the program closed the terminal
            return False
        self.raw += chunk
        return bool(chunk)

    def expect(self, pattern: str, timeout: float = 60, after: int = 0) -> re.Match:
        """Wait until `pattern` (a regex) shows on the terminal past offset `after`."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.screen, after)
            if m:
                return m
            left = deadline - time.monotonic()
            open_ = left > 0 and self._read(min(left, 0.5))
            if left <= 0 or not open_ and self.proc.poll() is not None:
                pytest.fail(f"{pattern!r} never showed on the terminal; it shows:\n{self.screen[-2000:]}")
            if not open_:
                time.sleep(0.1)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def finish(self, timeout: float = 60) -> int:
        """Read until the program exits and closes the terminal; its exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(0.5):
            pass
        try:
            return self.proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        if self.fd >= 0:  # once: a second close could hit a reused descriptor (e.g. an SDK socket)
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for t in opened:
        t.close()


def shell_roundtrip(term: Terminal) -> None:
    """At the sandbox's shell prompt: run a command whose output differs from what was typed, exit."""
    term.expect(re.escape(PROMPT))
    mark = len(term.screen)
    term.type("echo hi-$((6*7))\r")
    term.expect(r"(?m)^hi-42$", after=mark)  # the shell's output, not the echo of the typed line
    term.type("exit\r")


def gone(sandbox_id: str) -> bool:
    """The sandbox is neither running nor paused (every page of the SDK's list)."""
    pages = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED]), limit=100)
    while pages.has_next:
        if any(s.sandbox_id == sandbox_id for s in pages.next_items()):
            return False
    return True


# --- sandboxes ----------------------------------------------------------------------------------


def test_sandbox_list_info_exec_logs_and_kill(cli_env):
    run = new_tag()
    boxes = [Sandbox.create(metadata={"suite": "e2b-cli", "run": run, "n": str(i)}, timeout=300) for i in range(2)]
    try:
        ids = {b.sandbox_id for b in boxes}
        listed = json.loads(e2b(cli_env, "sandbox", "list", "-m", f"run={run}", "-f", "json").stdout)
        assert {s["sandboxId"] for s in listed} == ids
        assert all(s["state"] == "running" and s["templateId"] == "base" and s["metadata"]["run"] == run
                   for s in listed), listed
        table = e2b(cli_env, "sandbox", "list", "-m", f"run={run}").stdout
        assert "SANDBOX ID" in table and all(i in table for i in ids), table

        first, second = boxes
        info = e2b(cli_env, "sandbox", "info", first.sandbox_id).stdout
        assert f"Sandbox ID: {first.sandbox_id}" in info and "State: running" in info, info

        first.files.write("/home/user/cli.txt", f"written {run}")
        out = e2b(cli_env, "sandbox", "exec", first.sandbox_id, "--", "cat", "/home/user/cli.txt")
        assert out.stdout.strip() == f"written {run}"
        failing = e2b(cli_env, "sandbox", "exec", first.sandbox_id, "--", "sh", "-c", "exit 3", check=False)
        assert failing.returncode == 3, (failing.stdout, failing.stderr)

        logs = e2b(cli_env, "sandbox", "logs", first.sandbox_id, "--format", "json").stdout
        entries = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        assert any("created" in e["message"].lower() for e in entries), logs

        metrics = wait_until(lambda: re.findall(r"CPU: +[0-9.]+% +/ +\d+ Cores \| Memory: +\d+ / +\d+ +MiB",
                                                e2b(cli_env, "sandbox", "metrics", first.sandbox_id).stdout),
                             "a metrics sample shown by `e2b sandbox metrics`", limit=30, interval=1)
        assert metrics

        second.files.write("/home/user/kept.txt", run)
        e2b(cli_env, "sandbox", "pause", second.sandbox_id)
        paused = json.loads(e2b(cli_env, "sandbox", "list", "-s", "paused", "-m", f"run={run}", "-f", "json").stdout)
        assert [s["sandboxId"] for s in paused] == [second.sandbox_id]
        e2b(cli_env, "sandbox", "resume", second.sandbox_id)
        assert Sandbox.get_info(second.sandbox_id).state == SandboxState.RUNNING
        assert Sandbox.connect(second.sandbox_id).files.read("/home/user/kept.txt") == run
        e2b(cli_env, "sandbox", "pause", second.sandbox_id)

        killed = e2b(cli_env, "sandbox", "kill", first.sandbox_id)
        assert f"Sandbox {first.sandbox_id} has been killed" in killed.stdout
        assert gone(first.sandbox_id)
        again = e2b(cli_env, "sandbox", "kill", first.sandbox_id)
        assert f"Sandbox {first.sandbox_id} wasn't found" in again.stderr

        everything = e2b(cli_env, "sandbox", "kill", "--all", "-s", "running,paused", "-m", f"run={run}")
        assert "Killed 1 running sandboxes" in everything.stdout, everything.stdout
        assert gone(second.sandbox_id)
    finally:
        for b in boxes:
            kill_quietly(b)


def test_sandbox_connect_is_a_terminal_in_that_sandbox(cli_env, terminals):
    sbx = Sandbox.create(metadata={"suite": "e2b-cli"}, timeout=300)
    try:
        sbx.files.write("/home/user/who.txt", sbx.sandbox_id)
        term = Terminal.spawn([str(E2B_BIN), "sandbox", "connect", sbx.sandbox_id], cli_env)
        terminals.append(term)
        term.expect(rf"Terminal connecting to sandbox {sbx.sandbox_id}")
        term.expect(re.escape(PROMPT))
        mark = len(term.screen)
        term.type("cat who.txt; echo; echo typed-$((1+1)) > typed.txt\r")
        term.expect(rf"(?m)^{sbx.sandbox_id}$", after=mark)
        shell_roundtrip(term)
        term.expect(rf"Closing terminal connection to sandbox {sbx.sandbox_id}")
        assert term.finish() == 0, term.screen[-2000:]
        # the terminal was that sandbox's shell, and leaving it leaves the sandbox running
        assert sbx.files.read("/home/user/typed.txt").strip() == "typed-2"
        assert sbx.is_running()

        # --user, --cwd and --env shape the terminal's shell
        term = Terminal.spawn([str(E2B_BIN), "sandbox", "connect", sbx.sandbox_id, "-u", "root", "-c", "/etc",
                               "-e", "CLI_VAR=from-cli"], cli_env)
        terminals.append(term)
        term.expect(r"# $|\$ $")
        mark = len(term.screen)
        term.type("echo \"$(whoami):$(pwd):$CLI_VAR\"; exit\r")
        term.expect(r"(?m)^root:/etc:from-cli$", after=mark)
        assert term.finish() == 0, term.screen[-2000:]
    finally:
        kill_quietly(sbx)


@pytest.mark.parametrize("command", ["create", "spawn"])
def test_sandbox_create_and_spawn_open_a_terminal_then_end_the_sandbox(cli_env, terminals, command):
    """`e2b sandbox create` (and its deprecated alias `spawn`) make a sandbox, attach a terminal to it
    and, when the shell exits, set the sandbox's timeout to 1 s so it ends."""
    term = Terminal.spawn([str(E2B_BIN), "sandbox", command, "base"], cli_env)
    terminals.append(term)
    sandbox_id = term.expect(r"with sandbox ID ([a-z0-9]+)").group(1)
    try:
        if command == "spawn":
            assert "'spawn' command is deprecated" in term.screen
        shell_roundtrip(term)
        term.expect(rf"Closing terminal connection to template base with sandbox ID {sandbox_id}")
        assert term.finish() == 0, term.screen[-2000:]
        wait_until(lambda: gone(sandbox_id), f"sandbox {sandbox_id} to end after the terminal closed", limit=30)
    finally:
        Sandbox.kill(sandbox_id)  # False (no error) once it has ended


def test_sandbox_create_detached_and_snapshot(cli_env):
    sandbox_id = e2b(cli_env, "sandbox", "create", "base", "--detach", "--timeout", "120").stdout.strip()
    assert re.fullmatch(r"[a-z0-9]+", sandbox_id), sandbox_id
    try:
        sbx = Sandbox.connect(sandbox_id)
        assert sbx.commands.run("echo up").stdout == "up\n"
        sbx.files.write("/home/user/snap.txt", "in the snapshot")
        made = e2b(cli_env, "sandbox", "snapshot", "create", sandbox_id).stdout
        snapshot_id = re.search(r"Created snapshot (\S+) from sandbox", made).group(1)
        try:
            assert snapshot_id in e2b(cli_env, "sandbox", "snapshot", "list").stdout
            child = Sandbox.create(snapshot_id, timeout=120)
            try:
                assert child.files.read("/home/user/snap.txt") == "in the snapshot"
            finally:
                kill_quietly(child)
        finally:
            Sandbox.delete_snapshot(snapshot_id)
    finally:
        Sandbox.kill(sandbox_id)


# --- templates ----------------------------------------------------------------------------------


def test_template_list(cli_env):
    templates = json.loads(e2b(cli_env, "template", "list", "-f", "json").stdout)
    base = next(t for t in templates if t["templateID"] == "base")
    assert "base" in base["aliases"] and base["public"] is True and base["cpuCount"] >= 1
    table = e2b(cli_env, "template", "list").stdout
    assert "TEMPLATE ID" in table and "base" in table


def test_template_create_from_dockerfile_then_use_publish_and_delete(cli_env, server, tmp_path):
    """`e2b template create` parses a Dockerfile into build steps and builds them on the server (no
    Docker, no registry); a sandbox of the new template has the files. Publishing is refused clearly."""
    name = f"cli-tpl-{new_tag()}"
    (tmp_path / "greeting.txt").write_text("copied from the build context\n")
    (tmp_path / "e2b.Dockerfile").write_text(
        "FROM e2bdev/base\n"
        "ENV CLI_BUILT=yes\n"
        "RUN echo ran-$((20+22)) built=$CLI_BUILT > /home/user/run.txt\n"  # ENV applies to the build steps
        "COPY greeting.txt /home/user/greeting.txt\n")
    try:
        built = e2b(cli_env, "template", "create", name, "--cpu-count", "1", "--memory-mb", "512", cwd=tmp_path,
                    timeout=600)
        assert f"Building sandbox template {name} finished" in built.stdout, built.stdout
        listed = {a: t for t in json.loads(e2b(cli_env, "template", "list", "-f", "json").stdout) for a in t["aliases"]}
        assert listed[name]["public"] is False and listed[name]["cpuCount"] == 1 and listed[name]["memoryMB"] == 512

        sandbox_id = e2b(cli_env, "sandbox", "create", name, "--detach", "--timeout", "60").stdout.strip()
        try:
            out = e2b(cli_env, "sandbox", "exec", sandbox_id, "--", "sh", "-c",
                      "cat /home/user/run.txt /home/user/greeting.txt").stdout
            assert out.splitlines() == ["ran-42 built=yes", "copied from the build context"]
        finally:
            Sandbox.kill(sandbox_id)

        published = e2b(cli_env, "template", "publish", name, "--yes", check=False)
        assert published.returncode != 0 and "publishing a template is not supported" in published.stderr
        e2b(cli_env, "template", "unpublish", name, "--yes")
        e2b(cli_env, "template", "delete", name, "--yes")
        assert name not in e2b(cli_env, "template", "list").stdout
    finally:
        requests.delete(f"{server.api_url}/templates/{name}", headers={"X-API-KEY": server.api_key}, timeout=60)


def test_template_update_route_answers_json(server):
    """The route behind `template publish`: JSON answers, including for a built-in template."""
    headers = {"X-API-KEY": server.api_key}
    r = requests.patch(f"{server.api_url}/v2/templates/base", json={"public": False}, headers=headers, timeout=30)
    assert r.status_code == 403 and r.json()["code"] == 403 and "built in" in r.json()["message"]
    r = requests.patch(f"{server.api_url}/v2/templates/no-such-template", json={"public": True}, headers=headers,
                       timeout=30)
    assert r.status_code == 404 and r.json()["code"] == 404
    r = requests.patch(f"{server.api_url}/templates/base", json={"public": "yes"}, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["code"] == 400
