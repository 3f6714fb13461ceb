"""The JS SDK (tests/js/node_modules) against envd: stream framing (end-stream envelope), files, watch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SDK = HERE.parent / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"


@pytest.mark.skipif(shutil.which("node") is None or not SDK.exists(), reason="node or the JS e2b SDK is not installed")
def test_js_sdk_smoke(envd, workdir):
    out = subprocess.run(
        ["node", str(HERE / "js_smoke.mjs"), SDK.as_uri(), envd.url, envd.token, workdir],
        capture_output=True, text=True, timeout=60,
    )
    assert "JS-SMOKE-OK" in out.stdout, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}\nenvd log:\n{envd.log_tail()}"
