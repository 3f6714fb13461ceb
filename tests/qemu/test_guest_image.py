"""The microVM guest image as built by `agentenv image build --vm` (no VM is booted here)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from agentenv.storage import guest


def _cpio(data: bytes) -> dict[str, tuple[int, bytes]]:
    """name -> (mode, content) of a newc archive."""
    out, pos = {}, 0
    while True:
        assert data[pos:pos + 6] == b"070701", f"bad cpio header at {pos}"
        fields = [int(data[pos + 6 + 8 * i:pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name_at = pos + 110
        name = data[name_at:name_at + namesize - 1].decode()
        body = (name_at + namesize + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data[body:body + size])
        pos = (body + size + 3) & ~3


@pytest.fixture(scope="module")
def initrd(guest_image) -> dict[str, tuple[int, bytes]]:
    return _cpio(guest_image["initrd"].read_bytes())


def test_kernel_is_debian_cloud_kernel_in_both_forms(guest_image):
    vmlinux = guest_image["vmlinux"].read_bytes()
    assert vmlinux[:4] == b"\x7fELF" and vmlinux[4] == 2, "vmlinux must be an ELF64 (Firecracker, QEMU PVH)"
    assert b"Xen\x00" in vmlinux, "no PVH (Xen) ELF note: QEMU could not boot the uncompressed kernel"
    bz = guest_image["kernel"].read_bytes()
    assert bz[0x202:0x206] == b"HdrS", "vmlinuz is not a bzImage"
    assert re.search(rb"6\.1\.\d+-\d+-cloud-amd64", bz) is not None


def test_initramfs_loads_virtio_modules_dependencies_first(initrd):
    assert initrd["bin/busybox"][0] & 0o111 and initrd["init"][0] & 0o111
    order = initrd["modules.order"][1].decode().split()
    for needed in ("virtio", "virtio_ring", "virtio_mmio", "virtio_pci", "virtio_blk", "virtio_net",
                   "virtio_console", "virtio_balloon"):
        assert needed in order, f"{needed} missing from the initramfs ({order})"
    seen: set[str] = set()
    for name in order:
        ko = initrd[f"lib/modules/{name}.ko"][1]
        m = re.search(rb"\x00depends=([^\x00]*)\x00", ko)
        deps = [d.replace("-", "_") for d in (m.group(1).decode().split(",") if m else []) if d]
        missing = [d for d in deps if d not in seen]
        assert not missing, f"{name} is loaded before its dependencies {missing}"
        seen.add(name.replace("-", "_"))
    init = initrd["init"][1].decode()
    assert guest.READY_MARKER in init and "switch_root /newroot" in init


def test_config_parameter_survives_the_guest_shell(initrd, tmp_path):
    """What /init evals: odd values (quotes, spaces, $) arrive intact, with busybox's own sh and base64."""
    bb = tmp_path / "busybox"
    bb.write_bytes(initrd["bin/busybox"][1])
    bb.chmod(0o755)
    env = {"PLAIN": "x", "TRICKY": "it's a \"test\" with $HOME and spaces"}
    argv = ["/.agentenv/bin/python3", "-m", "agentenv.envd", "--flag=a b"]
    param = guest.guest_config_param(env, argv, "my-host")
    assert len(guest.kernel_cmdline(env, argv, "my-host")) < 2048
    script = ('cfg="${P#agentenv.cfg=}"; eval "$(echo "$cfg" | base64 -d)"; '
              'printf "%s\\n%s\\n%s\\n" "$TRICKY" "$AE_HOSTNAME" "$AE_ARGV"')
    r = subprocess.run([str(bb), "sh", "-c", script], env={"P": param}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    tricky, host, got_argv = r.stdout.split("\n")[:3]
    assert (tricky, host) == (env["TRICKY"], "my-host")
    assert shlex.split(got_argv) == argv


def test_drives_are_labelled_ext4_images(guest_image):
    for key, label in (("root", guest.ROOT_LABEL), ("tools", guest.TOOLS_LABEL)):
        r = subprocess.run(["dumpe2fs", "-h", str(guest_image[key])], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert re.search(rf"^Filesystem volume name:\s+{label}$", r.stdout, re.M), r.stdout[:500]
        assert not (Path(guest_image[key]).stat().st_mode & 0o222), f"{key} drive must be read-only"
