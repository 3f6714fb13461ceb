"""Host-level CLI behaviour: `doctor`, and `serve` failing cleanly."""

from __future__ import annotations

import os
import socket
import subprocess

from serverproc import agentenv_executable, new_data_dir, remove_data_dir, run_gc


def test_doctor_reports_the_host():
    p = subprocess.run([agentenv_executable(), "doctor"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr  # this machine has everything the server needs
    for check in ("runsc", "network namespaces", "cgroups", "overlayfs", "KVM", "free disk"):
        assert check in p.stdout, (check, p.stdout)


def test_serve_on_a_busy_port_fails_with_a_clear_error_and_exits():
    d = new_data_dir("busyport")
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        env = dict(os.environ, AGENTENV_DATA_DIR=str(d), AGENTENV_PORT=str(port), AGENTENV_HOST="127.0.0.1")
        p = subprocess.run([agentenv_executable(), "serve"], env=env, capture_output=True, text=True,
                           timeout=180, stdin=subprocess.DEVNULL)
        assert p.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    finally:
        blocker.close()
        run_gc(d)
        remove_data_dir(d)
