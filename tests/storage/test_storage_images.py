"""Base image: manifest, contents, lookup, progress parsing, build lock and failure cleanup."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentenv import constants
from agentenv.config import Settings
from agentenv.errors import BadRequest, NotFound
from agentenv.storage._util import mounts_under
from agentenv.storage import nodejs
from agentenv.storage.images import (BASE_PACKAGES, LEGACY_PRELOAD, ImageBuildError, ImageStore,
                                     _DebootstrapProgress, remove_legacy_preload)

from _storage_helpers import run_in_mount_ns


def test_manifest_and_listing(store: ImageStore, base_rootfs: Path) -> None:
    assert base_rootfs == store.image_rootfs("base")
    m = json.loads((base_rootfs.parent / "manifest.json").read_text())
    assert m["name"] == "base"
    assert m["suite"] == store.settings.debian_suite
    for pkg in ("python3", "sudo", "git", "curl", "ca-certificates", "procps"):
        assert pkg in m["packages"], pkg
    assert m["size"] > 50 * 1024 * 1024
    assert m["build_id"] and m["created"]
    listed = {i["name"]: i for i in store.list_images()}
    assert listed["base"]["size"] == m["size"] and listed["base"]["created"] == m["created"]
    assert "tools" not in listed


def test_image_lookup_errors(store: ImageStore) -> None:
    with pytest.raises(NotFound):
        store.image_rootfs("never-built")
    for bad in ("../etc", "a/b", "", "tools"):
        with pytest.raises(BadRequest):
            store.image_rootfs(bad)


def test_user_and_system_files(base_rootfs: Path) -> None:
    passwd = {l.split(":")[0]: l.split(":") for l in (base_rootfs / "etc/passwd").read_text().splitlines()}
    user = passwd[constants.DEFAULT_USER]
    assert user[2:4] == ["1000", "1000"] and user[5] == constants.DEFAULT_HOME and user[6] == "/bin/bash"
    home = base_rootfs / constants.DEFAULT_HOME.lstrip("/")
    assert home.stat().st_uid == 1000
    assert (base_rootfs / "etc/hostname").read_text().strip()
    assert "localhost" in (base_rootfs / "etc/hosts").read_text()
    assert "nameserver" in (base_rootfs / "etc/resolv.conf").read_text()
    assert not list((base_rootfs / "var/cache/apt/archives").glob("*.deb"))


def test_user_has_passwordless_sudo(base_rootfs: Path, tmp_path: Path) -> None:
    """Run as `user` inside an overlay of the image (the image itself stays untouched)."""
    for d in ("u", "w", "m"):
        (tmp_path / d).mkdir()
    r = run_in_mount_ns(
        f"mount -t overlay x -o lowerdir={base_rootfs},upperdir={tmp_path}/u,workdir={tmp_path}/w {tmp_path}/m\n"
        f"env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot {tmp_path}/m "
        "runuser -u user -- sh -c 'id -un; sudo -n id -u; python3 -c \"print(6*7)\"'"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["user", "0", "42"]


def test_login_shells_get_the_path_of_their_user(base_rootfs: Path, tmp_path: Path) -> None:
    """The image's /etc/profile takes bash's $EUID instead of asking `id -u` (a process per SDK
    command); bash and dash login shells still get root's or a user's PATH."""
    assert "${EUID:-$(id -u)}" in (base_rootfs / "etc/profile").read_text()
    for d in ("u", "w", "m"):
        (tmp_path / d).mkdir()
    r = run_in_mount_ns(
        f"mount -t overlay x -o lowerdir={base_rootfs},upperdir={tmp_path}/u,workdir={tmp_path}/w {tmp_path}/m\n"
        f"E='env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin'\n"
        f"$E chroot {tmp_path}/m runuser -u user -- bash -l -c 'echo $PATH'\n"
        f"$E chroot {tmp_path}/m runuser -u user -- sh -l -c 'echo $PATH'\n"
        f"$E chroot {tmp_path}/m bash -l -c 'echo $PATH'\n"
        f"$E chroot {tmp_path}/m sh -l -c 'echo $PATH'\n"
    )
    assert r.returncode == 0, r.stderr
    user_bash, user_sh, root_bash, root_sh = r.stdout.split()
    for path in (user_bash, user_sh):
        assert "/usr/bin" in path.split(":") and "/usr/sbin" not in path.split(":"), path
    for path in (root_bash, root_sh):
        assert "/usr/sbin" in path.split(":"), path


def test_progress_parser_counts(tmp_path: Path) -> None:
    (tmp_path / "debootstrap").mkdir()
    (tmp_path / "debootstrap/deburis").write_text("a 1 x\nb 1 y\nc 1 z\nd 1 w\n")
    calls: list[tuple[str, float | None]] = []
    p = _DebootstrapProgress(tmp_path, lambda m, f: calls.append((m, f)))
    lines = ["I: Retrieving InRelease", "I: Resolving dependencies of base packages..."]
    lines += [f"I: Retrieving {n} 1.0" for n in "abcd"]
    (tmp_path / "debootstrap/required").write_text("a b\n")
    (tmp_path / "debootstrap/base").write_text("c d\n")
    lines += ["I: Extracting a...", "I: Extracting b...", "I: Installing core packages...",
              "I: Unpacking required packages...", "I: Unpacking a...", "I: Unpacking b...",
              "I: Configuring required packages...", "I: Configuring a...", "I: Configuring b...",
              "I: Unpacking the base system...", "I: Unpacking c...", "I: Unpacking d...",
              "I: Configuring the base system...", "I: Configuring c...", "I: Configuring d...",
              "I: Base system installed successfully.", "W: ignored", "plain output"]
    for line in lines:
        p.feed(line)
    fracs = [f for _, f in calls if f is not None]
    assert fracs == sorted(fracs) and 0 <= fracs[0] and fracs[-1] <= 1
    msgs = [m for m, _ in calls]
    assert "Retrieving d 1.0 (4/4)" in msgs
    assert "Unpacking d... (2/2)" in msgs and "Configuring b... (2/2)" in msgs
    assert "Unpacking required packages..." in msgs  # headers are not counted as packages
    assert len(calls) == len(lines) - 2  # non-I: lines are ignored


async def test_second_process_waits_for_the_lock(tmp_path: Path) -> None:
    """While another process holds the build lock, ensure_base waits, then uses that build."""
    images = tmp_path / "images"
    images.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(images / '.base.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True)\n"
         "sys.stdin.readline()\n"  # the 'build' finishes when the test says so
         f"os.makedirs({str(images / 'base/rootfs')!r}); "
         f"open({str(images / 'base/manifest.json')!r}, 'w').write('{{\"name\": \"base\"}}')\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        store = ImageStore(Settings(data_dir=tmp_path))
        task = asyncio.create_task(store.ensure_base())
        await asyncio.sleep(1.0)
        assert not task.done(), "ensure_base did not wait for the lock holder"
        holder.stdin.write("go\n")
        holder.stdin.flush()
        t0 = time.monotonic()
        path = await asyncio.wait_for(task, 10)
        assert path == images / "base/rootfs"
        assert time.monotonic() - t0 < 5
        assert not (images / "base.log").exists(), "the waiter built a second copy"
    finally:
        holder.kill()
        holder.wait(timeout=10)


async def test_failed_build_is_removed_and_names_log(tmp_path: Path) -> None:
    store = ImageStore(Settings(data_dir=tmp_path, debian_mirror="http://127.0.0.1:9/debian"))
    with pytest.raises(ImageBuildError) as ei:
        await asyncio.wait_for(store.ensure_base(), 120)
    log = tmp_path / "images/base.log"
    assert str(log) in str(ei.value) and log.stat().st_size > 0
    leftovers = [p.name for p in (tmp_path / "images").iterdir() if p.name not in ("base.log", ".base.lock")]
    assert leftovers == []
    assert mounts_under(tmp_path) == []


def test_requested_packages_installed(store: ImageStore, base_rootfs: Path) -> None:
    installed = store.manifest("base")["packages"]
    assert [p for p in BASE_PACKAGES if p not in installed] == []


def test_node_and_npm_in_the_image(store: ImageStore, base_rootfs: Path) -> None:
    """Node.js >= 20 and npm from the pinned, integrity-checked tarballs (Debian 12 has only 18)."""
    extras = store.manifest("base")["extras"]["nodejs"]
    assert extras["node"] == nodejs.NODE_VERSION and extras["npm"] == nodejs.NPM_VERSION
    out = subprocess.run(["chroot", str(base_rootfs), "/usr/local/bin/node", "-e", "console.log(process.version)"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == f"v{nodejs.NODE_VERSION}" and int(out[1:].split(".")[0]) >= 20
    npm = subprocess.run([shutil.which("chroot"), str(base_rootfs), "/usr/local/bin/npm", "--version"], capture_output=True,
                         text=True, timeout=60, check=True, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root"})
    assert npm.stdout.strip() == nodejs.NPM_VERSION
    assert (base_rootfs / "usr/local/include/node/node.h").is_file()  # native addons can build
    assert not (base_rootfs / "etc/ld.so.preload").exists()


async def test_cached_image_is_fixed_up_in_place(tmp_path: Path) -> None:
    """An image from an older agentenv: the statx shim's preload line goes, Node.js comes, the revision
    (and with it the microVM root-drive key) changes; other preload lines stay."""
    from agentenv.storage.guest import root_key

    rootfs = tmp_path / "images/base/rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "usr/local/bin").mkdir(parents=True)
    (rootfs / "etc/ld.so.preload").write_text(f"/usr/lib/keep-me.so\n{LEGACY_PRELOAD}\n")
    slow_profile = 'if [ "$(id -u)" -eq 0 ]; then\n  PATH=/usr/sbin:/usr/bin\nfi\n'
    (rootfs / "etc/profile").write_text(slow_profile)
    os.link(rootfs / "etc/profile", tmp_path / "profile-of-another-data-dir")  # images shared by hard links
    manifest = {"name": "base", "build_id": "b1", "created": "x"}
    (rootfs.parent / "manifest.json").write_text(json.dumps(manifest))
    key_before = root_key([rootfs])
    progress: list[str] = []
    store = ImageStore(Settings(data_dir=tmp_path))
    assert await asyncio.wait_for(store.ensure_base(lambda m, f: progress.append(m)), 600) == rootfs
    assert (rootfs / "etc/ld.so.preload").read_text() == "/usr/lib/keep-me.so\n"
    assert (rootfs / "etc/profile").read_text() == slow_profile.replace('"$(id -u)"', '"${EUID:-$(id -u)}"')
    assert (tmp_path / "profile-of-another-data-dir").read_text() == slow_profile  # replaced, not rewritten
    assert nodejs.is_current(rootfs) and os.access(rootfs / "usr/local/bin/node", os.X_OK)
    assert os.readlink(rootfs / "usr/local/bin/npm") == "../lib/node_modules/npm/bin/npm-cli.js"
    assert any("Node.js" in m for m in progress), progress
    m = json.loads((rootfs.parent / "manifest.json").read_text())
    assert m["revision"] == 1 and m["extras"]["nodejs"]["node"] == nodejs.NODE_VERSION and m["build_id"] == "b1"
    assert root_key([rootfs]) != key_before
    # Up to date now: a second server start changes nothing.
    await ImageStore(Settings(data_dir=tmp_path)).ensure_base()
    assert json.loads((rootfs.parent / "manifest.json").read_text())["revision"] == 1
    # Only our line is removed; a file left empty goes away.
    (rootfs / "etc/ld.so.preload").write_text(LEGACY_PRELOAD + "\n")
    assert remove_legacy_preload(rootfs) and not (rootfs / "etc/ld.so.preload").exists()
    assert not remove_legacy_preload(rootfs)


def test_node_tarball_must_match_its_pinned_integrity(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(nodejs, "NPM_INTEGRITY", "sha512-" + "A" * 86 + "==")
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    with pytest.raises(nodejs.NodeInstallError, match="pinned integrity"):
        nodejs.install(tmp_path, tmp_path / "cache", tmp_path / "log")
    assert not (tmp_path / nodejs.MARKER).exists()
    assert not (tmp_path / "usr/local/bin/node").exists()
