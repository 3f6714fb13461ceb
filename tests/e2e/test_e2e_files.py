"""Filesystem API through the sync Python SDK (one shared sandbox) and signed file URLs."""

from __future__ import annotations

import hashlib
import os
import urllib.parse

import pytest
import requests
from e2b import FilesystemEventType, FileType, NotFoundException, Sandbox, SandboxException

from e2e_util import new_tag, wait_until

BIG_SIZE = 50 * 1024 * 1024


@pytest.fixture
def workdir(sbx: Sandbox) -> str:
    path = f"/home/user/files-{new_tag()}"
    assert sbx.files.make_dir(path) is True
    return path


def test_write_read_text(sbx: Sandbox, workdir: str):
    text = "héllo wörld ✓\nsecond line\n"
    info = sbx.files.write(f"{workdir}/t.txt", text)
    assert info.path == f"{workdir}/t.txt"
    assert info.name == "t.txt"
    assert info.type == FileType.FILE
    assert sbx.files.read(f"{workdir}/t.txt") == text
    # visible to processes, owned by the default user
    assert sbx.commands.run(f"cat {workdir}/t.txt").stdout == text
    assert sbx.commands.run(f"stat -c %U {workdir}/t.txt").stdout == "user\n"
    # overwrite truncates
    sbx.files.write(f"{workdir}/t.txt", "short")
    assert sbx.files.read(f"{workdir}/t.txt") == "short"


def test_write_read_bytes(sbx: Sandbox, workdir: str):
    data = bytes(range(256)) * 16 + os.urandom(1000)
    sbx.files.write(f"{workdir}/b.bin", data)
    assert bytes(sbx.files.read(f"{workdir}/b.bin", format="bytes")) == data
    streamed = b"".join(sbx.files.read(f"{workdir}/b.bin", format="stream"))
    assert streamed == data


def test_relative_path_resolves_to_home(sbx: Sandbox):
    name = f"rel-{new_tag()}.txt"
    sbx.files.write(name, "relative")
    assert sbx.files.read(f"/home/user/{name}") == "relative"
    assert sbx.files.exists(name)


def test_write_creates_parent_dirs(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/a/b/c/deep.txt", "deep")
    assert sbx.files.read(f"{workdir}/a/b/c/deep.txt") == "deep"
    assert sbx.commands.run(f"stat -c %U {workdir}/a/b").stdout == "user\n"


def test_large_file_round_trip(sbx: Sandbox, workdir: str):
    data = os.urandom(BIG_SIZE)
    digest = hashlib.sha256(data).hexdigest()
    path = f"{workdir}/big.bin"
    sbx.files.write(path, data, request_timeout=600)
    # on disk inside the sandbox
    assert sbx.commands.run(f"sha256sum {path}").stdout.split()[0] == digest
    assert sbx.files.get_info(path).size == BIG_SIZE
    back = sbx.files.read(path, format="bytes", request_timeout=600)
    assert len(back) == BIG_SIZE
    assert hashlib.sha256(back).hexdigest() == digest
    sbx.files.remove(path)


def test_list(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/a.txt", "aaa")
    sbx.files.write(f"{workdir}/sub/b.txt", "bb")
    entries = {e.name: e for e in sbx.files.list(workdir)}
    assert set(entries) == {"a.txt", "sub"}
    assert entries["a.txt"].type == FileType.FILE
    assert entries["a.txt"].size == 3
    assert entries["a.txt"].path == f"{workdir}/a.txt"
    assert entries["sub"].type == FileType.DIR
    deep = {e.path for e in sbx.files.list(workdir, depth=2)}
    assert deep == {f"{workdir}/a.txt", f"{workdir}/sub", f"{workdir}/sub/b.txt"}


def test_exists(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/here.txt", "x")
    assert sbx.files.exists(f"{workdir}/here.txt") is True
    assert sbx.files.exists(workdir) is True
    assert sbx.files.exists(f"{workdir}/not-here.txt") is False


def test_get_info(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/info.txt", "12345")
    sbx.commands.run(f"chmod 640 {workdir}/info.txt")
    info = sbx.files.get_info(f"{workdir}/info.txt")
    assert info.name == "info.txt"
    assert info.path == f"{workdir}/info.txt"
    assert info.type == FileType.FILE
    assert info.size == 5
    assert info.mode & 0o777 == 0o640
    assert info.owner == "user"
    d = sbx.files.get_info(workdir)
    assert d.type == FileType.DIR
    with pytest.raises(NotFoundException):
        sbx.files.get_info(f"{workdir}/missing")


def test_rename(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/old.txt", "content")
    entry = sbx.files.rename(f"{workdir}/old.txt", f"{workdir}/moved/new.txt")
    assert entry.path == f"{workdir}/moved/new.txt"
    assert entry.name == "new.txt"
    assert sbx.files.exists(f"{workdir}/old.txt") is False
    assert sbx.files.read(f"{workdir}/moved/new.txt") == "content"


def test_remove(sbx: Sandbox, workdir: str):
    sbx.files.write(f"{workdir}/gone/x.txt", "x")
    sbx.files.remove(f"{workdir}/gone/x.txt")
    assert sbx.files.exists(f"{workdir}/gone/x.txt") is False
    sbx.files.write(f"{workdir}/gone/y.txt", "y")
    sbx.files.remove(f"{workdir}/gone")  # recursive
    assert sbx.files.exists(f"{workdir}/gone") is False
    sbx.files.remove(f"{workdir}/never-existed")  # no error


def test_make_dir(sbx: Sandbox, workdir: str):
    assert sbx.files.make_dir(f"{workdir}/p/q/r") is True
    assert sbx.files.get_info(f"{workdir}/p/q/r").type == FileType.DIR
    assert sbx.files.make_dir(f"{workdir}/p/q/r") is False  # already exists
    assert sbx.commands.run(f"stat -c %U {workdir}/p/q").stdout == "user\n"


def test_watch_dir_polling(sbx: Sandbox, workdir: str):
    handle = sbx.files.watch_dir(workdir)
    events = []
    try:
        sbx.files.write(f"{workdir}/watched.txt", "hello")

        def got(kind: FilesystemEventType) -> bool:
            events.extend(handle.get_new_events())
            return any(e.name == "watched.txt" and e.type == kind for e in events)

        wait_until(lambda: got(FilesystemEventType.CREATE) or got(FilesystemEventType.WRITE), "create/write event")
        sbx.files.remove(f"{workdir}/watched.txt")
        wait_until(lambda: got(FilesystemEventType.REMOVE), "remove event")
    finally:
        handle.stop()
    assert all(e.name == "watched.txt" for e in events), events


def test_watch_dir_missing_path_fails(sbx: Sandbox, workdir: str):
    with pytest.raises(SandboxException):
        sbx.files.watch_dir(f"{workdir}/does-not-exist")


def test_upload_and_download_urls(sbx: Sandbox, workdir: str):
    path = f"{workdir}/via-url.bin"
    data = os.urandom(100_000)
    up = sbx.upload_url(path)
    r = requests.post(up, files={"file": ("via-url.bin", data)}, timeout=60)
    assert r.status_code == 200, r.text
    assert bytes(sbx.files.read(path, format="bytes")) == data
    assert sbx.commands.run(f"stat -c %U {path}").stdout == "user\n"

    down = sbx.download_url(path)
    r = requests.get(down, timeout=60)
    assert r.status_code == 200, r.text
    assert r.content == data

    # signed URLs with an expiry work too
    r = requests.get(sbx.download_url(path, use_signature_expiration=600), timeout=60)
    assert r.status_code == 200 and r.content == data


def test_tampered_signature_is_rejected(sbx: Sandbox, workdir: str):
    path = f"{workdir}/secret.txt"
    sbx.files.write(path, "secret")
    url = sbx.download_url(path)
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    assert query.get("signature", "").startswith("v1_")
    # a valid signature for another path must not grant access to this one
    query["signature"] = urllib.parse.parse_qs(urllib.parse.urlsplit(sbx.download_url("/etc/hostname")).query)[
        "signature"
    ][0]
    forged = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    # (under E2B_SANDBOX_URL a file URL names no sandbox; the server finds it by the signature)
    r = requests.get(forged, timeout=30)
    assert 400 <= r.status_code < 600, r.status_code
    assert b"secret" not in r.content
    query.pop("signature")
    unsigned = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    r = requests.get(unsigned, timeout=30)
    assert 400 <= r.status_code < 600, r.status_code
    assert b"secret" not in r.content
