"""Plain helpers for the storage tests (a uniquely named module: conftest.py names collide)."""

from __future__ import annotations

import subprocess


def run_in_mount_ns(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a shell script in a throw-away private mount namespace (its mounts vanish with it)."""
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-euc", script],
        capture_output=True, text=True, timeout=timeout,
    )
