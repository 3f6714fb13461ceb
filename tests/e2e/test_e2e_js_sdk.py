"""Runs tests/js/smoke.test.mjs (official npm `e2b` SDK) against the test server."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

JS_DIR = Path(__file__).resolve().parent.parent / "js"


def test_js_sdk_smoke(server):
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (run scripts/setup.sh --test)")
    if not (JS_DIR / "node_modules" / "e2b" / "package.json").exists():
        pytest.fail(f"{JS_DIR}/node_modules is missing (run scripts/setup.sh --test)")
    proc = subprocess.run(
        [node, "--test", "smoke.test.mjs"],
        cwd=JS_DIR,
        env=server.sdk_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"node --test exited with {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    # the run really executed the test (guards against an empty/renamed test file)
    assert "# pass 1" in proc.stdout, proc.stdout
