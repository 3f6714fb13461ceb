"""GET/POST /files through the SDK and raw HTTP: content, streaming, gzip, ranges, signatures, limits."""

from __future__ import annotations

import gzip
import hashlib
import os
import pwd

import pytest
import requests
from e2b import FileType
from e2b.exceptions import AuthenticationException, FileNotFoundException, InvalidArgumentException
from e2b.sandbox.signature import get_signature


def owner(path: str) -> str:
    return pwd.getpwuid(os.stat(path).st_uid).pw_name


def test_write_and_read_text_and_bytes(sbx, temp_user, workdir):
    info = sbx.files.write(f"{workdir}/sub/dir/a.txt", "hello ünïcode")
    assert info.path == f"{workdir}/sub/dir/a.txt" and info.name == "a.txt"
    assert info.type == FileType.FILE
    assert sbx.files.read(f"{workdir}/sub/dir/a.txt") == "hello ünïcode"
    # parents created and everything owned by the (default) user
    assert owner(f"{workdir}/sub") == owner(f"{workdir}/sub/dir/a.txt") == temp_user.name
    payload = bytes(range(256)) * 10
    sbx.files.write(f"{workdir}/b.bin", payload)
    assert bytes(sbx.files.read(f"{workdir}/b.bin", format="bytes")) == payload
    # relative paths resolve against the user's home; overwrite truncates
    rel = os.path.relpath(f"{workdir}/b.bin", temp_user.home)
    sbx.files.write(rel, "short")
    assert sbx.files.read(f"{workdir}/b.bin") == "short"
    assert sbx.files.read("~/" + rel) == "short"


def test_write_files_multipart_several(sbx, workdir):
    infos = sbx.files.write_files(
        [{"path": f"{workdir}/m1.txt", "data": "one"}, {"path": f"{workdir}/x/m2.txt", "data": b"two"}]
    )
    assert sorted(i.path for i in infos) == [f"{workdir}/m1.txt", f"{workdir}/x/m2.txt"]
    assert sbx.files.read(f"{workdir}/m1.txt") == "one"
    assert sbx.files.read(f"{workdir}/x/m2.txt") == "two"


def test_octet_stream_gzip(sbx, workdir):
    data = b"compressible " * 5000
    sbx.files.write(f"{workdir}/g.txt", data, gzip=True)
    assert bytes(sbx.files.read(f"{workdir}/g.txt", format="bytes", gzip=True)) == data
    assert sbx.files.get_info(f"{workdir}/g.txt").size == len(data)


def xattrs_supported(directory: str) -> bool:
    probe = os.path.join(directory, ".xattr-probe")
    open(probe, "w").close()
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


def test_metadata(sbx, workdir):
    """E2B's file metadata: user.e2b.<key> xattrs, keys lowercased, an upload replaces the whole set."""
    if not xattrs_supported(workdir):
        pytest.skip(f"{workdir} has no user xattrs on this host")
    f = f"{workdir}/m.txt"
    info = sbx.files.write(f, "x", metadata={"Origin": "test", "k2": "a b=c"})
    assert info.metadata == {"origin": "test", "k2": "a b=c"}
    assert os.getxattr(f, "user.e2b.origin") == b"test"  # stored as E2B's envd stores it
    assert sbx.files.get_info(f).metadata == {"origin": "test", "k2": "a b=c"}
    assert {e.name: e.metadata for e in sbx.files.list(workdir)}["m.txt"] == {"origin": "test", "k2": "a b=c"}
    sbx.files.write(f, "y", metadata={"other": "v"})  # replaces, not merges
    assert sbx.files.get_info(f).metadata == {"other": "v"}
    assert sbx.files.read(f) == "y"
    # Set out of band (as setfattr or os.setxattr inside a sandbox would): surfaced too; other
    # namespaces and non-UTF-8 values are not metadata.
    os.setxattr(f, "user.e2b.by-hand", b"yes")
    os.setxattr(f, "user.plain", b"not metadata")
    os.setxattr(f, "user.e2b.binary", b"\xff\xfe")
    assert sbx.files.get_info(f).metadata == {"other": "v", "by-hand": "yes"}
    os.symlink(f, f"{workdir}/m-link")  # a symlink shows its target's metadata
    assert sbx.files.get_info(f"{workdir}/m-link").metadata == {"other": "v", "by-hand": "yes"}
    moved = sbx.files.rename(f, f"{workdir}/m2.txt")  # metadata travels with the file
    assert moved.metadata == {"other": "v", "by-hand": "yes"}
    # An upload without metadata clears it (E2B: an overwrite replaces the full set); other xattrs stay.
    assert sbx.files.write(f"{workdir}/m2.txt", "z").metadata is None
    assert sbx.files.get_info(f"{workdir}/m2.txt").metadata is None
    assert os.getxattr(f"{workdir}/m2.txt", "user.plain") == b"not metadata"
    # write_files applies one map to every file.
    infos = sbx.files.write_files([{"path": f"{workdir}/w1", "data": "1"}, {"path": f"{workdir}/w2", "data": "2"}],
                                  metadata={"batch": "7"})
    assert [i.metadata for i in infos] == [{"batch": "7"}, {"batch": "7"}]


def test_metadata_rejected_before_anything_is_written(sbx, envd, workdir):
    f = f"{workdir}/keep.txt"
    sbx.files.write(f, "original")
    with pytest.raises(InvalidArgumentException):  # the SDK's own check
        sbx.files.write(f, "x", metadata={"bad": "non-ascii é"})
    url = envd.url + "/files"
    too_long = {"X-Metadata-" + "k" * 250: "v"}
    too_big = {f"X-Metadata-k{i}": "v" * 500 for i in range(9)}
    for headers in (too_long, too_big):
        r = requests.post(url, params={"path": f}, data=b"new", headers=envd.headers(
            **headers, **{"Content-Type": "application/octet-stream"}), timeout=30)
        assert r.status_code == 400, r.text
        assert "metadata" in r.json()["message"]
    assert sbx.files.read(f) == "original"


def test_60_mib_streamed_both_ways(sbx, workdir):
    size = 60 * 1024 * 1024
    block = os.urandom(1024 * 1024)

    def produce():
        for _ in range(size // len(block)):
            yield block

    expected = hashlib.sha256(block * (size // len(block))).hexdigest()
    sbx.files.write(f"{workdir}/big.bin", produce())
    assert os.path.getsize(f"{workdir}/big.bin") == size
    h = hashlib.sha256()
    total = 0
    for chunk in sbx.files.read(f"{workdir}/big.bin", format="stream"):
        h.update(chunk)
        total += len(chunk)
    assert total == size and h.hexdigest() == expected


def test_read_errors(sbx, workdir):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{workdir}/missing.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(workdir)
    with pytest.raises(InvalidArgumentException):
        sbx.files.write(workdir, "cannot overwrite a directory")


def test_permissions_enforced_as_user(sbx, temp_user, workdir):
    with pytest.raises(Exception):
        sbx.files.write("/root/envd-should-not-exist.txt", "x")
    assert not os.path.exists("/root/envd-should-not-exist.txt")
    with pytest.raises(Exception):
        sbx.files.read("/etc/shadow")
    # root can, and the file then belongs to root
    sbx.files.write(f"{workdir}/root.txt", "r", user="root")
    assert owner(f"{workdir}/root.txt") == "root"
    assert sbx.files.read("/etc/shadow", user="root")
    with pytest.raises(AuthenticationException):
        sbx.files.read(f"{workdir}/root.txt", user="no-such-user-xyz")


def test_range_and_raw_headers(envd, workdir):
    path = f"{workdir}/range.txt"
    with open(path, "wb") as f:
        f.write(b"0123456789")
    url = envd.url + "/files"
    r = requests.get(url, params={"path": path}, headers=envd.headers(Range="bytes=2-5"), timeout=10)
    assert r.status_code == 206 and r.content == b"2345"
    assert r.headers["Content-Range"] == "bytes 2-5/10"
    assert r.headers["Content-Disposition"] == 'inline; filename="range.txt"'
    r = requests.get(url, params={"path": path}, headers=envd.headers(Range="bytes=-3"), timeout=10)
    assert r.content == b"789"
    r = requests.get(url, params={"path": path}, headers=envd.headers(Range="bytes=20-"), timeout=10)
    assert r.status_code == 416
    r = requests.get(url, params={"path": f"{workdir}/nope"}, headers=envd.headers(), timeout=10)
    assert r.status_code == 404 and r.json() == {"code": 404, "message": f"path '{workdir}/nope' does not exist"}


def test_download_gzip_negotiation(envd, workdir):
    text = b"compressible line of text\n" * 20000
    noise = os.urandom(200000)
    for name, data in (("text.txt", text), ("noise.bin", noise)):
        with open(f"{workdir}/{name}", "wb") as f:
            f.write(data)
    url = envd.url + "/files"
    r = requests.get(url, params={"path": f"{workdir}/text.txt"}, stream=True, timeout=10,
                     headers=envd.headers(**{"Accept-Encoding": "gzip"}))
    assert r.headers.get("Content-Encoding") == "gzip"
    raw = r.raw.read()
    assert len(raw) < len(text) / 5 and gzip.decompress(raw) == text
    # incompressible data is sent as is even when gzip is acceptable
    r = requests.get(url, params={"path": f"{workdir}/noise.bin"}, stream=True, timeout=10,
                     headers=envd.headers(**{"Accept-Encoding": "gzip"}))
    assert "Content-Encoding" not in r.headers and r.raw.read() == noise
    # identity when gzip is not acceptable
    r = requests.get(url, params={"path": f"{workdir}/text.txt"}, stream=True, timeout=10,
                     headers=envd.headers(**{"Accept-Encoding": "identity"}))
    assert "Content-Encoding" not in r.headers and r.raw.read() == text


def test_signed_urls(sbx, envd, temp_user, workdir):
    path = f"{workdir}/signed.txt"
    up = sbx.upload_url(path)
    assert "signature=" in up
    r = requests.post(up, files={"file": ("ignored-name", b"via signed url")}, timeout=10)
    assert r.status_code == 200, r.text
    down = sbx.download_url(path)
    assert requests.get(down, timeout=10).content == b"via signed url"
    # expiring signature, still valid
    down = sbx.download_url(path, use_signature_expiration=60)
    assert requests.get(down, timeout=10).status_code == 200
    # tampered signature
    bad = down.replace("signature=v1_", "signature=v1_x")
    r = requests.get(bad, timeout=10)
    assert r.status_code == 401 and r.json()["code"] == 401
    # expired signature (correctly signed, but in the past)
    sig = get_signature(path, "read", None, envd.token, -10)
    r = requests.get(envd.url + "/files", timeout=10, params={
        "path": path, "signature": sig["signature"], "signature_expiration": str(sig["expiration"])})
    assert r.status_code == 401 and "expired" in r.json()["message"]
    # signed for another operation
    sig = get_signature(path, "write", None, envd.token)
    r = requests.get(envd.url + "/files", params={"path": path, "signature": sig["signature"]}, timeout=10)
    assert r.status_code == 401
    # no token and no signature
    r = requests.get(envd.url + "/files", params={"path": path}, timeout=10)
    assert r.status_code == 401
    # signature with a username
    sig = get_signature(path, "read", "root", envd.token)
    r = requests.get(envd.url + "/files", params={"path": path, "username": "root", "signature": sig["signature"]},
                     timeout=10)
    assert r.status_code == 200


def test_raw_octet_stream_chunked_gzip_upload(envd, workdir):
    body = gzip.compress(b"chunked-gzip-data" * 1000)

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    r = requests.post(envd.url + "/files", params={"path": f"{workdir}/cg.txt"}, data=chunks(), timeout=10,
                      headers=envd.headers(**{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}))
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "cg.txt", "path": f"{workdir}/cg.txt", "type": "file"}]
    with open(f"{workdir}/cg.txt", "rb") as f:
        assert f.read() == b"chunked-gzip-data" * 1000


def test_multipart_duplicate_and_missing_path(envd, workdir):
    files = [("file", (f"{workdir}/d.txt", b"1")), ("file", (f"{workdir}/d.txt", b"2"))]
    r = requests.post(envd.url + "/files", files=files, headers=envd.headers(), timeout=10)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = requests.post(envd.url + "/files", data=b"x", headers=envd.headers(**{"Content-Type": "application/octet-stream"}),
                      timeout=10)
    assert r.status_code == 400


def test_upload_limit(envd_factory, temp_user):
    server = envd_factory({"AGENTENV_ENVD_MAX_UPLOAD": "100000"})
    if True:
        target = os.path.join(temp_user.home, "limit-" + os.urandom(3).hex() + ".bin")

        def chunks():  # chunked: no Content-Length to reject up front
            for _ in range(50):
                yield b"x" * 10000

        r = requests.post(server.url + "/files", params={"path": target, "username": "root"}, data=chunks(),
                          headers={"Content-Type": "application/octet-stream"}, timeout=20)
        assert r.status_code == 413 and r.json()["code"] == 413
        assert not os.path.exists(target)  # partial file removed
        r = requests.post(server.url + "/files", params={"path": target, "username": "root"}, data=b"y" * 1000,
                          headers={"Content-Type": "application/octet-stream"}, timeout=20)
        assert r.status_code == 200
        os.unlink(target)
