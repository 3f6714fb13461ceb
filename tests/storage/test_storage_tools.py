"""Tools layer: its own interpreter runs envd's imports in a rootfs that has no Python at all."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from agentenv import constants
from agentenv.storage import tools
from agentenv.storage.images import ImageStore
from agentenv.storage.rootfs import RootfsManager

from _storage_helpers import run_in_mount_ns

PROBE = r"""
import json, os, subprocess, sys
import aiohttp, asyncinotify, ssl, ctypes
out = {"prefix": sys.prefix, "path": sys.path, "aiohttp": aiohttp.__file__}
try:
    import agentenv.envd
    out["envd"] = agentenv.envd.__file__
except ModuleNotFoundError as e:
    out["envd_error"] = str(e)
child = subprocess.run(["/bin/sh", "-c", "env; test -e /usr/bin/python3 && echo HAS_PYTHON || true"],
                       capture_output=True, text=True)
out["child"] = child.stdout
print(json.dumps(out))
"""


def test_manifest_and_argv(store: ImageStore, tools_dir: Path) -> None:
    m = json.loads((tools_dir / "tools.json").read_text())
    assert m["hash"] == tools_dir.name
    names = {d.split("==")[0].lower() for d in m["installed"]}
    for req in tools.envd_requirements():
        assert req.split(">")[0].split("=")[0].split("<")[0].strip().lower() in names
    argv = store.envd_argv()
    assert all(a.startswith(constants.TOOLS_MOUNT) for a in (argv[0], argv[2], argv[3]))
    for a in (argv[0], argv[3]):
        assert (tools_dir / a.removeprefix(constants.TOOLS_MOUNT + "/")).is_file()
    env = store.envd_env()
    assert not [k for k in env if k.startswith(("PYTHON", "LD_"))]


async def test_unchanged_sources_reuse_the_layer(store: ImageStore, tools_dir: Path) -> None:
    t0 = time.monotonic()
    again = await store.ensure_tools()
    assert again == tools_dir and time.monotonic() - t0 < 2


def test_prune_keeps_current_and_in_use_layers(tmp_path: Path) -> None:
    for name in ("current", "old-unused", "old-in-use"):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin/python3").write_text("x")
    fd = os.open(tmp_path / "old-in-use/bin/python3", os.O_RDONLY)  # like a runsc gofer holding a file
    try:
        tools._prune_old(tmp_path, keep="current")
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "old-in-use"]


async def test_envd_imports_without_rootfs_python(
    store: ImageStore, base_rootfs: Path, tools_dir: Path, rootfs_mgr: RootfsManager
) -> None:
    root = await rootfs_mgr.prepare("nopython", [base_rootfs])
    # Remove every trace of the image's Python (goes to the upper layer only).
    r = run_in_mount_ns(
        f"cd {root} && rm -rf usr/bin/python3* usr/bin/python usr/lib/python3* usr/local/lib/python3* "
        "usr/lib/x86_64-linux-gnu/libpython3* usr/lib/x86_64-linux-gnu/libssl* usr/lib/x86_64-linux-gnu/libffi*"
    )
    assert r.returncode == 0, r.stderr
    assert (base_rootfs / "usr/bin/python3").exists()  # the base image is untouched
    argv = store.envd_argv()
    argv = argv[: argv.index("-m")] + ["-c", PROBE]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in store.envd_env().items())
    script = (
        f"mkdir -p {root}/.agentenv\n"
        f"mount --bind {tools_dir} {root}/.agentenv\n"
        f"mount -o remount,bind,ro {root}/.agentenv\n"
        f"exec env -i {env} chroot {root} {' '.join(shlex.quote(a) for a in argv)}"
    )
    r = run_in_mount_ns(script)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prefix"] == constants.TOOLS_MOUNT
    assert all(p.startswith(constants.TOOLS_MOUNT) for p in out["path"]), out["path"]
    assert out["aiohttp"].startswith(constants.TOOLS_MOUNT)
    child_env = out["child"]
    assert "HAS_PYTHON" not in child_env
    assert not [l for l in child_env.splitlines() if l.startswith(("PYTHON", "LD_"))]
    if (Path(tools.__file__).parents[1] / "envd" / "__main__.py").exists():
        assert out.get("envd", "").startswith(constants.TOOLS_MOUNT), out.get("envd_error")


async def test_envd_serves_from_the_tools_layer(
    store: ImageStore, base_rootfs: Path, tools_dir: Path, rootfs_mgr: RootfsManager
) -> None:
    """The real envd, started with envd_argv() in a Python-less rootfs, answers on loopback."""
    if not (Path(tools.__file__).parents[1] / "envd" / "__main__.py").exists():
        pytest.skip("agentenv.envd has no __main__ yet")
    root = await rootfs_mgr.prepare("envd-run", [base_rootfs])
    run_in_mount_ns(f"rm -rf {root}/usr/bin/python3* {root}/usr/lib/python3*")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = store.envd_argv() + ["--host", "127.0.0.1", "--port", str(port)]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in store.envd_env().items())
    script = (
        f"mkdir -p {root}/.agentenv && mount --bind {tools_dir} {root}/.agentenv\n"
        f"mount -o remount,bind,ro {root}/.agentenv\n"
        f"exec env -i {env} chroot {root} {' '.join(shlex.quote(a) for a in argv)}"
    )
    # unshare and env exec, so this PID is envd's own; its mounts vanish with its namespace.
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-euc", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    status = resp.status
                    break
            except OSError:
                await asyncio.sleep(0.1)
        assert status in (200, 204), proc.stdout.read().decode() if proc.poll() is not None else "no answer"
    finally:
        proc.kill()
        proc.wait(timeout=10)
