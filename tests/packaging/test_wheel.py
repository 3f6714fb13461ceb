"""The wheel, as a user installs it: built from this tree, installed into a clean virtualenv (pinned by
constraints.txt, with no npm reachable), then its own `agentenv` answers --version, doctor --json,
serves the console's npm libraries from the wheel, and runs a command in a sandbox of the session server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.console.libraries import LIBRARIES

REPO = Path(__file__).resolve().parents[2]
CONSOLE = REPO / "agentenv" / "console"


@dataclass
class Installed:
    venv: Path
    cwd: Path   # outside the repo, so nothing imports the checkout's agentenv

    @property
    def agentenv(self) -> str:
        return str(self.venv / "bin" / "agentenv")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(base if base is not None else os.environ)
        for k in ("PYTHONPATH", "VIRTUAL_ENV", "AGENTENV_CONSOLE_NODE_MODULES"):
            env.pop(k, None)
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def run(self, *args: str, base_env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([self.agentenv, *args], cwd=self.cwd, env=self.env(base_env), capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert p.returncode == 0, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        return p


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, (cmd, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def _export_tree(dest: Path) -> Path:
    """The checkout's files (tracked, plus new ones not ignored) without build/, node_modules or caches,
    as a release build sees them."""
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for rel in filter(None, files.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = _export_tree(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    # The console's libraries come from the checkout's node_modules (setup.sh's npm ci).
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "AGENTENV_CONSOLE_NODE_MODULES": str(CONSOLE / "node_modules")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
         cwd=out, timeout=300, env=env)
    wheels = list(out.glob("agentenv-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel-venv")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    # No npm on PATH while installing: the console's libraries must come inside the wheel.
    no_npm = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    no_npm["PATH"] = str(venv / "bin")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "-c", str(REPO / "constraints.txt"), str(wheel)], cwd=root, env=no_npm, timeout=600)
    yield Installed(venv=venv, cwd=root)


def test_wheel_installs_its_own_agentenv_with_the_projects_version(installed: Installed):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert installed.run("--version").stdout.strip() == f"agentenv, version {version}"
    where = subprocess.run([str(installed.venv / "bin" / "python"), "-c",
                            "import agentenv, pathlib; print(pathlib.Path(agentenv.__file__).resolve())"],
                           cwd=installed.cwd, env=installed.env(), capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(installed.venv.resolve()), where.stdout


def test_wheel_doctor_json_reports_this_host(installed: Installed):
    p = installed.run("doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(p.stdout)}
    assert checks["python"]["status"] == "ok"
    assert checks["runsc (gVisor)"]["status"] == "ok", checks["runsc (gVisor)"]
    failed = [c for c in checks.values() if c["status"] == "fail"]
    assert p.returncode == (1 if failed else 0), (p.returncode, failed)
    assert not failed, failed   # this CI host is set up


def test_wheel_migrates_a_state_database(installed: Installed, tmp_path):
    """The Alembic history ships in the wheel: `db upgrade` creates the schema, `db status` agrees."""
    env = {k: v for k, v in os.environ.items() if k != "AGENTENV_DATABASE_URL"}
    up = json.loads(installed.run("db", "upgrade", "--data-dir", str(tmp_path), "--json", base_env=env).stdout)
    assert up["before"] is None and up["revision"] == up["head"] and up["head"]
    st = json.loads(installed.run("db", "status", "--data-dir", str(tmp_path), "--json", base_env=env).stdout)
    assert st["up_to_date"] is True and (tmp_path / "state.db").exists()


def test_wheel_serves_the_console_libraries_without_node_modules(installed: Installed):
    probe = (
        "import asyncio, hashlib, json, sys\n"
        "from aiohttp import web\n"
        "from aiohttp.test_utils import TestClient, TestServer\n"
        "from agentenv.console import LIBRARIES, mount_console\n"
        "async def main():\n"
        "    app = web.Application(); mount_console(app)\n"
        "    async with TestClient(TestServer(app)) as c:\n"
        "        out = {}\n"
        "        for name in LIBRARIES:\n"
        "            r = await c.get('/console/lib/' + name)\n"
        "            out[name] = [r.status, hashlib.sha256(await r.read()).hexdigest()]\n"
        "        r = await c.get('/console/')\n"
        "        out['index'] = [r.status, (await r.text())[:200]]\n"
        "    print(json.dumps(out))\n"
        "asyncio.run(main())\n")
    p = subprocess.run([str(installed.venv / "bin" / "python"), "-c", probe], cwd=installed.cwd,
                       env=installed.env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    assert got.pop("index")[0] == 200
    nm = CONSOLE / "node_modules"
    want = {name: [200, hashlib.sha256((nm / rel).read_bytes()).hexdigest()] for name, rel in LIBRARIES.items()}
    assert got == want


def test_wheel_cli_runs_a_command_in_a_sandbox(installed: Installed, server):
    created = installed.run("sandbox", "create", "--timeout", "120", "--json", base_env=server.sdk_env())
    sid = json.loads(created.stdout)["sandboxID"]
    try:
        p = installed.run("sandbox", "exec", sid, "--", "echo from-wheel; echo err >&2; exit 7",
                          base_env=server.sdk_env(), check=False)
        assert (p.returncode, p.stdout, p.stderr) == (7, "from-wheel\n", "err\n")
    finally:
        installed.run("sandbox", "kill", sid, base_env=server.sdk_env(), check=False)


def test_wheel_setup_finds_this_hosts_packages_installed(installed: Installed):
    check = installed.run("setup", "--check")
    assert check.stdout.strip() == "all host packages are installed", check.stdout
    # A real run on a set-up host installs nothing and leaves apt alone.
    run = installed.run("setup", timeout=300)
    assert "apt-get" not in run.stderr, run.stderr
    assert "host packages done" in run.stderr
