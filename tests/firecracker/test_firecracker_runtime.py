"""Firecracker runtime on a purpose-written guest: boot, pause, full + diff snapshots, restore, fork.

The guest counts in memory and prints each value to its serial console; a capture's memory image
holds the counter at its guest-physical address. A restore is correct when its console continues
from exactly the captured value, in a fresh VMM process with its own disk, tap and MMDS identity.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from agentenv.runtimes.firecracker import MEMORY_FILE, META, TAP
from agentenv.storage import reflink as rl

from .testguest import counters

pytestmark = pytest.mark.timeout(300)


async def wait_counter(kit, sid: str, above: int = 0, timeout: float = 30.0) -> list[int]:
    """The console's counters once one exceeds `above`."""
    deadline = time.monotonic() + timeout
    while True:
        vals = counters(await kit.rt.console(sid))
        if vals and vals[-1] > above:
            return vals
        if time.monotonic() > deadline:
            raise AssertionError(f"{sid}: no counter above {above} after {timeout}s; console: "
                                 f"{(await kit.rt.console(sid))[-300:]!r}; log: {kit.rt.vm(sid).log_tail()}")
        await asyncio.sleep(0.05)


def assert_continues_from(vals: list[int], captured: int) -> None:
    """A restored guest's console: consecutive values starting right after the captured one.

    The capture may fall between the increment and the end of its line, so the first complete line
    shows the captured value or the next one; nothing before it, no gaps after.
    """
    assert vals, "restored guest printed nothing"
    assert vals[0] in (captured, captured + 1), (captured, vals[:5])
    assert vals == list(range(vals[0], vals[0] + len(vals))), vals[:20]


def ip_link(ns: str, dev: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-d", "link", "show", dev], capture_output=True, text=True,
                          timeout=10).stdout


async def test_boot_pause_resume_balloon_mmds(kit):
    spec = await kit.spec()
    sid = spec.sandbox_id
    await kit.rt.start(spec)
    assert await kit.rt.is_alive(sid)
    vals = await wait_counter(kit, sid, above=2)
    assert vals == list(range(1, len(vals) + 1))

    await kit.rt.pause(sid)
    await asyncio.sleep(0.1)
    frozen = counters(await kit.rt.console(sid))[-1]
    await asyncio.sleep(0.5)
    assert counters(await kit.rt.console(sid))[-1] == frozen, "paused guest kept running"
    await kit.rt.resume(sid)
    await wait_counter(kit, sid, above=frozen)

    vm = kit.rt.vm(sid)
    balloon = await vm.balloon()
    assert balloon["deflate_on_oom"] is True
    assert balloon["stats_polling_interval_s"] == 1
    mmds = await vm.api.get("/mmds")
    assert mmds["agentenv"]["sandbox_id"] == sid
    assert mmds["agentenv"]["env"]["AGENTENV_TEST"] == "1"
    cfg = await vm.api.get("/vm/config")
    assert cfg["machine-config"]["track_dirty_pages"] is True
    assert cfg["vsock"]["guest_cid"] == 3
    # The tap lives in the sandbox's own netns, bridged with the slot's guest-side link.
    assert "tun" in ip_link(spec.slot.netns, TAP) and "master fcbr0" in ip_link(spec.slot.netns, TAP)
    assert "master fcbr0" in ip_link(spec.slot.netns, "eth0")
    # Per-sandbox writable disk: a reflink copy of the template (shares its blocks); read-only shared.
    work = kit.rt.workdir(sid)
    assert (work / "rootfs.raw").read_bytes()[:15] == b"template-rootfs"
    assert (work / "tools.raw").is_symlink()

    await kit.destroy(sid)
    assert not await kit.rt.is_alive(sid)
    assert not work.exists()
    # The guest console outlives the VM next to the orchestrator's other logs of the sandbox.
    assert "n=1\n" in (spec.bundle_dir / "firecracker-console.log").read_text()


async def test_full_then_diff_snapshot_restore_in_fresh_process(kit, tmp_path):
    spec = await kit.spec()
    sid = spec.sandbox_id
    await kit.rt.start(spec)
    await wait_counter(kit, sid, above=3)
    pid_a = kit.rt.vm(sid).pid

    full = kit.rt.root / "captures" / f"{sid}-full"
    await kit.rt.checkpoint(sid, full)              # booted VM: full snapshot; the VM is stopped
    assert not await kit.rt.is_alive(sid)
    c1 = kit.guest.counter_in(full / MEMORY_FILE)
    assert c1 >= 3
    assert (full / "rootfs.raw").exists() and not (full / "tools.raw").exists()

    await kit.rt.restore(spec, full)                # same id, same slot, fresh process
    vm = kit.rt.vm(sid)
    assert vm.pid != pid_a
    vals = await wait_counter(kit, sid, above=c1 + 3)
    assert_continues_from(vals, c1)

    diff = kit.rt.root / "captures" / f"{sid}-diff"
    await kit.rt.checkpoint(sid, diff)              # restored with dirty tracking: a diff snapshot
    meta = (diff / META).read_text()
    assert f'"diff_from": "{(full / MEMORY_FILE).resolve()}"' in meta
    c2 = kit.guest.counter_in(diff / MEMORY_FILE)
    assert c2 > c1
    assert kit.guest.counter_in(full / MEMORY_FILE) == c1, "the base image must never be written"
    # The merged image shares everything but the dirty pages with its base.
    with open(diff / MEMORY_FILE, "rb") as a, open(full / MEMORY_FILE, "rb") as b:
        differing = sum(1 for off in range(0, (full / MEMORY_FILE).stat().st_size, 4096)
                        if a.read(4096) != b.read(4096))
    assert 0 < differing < 64, f"{differing} pages differ between a diff-merged image and its base"

    await kit.rt.restore(spec, diff)
    vals = await wait_counter(kit, sid, above=c2 + 3)
    assert_continues_from(vals, c2)
    for d in (full, diff):
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


async def test_fork_four_restores_continue_from_capture(kit):
    spec = await kit.spec()
    src = spec.sandbox_id
    await kit.rt.start(spec)
    await wait_counter(kit, src, above=3)
    cap = kit.rt.root / "captures" / f"{src}-fork"
    await kit.rt.checkpoint(src, cap)               # one capture ...
    captured = kit.guest.counter_in(cap / MEMORY_FILE)

    children = [await kit.spec() for _ in range(4)]
    t0 = time.monotonic()
    await asyncio.gather(*(kit.rt.restore(c, cap) for c in children))   # ... N restores
    restore_s = time.monotonic() - t0
    pids = {kit.rt.vm(c.sandbox_id).pid for c in children}
    assert len(pids) == 4
    for c in children:
        vals = await wait_counter(kit, c.sandbox_id, above=captured + 3)
        assert_continues_from(vals, captured)
        vm = kit.rt.vm(c.sandbox_id)
        # Each child: own identity in MMDS, own tap in its own fresh slot, own copy of the disk.
        assert (await vm.api.get("/mmds"))["agentenv"]["sandbox_id"] == c.sandbox_id
        assert "tun" in ip_link(c.slot.netns, TAP)
        assert (await vm.balloon())["deflate_on_oom"] is True
    disks = [kit.rt.workdir(c.sandbox_id) / "rootfs.raw" for c in children]
    with open(disks[0], "r+b") as f:
        f.write(b"child-0-was-here")
    assert disks[1].read_bytes()[:15] == b"template-rootfs"
    assert (cap / "rootfs.raw").read_bytes()[:15] == b"template-rootfs"
    # Memory is mapped from the one image copy-on-write (File backend): no per-child copy on disk.
    for c in children:
        assert not any(p.stat().st_size >= 32 << 20 and not p.name.endswith(".raw")
                       for p in kit.rt.workdir(c.sandbox_id).iterdir() if p.is_file())
    print(f"4 restores in {restore_s * 1e3:.0f} ms")
    for p in cap.iterdir():
        p.unlink()
    cap.rmdir()


async def test_reflink_store_shares_blocks(kit):
    root = kit.rt.root
    assert rl.supports_reflink(root)
    a, b = root / "share-a", root / "share-b"
    with open(a, "wb") as f:
        f.write(os.urandom(1 << 20) * 16)
    try:
        assert rl.clone(a, b) is True
        out = subprocess.run(["filefrag", "-v", str(b)], capture_output=True, text=True, timeout=30).stdout
        assert "shared" in out, out
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


async def test_jailed_vm_runs_unprivileged_in_its_chroot_and_restores(jailed_kit):
    from .conftest import JAIL_UID

    kit = jailed_kit
    spec = await kit.spec()
    sid = spec.sandbox_id
    await kit.rt.start(spec)
    await wait_counter(kit, sid, above=2)
    pid = kit.rt.vm(sid).pid
    status = Path(f"/proc/{pid}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == [str(JAIL_UID)] * 4, uid_line          # dropped privileges
    # Its root is its work dir (pivot_root in a mount namespace of its own): nothing of the host.
    root = Path(f"/proc/{pid}/root")
    assert os.stat(root / "api.sock").st_ino == os.stat(kit.rt.workdir(sid) / "api.sock").st_ino
    assert not (root / "etc").exists() and not (root / "usr").exists()
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(spec.slot.netns_path).st_ino  # slot netns

    cap = kit.rt.root / "captures" / f"{sid}-jail"
    await kit.rt.checkpoint(sid, cap)
    captured = kit.guest.counter_in(cap / MEMORY_FILE)
    st = (cap / MEMORY_FILE).stat()   # restores map it; none of them (same uid) may write it
    assert st.st_uid == 0 and st.st_mode & 0o222 == 0
    child = await kit.spec()
    await kit.rt.restore(child, cap)
    vals = await wait_counter(kit, child.sandbox_id, above=captured + 3)
    assert_continues_from(vals, captured)
    await kit.destroy(child.sandbox_id)
    assert not kit.rt.workdir(child.sandbox_id).parent.exists()   # the jail is removed with the VM
    for p in cap.iterdir():
        p.unlink()
    cap.rmdir()


async def test_boot_probe_proves_the_vmm_boots_a_guest(fc_data_dir):
    from agentenv.runtimes.firecracker import find_firecracker
    from agentenv.runtimes.select import firecracker_boot_probe

    proof = await firecracker_boot_probe(find_firecracker())
    assert proof.ok, proof.detail
    assert 0 < proof.seconds < 5
    # A VMM that cannot boot is reported as such (here: a "binary" that is no VMM at all).
    bad = await firecracker_boot_probe(Path("/bin/false"), timeout=2)
    assert not bad.ok


async def test_a_restarted_server_re_adopts_running_vms(kit):
    """A second runtime object on the same data dir (a restarted server) finds, drives and stops the VM."""
    from agentenv.runtimes.firecracker import FirecrackerRuntime
    from agentenv.storage.reflink import ReflinkStore

    spec = await kit.spec()
    sid = spec.sandbox_id
    await kit.rt.start(spec)
    await wait_counter(kit, sid, above=1)
    later = FirecrackerRuntime(kit.settings.data_dir, store=ReflinkStore(kit.settings.data_dir, size_gb=16))
    try:
        assert sid in await later.list_ids()
        assert await later.is_alive(sid)
        await later.pause(sid)
        await asyncio.sleep(0.1)
        frozen = counters(await later.console(sid))[-1]
        await asyncio.sleep(0.4)
        assert counters(await later.console(sid))[-1] == frozen
        await later.resume(sid)
        await wait_counter(kit, sid, above=frozen)
        pid = later.vm(sid).pid
        await later.stop(sid)
        assert not os.path.exists(f"/proc/{pid}/cmdline") or not await later.is_alive(sid)
        assert sid not in await later.list_ids()
    finally:
        await later.close()


async def test_close_unmounts_the_vm_store_only_when_no_vm_runs(kit):
    spec = await kit.spec()
    await kit.rt.start(spec)
    await kit.rt.close()                       # a server stopping with a VM still running (kept)
    assert kit.rt.store.is_mounted() and await kit.rt.is_alive(spec.sandbox_id)
    await kit.destroy(spec.sandbox_id)
    await kit.rt.close()
    assert not kit.rt.store.is_mounted()       # no loop mount left under the data dir
