"""The same SDK basics with each pinned pair of official E2B SDKs: the suite's pins (pyproject.toml's
`e2b`, tests/js's `e2b`) and the newest releases (tests/sdk-latest/requirements.txt in .venv-sdk-latest,
tests/js's `e2b-latest` alias), so a new SDK release that breaks against agentenv fails here.

Each case runs a program (tests/e2e/sdk_basics.py, tests/js/sdk-basics.mjs) under that SDK: create,
commands, files, list, pause/resume, kill; it reports the SDK version it imported, checked against the pin.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
STEPS = ["commands.run", "commands.exit_code", "files.read", "files.list", "list.running", "pause", "list.paused",
         "resume.files", "resume.process", "kill", "killed"]


@dataclass(frozen=True)
class Sdk:
    lang: str
    pair: str  # "pinned" (what the rest of the suite uses) or "latest" (the newest release)

    def pin(self) -> str:
        if self.lang == "python":
            text = (REPO / "pyproject.toml" if self.pair == "pinned" else TESTS / "sdk-latest" / "requirements.txt")
            return re.search(r'^\s*"?e2b==([0-9][^"\s,]*)', text.read_text(), re.M).group(1)
        deps = json.loads((TESTS / "js" / "package.json").read_text())["dependencies"]
        return deps["e2b"] if self.pair == "pinned" else deps["e2b-latest"].removeprefix("npm:e2b@")

    def argv(self) -> tuple[list[str], dict[str, str], Path]:
        if self.lang == "python":
            python = sys.executable if self.pair == "pinned" else str(REPO / ".venv-sdk-latest" / "bin" / "python")
            if not Path(python).exists():
                pytest.fail(f"{python} is missing (run scripts/setup.sh --test)")
            return [python, str(TESTS / "e2e" / "sdk_basics.py")], {}, REPO
        module = "e2b" if self.pair == "pinned" else "e2b-latest"
        node = shutil.which("node")
        if node is None or not (TESTS / "js" / "node_modules" / module / "package.json").exists():
            pytest.fail(f"node or tests/js/node_modules/{module} is missing (run scripts/setup.sh --test)")
        return [node, "sdk-basics.mjs"], {"E2B_SDK_MODULE": module}, TESTS / "js"


SDKS = [Sdk(lang, pair) for lang in ("python", "js") for pair in ("pinned", "latest")]


@pytest.mark.parametrize("sdk", SDKS, ids=[f"{s.lang}-{s.pair}" for s in SDKS])
def test_sdk_basics(server, sdk: Sdk):
    argv, extra, cwd = sdk.argv()
    env = {**server.sdk_env(), **extra}
    env.pop("PYTHONPATH", None)
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{sdk.lang} SDK ({sdk.pair}) failed:\n{p.stderr[-3000:]}\n{p.stdout[-1000:]}"
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["version"] == sdk.pin(), report  # the pair under test is the one pinned
    assert report["steps"] == STEPS, report
