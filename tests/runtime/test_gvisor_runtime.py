"""GVisorRuntime + NetworkManager against real runsc, netns and nftables (no mocks)."""

from __future__ import annotations

import asyncio
import glob
import os
import statistics
import time
from pathlib import Path

import pytest

from agentenv import constants
from agentenv.network.manager import NetworkManager
from agentenv.runtimes.gvisor import GVisorRuntime

from .conftest import SandboxKit, http_get, is_mounted, run, tcp_reachable, wait_http


def report(msg: str) -> None:
    print(f"[measure] {msg}")


def link_exists(ifname: str) -> bool:
    return os.path.exists(f"/sys/class/net/{ifname}")


def cgroup_dirs(sandbox_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/agentenv/{sandbox_id}") + glob.glob(f"/sys/fs/cgroup/agentenv/{sandbox_id}")


async def assert_gone(kit: SandboxKit, box) -> None:
    assert box.sandbox_id not in await kit.rt.list_ids()
    assert not os.path.exists(box.slot.netns_path)
    assert not link_exists(box.slot.veth_host)
    assert cgroup_dirs(box.sandbox_id) == []
    assert not is_mounted(box.rootfs)
    nft = run("nft", "list", "set", "ip", "agentenv", "internet").stdout
    assert f'"{box.slot.veth_host}"' not in nft


async def test_start_http_stop_leaves_nothing(kit: SandboxKit):
    box, latency = await kit.start(memory_mb=384)
    report(f"start-to-HTTP {latency:.3f}s")
    assert await kit.rt.is_alive(box.sandbox_id)
    assert box.sandbox_id in await kit.rt.list_ids()
    who = http_get(box.slot.host_ip, "/whoami")
    assert who == {"local": constants.GUEST_IP, "hostname": "sandbox"}
    # memory limit from the spec is what the guest sees
    meminfo = http_get(box.slot.host_ip, "/meminfo")["meminfo"]
    total_kb = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")))
    assert abs(total_kb - 384 * 1024) <= 384 * 1024 * 0.02, total_kb
    # the tools layer is mounted read-only
    assert http_get(box.slot.host_ip, f"/file?path={constants.TOOLS_MOUNT}/../etc/hostname")  # path resolves
    assert cgroup_dirs(box.sandbox_id), "cgroups of the running sandbox should exist"

    await kit.destroy(box)
    await assert_gone(kit, box)
    # idempotent
    await kit.rt.stop(box.sandbox_id)
    await kit.net.release(box.slot)
    assert not await kit.rt.is_alive(box.sandbox_id)


async def test_two_sandboxes_same_inner_ip_isolated(kit: SandboxKit):
    (a, _), (b, _) = await asyncio.gather(kit.start(), kit.start())
    assert a.slot.host_ip != b.slot.host_ip
    assert http_get(a.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP
    assert http_get(b.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP
    # independent processes
    assert http_get(a.slot.host_ip, "/count")["count"] == 1
    assert http_get(a.slot.host_ip, "/count")["count"] == 2
    assert http_get(b.slot.host_ip, "/count")["count"] == 1
    # each reaches itself through its own host address...
    # ...but never the other sandbox, nor the host side of any slot.
    for target in (b.slot.host_ip, b.slot.peer_ip, a.slot.peer_ip):
        res = http_get(a.slot.host_ip, f"/connect?host={target}&port=49983&timeout=1")
        assert res["connected"] is False, (target, res)
    res = http_get(b.slot.host_ip, f"/connect?host={a.slot.host_ip}&port=49983&timeout=1")
    assert res["connected"] is False, res
    # Killing one leaves the other untouched.
    await kit.destroy(a)
    await assert_gone(kit, a)
    assert http_get(b.slot.host_ip, "/count")["count"] == 2


async def test_pause_resume(kit: SandboxKit):
    box, _ = await kit.start()
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    t0 = time.monotonic()
    await kit.rt.pause(box.sandbox_id)
    t_pause = time.monotonic() - t0
    assert await kit.rt.state(box.sandbox_id) == "paused"
    assert await kit.rt.is_alive(box.sandbox_id)
    with pytest.raises(OSError):
        http_get(box.slot.host_ip, "/count", timeout=0.5)
    t0 = time.monotonic()
    await kit.rt.resume(box.sandbox_id)
    t_resume = time.monotonic() - t0
    report(f"pause {t_pause * 1e3:.0f} ms, resume {t_resume * 1e3:.0f} ms")
    assert await kit.rt.state(box.sandbox_id) == "running"
    # The request sent while paused was queued (count 2); this one is the third.
    assert http_get(box.slot.host_ip, "/count")["count"] == 3


async def test_checkpoint_restore_into_two_new_slots(kit: SandboxKit):
    src, _ = await kit.start()
    for i in range(1, 4):
        assert http_get(src.slot.host_ip, "/count")["count"] == i
    (src.rootfs / "srv" / "note.txt").write_text("written before checkpoint")
    await asyncio.sleep(0.3)  # let the closed connections' last ACKs land: no endpoint may remain

    image = src.dir / "checkpoint"
    t0 = time.monotonic()
    await kit.rt.checkpoint(src.sandbox_id, image)
    t_ckpt = time.monotonic() - t0
    assert not await kit.rt.is_alive(src.sandbox_id)
    assert src.sandbox_id not in await kit.rt.list_ids()
    image_mb = sum(p.stat().st_size for p in image.rglob("*") if p.is_file()) / 1e6

    # Children: new ids, new slots, rootfs at a different path (copy of the source's upper).
    run("umount", str(src.rootfs))
    children = [await kit.prepare(upper_from=src.upper) for _ in range(2)]
    times = []
    for child in children:
        t0 = time.monotonic()
        await kit.rt.restore(child.spec, image)
        await kit.net.activate(child.slot)
        wait_http(child.slot.host_ip)
        times.append(time.monotonic() - t0)
    report(f"checkpoint {t_ckpt:.3f}s image {image_mb:.1f} MB; restore-to-HTTP {', '.join(f'{t:.3f}s' for t in times)}")

    a, b = children
    assert http_get(a.slot.host_ip, "/count")["count"] == 4
    assert http_get(b.slot.host_ip, "/count")["count"] == 4
    assert http_get(a.slot.host_ip, "/count")["count"] == 5
    assert http_get(b.slot.host_ip, "/count")["count"] == 5
    assert http_get(a.slot.host_ip, "/count")["count"] == 6
    # File state came along and each child writes to its own rootfs.
    assert http_get(a.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "written before checkpoint"
    (a.rootfs / "srv" / "note.txt").write_text("child a")
    assert http_get(b.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "written before checkpoint"
    assert http_get(a.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "child a"
    assert http_get(a.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP


async def test_checkpoint_restore_same_id_same_slot(kit: SandboxKit):
    """The 'pause to disk' flow: checkpoint, then restore under the same id into its own slot."""
    box, _ = await kit.start()
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    await asyncio.sleep(0.3)
    image = box.dir / "checkpoint"
    await kit.rt.checkpoint(box.sandbox_id, image)
    await kit.net.deactivate(box.slot)
    t0 = time.monotonic()
    await kit.rt.restore(box.spec, image)
    await kit.net.activate(box.slot)
    wait_http(box.slot.host_ip)
    report(f"restore same id/slot to HTTP {time.monotonic() - t0:.3f}s")
    assert http_get(box.slot.host_ip, "/count")["count"] == 2


async def test_cleanup_orphans_after_crash(kit: SandboxKit, settings):
    box, _ = await kit.start()
    # Simulated crash: forget every object; a fresh manager/runtime must find and remove it.
    kit.boxes.remove(box)
    net2, rt2 = NetworkManager(settings), GVisorRuntime(settings)
    await net2.setup_host()
    found = net2.slot_for(box.sandbox_id)
    assert found is not None and found.index == box.slot.index and found.host_ip == box.slot.host_ip
    assert box.sandbox_id in await rt2.list_ids()
    # Only sandboxes of this data dir are touched; keep every other agentenv netns on the host.
    others = {n.removeprefix("agentenv-") for n in os.listdir("/run/netns") if n.startswith("agentenv-")}
    keep = (others | {b.sandbox_id for b in kit.boxes}) - {box.sandbox_id}
    for sid in await rt2.list_ids():
        if sid not in keep:
            await rt2.stop(sid)
    removed = await net2.cleanup_orphans(keep)
    assert box.sandbox_id in removed
    run("umount", str(box.rootfs), check=False)
    await assert_gone(kit, box)


async def test_allocation_speed_and_release(kit: SandboxKit):
    ids = [kit.new_id("alloc") for _ in range(20)]
    slots, times = [], []
    try:
        for sid in ids:
            t0 = time.monotonic()
            slots.append(await kit.net.allocate(sid))
            times.append(time.monotonic() - t0)
        assert len({s.index for s in slots}) == len(slots)
        assert len({s.host_ip for s in slots}) == len(slots)
        nft = run("nft", "list", "set", "ip", "agentenv", "internet").stdout
        assert all(f'"{s.veth_host}"' in nft for s in slots)
    finally:
        t0 = time.monotonic()
        for s in slots:
            await kit.net.release(s)
        t_rel = (time.monotonic() - t0) / max(len(slots), 1)
    report(f"allocate median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
           f"release {t_rel * 1e3:.1f} ms each")
    for s in slots:
        assert not os.path.exists(s.netns_path) and not link_exists(s.veth_host)
    assert statistics.median(times) < 0.25
