"""Large downloads sent from the sandbox's disk on the host (agentenv/proxy/hostfiles.py), through
the real SDK and signed URLs: the bytes are the sandbox's, whatever the sandbox did to the file, and
a pause in the middle of one never costs the sandbox."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from e2e_util import new_tag, wait_until

MIB = 1 << 20


@pytest.fixture
def host_sends(server):
    """The server's count of downloads it sent from the host (its /metrics)."""
    def read() -> int:
        text = requests.get(f"{server.api_url}/metrics", timeout=30).text
        m = re.search(r"^agentenv_proxy_host_file_sends_total (\S+)$", text, re.M)
        assert m is not None, "agentenv_proxy_host_file_sends_total is missing from /metrics"
        return int(float(m.group(1)))
    return read


def sha_in(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"sha256sum {path}").stdout.split()[0]


def test_large_download_comes_from_the_host_with_the_sandbox_bytes(sbx: Sandbox, host_sends):
    path = f"/home/user/host-read-{new_tag()}.bin"
    data = os.urandom(8 * MIB + 12345)
    sbx.files.write(path, data)
    before = host_sends()
    assert bytes(sbx.files.read(path, format="bytes")) == data
    assert b"".join(sbx.files.read(path, format="stream")) == data
    r = requests.get(sbx.download_url(path), timeout=60)
    assert r.status_code == 200 and r.content == data
    assert r.headers["Content-Type"] == "application/octet-stream"
    assert r.headers["Content-Disposition"] == f'inline; filename="{os.path.basename(path)}"'
    assert host_sends() == before + 3
    # A small file is still envd's to send.
    sbx.files.write(path, b"small")
    assert bytes(sbx.files.read(path, format="bytes")) == b"small"
    assert host_sends() == before + 3


def test_writes_the_sandbox_just_made_are_in_the_download(sbx: Sandbox, host_sends):
    """Bytes written in place by a program still running, and through a shared mapping, are what the
    host sends: gVisor writes through to the host file."""
    path = f"/tmp/host-read-{new_tag()}.bin"
    sbx.commands.run(f"head -c {4 * MIB} /dev/urandom > {path}")
    before = host_sends()
    first = bytes(sbx.files.read(path, format="bytes"))
    assert hashlib.sha256(first).hexdigest() == sha_in(sbx, path)
    # A writer that keeps the file open (and a mapping of it) while the download happens.
    writer = sbx.commands.run(
        "python3 -c \"import mmap,os,sys,time\n"
        f"f=open('{path}','r+b'); f.seek({MIB}); f.write(b'W'*{MIB}); f.flush()\n"
        "m=mmap.mmap(f.fileno(),0); m[:4096]=b'M'*4096\n"
        "print('ready',flush=True); time.sleep(30)\"",
        background=True)
    try:
        deadline = time.monotonic() + 30
        while b"M" * 4096 != bytes(sbx.files.read(path, format="bytes"))[:4096]:
            assert time.monotonic() < deadline, "the mapped write never showed"
            time.sleep(0.2)
        got = bytes(sbx.files.read(path, format="bytes"))
        assert got[:4096] == b"M" * 4096
        assert got[MIB:2 * MIB] == b"W" * MIB
        assert got[2 * MIB:] == first[2 * MIB:]
    finally:
        writer.kill()
    assert hashlib.sha256(bytes(sbx.files.read(path, format="bytes"))).hexdigest() == sha_in(sbx, path)
    assert host_sends() > before


def test_symlinks_resolve_inside_the_sandbox(sbx: Sandbox, host_sends):
    """A link to an absolute path, and one climbing with `..`, name the sandbox's file, never the
    host's file at the same path (this test runs on the server's host and plants one there)."""
    tag = new_tag()
    target = f"/var/tmp/agentenv-host-read-{tag}"
    with open(target, "wb") as f:  # the host's file at the path the links name
        f.write(b"H" * (2 * MIB))
    try:
        sbx.commands.run(f"head -c {2 * MIB} /dev/urandom > {target} && "
                         f"ln -s {target} /home/user/abs-{tag} && "
                         f"ln -s ../../../../../../..{target} /home/user/up-{tag}")
        want = sha_in(sbx, target)
        before = host_sends()
        for link in (f"/home/user/abs-{tag}", f"/home/user/up-{tag}"):
            got = bytes(sbx.files.read(link, format="bytes"))
            assert len(got) == 2 * MIB and hashlib.sha256(got).hexdigest() == want
        assert host_sends() == before + 2
    finally:
        os.unlink(target)


def test_files_on_other_mounts_come_from_envd(sbx: Sandbox, host_sends):
    """/dev/shm is a tmpfs of the sandbox's own: the host has no view of it, envd sends the bytes."""
    path = f"/dev/shm/host-read-{new_tag()}.bin"
    sbx.commands.run(f"head -c {3 * MIB} /dev/urandom > {path}")
    before = host_sends()
    got = bytes(sbx.files.read(path, format="bytes"))
    assert len(got) == 3 * MIB and hashlib.sha256(got).hexdigest() == sha_in(sbx, path)
    assert host_sends() == before


def test_client_header_cannot_ask_envd_for_a_host_read(sbx: Sandbox):
    path = f"/home/user/host-read-{new_tag()}.bin"
    data = os.urandom(2 * MIB)
    sbx.files.write(path, data)
    r = requests.get(sbx.download_url(path), headers={"X-Agentenv-Host-Read": "0"}, timeout=60)
    assert r.status_code == 200 and r.content == data


def test_pause_during_a_host_download_keeps_the_sandbox(sandbox_factory):
    """A slow client holds a download from the host open; pausing the sandbox cuts it (as it cuts any
    stream into a sandbox) and the sandbox pauses, resumes and still has the file."""
    sbx = sandbox_factory.create()
    path = "/home/user/slow.bin"
    sbx.commands.run(f"head -c {64 * MIB} /dev/urandom > {path}")
    want = sha_in(sbx, path)
    received = []
    started = threading.Event()

    def slow_client() -> None:
        try:
            with requests.get(sbx.download_url(path), stream=True, timeout=120) as r:
                for chunk in r.iter_content(64 * 1024):
                    received.append(len(chunk))
                    started.set()
                    time.sleep(0.05)
        except requests.RequestException:
            pass
        finally:
            started.set()

    t = threading.Thread(target=slow_client, daemon=True)
    t.start()
    assert started.wait(60)
    assert sbx.pause() is True
    t.join(120)
    assert not t.is_alive()
    assert sum(received) < 64 * MIB, "the download should have been cut by the pause"
    # Nothing holds the paused sandbox's rootfs: it is unmounted once the pause stood the sandbox down.
    wait_until(lambda: f"/sandboxes/{sbx.sandbox_id}/rootfs " not in Path("/proc/mounts").read_text(),
               "the paused sandbox's rootfs to be unmounted")
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sha_in(resumed, path) == want
    got = bytes(resumed.files.read(path, format="bytes"))
    assert hashlib.sha256(got).hexdigest() == want
