"""Helpers for the security suite: extra teams (API keys) on the session server, sandboxes that
are always killed, and helpers that talk to the API and the data plane directly."""

from __future__ import annotations

import os
import subprocess

import requests
from e2b import Sandbox

from serverproc import agentenv_executable

SANDBOX_TIMEOUT_S = 600


def agentenv_cli(server, *args: str) -> str:
    """Runs the host CLI against the session server's data dir (its state DB is shared, WAL mode)."""
    env = dict(os.environ, AGENTENV_DATA_DIR=str(server.data_dir))
    res = subprocess.run([agentenv_executable(), *args, "--data-dir", str(server.data_dir)], env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"agentenv {' '.join(args)} failed: {res.stdout}{res.stderr}"
    return res.stdout.strip()


def new_team_key(server, team: str, *, max_sandboxes: int | None = None) -> str:
    """A fresh API key of `team` (created through the CLI, as an operator would)."""
    create = ["teams", "create", team]
    if max_sandboxes is not None:
        create += ["--max-sandboxes", str(max_sandboxes)]
    agentenv_cli(server, *create)
    return agentenv_cli(server, "keys", "create", "--name", f"sec-{team}", "--team", team).splitlines()[-1]


class Sandboxes:
    """Creates sandboxes (any key) and kills every one at teardown with the key that made it."""

    def __init__(self, server) -> None:
        self.server = server
        self.made: list[tuple[str, str]] = []

    def create(self, api_key: str | None = None, **kw) -> Sandbox:
        kw.setdefault("timeout", SANDBOX_TIMEOUT_S)
        key = api_key or self.server.api_key
        sbx = Sandbox.create(api_key=key, metadata={"suite": "security"}, **kw)
        self.made.append((sbx.sandbox_id, key))
        return sbx

    def cleanup(self) -> None:
        for sid, key in self.made:
            try:
                Sandbox.kill(sid, api_key=key)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


def api(server, method: str, path: str, key: str, **kw) -> requests.Response:
    kw.setdefault("timeout", 120)
    return requests.request(method, server.api_url + path, headers={"X-API-KEY": key}, **kw)


