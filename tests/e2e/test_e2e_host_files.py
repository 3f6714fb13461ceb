"""Large downloads sent from the sandbox's disk on the host, and large uploads staged there
(agentenv/proxy/hostfiles.py), through the real SDK and signed URLs: the bytes are the sandbox's,
whatever the sandbox did to the file, an upload lands as any upload does, and a pause in the middle
of either never costs the sandbox."""

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
from serverproc import new_data_dir, remove_data_dir, start_extra_server

MIB = 1 << 20


def counter(server, name: str) -> int:
    return counter_at(server.api_url, name)


def counter_at(url: str, name: str) -> int:
    """A counter of the server at `url` (its /metrics)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, f"{name} is missing from /metrics"
    return int(float(m.group(1)))


@pytest.fixture
def host_sends(server):
    """The server's count of downloads it sent from the host (its /metrics)."""
    return lambda: counter(server, "agentenv_proxy_host_file_sends_total")


@pytest.fixture
def host_stages(server):
    """The server's count of uploads it staged on the host."""
    return lambda: counter(server, "agentenv_proxy_host_file_stages_total")


def staged_leftovers(sbx: Sandbox) -> str:
    """Staging dirs (and files in them) in the sandbox's root dir."""
    return sbx.commands.run("ls -a / | grep '^.agentenv-upload-' || true", user="root").stdout


def pause_during(server, sbx: Sandbox, client, begun: threading.Event) -> None:
    """Run `client` on a thread, pause the sandbox once `begun` is set and the server holds a file of
    the transfer (so it goes through the host), wait for the client to end."""
    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert begun.wait(60)
    wait_until(lambda: open_below(server.data_dir / "sandboxes" / sbx.sandbox_id, [server.proc.pid]),
               "the server to hold a file of the transfer")
    assert sbx.pause() is True
    t.join(120)
    assert not t.is_alive()


def sha_in(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"sha256sum {path}").stdout.split()[0]


def random_file(sbx: Sandbox, path: str, size: int = 64 * MIB) -> str:
    """`size` random bytes made in the sandbox at `path`; their sha256."""
    sbx.commands.run(f"head -c {size} /dev/urandom > {path}")
    return sha_in(sbx, path)


def open_below(path: Path, pids: list[int]) -> list[str]:
    """Descriptors of processes `pids` open on files below `path`: "<pid>: <target>"."""
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(f"{path}/"):
                found.append(f"{pid}: {target}")
    return found


def slow_download(url: str, received: list[int], begun: threading.Event, outcome: list[object] | None = None,
                  pause_s: float = 0.05, timeout: float = 120):
    """A client reading a download 64 KiB at a time, `pause_s` between pieces; sets `begun` at its
    first bytes; puts "complete" or the error that ended it in `outcome`."""
    def client() -> None:
        try:
            with requests.get(url, stream=True, timeout=timeout) as r:
                for chunk in r.iter_content(64 * 1024):
                    received.append(len(chunk))
                    begun.set()
                    time.sleep(pause_s)
            if outcome is not None:
                outcome.append("complete")
        except requests.RequestException as exc:
            if outcome is not None:
                outcome.append(exc)
        finally:
            begun.set()
    return client


class SlowBody:
    """`size` random bytes sent slowly with a Content-Length (an iterable of known length: requests
    would send a bare generator chunked); sets `begun` once 2 MiB are out."""

    def __init__(self, size: int, begun: threading.Event) -> None:
        self.size, self.begun = size, begun

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        piece = os.urandom(256 * 1024)
        for i in range(self.size // len(piece)):
            yield piece
            if i == 8:
                self.begun.set()
            time.sleep(0.02)


def slow_upload(url: str, size: int, outcome: list[object], begun: threading.Event):
    """A client uploading `size` random bytes slowly (`SlowBody`)."""
    def client() -> None:
        try:
            r = requests.post(url, data=SlowBody(size, begun), timeout=120,
                              headers={"Content-Type": "application/octet-stream"})
            outcome.append(r.status_code)
        except requests.RequestException as exc:
            outcome.append(exc)
        finally:
            begun.set()
    return client


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


def test_pause_during_a_host_download_keeps_the_sandbox(server, sandbox_factory):
    """A slow client holds a download from the host open; pausing the sandbox cuts it (as it cuts any
    stream into a sandbox) and the sandbox pauses, resumes and still has the file."""
    sbx = sandbox_factory.create()
    path = "/home/user/slow.bin"
    want = random_file(sbx, path)
    received: list[int] = []
    started = threading.Event()
    pause_during(server, sbx, slow_download(sbx.download_url(path), received, started), started)
    assert sum(received) < 64 * MIB, "the download should have been cut by the pause"
    # Nothing holds the paused sandbox's rootfs: it is unmounted once the pause stood the sandbox down.
    wait_until(lambda: f"/sandboxes/{sbx.sandbox_id}/rootfs " not in Path("/proc/mounts").read_text(),
               "the paused sandbox's rootfs to be unmounted")
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sha_in(resumed, path) == want
    got = bytes(resumed.files.read(path, format="bytes"))
    assert hashlib.sha256(got).hexdigest() == want


# ---- uploads -----------------------------------------------------------------------------------------


def test_large_upload_is_staged_and_lands_as_any_upload(sbx: Sandbox, host_stages):
    path = f"/home/user/host-write-{new_tag()}.bin"
    data = os.urandom(8 * MIB + 777)
    before = host_stages()
    info = sbx.files.write(path, data)
    assert info.path == path and info.name == os.path.basename(path)
    assert sha_in(sbx, path) == hashlib.sha256(data).hexdigest()
    assert sbx.commands.run(f"stat -c '%U %a' {path}").stdout == "user 644\n"
    # An overwrite keeps the file (its mode, its inode), as envd's own uploads do.
    sbx.commands.run(f"chmod 755 {path}")
    inode = sbx.commands.run(f"stat -c %i {path}").stdout
    again = os.urandom(3 * MIB)
    sbx.files.write(path, again)
    assert sha_in(sbx, path) == hashlib.sha256(again).hexdigest()
    assert sbx.commands.run(f"stat -c '%U %a %i' {path}").stdout == f"user 755 {inode}"
    # A raw (octet-stream) upload through a signed URL.
    raw = f"/home/user/host-write-raw-{new_tag()}.bin"
    r = requests.post(sbx.upload_url(raw), data=again, headers={"Content-Type": "application/octet-stream"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": os.path.basename(raw), "path": raw, "type": "file"}]
    assert sha_in(sbx, raw) == hashlib.sha256(again).hexdigest()
    assert host_stages() == before + 3
    assert staged_leftovers(sbx) == ""
    # A small one is still envd's to take.
    sbx.files.write(path, b"small")
    assert host_stages() == before + 3 and sbx.files.read(path) == "small"


def test_several_files_in_one_upload(server, sbx: Sandbox, host_stages):
    """A multipart body with two file parts (destinations in their filenames) and another part."""
    tag = new_tag()
    one, two = os.urandom(MIB), os.urandom(2 * MIB)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id}
    if sbx._envd_access_token:
        headers["X-Access-Token"] = sbx._envd_access_token
    before = host_stages()
    r = requests.post(f"{server.api_url}/files?username=user", headers=headers, timeout=60,
                      files=[("file", (f"/home/user/{tag}/one.bin", one)), ("note", ("n.txt", b"skip me")),
                             ("file", (f"/home/user/{tag}/sub/two.bin", two))])
    assert r.status_code == 200, r.text
    assert [e["path"] for e in r.json()] == [f"/home/user/{tag}/one.bin", f"/home/user/{tag}/sub/two.bin"]
    assert sha_in(sbx, f"/home/user/{tag}/one.bin") == hashlib.sha256(one).hexdigest()
    assert sha_in(sbx, f"/home/user/{tag}/sub/two.bin") == hashlib.sha256(two).hexdigest()
    assert sbx.commands.run(f"stat -c %U /home/user/{tag}/sub").stdout == "user\n"
    assert host_stages() == before + 1
    # The same destination twice: envd's 400, and neither file written.
    r = requests.post(f"{server.api_url}/files?username=user", headers=headers, timeout=60,
                      files=[("file", (f"/home/user/{tag}/dup.bin", one)), ("file", (f"/home/user/{tag}/dup.bin", two))])
    assert r.status_code == 400 and "more than once" in r.json()["message"], r.text
    assert staged_leftovers(sbx) == ""


def test_refused_uploads_stage_nothing(sbx: Sandbox, host_stages):
    tag = new_tag()
    data = os.urandom(2 * MIB)
    before = host_stages()
    # A signature for another path: envd refuses before any byte is staged.
    forged = sbx.upload_url(f"/home/user/other-{tag}.bin").replace("other-", "target-")
    r = requests.post(forged, data=data, headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 401, r.text
    assert not sbx.files.exists(f"/home/user/target-{tag}.bin")
    # A destination the user may not write: staged, then refused by envd as any upload is.
    with pytest.raises(Exception) as info:
        sbx.files.write(f"/root/denied-{tag}.bin", data)
    assert "ermission" in str(info.value), info.value
    assert "No such file" in sbx.commands.run(f"ls /root/denied-{tag}.bin 2>&1 || true", user="root").stdout
    assert host_stages() == before + 1
    assert staged_leftovers(sbx) == ""


def test_pause_during_a_staged_upload_keeps_the_sandbox(server, sandbox_factory):
    """A slow client is half way through a large upload when the sandbox pauses: the upload fails, the
    sandbox pauses, resumes and works, and neither the destination nor staged bytes are left."""
    sbx = sandbox_factory.create()
    path = "/home/user/slow-upload.bin"
    size = 128 * MIB  # ~10 s at the client's pace
    sent = threading.Event()
    outcome: list[object] = []
    pause_during(server, sbx, slow_upload(sbx.upload_url(path), size, outcome, sent), sent)
    assert outcome and outcome[0] != 200, outcome
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert not resumed.files.exists(path)
    # No staged bytes: the host removed what it had written (an empty staging dir is envd's to sweep).
    files = resumed.commands.run("find / -maxdepth 2 -path '/.agentenv-upload-*/*' 2>/dev/null || true",
                                 user="root").stdout
    assert files == "", files
    resumed.files.write(path, os.urandom(2 * MIB))
    assert resumed.files.get_info(path).size == 2 * MIB


# ---- kill and fork in the middle ---------------------------------------------------------------------


@pytest.mark.parametrize("transfer", ["download", "upload"])
def test_kill_during_a_host_transfer_leaves_nothing(server, sandbox_factory, transfer):
    """A sandbox killed while the host sends one of its files, or stages an upload for it, goes
    entirely: the transfer ends, and no mount, dir or open descriptor of its rootfs stays on the host."""
    sbx = sandbox_factory.create()
    begun = threading.Event()
    sandbox_dir = server.data_dir / "sandboxes" / sbx.sandbox_id
    if transfer == "download":
        random_file(sbx, "/home/user/big.bin")
        received: list[int] = []
        client = slow_download(sbx.download_url("/home/user/big.bin"), received, begun)
    else:
        outcome: list[object] = []
        client = slow_upload(sbx.upload_url("/home/user/big.bin"), 128 * MIB, outcome, begun)  # ~10 s
    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert begun.wait(60)
    # the server itself holds a file of it (the download's source, the upload's staged file)
    wait_until(lambda: open_below(sandbox_dir, [server.proc.pid]), f"the server to hold a file of the {transfer}")
    sbx.kill()
    t.join(120)
    assert not t.is_alive(), "the transfer went on after its sandbox was killed"
    if transfer == "download":
        assert sum(received) < 64 * MIB, "the download should have been cut by the kill"
    else:
        assert outcome and outcome[0] != 200, outcome
    wait_until(lambda: str(sandbox_dir) not in Path("/proc/mounts").read_text() and not sandbox_dir.exists(),
               "the killed sandbox's mounts and dir to be gone")
    holders = open_below(sandbox_dir, [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()])
    assert holders == [], f"descriptors still open on the killed sandbox's files: {holders}"


def test_fork_during_a_host_download_keeps_both(sandbox_factory):
    """A fork while the host sends the source's file: the source keeps running with the file, and
    the child has the same bytes (the download either ends whole or is cut, never corrupts either)."""
    sbx = sandbox_factory.create()
    path = "/home/user/fork.bin"
    want = random_file(sbx, path)
    received: list[int] = []
    begun = threading.Event()
    t = threading.Thread(target=slow_download(sbx.download_url(path), received, begun), daemon=True)
    t.start()
    assert begun.wait(60)
    (child,) = sbx.fork(count=1, timeout=300)
    if isinstance(child, Sandbox):
        sandbox_factory.created.append(child)  # killed at teardown
    t.join(120)
    assert not t.is_alive()
    assert isinstance(child, Sandbox), child
    assert sha_in(sbx, path) == want
    assert sha_in(child, path) == want


# ---- a nearly full disk ------------------------------------------------------------------------------


def test_upload_without_room_to_stage_goes_through_envd(server):
    """With per-sandbox disk images (`disk_quota = loop`), an upload that fits the free space once but
    not twice (staged, then copied in) is not staged: envd takes the body and it lands, where staging
    would have answered 507. With room again, the next one is staged."""
    data_dir = new_data_dir("hostfiles-quota")
    srv = start_extra_server(data_dir, env={"AGENTENV_DISK_QUOTA": "loop", "AGENTENV_DEFAULT_DISK_MB": "256",
                                            "AGENTENV_POOL_SIZE": "0"})
    try:
        stages = lambda: counter_at(srv.url, "agentenv_proxy_host_file_stages_total")  # noqa: E731
        sbx = Sandbox.create(timeout=300, **srv.sdk_opts())
        srv.known_ids.add(sbx.sandbox_id)
        rootfs = data_dir / "sandboxes" / sbx.sandbox_id / "rootfs"

        def free() -> int:
            st = os.statvfs(rootfs)
            return st.f_bavail * st.f_frsize

        size = 40 * MIB
        fill = free() - 70 * MIB  # leaves 70 MiB: room for the upload once, not twice
        assert fill > 0, free()
        sbx.commands.run(f"head -c {fill} /dev/zero > /home/user/fill && sync")
        assert size + 8 * MIB < free() < 2 * size, free()
        before = stages()
        data = os.urandom(size)
        sbx.files.write("/home/user/tight.bin", data)
        assert sha_in(sbx, "/home/user/tight.bin") == hashlib.sha256(data).hexdigest()
        assert stages() == before, "an upload without room for it twice was staged"

        sbx.commands.run("rm /home/user/fill /home/user/tight.bin && sync")
        sbx.files.write("/home/user/roomy.bin", data)
        assert sha_in(sbx, "/home/user/roomy.bin") == hashlib.sha256(data).hexdigest()
        assert stages() == before + 1
        sbx.kill()
    finally:
        srv.stop()
        remove_data_dir(data_dir)


@pytest.mark.parametrize("where", ["/home/user", "/dev/shm"])
def test_a_file_cut_short_while_it_downloads_ends_the_download(sandbox_factory, where):
    """A program in the sandbox truncates the file while a client downloads it (from the host, or
    from envd for /dev/shm): the client sees the response end short at once (the connection closes),
    rather than waiting for bytes that will never come on a connection that then carries garbage."""
    sbx = sandbox_factory.create()
    path = f"{where}/shrinks.bin"
    random_file(sbx, path, 32 * MIB)
    received: list[int] = []
    begun = threading.Event()
    outcome: list[object] = []
    client = slow_download(sbx.download_url(path), received, begun, outcome, pause_s=0.01, timeout=60)
    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert begun.wait(60)
    sbx.commands.run(f"truncate -s {MIB} {path}")
    t0 = time.monotonic()
    t.join(50)
    assert not t.is_alive(), "the client still waits for bytes of a file that was cut short"
    assert time.monotonic() - t0 < 30
    assert outcome and outcome[0] != "complete" and sum(received) < 32 * MIB, (outcome, sum(received))
    assert sbx.files.read(path, format="bytes")[:16] is not None  # the sandbox still serves files


def test_plain_curl_moves_large_files_both_ways(sbx: Sandbox, host_sends, host_stages, tmp_path: Path):
    """curl sends `Expect: 100-continue` before a large body and reads a download to its end: a
    multipart and a raw upload through signed URLs are staged and land, and the download comes back
    from the host byte for byte."""
    import subprocess

    payload = tmp_path / "big.bin"
    payload.write_bytes(os.urandom(6 * MIB + 7))
    want = hashlib.sha256(payload.read_bytes()).hexdigest()
    stages, sends = host_stages(), host_sends()
    for i, args in enumerate((["-F", f"file=@{payload}"],
                              ["--data-binary", f"@{payload}", "-H", "Content-Type: application/octet-stream"])):
        path = f"/home/user/curl-{i}.bin"
        r = subprocess.run(["curl", "-sS", "-f", "-v", *args, sbx.upload_url(path)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Expect: 100-continue" in r.stderr, "curl did not wait for 100 Continue (a smaller body?)"
        assert sha_in(sbx, path) == want
        out = tmp_path / f"back-{i}.bin"
        r = subprocess.run(["curl", "-sS", "-f", "-o", str(out), sbx.download_url(path)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert hashlib.sha256(out.read_bytes()).hexdigest() == want
    assert host_stages() == stages + 2 and host_sends() == sends + 2


def test_range_requests_are_sent_from_the_host(sbx: Sandbox, host_sends):
    """`Range` parts of a large file (a span, an open end, a suffix) come from the host with envd's
    206 and Content-Range; a range past the end stays envd's 416."""
    path = "/home/user/ranged.bin"
    data = os.urandom(5 * MIB + 3)
    sbx.files.write(path, data)
    url = sbx.download_url(path)
    before = host_sends()
    for header, (start, end) in (("bytes=1000-2000999", (1000, 2000999)), ("bytes=4000000-", (4000000, len(data) - 1)),
                                 ("bytes=-4096", (len(data) - 4096, len(data) - 1))):
        r = requests.get(url, headers={"Range": header}, timeout=60)
        assert r.status_code == 206, (header, r.status_code, r.text[:200])
        assert r.headers["Content-Range"] == f"bytes {start}-{end}/{len(data)}", header
        assert r.content == data[start:end + 1], header
    assert host_sends() == before + 3
    r = requests.get(url, headers={"Range": f"bytes={len(data) + 10}-"}, timeout=60)
    assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{len(data)}"
    assert host_sends() == before + 3
