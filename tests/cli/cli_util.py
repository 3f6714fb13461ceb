"""Helpers of the CLI tests: run `agentenv` against the session server; track sandboxes to kill."""

from __future__ import annotations

import json
import subprocess

from serverproc import agentenv_executable


def run_cli(server, *args: str, check: bool = True, input: bytes | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
    """`agentenv ARGS` with the server's E2B_* environment; bytes out (binary-safe)."""
    p = subprocess.run([agentenv_executable(), *args], env=server.sdk_env(), capture_output=True,
                       input=input, timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p


class Sandboxes:
    """Sandboxes a test module created through the CLI; all killed at the end, also on failure."""

    def __init__(self, server):
        self.server = server
        self.ids: list[str] = []

    def create(self, *args: str) -> str:
        out = run_cli(self.server, "sandbox", "create", "--timeout", "300", "--json", *args).stdout
        sid = json.loads(out)["sandboxID"]
        self.ids.append(sid)
        return sid

    def adopt(self, *ids: str) -> None:
        self.ids += ids

    def cleanup(self) -> None:
        for sid in self.ids:
            run_cli(self.server, "sandbox", "kill", sid, check=False)
