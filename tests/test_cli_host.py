"""Host-level CLI behaviour: `doctor`, and `serve` failing cleanly."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

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


def _host_virt_facts() -> tuple[bool, bool]:
    """(hardware virtualization, PVM), read from the host directly (not through agentenv's detector)."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    return bool(flags & {"vmx", "svm"}), os.path.exists("/sys/module/kvm_pvm")


def test_doctor_explains_firecracker_and_the_auto_choice():
    import json

    p = subprocess.run([agentenv_executable(), "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["name"]: c for c in json.loads(p.stdout)}
    fc, sel = checks["runtime firecracker"], checks["runtime selection (auto)"]
    hardware, pvm = _host_virt_facts()
    chosen = sel["detail"].split()[0]
    assert chosen in ("gvisor", "firecracker", "qemu"), sel
    assert checks[f"runtime {chosen}"]["status"] == "ok"
    if not hardware and os.path.exists("/dev/kvm"):
        # This machine's case: Firecracker runs (the probe guest boots) but Linux guests cannot.
        assert fc["status"] != "ok" and chosen != "firecracker"
        assert "cannot boot a Linux guest" in fc["detail"] and "no vmx/svm" in fc["detail"], fc
        if pvm:
            assert "PVM" in fc["detail"] and "kvm_pvm" in fc["detail"], fc
        if os.path.exists("/usr/local/lib/agentenv/firecracker/firecracker"):
            assert "probe guest booted" in fc["detail"], fc
        assert "firecracker" in sel["detail"].split("unavailable here:")[1], sel
        assert "VT-x" in (fc["fix"] or ""), fc


def test_serve_with_an_unavailable_vm_runtime_fails_with_the_reason():
    hardware, _ = _host_virt_facts()
    if hardware:
        pytest.skip("this host has hardware virtualization: Firecracker is not unavailable for that reason")
    d = new_data_dir("fcrt")
    try:
        env = dict(os.environ, AGENTENV_DATA_DIR=str(d), AGENTENV_RUNTIME="firecracker", AGENTENV_PORT="1")
        p = subprocess.run([agentenv_executable(), "serve"], env=env, capture_output=True, text=True,
                           timeout=180, stdin=subprocess.DEVNULL)
        assert p.returncode != 0
        assert "runtime 'firecracker' was requested but cannot run on this host" in p.stderr, p.stderr[-2000:]
        assert "no fallback" in p.stderr and "Traceback" not in p.stderr
    finally:
        run_gc(d)
        remove_data_dir(d)


def test_gc_removes_the_images_forks_of_a_killed_server_kept():
    """A fork's children restore from an image in `fork-images/` that the fork removes when they are
    up; a server killed in between leaves it, and `agentenv gc` (no server on the data dir) removes it."""
    d = new_data_dir("gcfork")
    try:
        kept = d / "fork-images" / "isource000000000000000-0123456789ab"
        kept.mkdir(parents=True)
        (kept / "checkpoint.img").write_bytes(b"\0" * 4096)
        r = run_gc(d)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not kept.exists() and not list((d / "fork-images").glob("*"))
    finally:
        remove_data_dir(d)
