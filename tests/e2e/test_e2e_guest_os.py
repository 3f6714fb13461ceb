"""What the OS inside a sandbox offers, through the real SDK: coreutils' stat family without agentenv's
old statx preload shim, E2B's file metadata as user xattrs, `/proc/sys/kernel/random/boot_id` across
pause/resume, fork and a filesystem-only pause, and Node.js + npm in the base template.
"""

from __future__ import annotations

import re

import pytest
from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException

from e2e_util import SandboxFactory, kill_quietly, run_node_tests

HOME = "/home/user"
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def run(sbx: Sandbox, cmd: str, **kw):
    r = sbx.commands.run(cmd, **kw)
    # A stale /etc/ld.so.preload makes glibc's loader complain in every process.
    assert "ld.so" not in r.stderr, r.stderr
    return r


# ---- stat & co. without the preload shim ---------------------------------------------------------


def test_stat_family_works_without_a_preload_shim(sbx):
    preload = run(sbx, "cat /etc/ld.so.preload 2>/dev/null; ls /.agentenv").stdout
    assert "compat" not in preload, preload
    d = f"{HOME}/statdir"
    run(sbx, f"mkdir -p {d} && cd {d} && printf hi > a && touch -d 2001-01-01 old && touch new && ln -sf a link")

    ls = run(sbx, f"ls -l {d}")
    assert ls.exit_code == 0
    print("ls -l stderr:", repr(ls.stderr))  # runsc 20240729: lgetxattr on a symlink is EBADF (limitations.md)
    rows = {line.split(" -> ")[0].split()[-1]: line.split() for line in ls.stdout.splitlines()[1:]}
    assert set(rows) == {"a", "link", "new", "old"}, ls.stdout
    assert rows["a"][0].startswith("-rw") and rows["a"][2:5] == ["user", "user", "2"], rows["a"]
    assert rows["link"][0].startswith("l") and rows["link"][-3:] == ["link", "->", "a"], rows["link"]
    assert "2001" in rows["old"], rows["old"]

    st = run(sbx, f"stat -c '%n %s %F' {d}/a {d}/link && stat -L -c '%s' {d}/link").stdout.splitlines()
    assert st == [f"{d}/a 2 regular file", f"{d}/link 1 symbolic link", "2"], st
    newer = run(sbx, f"cd {d} && find . -newer old -type f | sort").stdout.split()
    assert newer == ["./a", "./new"], newer
    assert run(sbx, f"cp -a {d} {d}-copy && ls {d}-copy | wc -l").stdout.strip() == "4"
    py = run(sbx, "python3 -c \"import os, stat; s = os.stat('link', follow_symlinks=False); "
                  "t = os.stat('link'); print(stat.S_ISLNK(s.st_mode), s.st_size, stat.S_ISREG(t.st_mode), t.st_size)\"",
             cwd=d).stdout.split()
    assert py == ["True", "1", "True", "2"], py


# ---- file metadata (user.e2b.* xattrs) -------------------------------------------------------------

_PROBE = ("python3 -c \"import os, sys; p = sys.argv[1]; open(p, 'w').close()\n"
          "try:\n    os.setxattr(p, 'user.e2b.probe', b'1'); print('yes')\n"
          "except OSError as e:\n    print('no', e.errno)\nos.unlink(p)\" ")


def _setxattr(sbx: Sandbox, path: str, key: str, value: str) -> None:
    run(sbx, f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.{key}', b'{value}')\"")


def _metadata_of(sbx: Sandbox, directory: str, name: str):
    return {e.name: e.metadata for e in sbx.files.list(directory)}[name]


def test_file_metadata_as_user_xattrs(sandbox_factory: SandboxFactory):
    sbx = sandbox_factory.create()
    # tmpfs mounts have user xattrs under every gVisor release.
    f = "/dev/shm/meta.txt"
    info = sbx.files.write(f, "payload", metadata={"Origin": "sdk", "run": "42"})
    assert info.metadata == {"origin": "sdk", "run": "42"}
    assert sbx.files.get_info(f).metadata == {"origin": "sdk", "run": "42"}
    assert _metadata_of(sbx, "/dev/shm", "meta.txt") == {"origin": "sdk", "run": "42"}
    # ... stored where a program inside sees them ...
    got = run(sbx, f"python3 -c \"import os; print(sorted(os.listxattr('{f}')), os.getxattr('{f}', 'user.e2b.origin'))\"")
    assert got.stdout.strip() == "['user.e2b.origin', 'user.e2b.run'] b'sdk'", got.stdout
    # ... and set inside the sandbox, they are metadata too; other user.* names are not.
    _setxattr(sbx, f, "inside", "os.setxattr")
    run(sbx, f"python3 -c \"import os; os.setxattr('{f}', 'user.unrelated', b'x')\"")
    want = {"origin": "sdk", "run": "42", "inside": "os.setxattr"}
    assert sbx.files.get_info(f).metadata == want
    # An upload replaces the set; one without metadata clears it.
    sbx.files.write(f, "v2", metadata={"only": "this"})
    assert sbx.files.get_info(f).metadata == {"only": "this"}
    sbx.files.write("/dev/shm/plain.txt", "v1", metadata={"gone": "soon"})
    assert sbx.files.write("/dev/shm/plain.txt", "v2").metadata is None
    assert sbx.files.get_info("/dev/shm/plain.txt").metadata is None
    _setxattr(sbx, f, "inside", "os.setxattr")
    want = {"only": "this", "inside": "os.setxattr"}

    # The root filesystem: host files behind gVisor's gofer. runsc releases before 20260520 refuse
    # user xattrs there (EOPNOTSUPP); then an upload with metadata is refused before it writes a byte.
    rootfs_ok = run(sbx, _PROBE + f"{HOME}/.xattr-probe").stdout.split()
    sbx.files.write(f"{HOME}/kept.txt", "original")
    if rootfs_ok == ["yes"]:
        assert sbx.files.write(f"{HOME}/kept.txt", "new", metadata={"k": "v"}).metadata == {"k": "v"}
        assert sbx.files.get_info(f"{HOME}/kept.txt").metadata == {"k": "v"}
    else:
        assert rootfs_ok == ["no", "95"], rootfs_ok  # EOPNOTSUPP, nothing else
        with pytest.raises(InvalidArgumentException, match="no user extended attributes"):
            sbx.files.write(f"{HOME}/kept.txt", "new", metadata={"k": "v"})
        assert sbx.files.read(f"{HOME}/kept.txt") == "original"
        with pytest.raises(InvalidArgumentException, match="no user extended attributes"):
            sbx.files.write(f"{HOME}/never.txt", "new", metadata={"k": "v"})
        assert not sbx.files.exists(f"{HOME}/never.txt")
        assert sbx.files.get_info(f"{HOME}/kept.txt").metadata is None

    # Pause/resume and fork keep them (memory images carry tmpfs; layers are tars with xattrs).
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert resumed.files.get_info(f).metadata == want
    assert resumed.files.read(f) == "v2"
    children = resumed.fork(count=1, timeout=600)
    assert len(children) == 1 and isinstance(children[0], Sandbox), children
    child = children[0]
    try:
        assert child.files.get_info(f).metadata == want
        _setxattr(child, f, "child", "only")
        assert child.files.get_info(f).metadata == {**want, "child": "only"}
        assert resumed.files.get_info(f).metadata == want  # the source does not see the child's
    finally:
        kill_quietly(child)


# ---- boot_id ---------------------------------------------------------------------------------------


def _boot_id(sbx: Sandbox) -> str:
    out = run(sbx, "cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert UUID_RE.match(out), out
    return out


@pytest.mark.timeout(600)
def test_boot_id_across_pause_fork_and_reboot(sandbox_factory: SandboxFactory):
    sbx = sandbox_factory.create()
    boot = _boot_id(sbx)
    assert _boot_id(sbx) == boot  # stable while running

    # A full pause/resume continues the same boot.
    assert sbx.pause() is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert _boot_id(sbx) == boot

    # A fork child continues its source's boot (its memory, processes and uptime are the source's).
    children = sbx.fork(count=2, timeout=600)
    try:
        assert all(isinstance(c, Sandbox) for c in children), children
        assert [_boot_id(c) for c in children] == [boot, boot]
        assert _boot_id(sbx) == boot
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                kill_quietly(c)

    # A filesystem-only pause drops memory: the resume is a new boot.
    run(sbx, f"echo survives > {HOME}/fs-only.txt")
    assert sbx.pause(mode="filesystem") is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    rebooted = _boot_id(sbx)
    assert rebooted != boot
    assert sbx.files.read(f"{HOME}/fs-only.txt") == "survives\n"


def test_boot_id_differs_between_sandboxes(sandbox_factory: SandboxFactory):
    """Each create is its own boot, also when both are restores of the template's one warm image."""
    a, b = sandbox_factory.create(), sandbox_factory.create()
    assert _boot_id(a) != _boot_id(b)
    raw = run(a, "cat /proc/sys/kernel/random/boot_id").stdout
    assert raw.endswith("\n") and raw.count("\n") == 1, repr(raw)  # like Linux: one line


@pytest.mark.timeout(600)
def test_boot_id_of_sandboxes_from_snapshots(sandbox_factory: SandboxFactory):
    """A memory snapshot continues its source's boot (as a fork child does); a filesystem-only one
    boots anew. The source keeps its boot through both captures."""
    src = sandbox_factory.create()
    boot = _boot_id(src)
    full = src.create_snapshot()
    fs = src.create_snapshot(mode="filesystem")
    try:
        assert _boot_id(src) == boot
        from_full = sandbox_factory.create(template=full.snapshot_id)
        assert _boot_id(from_full) == boot
        from_fs = sandbox_factory.create(template=fs.snapshot_id)
        assert _boot_id(from_fs) not in (boot, _boot_id(from_full))
    finally:
        for s in (full, fs):
            try:
                Sandbox.delete_snapshot(s.snapshot_id)
            except Exception:  # noqa: BLE001 - cleanup
                pass


# ---- Node.js and npm -------------------------------------------------------------------------------


def test_node_and_npm_in_the_base_template(sbx):
    version = run(sbx, "node -e 'console.log(process.version)'").stdout.strip()
    major = int(re.match(r"^v(\d+)\.\d+\.\d+$", version).group(1))
    assert major >= 20, version
    npm = run(sbx, "npm --version").stdout.strip()
    assert re.match(r"^\d+\.\d+\.\d+$", npm), npm
    assert run(sbx, "npx --version").stdout.strip() == npm
    # As the default user, in a fresh project: npm works offline for local work, node runs it.
    proj = f"{HOME}/nodeproj"
    r = run(sbx, f"mkdir -p {proj} && cd {proj} && npm init -y >/dev/null && npm pkg set scripts.hi='node -p 6*7' "
                 "&& npm run -s hi")
    assert r.stdout.strip() == "42", (r.stdout, r.stderr)
    assert run(sbx, "id -un").stdout.strip() == "user"


# ---- the same through the npm SDK ------------------------------------------------------------------


def test_js_sdk_file_metadata_and_boot_id(server):
    run_node_tests(server, "guest_os.test.mjs", passes=2)

