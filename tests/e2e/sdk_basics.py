"""E2B SDK basics, run as a program by tests/e2e/test_e2e_sdk_versions.py with the interpreter of one
pinned SDK (`.venv` = the suite's pin, `.venv-sdk-latest` = the newest release; see docs/cli.md).

Creates a sandbox, runs commands, writes/reads/lists files, pauses and resumes it (the files and
a running process's memory survive), finds it by metadata in the list, and kills it. Needs
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY. Prints one JSON line: the SDK version and the steps
that passed; exits non-zero on the first failure (with the failing step on stderr).
"""

from __future__ import annotations

import json
import secrets
import sys
from importlib.metadata import version

from e2b import CommandExitException, Sandbox, SandboxQuery, SandboxState

steps: list[str] = []


def check(step: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"{step}: {detail}")
    steps.append(step)


def in_list(sandbox_id: str, run: str, state: SandboxState) -> bool:
    pages = Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=[state]))
    found: list[str] = []
    while pages.has_next:
        found += [s.sandbox_id for s in pages.next_items()]
    return found == [sandbox_id]


def main() -> None:
    run = secrets.token_hex(6)
    sbx = Sandbox.create(metadata={"suite": "sdk-versions", "run": run}, envs={"RUN_TAG": run}, timeout=180)
    try:
        r = sbx.commands.run("echo $RUN_TAG; echo err >&2")
        check("commands.run", (r.exit_code, r.stdout, r.stderr) == (0, f"{run}\n", "err\n"), r)
        try:
            sbx.commands.run("exit 7")
            check("commands.exit_code", False, "no CommandExitException")
        except CommandExitException as e:
            check("commands.exit_code", e.exit_code == 7, e.exit_code)
        bg = sbx.commands.run("sleep 600", background=True)

        sbx.files.write("/home/user/dir/data.txt", f"data {run}")
        check("files.read", sbx.files.read("/home/user/dir/data.txt") == f"data {run}")
        names = [e.name for e in sbx.files.list("/home/user/dir")]
        check("files.list", names == ["data.txt"], names)

        check("list.running", in_list(sbx.sandbox_id, run, SandboxState.RUNNING))
        sbx.pause()
        check("pause", Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED)
        check("list.paused", in_list(sbx.sandbox_id, run, SandboxState.PAUSED))
        resumed = Sandbox.connect(sbx.sandbox_id)
        check("resume.files", resumed.files.read("/home/user/dir/data.txt") == f"data {run}")
        pids = [p.pid for p in resumed.commands.list()]
        check("resume.process", bg.pid in pids, pids)

        check("kill", resumed.kill() is True)
        check("killed", not in_list(sbx.sandbox_id, run, SandboxState.RUNNING)
              and not in_list(sbx.sandbox_id, run, SandboxState.PAUSED))
    finally:
        try:
            Sandbox.kill(sbx.sandbox_id)
        except Exception:
            pass
    print(json.dumps({"sdk": "python", "version": version("e2b"), "steps": steps}))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(f"failed after {steps}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
