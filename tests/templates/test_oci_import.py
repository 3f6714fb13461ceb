"""`fromImage` with an imported OCI image built on musl + busybox (the Alpine userland's pieces).

Honest scope: this host cannot download an Alpine image (no container registry or Alpine mirror
is reachable, and no PyPI/npm/apt package ships an Alpine minirootfs). The test therefore builds
the most Alpine-like image it can from Debian packages: musl libc as the system loader at Alpine's
path (`/lib/ld-musl-x86_64.so.1`, `musl` / `musl-tools`), BusyBox as the entire userland (`busybox-
static`), no bash, no glibc, and a program dynamically linked against musl. That exercises what
matters for envd on Alpine: a rootfs without glibc or bash (the tools layer brings its own loader
and libc). Its `/etc/os-release` says `alpine-like`, not `alpine`.

The image is written as an OCI archive (two layers, the second with a whiteout) and as a
`docker save` tarball, imported with `agentenv image import`, built on with the SDK's
`Template().from_image(...)`, and run through the SDK.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import requests
from e2b import Sandbox, Template

from serverproc import agentenv_executable

pytestmark = pytest.mark.timeout(900)

MUSL_LIBC = Path("/usr/lib/x86_64-linux-musl/libc.so")
BUSYBOX = Path("/bin/busybox")
HELLO_C = '#include <stdio.h>\nint main(void){printf("hello from musl\\n");return 0;}\n'


def _need_tools() -> None:
    if not shutil.which("musl-gcc") or not MUSL_LIBC.exists():
        pytest.skip("musl-gcc / musl libc missing (apt install musl-tools; scripts/setup.sh --test does)")
    out = subprocess.run(["file", str(BUSYBOX)], capture_output=True, text=True).stdout if shutil.which("file") else ""
    if not BUSYBOX.exists() or (out and "statically linked" not in out):
        pytest.skip("a static busybox is missing (apt install busybox-static)")


def _tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = len(data), mode
    return ti, data


def _dir(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode = tarfile.DIRTYPE, mode
    return ti, None


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = tarfile.SYMTYPE, target
    return ti, None


def build_layers(work: Path) -> tuple[bytes, bytes]:
    hello = work / "hello-musl"
    (work / "hello.c").write_text(HELLO_C)
    subprocess.run(["musl-gcc", "-O2", "-o", str(hello), str(work / "hello.c")], check=True)
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    entries = [_dir(d) for d in ("bin", "sbin", "lib", "etc", "usr", "usr/bin", "usr/sbin", "root", "home", "var")]
    entries.append(_dir("tmp", 0o1777))
    entries.append(_file("bin/busybox", BUSYBOX.read_bytes(), 0o755))
    for a in applets:
        if a != "busybox":
            entries.append(_link(f"bin/{a}", "/bin/busybox"))
    entries.append(_file("lib/ld-musl-x86_64.so.1", MUSL_LIBC.read_bytes(), 0o755))
    entries.append(_link("lib/libc.musl-x86_64.so.1", "ld-musl-x86_64.so.1"))
    entries.append(_file("usr/bin/hello-musl", hello.read_bytes(), 0o755))
    entries.append(_file("etc/os-release", b'NAME="Alpine-like (musl + BusyBox)"\nID=alpine-like\n'
                                            b'PRETTY_NAME="Alpine-like musl/BusyBox test image"\n'))
    entries.append(_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"))
    entries.append(_file("etc/group", b"root:x:0:\n"))
    entries.append(_file("etc/junk-from-layer-1", b"must be hidden by the whiteout\n"))
    layer1 = _tar_bytes(entries)
    layer2 = _tar_bytes([_dir("etc"), _file("etc/.wh.junk-from-layer-1", b""), _file("etc/motd", b"layer 2\n")])
    return layer1, layer2


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def oci_archive(work: Path, layer1: bytes, layer2: bytes) -> Path:
    blobs: dict[str, bytes] = {}
    layers = []
    diff_ids = []
    for raw, gz in ((layer1, True), (layer2, False)):
        data = gzip.compress(raw, mtime=0) if gz else raw
        blobs[_sha(data)] = data
        diff_ids.append("sha256:" + _sha(raw))
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                       "digest": "sha256:" + _sha(data), "size": len(data)})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_FLAVOUR=alpine-like"],
                                    "Cmd": ["/bin/sh"]},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    blobs[_sha(config)] = config
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": "sha256:" + _sha(config), "size": len(config)},
                           "layers": layers}).encode()
    blobs[_sha(manifest)] = manifest
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                 "digest": "sha256:" + _sha(manifest), "size": len(manifest),
                                                 "annotations": {"org.opencontainers.image.ref.name": "3.20"}}]}
    entries = [_file("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), _file("index.json", json.dumps(index).encode()),
               _dir("blobs"), _dir("blobs/sha256")]
    entries += [_file(f"blobs/sha256/{d}", b) for d, b in blobs.items()]
    out = work / "alpine-like.oci.tar"
    out.write_bytes(_tar_bytes(entries))
    return out


def docker_save_archive(work: Path, layer1: bytes, layer2: bytes) -> Path:
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + _sha(layer1),
                                                                   "sha256:" + _sha(layer2)]}}).encode()
    manifest = [{"Config": f"{_sha(config)}.json", "RepoTags": ["alpine-like:docker"],
                 "Layers": [f"{_sha(layer1)}/layer.tar", f"{_sha(layer2)}/layer.tar"]}]
    entries = [_file("manifest.json", json.dumps(manifest).encode()), _file(f"{_sha(config)}.json", config)]
    for raw in (layer1, layer2):
        entries += [_dir(_sha(raw)), _file(f"{_sha(raw)}/layer.tar", raw)]
    out = work / "alpine-like.docker.tar"
    out.write_bytes(_tar_bytes(entries))
    return out


def import_image(server, archive: Path, ref: str) -> str:
    env = dict(os.environ, AGENTENV_DATA_DIR=str(server.data_dir))
    r = subprocess.run([agentenv_executable(), "image", "import", str(archive), "--name", ref,
                        "--data-dir", str(server.data_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    _need_tools()
    work = tmp_path_factory.mktemp("oci")
    l1, l2 = build_layers(work)
    return oci_archive(work, l1, l2), docker_save_archive(work, l1, l2)


def test_import_and_run_musl_busybox_oci_image(server, archives):
    oci, _ = archives
    out = import_image(server, oci, "alpine-like:3.20")
    assert "Alpine-like musl/BusyBox test image" in out
    name = f"alpine-like-{secrets.token_hex(3)}"
    t = (Template().from_image("alpine-like:3.20")
         .run_cmd("hello-musl > /home/user/from-build.txt; echo $IMAGE_FLAVOUR >> /home/user/from-build.txt")
         .set_start_cmd("sleep 100000", "ps | grep -q \"[s]leep 100000\""))
    info = Template.build(t, name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            r = sbx.commands.run("cat /home/user/from-build.txt; hello-musl; id -un; cat /etc/os-release")
            lines = r.stdout.splitlines()
            assert lines[:4] == ["hello from musl", "alpine-like", "hello from musl", "user"], r.stdout
            assert "ID=alpine-like" in r.stdout
            # No glibc and no bash in the image: envd runs from the tools layer all the same.
            check = sbx.commands.run("ls /lib; test -e /bin/bash && echo has-bash || echo no-bash")
            assert "ld-musl-x86_64.so.1" in check.stdout and "no-bash" in check.stdout
            assert "libc.so.6" not in check.stdout
            # The second layer's whiteout hid the first layer's file.
            assert sbx.commands.run("cat /etc/motd; ls /etc").stdout.count("junk-from-layer-1") == 0
            assert "sleep 100000" in sbx.commands.run("ps").stdout  # the start command, restored
            sbx.files.write("/home/user/f.txt", "files API on busybox")
            assert sbx.files.read("/home/user/f.txt") == "files API on busybox"
        finally:
            sbx.kill()
    finally:
        requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                        timeout=60)


def test_import_docker_save_tarball(server, archives):
    _, docker = archives
    out = import_image(server, docker, "alpine-like:docker")
    assert "imported docker.io/library/alpine-like:docker" in out
    name = f"alpine-docker-{secrets.token_hex(3)}"
    info = Template.build(Template().from_image("alpine-like:docker").run_cmd("hello-musl > /home/user/ok"), name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("cat /home/user/ok").stdout == "hello from musl\n"
        finally:
            sbx.kill()
    finally:
        requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                        timeout=60)


def test_unknown_image_fails_the_build_clearly(server):
    from e2b.exceptions import BuildException

    name = f"noimg-{secrets.token_hex(3)}"
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image(f"does-not-exist-{secrets.token_hex(3)}:1"), name)
    assert "agentenv image import" in str(ei.value) or "cannot pull" in str(ei.value)
    requests.delete(f"{server.api_url}/templates/{name}", headers={"X-API-KEY": server.api_key}, timeout=60)


def _registry_reachable(host: str = "registry-1.docker.io") -> bool:
    import socket

    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _registry_reachable(), reason="no container registry (registry-1.docker.io) reachable here")
def test_pull_alpine_from_registry(server):
    name = f"alpine-pulled-{secrets.token_hex(3)}"
    info = Template.build(Template().from_image("alpine:3.20").run_cmd("cat /etc/alpine-release > /home/user/rel"),
                          name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("cat /home/user/rel").stdout.startswith("3.20")
        finally:
            sbx.kill()
    finally:
        requests.delete(f"{server.api_url}/templates/{info.template_id}", headers={"X-API-KEY": server.api_key},
                        timeout=60)
